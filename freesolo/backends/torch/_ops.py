"""Small tensor helpers of the torch backend: dtypes, RoPE, cell statistics, chunk sizes.

Layout inside the backend: heads before time, queries split by kv head,
q [B, Hkv, G, T, D] (G = Hq // Hkv query heads per kv head), k / v [B, Hkv, T, D].
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "cell_stats",
    "chunk_blocks",
    "compute_dtype",
    "rope",
    "rope_tables",
    "take_rows",
]

# Memory budget of one query chunk (the transient tensors of one chunk, backward included).
# The chunk is a whole number of query blocks, at least one block; see `chunk_blocks`.
DEFAULT_CHUNK_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 computes in float64; float32 / bfloat16 / float16 compute (and accumulate) in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_tables(T: int, D: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] of half-split RoPE at positions 0..T-1 (angles computed in float64)."""
    half = D // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=device) / D)  # [D/2]
    angle = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]  # [T, D/2]
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
    """Query blocks per chunk: `chunk_tokens` rounded up to whole blocks when given, else as many
    blocks as fit `chunk_bytes` (default DEFAULT_CHUNK_BYTES by device type) at `bytes_per_query`
    transient bytes per query position (all heads and batch rows). Always >= 1."""
    if chunk_tokens is not None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
        return max(1, math.ceil(chunk_tokens / block))
    budget = (
        chunk_bytes if chunk_bytes is not None else DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["cpu"])
    )
    return max(1, int(budget // max(1, bytes_per_query)) // block)
