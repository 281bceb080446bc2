"""Streaming (decode / chunked prefill) state of `freesolo.FreeSoloCache` (spec §9).

- `host.HostCacheState`: float64 NumPy state for the "numpy" / "numba" backends, built from the
  oracle's primitives (one token at a time; the reference of the streaming form).
- `torch_state.TorchCacheState`: the torch state (CPU and CUDA, any float dtype, fp32
  accumulation), vectorized over batch and heads; its FS-L decode step never synchronises with
  the host and can be captured in a CUDA graph (`TorchCacheState.decode_graph`).

Both are reached through `freesolo.FreeSoloCache`; nothing here is imported by `import freesolo`.
"""

__all__ = ["cli", "host", "torch_fsb", "torch_state"]
