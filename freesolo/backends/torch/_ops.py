"""Small tensor helpers of the torch backend: dtypes, RoPE, cell statistics, chunk sizes.

Layout inside the backend: heads before time, queries split by kv head,
q [B, Hkv, G, T, D] (G = Hq // Hkv query heads per kv head), k / v [B, Hkv, T, D].

Row independence (spec L12). Every kernel result of query i in row b must be a function of
row b's tokens <= i alone, bit for bit. A matmul, a reduction or even an elementwise kernel may
pick its blocking, its summation order or its vector/scalar path from the *shape* of the whole
call, so the backend processes one batch row at a time, in chunks of a fixed number of query
blocks (`chunk_blocks`: from the per-row budget, the config and the head shapes; never from B, T
or the data), pads the last chunk to a whole chunk (`pad_time`) and pads every data-dependent
width to a fixed bound. The op that computes query i then has the same shapes, and the same
inputs in the entries that reach query i, whatever the other rows or the later tokens are.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "cell_stats",
    "chunk_blocks",
    "MAX_CHUNK_TOKENS",
    "compute_dtype",
    "pad_time",
    "padded_length",
    "selection_chunk_tokens",
    "selection_chunk_scope",
    "rope",
    "rope_tables",
    "take_rows",
]

# Memory budget of one query chunk (the transient tensors of one chunk, backward included).
# The chunk is a whole number of query blocks, at least one block; see `chunk_blocks`.
# CUDA: 4 GiB, so that the FS / FS-B readout (budgeted for its widest layout, about 1.2 MB per
# query position at H 16, D 64, bf16) takes 4096-position chunks like the FS-L stages: at
# T = 4096 one launch-bound chunk instead of two (2 GiB cost FS's forward ~20 % at 4k against the
# pre-L12 code, issue 9; benchmarks/torch_l12_ab.py).
DEFAULT_CHUNK_BYTES = {"cuda": 4 << 30, "cpu": 64 << 20}
# Most query positions per budget-derived chunk: the last chunk of a row is padded to a whole
# chunk (row independence), so a short sequence computes at most this many padded positions.
# On CUDA the cheap stages (FS-L selection) reach it: a few launch-bound chunks cost less than
# many small ones; the readout and FS / FS-B selection stay below it by their budgets. 4096, not
# more: a row shorter than the cap computes the whole cap (8192 doubled the FS-L selection's work
# at T = 4096), and past it the extra chunks' launches overlap the GPU's work.
MAX_CHUNK_TOKENS = {"cuda": 4096, "cpu": 128}
_SELECTION_CHUNK_TOKENS: list = [None]  # set by `selection_chunk_scope`


@contextlib.contextmanager
def selection_chunk_scope(tokens: int | None):
    """Within the scope, the torch backend's cell selection (called without `chunk_tokens` /
    `chunk_bytes`) cuts each row's queries into chunks of `tokens` positions (rounded up to whole
    blocks) instead of the budget default; None restores the default. FS-B's search is a Python
    loop of small ops per chunk (launch-bound on a GPU): chunks as long as the sequence cut its
    launches several-fold at the cost of transient memory (`fsb_bytes_per_query` per position).
    Rows stay independent (L12): the size is the caller's constant, not a function of B or the data.
    """
    if tokens is not None and tokens <= 0:
        raise ValueError(f"selection chunk tokens={tokens} must be positive (or None)")
    old = _SELECTION_CHUNK_TOKENS[0]
    _SELECTION_CHUNK_TOKENS[0] = tokens
    try:
        yield
    finally:
        _SELECTION_CHUNK_TOKENS[0] = old


def selection_chunk_tokens() -> int | None:
    """The chunk size `selection_chunk_scope` set (None: the budget default)."""
    return _SELECTION_CHUNK_TOKENS[0]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 computes in float64; float32 / bfloat16 / float16 compute (and accumulate) in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_tables(T: int, D: int, theta: float, device, dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] of half-split RoPE at positions start..start+T-1 (angles in float64;
    a negative position gives the table of a padded token that is masked out)."""
    half = D // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=device) / D)  # [D/2]
    pos = torch.arange(start, start + T, dtype=torch.float64, device=device)
    angle = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split ("rotate_half") RoPE. x [..., T, D], cos / sin [T, D/2] -> [..., T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def cell_stats(k: torch.Tensor, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, Hkv, T, D] (unrotated) -> kbar [B, Hkv, C, D] mean key, a [B, Hkv, C] max key norm; C = T // cell."""
    B, Hkv, T, D = k.shape
    C = T // cell
    cells = k[:, :, : C * cell].reshape(B, Hkv, C, cell, D)  # (B, Hkv, C, s, D)
    kbar = cells.mean(dim=-2)  # (B, Hkv, C, D)
    a = torch.sqrt((cells * cells).sum(dim=-1)).amax(dim=-1) if C > 0 else kbar.new_zeros(B, Hkv, 0)  # (B, Hkv, C)
    return kbar, a


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per (b, h) row gather: x [B, H, N, *rest], idx int64 [B, H, *shape] in [0, N)
    -> [B, H, *shape, *rest] (one flat index_select: faster than multi-tensor indexing)."""
    B, H, N = x.shape[:3]
    rest = x.shape[3:]
    base = (torch.arange(B * H, device=idx.device) * N).view(B, H, *([1] * (idx.dim() - 2)))
    rows = (idx + base).reshape(-1)
    return x.reshape(B * H * N, *rest).index_select(0, rows).view(*idx.shape, *rest)


def chunk_blocks(bytes_per_query: int, block: int, device: torch.device, chunk_tokens=None, chunk_bytes=None) -> int:
    """Query blocks per chunk of ONE batch row: `chunk_tokens` rounded up to whole blocks when
    given, else the power of two nearest to the number of blocks that fit `chunk_bytes` (default
    DEFAULT_CHUNK_BYTES by device type) at `bytes_per_query` transient bytes per query position
    of one row (all heads), capped at MAX_CHUNK_TOKENS positions. Always >= 1.

    Row independence (L12): callers pass bytes that depend on the config and the head shapes
    only (never on B, T or the data), so every row of every length is cut at the same block
    boundaries; a power of two leaves no padded block when T is a power-of-two multiple of it."""
    if chunk_tokens is not None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
        return max(1, math.ceil(chunk_tokens / block))
    budget = (
        chunk_bytes if chunk_bytes is not None else DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["cpu"])
    )
    fit = max(1, int(budget // max(1, bytes_per_query)) // block)
    cap = max(1, MAX_CHUNK_TOKENS.get(device.type, MAX_CHUNK_TOKENS["cpu"]) // block)
    nearest = 1 << max(0, round(math.log2(fit)))
    return max(1, min(nearest, 1 << (cap.bit_length() - 1)))


def padded_length(T: int, block: int, nblocks_per_chunk: int) -> int:
    """T rounded up to a whole number of chunks of `nblocks_per_chunk` query blocks (>= 1 chunk)."""
    step = block * nblocks_per_chunk
    return max(1, -(-T // step)) * step


def pad_time(x: torch.Tensor, T_pad: int, dim: int, value=0) -> torch.Tensor:
    """x padded with `value` along `dim` (the time axis) to length T_pad (differentiable; x itself
    when it is already that long)."""
    extra = T_pad - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
    return torch.nn.functional.pad(x, pad, value=value)
