"""`FreeSoloCache`: streaming FreeSolo attention for decode and chunked prefill (spec §9, §12).

    cache = FreeSoloCache(cfg, batch=B, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, backend="torch")
    o = cache.extend(q, k, v)          # q [B, n, Hq, D], k / v [B, n, Hkv, D], any n >= 1 -> [B, n, Hq, D]

The outputs equal the parallel op on the whole sequence (lemma L6). Backends: "numpy" and "numba"
run the float64 host state (`streaming.host`), "torch" the vectorized torch state
(`streaming.torch_state`, CPU or CUDA, fp32 accumulation; FS-B: `streaming.torch_fsb`, forests
grown at carries and searched with the torch backend's beam). FS-L keeps a state whose size does not
depend on T (lemma L7); FS and FS-B keep the archive.

Decode without host synchronisation (torch, CUDA, every variant; FS-B with the fused step):
`extend(q, k, v, check_finite=False)`
(the finite check is the only sync: it reads a flag back); `cache.prefill(k, v)` ingests a long
prompt without outputs; `step = cache.decode_graph()` captures the FS-L one-token step (and the
block-boundary step) in CUDA graphs: `o = step(q, k, v)`. With `decode_kernel="triton"` (or
"auto" on CUDA) a one-token step is one or two fused Triton launches (FS-B: three), and
`decode_graph()` also captures FS and FS-B (their block boundaries run eagerly, without a sync:
FS-B's forest carries are decided on the device, `streaming.torch_fsb`).

Rows at different positions (spec §9; serving: prompts of different lengths, rows that stop
early): `extend(q, k, v, lengths=[n_0, ..., n_{B-1}])` lets row b consume only its first n_b
tokens of the (right-padded) chunk, 0 <= n_b <= n (0: the row waits or has finished); its other
outputs are zeros. `prefill(k, v, lengths=...)` likewise. From the first uneven call on, the cache
holds one batch-1 state per row (`cache.lengths` gives each row's position; `cache.length` only
while they agree), so each row's outputs are bit for bit those of a batch-1 cache fed that row
alone (L6 per row, L12). Each row then launches its own steps (no CUDA graph in that mode).

The cache is inference-only: outputs carry no gradient (inputs that require grad are refused).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import numpy as np

from ._validation import check_inputs, is_torch_tensor
from .backends.registry import BackendUnavailableError, get_backend
from .config import FreeSoloConfig

__all__ = ["FreeSoloCache"]

_FORMAT = "freesolo.FreeSoloCache/1"

# per-row buffers (leading dim B) of the FS / FS-L states, for splitting a lockstep state into rows
_ROW_BUFFERS = ("ring_k", "ring_v", "block_k", "block_v", "cell_ids", "cell_k", "cell_v", "cell_kbar", "cell_a")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


class FreeSoloCache:
    """Streaming state of one FreeSolo attention layer.

    Args:
        cfg: FreeSoloConfig (any variant; FS-B needs `tau`).
        batch, num_heads, num_kv_heads, head_dim: B, Hq, Hkv (Hq % Hkv == 0), D (even).
        backend: "numpy" / "numba" (float64 host state) or "torch"; default `freesolo.get_backend()`.
        dtype, device: torch backend only: storage dtype and device (default: the first chunk's).
        check_finite: default of `extend(check_finite=...)`; the check syncs a CUDA device, so pass
            False on a decode path that must not synchronise.
        decode_kernel: torch backend, FS / FS-L: how a one-token step runs: "torch" (torch ops,
            default), "triton" (the fused Triton step, `freesolo.backends.triton.decode`: two
            launches with the default `DecodeTiles()`; CUDA, or CPU under TRITON_INTERPRET=1), or "auto"
            (triton on CUDA when triton imports and the dtype is float32 / bfloat16 / float16).
            FS-B: "triton" runs the step's beam search (both forests side by side) and rerank as
            Triton launches (`freesolo.backends.triton.fsb_search.decode_select_cells`), then the fused kernel
            (window, readout of the chosen cells); its block boundaries (forest carries) run torch
            ops eagerly and sync the host once. Chunks of n > 1 tokens and block boundaries always
            run torch ops.
        decode_tiles: torch backend, fused step: a `freesolo.streaming.torch_state.DecodeTiles`
            (how the step's work is split across programs; default `DecodeTiles()`, FS-B
            `streaming.torch_fsb.FSB_DECODE_TILES`; `impl="single"` is the first
            one-program-per-(row, kv head) kernel, the one FS-B runs).
    """

    def __init__(
        self,
        cfg: FreeSoloConfig,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: Optional[str] = None,
        dtype=None,
        device=None,
        check_finite: bool = True,
        decode_kernel: str = "torch",
        decode_tiles=None,
    ):
        if not isinstance(cfg, FreeSoloConfig):
            raise TypeError(f"cfg must be a freesolo.FreeSoloConfig, got {type(cfg).__name__}")
        B = _positive_int("batch", batch)
        Hq = _positive_int("num_heads", num_heads)
        Hkv = _positive_int("num_kv_heads", num_kv_heads)
        D = _positive_int("head_dim", head_dim)
        if Hq % Hkv != 0:
            raise ValueError(f"num_heads={Hq} must be a multiple of num_kv_heads={Hkv} (GQA)")
        if D % 2 != 0:
            raise ValueError(f"head_dim={D} must be even (RoPE)")
        cfg.per_head("sigma", Hq)
        cfg.per_head("lam", Hq)
        if cfg.variant == "fsb":
            cfg.tau_array(Hkv)
        self.cfg, self.batch, self.num_heads, self.num_kv_heads, self.head_dim = cfg, B, Hq, Hkv, D
        self.backend = get_backend() if backend is None else backend
        self._rows: Optional[list] = None  # one batch-1 cache per row once rows stand at different positions
        self._views = False  # torch FS-L: the rows' states are views of the batched state (one launch per step)
        self._active_masks: dict = {}  # torch FS-L views: device int8 [B] masks by pattern (made once, no sync)
        self._row_args = dict(backend=backend, dtype=dtype, device=device, check_finite=False)
        self._row_args.update(decode_kernel=decode_kernel, decode_tiles=decode_tiles)
        self.check_finite = bool(check_finite)
        self._input: Optional[tuple] = None  # (array kind, dtype, device) of the first chunk
        if self.backend in ("numpy", "numba"):
            if decode_kernel != "torch" or decode_tiles is not None:
                raise ValueError(
                    f"decode_kernel={decode_kernel!r} (and decode_tiles) needs backend='torch', not {self.backend!r}"
                )
            if dtype is not None or device is not None:
                raise ValueError(f"backend={self.backend!r} computes in float64 on the CPU: leave dtype / device None")
            from .streaming.host import HostCacheState

            self._state = HostCacheState(cfg, B, Hq, Hkv, D)
        elif self.backend == "torch":
            try:
                import torch  # noqa: F401
            except ImportError as error:
                raise BackendUnavailableError(f"backend='torch' needs torch: {error}") from error
            from .streaming.torch_fsb import TorchFsbDeviceState
            from .streaming.torch_state import TorchCacheState

            if dtype is not None and not getattr(dtype, "is_floating_point", False):
                raise TypeError(f"dtype={dtype!r} must be a torch floating dtype")
            state_class = TorchFsbDeviceState if cfg.variant == "fsb" else TorchCacheState
            self._state = state_class(
                cfg, B, Hq, Hkv, D, dtype=dtype, device=device, decode_kernel=decode_kernel, decode_tiles=decode_tiles
            )
            self._dtype, self._device = dtype, device
        elif self.backend == "triton":
            raise BackendUnavailableError(
                "FreeSoloCache has no triton state (its decode step is torch ops): pass backend='torch'"
            )
        else:
            raise BackendUnavailableError(f"unknown backend {self.backend!r} for FreeSoloCache")

    # ---- properties -----------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Tokens consumed so far (every row's; ValueError once rows stand at different positions)."""
        if self._rows is None:
            return self._state.length
        lengths = self.lengths
        if len(set(lengths)) != 1:
            raise ValueError(f"rows stand at different positions {lengths}: read cache.lengths")
        return lengths[0]

    @property
    def lengths(self) -> list:
        """Tokens consumed by each row: [B] ints."""
        if self._rows is None:
            return [self._state.length] * self.batch
        return [row.length for row in self._rows]

    @property
    def ragged(self) -> bool:
        """True once the rows are held as separate batch-1 states (after an uneven `lengths`)."""
        return self._rows is not None

    @property
    def state(self):
        """The backend state object (HostCacheState, TorchCacheState, TorchFsbDeviceState); once
        ragged, the list of the rows' states."""
        if self._rows is not None:
            return [row.state for row in self._rows]
        return self._state

    def memory_bytes(self) -> int:
        """Bytes of the arrays / tensors the cache holds (FS-L: constant in T, lemma L7)."""
        if self._rows is not None and not self._views:
            return sum(row.memory_bytes() for row in self._rows)
        return self._state.memory_bytes()

    # ---- rows at different positions --------------------------------------------------------
    def _parse_lengths(self, lengths, n: int) -> Optional[list]:
        """lengths: None or B host ints in [0, n] -> list (None when every row takes all n tokens
        and the cache is not ragged: the batched path; FS-B, whose forests are not split, goes
        ragged at the first `lengths`)."""
        if lengths is None:
            return None
        if is_torch_tensor(lengths):
            if lengths.device.type != "cpu":
                raise ValueError(f"lengths must be host ints (a tensor on {lengths.device} would sync)")
            lengths = lengths.tolist()
        values = list(np.asarray(lengths).reshape(-1)) if isinstance(lengths, np.ndarray) else list(lengths)
        if len(values) != self.batch:
            raise ValueError(f"lengths has {len(values)} entries, the cache has batch={self.batch}")
        out = []
        for b, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= n:
                raise ValueError(f"lengths[{b}]={value!r} must be an int in [0, {n}] (the chunk has n={n} tokens)")
            out.append(int(value))
        if self._rows is None and all(value == n for value in out) and self.cfg.variant != "fsb":
            return None  # FS / FS-L stay batched while rows move together (split later if they part)
        return out

    def _make_rows(self, like=None) -> None:
        """Switch to one batch-1 cache per row, each continuing this cache's state. Torch FS-L:
        the rows' states are views of the batched state (row b's buffers, a per-row position
        vector), so a decode step of every row is one batched launch of the fused kernel.
        like: the chunk (its dtype / device allocate a torch state not allocated yet)."""
        state = self._state
        if self.backend == "torch" and self.cfg.variant == "fsl":
            import torch

            if not state.allocated:
                if like is not None and not is_torch_tensor(like):
                    like = torch.from_numpy(np.ascontiguousarray(like[:0]))
                dtype = self._dtype or like.dtype
                state.allocate(dtype, self._device or (like.device if is_torch_tensor(like) else "cpu"))
            state.pos_rows = state.pos.expand(self.batch).clone()  # int64 [B] on the device
            args = dict(self._row_args, dtype=None, device=None)
            rows = []
            for b in range(self.batch):
                row = FreeSoloCache(self.cfg, 1, self.num_heads, self.num_kv_heads, self.head_dim, **args)
                row._state = state.row_view(b, state.pos_rows[b])
                row._dtype, row._device, row._input = state.dtype, state.device, self._input
                rows.append(row)
            self._rows, self._views = rows, True
            return
        rows = [
            FreeSoloCache(self.cfg, 1, self.num_heads, self.num_kv_heads, self.head_dim, **self._row_args)
            for _ in range(self.batch)
        ]
        if self._state.length > 0:
            if self.cfg.variant == "fsb" or getattr(self._state, "forests", None) is not None:
                raise ValueError(
                    "rows of an FS-B cache can only be held apart from the start: pass lengths from the first chunk"
                )
            full = self.state_dict()
            for b, row in enumerate(rows):
                sd = dict(full, batch=1, state=_row_state(full["state"], b))
                row.load_state_dict(sd)
        self._rows = rows

    def _active_mask(self, lengths: list):
        """int8 [B] device mask (1: the row takes a token), made once per pattern from pinned host
        memory without a sync (a serving loop repeats few patterns)."""
        import torch

        key = tuple(int(n > 0) for n in lengths)
        if key not in self._active_masks:
            if len(self._active_masks) >= 64:
                self._active_masks.clear()
            host = torch.tensor(key, dtype=torch.int8)
            if self._state.device.type == "cuda":
                host = host.pin_memory()
            self._active_masks[key] = (host, host.to(self._state.device, non_blocking=True))  # host kept alive
        return self._active_masks[key][1]

    def _decode_rows(self, q, k, v, beta, lengths: list, check: bool):
        """Torch FS-L views, fused step: one token for each row with lengths[b] = 1, one batched
        launch (per-row positions on the device, inactive rows untouched); block boundaries are
        applied per row before it (host-known, torch ops on the row's views)."""
        import torch

        state = self._state
        if state.decode_tiles.impl != "split":  # the first kernel holds one pos for all rows
            return self._extend_rows_each(q, k, v, beta, lengths, check)
        q, k, v = q[:, :1], k[:, :1], v[:, :1]
        out = torch.zeros_like(q)
        active = [b for b, n_b in enumerate(lengths) if n_b]
        if not active:
            return out
        if check:
            for b in active:
                check_inputs(q[b : b + 1], k[b : b + 1], v[b : b + 1], self.cfg, beta, check_finite=True)
        cfg = self.cfg
        at_boundary = [b for b in active if self._rows[b].state.length % cfg.block == 0 < self._rows[b].state.length]
        mask = self._active_mask(lengths) if len(active) < self.batch else None
        from .backends.triton.decode import decode_step, fsl_boundary

        if at_boundary and state.decode_tiles.boundary == "triton":  # every row's boundary, one launch
            fsl_boundary(state, pos=state.pos_rows, active=mask)
        else:
            for b in at_boundary:
                self._rows[b].state._boundary(self._rows[b].state.length)

        beta = state.ones_beta if beta is None else beta
        decode_step(state, q, k, v, beta, out=out, pos=state.pos_rows, active=mask)
        for b in active:
            self._rows[b].state.length += 1
        return out

    def _extend_rows(self, q, k, v, beta, lengths: list, check: bool) -> object:
        """Each row b consumes q[b, :lengths[b]] in its own batch-1 cache; zeros elsewhere."""
        if self._rows is None:
            self._make_rows(q)
        if self._views and self._state._fused and max(lengths) <= 1 and is_torch_tensor(q):
            return self._decode_rows(q, k, v, beta, lengths, check)
        return self._extend_rows_each(q, k, v, beta, lengths, check)

    def _extend_rows_each(self, q, k, v, beta, lengths: list, check: bool) -> object:
        """Row by row: row b's cache consumes q[b, :lengths[b]]; zeros elsewhere."""
        parts = {}
        for b, (row, n_b) in enumerate(zip(self._rows, lengths)):
            if n_b > 0:
                sl = (slice(b, b + 1), slice(0, n_b))
                parts[b] = row.extend(q[sl], k[sl], v[sl], beta=beta, check_finite=check)  # [1, n_b, Hq, D]
        if is_torch_tensor(q):
            import torch

            out = torch.zeros_like(q)
        else:
            dtype = next(iter(parts.values())).dtype if parts else np.float64
            out = np.zeros(q.shape, dtype=dtype)
        for b, part in parts.items():
            out[b : b + 1, : lengths[b]] = part
        return out

    # ---- validation -----------------------------------------------------------------------
    def _check_chunk(self, q, k, v, beta, check_finite: Optional[bool]):
        check = self.check_finite if check_finite is None else bool(check_finite)
        info = check_inputs(q, k, v, self.cfg, beta, check_finite=check)
        expected = (self.batch, self.num_heads, self.num_kv_heads, self.head_dim)
        got = (info.B, info.Hq, info.Hkv, info.D)
        if got != expected:
            raise ValueError(
                f"chunk has (B, Hq, Hkv, D)={got} but the cache was built for "
                f"(batch, num_heads, num_kv_heads, head_dim)={expected}"
            )
        if info.requires_grad:
            raise ValueError("FreeSoloCache is inference-only: inputs require grad (call it under torch.no_grad())")
        self._check_kind(info.kind, info.dtype, info.device)
        if beta is not None and is_torch_tensor(beta) != (info.kind == "torch"):
            raise TypeError("beta must be of the same array kind (numpy / torch) as q, k, v")
        if beta is not None and info.kind == "torch" and str(beta.device) != info.device:
            raise ValueError(f"beta is on {beta.device}, q, k, v on {info.device}")
        return info

    def _check_kind(self, kind: str, dtype: str, device: str) -> None:
        signature = (kind, dtype, device)
        if self._input is None:
            if self.backend == "torch":
                torch_dtype = dtype if kind == "torch" else f"torch.{dtype}"  # numpy chunks are converted
                if self._dtype is not None and torch_dtype != str(self._dtype):
                    raise TypeError(f"the cache was built for dtype={self._dtype}, the chunk is {dtype}")
                if self._device is not None and kind == "torch":
                    import torch

                    want = torch.device(self._device)
                    got = torch.device(device)
                    if want.type != got.type or (want.index is not None and want.index != got.index):
                        raise ValueError(f"the cache was built for device={self._device}, the chunk is on {device}")
            elif kind == "torch" and device != "cpu":
                raise ValueError(f"backend={self.backend!r} runs on the CPU, the chunk is on {device}")
            self._input = signature
        elif signature != self._input:
            raise TypeError(
                f"chunk changed mid-stream: (kind, dtype, device)={signature}, earlier chunks {self._input}"
            )

    # ---- streaming ------------------------------------------------------------------------
    def extend(self, q, k, v, beta=None, check_finite: Optional[bool] = None, lengths=None):
        """Consume a chunk and return the outputs of its positions (spec §9).

        Args:
            q: [B, n, Hq, D]; k, v: [B, n, Hkv, D], n >= 1 (n = 1 is decode); numpy or torch.
            beta: [Hq] long-range mixing coefficient (default ones).
            check_finite: check the inputs for nan / inf (default: the cache's setting; it syncs
                a CUDA device, so pass False for sync-free decode).
            lengths: optional [B] host ints in [0, n]: row b consumes only q / k / v[b, :lengths[b]]
                (right padding; 0 = the row does not move). Uneven lengths make the cache ragged
                (one batch-1 state per row, see the module docstring).
        Returns:
            o [B, n, Hq, D], same array kind, dtype and device as q; equal to the parallel op's
            outputs at these positions (of each row's own sequence); zeros at padded positions.
        """
        if lengths is None and self._rows is None:
            self._check_chunk(q, k, v, beta, check_finite)
        else:  # rows check their own tokens (padding may hold anything)
            self._check_chunk(q, k, v, beta, False)
            rows = self._parse_lengths(lengths, q.shape[1])
            if rows is not None or self._rows is not None:
                check = self.check_finite if check_finite is None else bool(check_finite)
                return self._extend_rows(q, k, v, beta, rows or [q.shape[1]] * self.batch, check)
            if self.check_finite if check_finite is None else check_finite:
                check_inputs(q, k, v, self.cfg, beta, check_finite=True)
        if self._state.kind == "numpy":
            from .api import _like_input, _to_float64

            beta64 = np.ones(self.num_heads) if beta is None else _to_float64(beta)
            out = self._state.extend(_to_float64(q), _to_float64(k), _to_float64(v), beta64)
            return _like_input(out, q)
        if not is_torch_tensor(q):  # numpy chunk on the torch state: in as tensors, out as numpy
            q, k, v, beta = (None if x is None else self._as_tensor(x) for x in (q, k, v, beta))
            return self._state.extend(q, k, v, beta).cpu().numpy()
        return self._state.extend(q, k, v, beta)

    def _as_tensor(self, x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(self._device or "cpu")

    def prefill(self, k, v, check_finite: Optional[bool] = None, lengths=None) -> None:
        """Consume keys / values [B, n, Hkv, D] without computing outputs (a long prompt whose
        outputs are not needed). The state is exactly the one `extend` would leave. `lengths`:
        as in `extend` (row b takes k / v[b, :lengths[b]])."""
        check = self.check_finite if check_finite is None else bool(check_finite)
        ragged = lengths is not None or self._rows is not None
        info = check_inputs(
            k, k, v, self.cfg.replace(variant="fs", sigma=4.0, lam=1.0), None, check_finite=check and not ragged
        )
        expected = (self.batch, self.num_kv_heads, self.head_dim)
        if (info.B, info.Hq, info.D) != expected:
            raise ValueError(f"k has (B, Hkv, D)={(info.B, info.Hq, info.D)}, the cache expects {expected}")
        self._check_kind(info.kind, info.dtype, info.device)
        rows = self._parse_lengths(lengths, k.shape[1])
        if rows is not None or self._rows is not None:
            if self._rows is None:
                self._make_rows(k)
            for b, (row, n_b) in enumerate(zip(self._rows, rows or [k.shape[1]] * self.batch)):
                if n_b > 0:
                    row.prefill(k[b : b + 1, :n_b], v[b : b + 1, :n_b], check_finite=check)
            return
        if ragged and check:  # lengths all full on a lockstep cache: the batched path, checked here
            check_inputs(k, k, v, self.cfg.replace(variant="fs", sigma=4.0, lam=1.0), None, check_finite=True)
        if self._state.kind == "numpy":
            from .api import _to_float64

            self._state.prefill(_to_float64(k), _to_float64(v))
        elif not is_torch_tensor(k):
            self._state.prefill(self._as_tensor(k), self._as_tensor(v))
        else:
            self._state.prefill(k, v)

    def decode_graph(self, beta=None):
        """torch backend on CUDA, FS-L (and FS / FS-B with decode_kernel="triton"): a CUDA graph of the
        one-token step (see `streaming.torch_state.DecodeGraph`; `step(q, k, v)`, or write q / k /
        v into `step.q / k / v` and call `step.replay()`). Rows at different positions (ragged
        FS-L, fused step with DecodeTiles(boundary="triton")): `step(q, k, v, lengths=[0/1 per
        row])`, one graph for every row (`streaming.torch_state.RaggedDecodeGraph`)."""
        if self._state.kind != "torch":
            raise ValueError(f"decode_graph needs backend='torch', not {self.backend!r}")
        if self._rows is not None:
            if not self._views:
                raise ValueError(
                    "decode_graph of rows at different positions needs torch FS-L (rows sharing one state); "
                    f"variant={self.cfg.variant!r}, backend={self.backend!r} holds a state per row"
                )
            return _RaggedStep(self, beta)
        return self._state.decode_graph(beta)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A plain dict: format, config fields, sizes, backend, and the state's arrays / tensors
        (ragged: "rows", the rows' batch-1 state dicts, and "state" None)."""
        return {
            "rows": None if self._rows is None else [row.state_dict() for row in self._rows],
            "format": _FORMAT,
            "config": asdict(self.cfg),
            "backend": self.backend,
            "batch": self.batch,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "input": self._input,
            "state": self._state.state_dict() if self._rows is None else None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()`; the cache then continues with bit-identical outputs."""
        if state_dict.get("format") != _FORMAT:
            raise ValueError(f"not a FreeSoloCache state dict (format={state_dict.get('format')!r})")
        if FreeSoloConfig(**state_dict["config"]) != self.cfg:
            raise ValueError(f"state dict config {state_dict['config']} differs from the cache's config {self.cfg}")
        mine = (self.batch, self.num_heads, self.num_kv_heads, self.head_dim)
        theirs = tuple(state_dict[key] for key in ("batch", "num_heads", "num_kv_heads", "head_dim"))
        if theirs != mine:
            raise ValueError(f"state dict sizes (B, Hq, Hkv, D)={theirs} differ from the cache's {mine}")
        kind_of = {"numpy": "numpy", "numba": "numpy", "torch": "torch"}
        if kind_of.get(state_dict["backend"]) != self._state.kind:
            raise ValueError(
                f"state dict of backend {state_dict['backend']!r} cannot load into backend {self.backend!r}"
            )
        if state_dict.get("rows") is not None:
            self._rows, self._views = None, False
            first = state_dict["rows"][0]["state"]
            if self.backend == "torch" and self.cfg.variant == "fsl" and first.get("dtype") is not None:
                import torch

                dtype = getattr(torch, first["dtype"].replace("torch.", ""))
                if self._state.allocated and self._state.dtype != dtype:
                    raise ValueError(f"state dtype {dtype} != cache dtype {self._state.dtype}")
                if not self._state.allocated:
                    self._state.allocate(dtype, first["ring_k"].device)
                self._make_rows()  # views of the batched state, filled below
            else:
                self._rows = [
                    FreeSoloCache(self.cfg, 1, self.num_heads, self.num_kv_heads, self.head_dim, **self._row_args)
                    for _ in range(self.batch)
                ]
            for row, sd in zip(self._rows, state_dict["rows"]):
                row.load_state_dict(sd)
        else:
            self._state.load_state_dict(state_dict["state"])
            self._rows, self._views = None, False
        self._input = None if state_dict["input"] is None else tuple(state_dict["input"])

    def __repr__(self) -> str:
        return (
            f"FreeSoloCache(variant={self.cfg.variant!r}, backend={self.backend!r}, B={self.batch}, "
            f"Hq={self.num_heads}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
            f"T={self.lengths if self.ragged else self.length}, "
            f"memory={self.memory_bytes()} bytes)"
        )


class _RaggedStep:
    """`FreeSoloCache.decode_graph()` of a ragged FS-L cache: `step(q, k, v, lengths=None)` with q
    [B, 1, Hq, D], k / v [B, 1, Hkv, D] and lengths [B] in {0, 1} (default all 1) replays one CUDA
    graph for every row and keeps the rows' host lengths. Returns the static output [B, 1, Hq, D]."""

    def __init__(self, cache: "FreeSoloCache", beta=None):
        from .streaming.torch_state import RaggedDecodeGraph

        self.cache = cache
        self.graph = RaggedDecodeGraph(cache._state, beta)

    def __call__(self, q, k, v, lengths=None):
        cache = self.cache
        lengths = cache._parse_lengths(lengths, 1) or [1] * cache.batch
        out = self.graph(q, k, v, cache._active_mask(lengths))
        for row, n_b in zip(cache._rows, lengths):
            row._state.length += n_b
        return out


def _row_state(state: dict, b: int) -> dict:
    """Row b of an FS / FS-L state dict (torch or host): per-row buffers sliced to batch 1."""
    out = {}
    for name, value in state.items():
        out[name] = value[b : b + 1] if name in _ROW_BUFFERS else value
    return out
