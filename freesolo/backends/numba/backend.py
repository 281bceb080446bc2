"""`numba` backend: the oracle's algorithm (spec §2-§7) compiled with numba, float64 throughout.

Host functions here convert to float64, lay the arrays out for the kernels of
`kernels.py` (per-head keys, transposed values, cell-major values) and call them. RoPE
tables come from NumPy with the oracle's arithmetic (cached per (T, D, theta)). FS-L scores only
the <= P+W cells of its block's candidate pool (computed once per block and kv head); the local
branch keeps O(window) scratch per task, so memory is O(T * D) at any T.

Public helpers (NumPy or torch inputs, converted to float64; the public API validates first):
    select_cells(q, k, cfg)                -> int64 [B, T, Hq, K]
    local_attention(q, k, v, cfg)          -> [B, T, Hq, D]
    long_range_readout(q, k, v, idx, cfg)  -> [B, T, Hq, D]   (any selection, e.g. FS-B's)
    attention(q, k, v, cfg, beta=None)     -> [B, T, Hq, D]
    count_costs(q, k, cfg)                 -> dict of counted costs (spec §10)
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from ...config import FreeSoloConfig
from ..base import HostBackend

__all__ = [
    "NumbaBackend",
    "attention",
    "block_candidates",
    "cell_stats",
    "count_costs",
    "local_attention",
    "long_range_readout",
    "select_cells",
]


def _kernels():
    """The compiled kernels (imported lazily: `import freesolo` never imports numba)."""
    from . import kernels

    return kernels


def _f64(x) -> np.ndarray:
    """float64, C-contiguous NumPy copy/view of x (torch tensors are detached to the CPU)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float64)


@functools.lru_cache(maxsize=4)
def _rope_tables(T: int, D: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, D/2] of the half-split RoPE at positions 0..T-1 (the oracle's arithmetic; cached, read-only)."""
    half = D // 2
    inv_freq = theta ** (-2.0 * np.arange(half, dtype=np.float64) / D)  # [D/2]
    angle = np.arange(T).astype(np.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(angle), np.sin(angle)
    cos.flags.writeable = False
    sin.flags.writeable = False
    return cos, sin


def _rope_all(x: np.ndarray, theta: float, per_head: bool = False, tables=None) -> np.ndarray:
    """Half-split RoPE at positions 0..T-1 of x [B, T, H, D] -> [B, T, H, D] ([B, H, T, D] if per_head)."""
    cos, sin = tables if tables is not None else _rope_tables(x.shape[1], x.shape[3], theta)
    return _kernels().rope_kernel(x, cos, sin, per_head)


def _per_head(x: np.ndarray) -> np.ndarray:
    """x [B, T, H, D] -> [B, H, T, D] contiguous (each head's rows contiguous)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _transposed(x: np.ndarray) -> np.ndarray:
    """x [B, T, H, D] -> [B, H, D, T] contiguous (token index innermost)."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def _cells_transposed(x: np.ndarray, cell: int) -> np.ndarray:
    """x [B, T, H, D] -> [B, H, C, D, cell] contiguous: each complete cell's tokens, transposed."""
    B, T, H, D = x.shape
    C = T // cell
    cells = x[:, : C * cell].reshape(B, C, cell, H, D)  # (B, C, cell, H, D)
    return np.ascontiguousarray(cells.transpose(0, 3, 1, 4, 2))  # (B, H, C, D, cell)


def _check_fs_fsl(cfg: FreeSoloConfig, what: str) -> None:
    if cfg.variant not in ("fs", "fsl"):
        raise ValueError(f"{what} serves variant 'fs' and 'fsl', not variant={cfg.variant!r}")


def cell_stats(k: np.ndarray, cfg: FreeSoloConfig) -> tuple[np.ndarray, np.ndarray]:
    """k [B, T, Hkv, D] -> kbar [B, Hkv, C, D], a [B, Hkv, C]; C = T // cell (spec §3)."""
    return _kernels().cell_stats_kernel(_f64(k), cfg.cell)


def block_candidates(a: np.ndarray, T: int, cfg: FreeSoloConfig) -> tuple[np.ndarray, np.ndarray]:
    """FS-L candidate sets per query block and kv head (spec §5).

    a [B, Hkv, C] -> cand int64 [B, Hkv, nb, P+W] (-1 padded; pool by (a_c, c) descending, then the
    recent cells in order), ncand int64 [B, Hkv, nb]; nb = ceil(T / block).
    """
    if cfg.variant != "fsl":
        raise ValueError(f"block_candidates is the FS-L pool, not variant={cfg.variant!r}")
    nb = (T + cfg.block - 1) // cfg.block
    return _kernels().fsl_pool_kernel(
        np.ascontiguousarray(a, dtype=np.float64), nb, cfg.block, cfg.cell, cfg.pool, cfg.recent
    )


def _select(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FS / FS-L selection with its counters: idx [B, T, Hq, K], scored [B, T, Hq], ncand [B, Hkv, nb]."""
    _check_fs_fsl(cfg, "numba selection")
    kern = _kernels()
    q, k = _f64(q), _f64(k)
    B, T, Hq, _ = q.shape
    nb = (T + cfg.block - 1) // cfg.block
    kbar, a = kern.cell_stats_kernel(k, cfg.cell)  # [B, Hkv, C, D], [B, Hkv, C]
    if cfg.variant == "fsl":
        cand, ncand = block_candidates(a, T, cfg)  # [B, Hkv, nb, P+W], [B, Hkv, nb]
    else:
        cand = np.zeros((1, 1, 1, 1), dtype=np.int64)  # unused by FS
        n_avail = np.arange(nb, dtype=np.int64) * cfg.block // cfg.cell  # [nb]
        ncand = np.ascontiguousarray(np.broadcast_to(n_avail, (B, k.shape[2], nb)))
    sigma = cfg.per_head("sigma", Hq)
    lam = cfg.per_head("lam", Hq)
    idx, scored = kern.select_kernel(
        q, kbar, a, cand, ncand, cfg.variant == "fsl", sigma, lam, cfg.block, cfg.cell, cfg.top_k
    )
    return idx, scored, ncand


def _fsb_module():
    """`fsb`, imported on first FS-B use (its kernels compile then)."""
    return importlib.import_module("freesolo.backends.numba.fsb")


def select_cells(q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """Selected cells: q [B, T, Hq, D], k [B, T, Hkv, D] -> int64 [B, T, Hq, K], descending score, -1 padded."""
    if cfg.variant == "fsb":
        return np.asarray(_fsb_module().select_cells_fsb_numba(_f64(q), _f64(k), cfg), dtype=np.int64)
    return _select(q, k, cfg)[0]


def local_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """RoPE sliding-window attention (spec §2): q [B, T, Hq, D], k / v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    T = q.shape[1]
    pad = -T % cfg.block  # whole blocks: the kernel's query tiles and key spans (hence its vectorised
    if pad:  # sums) depend on positions only, never on T (row independence, L12)
        q, k, v = (np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    tables = _rope_tables(q.shape[1], q.shape[3], cfg.rope_theta)  # cos, sin [T, D/2]
    q_rot = _rope_all(q, cfg.rope_theta, tables=tables)  # [B, T, Hq, D]
    k_rot = _rope_all(k, cfg.rope_theta, per_head=True, tables=tables)  # [B, Hkv, T, D]
    return _kernels().local_kernel(q_rot, k_rot, _transposed(v), cfg.window, cfg.block)[:, :T]


def _check_idx(idx, q: np.ndarray, k: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    B, T, Hq, _ = q.shape
    idx = np.asarray(idx)
    if idx.ndim != 4 or idx.shape[:3] != (B, T, Hq):
        raise ValueError(f"idx shape {idx.shape} must be [B={B}, T={T}, Hq={Hq}, K]")
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"idx must be an integer array, got {idx.dtype}")
    C = k.shape[1] // cfg.cell
    if idx.size and (idx.min() < -1 or idx.max() >= C):
        raise ValueError(f"idx values must be -1 or complete cells in [0, {C}), got [{idx.min()}, {idx.max()}]")
    return np.ascontiguousarray(idx, dtype=np.int64)


def long_range_readout(q: np.ndarray, k: np.ndarray, v: np.ndarray, idx: np.ndarray, cfg: FreeSoloConfig) -> np.ndarray:
    """NoPE attention over the selected cells idx [B, T, Hq, K] (-1 = none) -> [B, T, Hq, D]; no cell -> 0."""
    q, k = _f64(q), _f64(k)
    idx = _check_idx(idx, q, k, cfg)
    k_h = _per_head(k)  # [B, Hkv, T, D]
    vTc = _cells_transposed(_f64(v), cfg.cell)  # [B, Hkv, C, D, cell]
    return _kernels().readout_kernel(q, k_h, vTc, idx, cfg.cell, cfg.block)


def combine(o_loc: np.ndarray, o_long: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """o = o_loc + beta_h * rmsnorm(o_long) over D. o_loc / o_long [B, T, Hq, D], beta [Hq]."""
    rms = np.sqrt(np.mean(o_long * o_long, axis=-1, keepdims=True) + eps)  # [B, T, Hq, 1]
    return o_loc + np.asarray(beta, dtype=np.float64)[None, None, :, None] * (o_long / rms)


def attention(q, k, v, cfg: FreeSoloConfig, beta: np.ndarray | None = None) -> np.ndarray:
    """FreeSolo attention (spec §7): q [B, T, Hq, D], k / v [B, T, Hkv, D], beta [Hq] -> [B, T, Hq, D]."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    beta = np.ones(q.shape[2]) if beta is None else _f64(beta)
    idx = select_cells(q, k, cfg)
    return combine(local_attention(q, k, v, cfg), long_range_readout(q, k, v, idx, cfg), beta, cfg.eps)


def count_costs(q, k, cfg: FreeSoloConfig) -> dict[str, np.ndarray]:
    """Counted costs from the instrumented selection path (spec §10).

    Args:
        q: [B, T, Hq, D]; k: [B, T, Hkv, D] (numpy or torch; converted to float64).
    Returns a dict of arrays:
        "cells_scored"  int64 [B, T, Hq]: cells whose score each query computed (FS: n_j, FS-L: |C_j|, FS-B: 0)
        "tokens_read"   int64 [B, T, Hq]: local window tokens + tokens of the selected cells
        "cells_selected" int64 [B, T, Hq]: selected cells (<= top_k)
        "available_per_block"  int64 [nb]: n_j
        "total_cells_scored", "total_tokens_read": int64 scalars (0-d arrays), sums over (b, i, h).
      FS / FS-L also: "candidates_per_block" int64 [B, Hkv, nb]: |C_j| per kv head and query block.
      FS-B also (from `fsb.py`): "node_keys", "cells_reranked" int64 [B, T, Hq].
    """
    from ..._validation import check_inputs

    check_inputs(q, k, None, cfg)
    q, k = _f64(q), _f64(k)
    B, T, Hq, _ = q.shape
    extra: dict[str, np.ndarray] = {}
    if cfg.variant == "fsb":
        idx, fsb_costs = _fsb_module().select_cells_fsb_numba(q, k, cfg, return_costs=True)
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        scored = np.zeros((B, T, Hq), dtype=np.int64)
        extra = {name: np.asarray(value, dtype=np.int64) for name, value in fsb_costs.items()}
    else:
        idx, scored, ncand = _select(q, k, cfg)
        extra["candidates_per_block"] = ncand
    tokens = _kernels().tokens_read_kernel(idx, cfg.window, cfg.cell)
    nb = (T + cfg.block - 1) // cfg.block
    return {
        "cells_scored": scored,
        "tokens_read": tokens,
        "cells_selected": (idx >= 0).sum(axis=-1).astype(np.int64),
        "available_per_block": np.arange(nb, dtype=np.int64) * cfg.block // cfg.cell,
        "total_cells_scored": np.asarray(scored.sum(), dtype=np.int64),
        "total_tokens_read": np.asarray(tokens.sum(), dtype=np.int64),
        **extra,
    }


class NumbaBackend(HostBackend):
    """Compiled CPU backend (float64, parallel over batch x heads x query blocks)."""

    name = "numba"

    def unavailable_reason(self) -> str | None:
        try:
            import numba  # noqa: F401
        except ImportError:
            return "numba is not installed (pip install numba)"
        return None

    def attention(self, q, k, v, cfg, beta):
        return attention(q, k, v, cfg, beta)

    def select_cells(self, q, k, cfg):
        return select_cells(q, k, cfg)
