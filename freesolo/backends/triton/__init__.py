"""`triton` backend: fused Triton kernels for FS, FS-L (and FS-B's readout) on CUDA.

Modules:
- `selection.py`: cell statistics, FS-L candidate pools, scoring + per-query top-K (FS, FS-L).
- `attention.py`: fused forward (local RoPE window + sparse NoPE readout + RMSNorm + beta) and backward.
- `decode.py`: fused decode step over `FreeSoloCache`.
- `backend.py`: the registry entry, `torch.library.custom_op` registrations.
- `graphs.py`: CUDA graphs of short eager calls (host-bound at a few thousand tokens), replayed.

`import freesolo` never imports triton; the registry imports this package lazily.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
