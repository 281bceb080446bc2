"""`torch` backend: FS, FS-L, FS-B on CPU and CUDA with autograd (spec §2-§8).

Inputs are tensors as the user passed them (q [B, T, Hq, D], k / v [B, T, Hkv, D], beta [Hq] or
None); outputs have q's dtype and device; nothing is moved between devices. float64 computes
in float64, float32 / bfloat16 / float16 compute (and accumulate) in float32.

Row independence (spec L12). Selection and readout run one batch row at a time, in chunks of a
fixed number of whole query blocks, the row padded to a whole number of chunks, with every
buffer padded to a width fixed by the config and the chunk's position (see `_ops`): the output
and the selection of query i in row b are the same bits whatever the other rows (B = 1
included) and the later tokens are.

Memory. Work proceeds per row in chunks of whole query blocks whose size follows a memory budget
(`DEFAULT_CHUNK_BYTES`: 4 GiB on CUDA, 64 MiB on CPU; a power of two of blocks, at most
`MAX_CHUNK_TOKENS` positions) or `chunk_tokens`; nothing of size T x T is ever built. FS sizes
its chunks for 2048 available cells (T = 64k at s = 32): its scores grow with T beyond that
(linear in T per chunk, as the chunk size may not depend on T). Beyond one chunk, the op keeps
heads-first copies of q, k, v in their own dtype (one row of them padded to whole chunks), the
selection (int64 [B, Hq, T, K]) and, in backward, dk / dv accumulators in the compute dtype:
O(T) for every variant (FS-B adds its tree tables, O((T/s) log(T/s) D) per kv head). FS scores
all available cells per query (quadratic time, linear memory).
On CUDA the scatter of key / value gradients uses atomics (index_add_): not bitwise reproducible.
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig
from ..base import Backend
from ._ops import chunk_blocks, compute_dtype, pad_time, padded_length, selection_chunk_tokens
from .attention import FreeSoloReadout, readout_bytes_per_query, readout_mode
from .selection import fs_fsl_select

__all__ = ["TorchBackend", "attention", "select_cells"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FS_CHUNK_CELLS = 2048  # FS: the available cells its chunk size is budgeted for (never T: L12)


def _heads_first(x: torch.Tensor, Hkv: int, cdt: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, Hkv, H // Hkv, T, D] contiguous, in dtype `cdt` (differentiable)."""
    B, T, H, D = x.shape
    return x.to(cdt).permute(0, 2, 1, 3).reshape(B, Hkv, H // Hkv, T, D).contiguous()


def _per_head(cfg: FreeSoloConfig, name: str, Hq: int, Hkv: int, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(cfg.per_head(name, Hq), dtype=like.dtype, device=like.device).view(Hkv, Hq // Hkv)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, beta) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor for the torch backend, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: move it (the backend never moves data)")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q dtype {q.dtype} is not one of {_DTYPES}")


def _select(q4, k4, cfg: FreeSoloConfig, chunk_tokens, chunk_bytes, candidates: bool = False):
    """q4 [B, Hkv, G, T, D], k4 [B, Hkv, T, D] (compute dtype) -> idx [B, Hkv, G, T, K]; with
    `candidates` -> (idx, cand): cand int64 [B, Hkv, ceil(T / Bq), P + W], FS-L's candidate sets
    (None for FS and FS-B). Chunk sizes are per row, from the config and head shapes only (L12);
    the selection functions run one row at a time."""
    B, Hkv, G, T, D = q4.shape
    Hq = Hkv * G
    rerank_tokens = chunk_tokens  # FS-B's rerank sub-chunks: never from the scope (its memory grows fastest)
    if chunk_tokens is None and chunk_bytes is None:
        chunk_tokens = selection_chunk_tokens()  # `selection_chunk_scope`; None: the budget default
    if cfg.variant == "fsb":
        from .fsb import fsb_bytes_per_query, fsb_select

        beam_bytes, rerank_bytes = fsb_bytes_per_query(1, Hq, D, cfg, q4.element_size())
        nbc = chunk_blocks(beam_bytes, cfg.block, q4.device, chunk_tokens, chunk_bytes)
        nbr = min(nbc, chunk_blocks(rerank_bytes, cfg.block, q4.device, rerank_tokens, chunk_bytes))
        sigma, lam = _per_head(cfg, "sigma", Hq, Hkv, q4), _per_head(cfg, "lam", Hq, Hkv, q4)
        idx = fsb_select(q4, k4, cfg, sigma, lam, nbc, nbr)
        return (idx, None) if candidates else idx
    n_cand = cfg.pool + cfg.recent if cfg.variant == "fsl" else FS_CHUNK_CELLS
    per_query = Hq * q4.element_size() * (6 * n_cand + 2 * D)
    nbc = chunk_blocks(per_query, cfg.block, q4.device, chunk_tokens, chunk_bytes)
    sigma, lam = _per_head(cfg, "sigma", Hq, Hkv, q4), _per_head(cfg, "lam", Hq, Hkv, q4)
    if candidates and cfg.variant == "fsl":
        return fs_fsl_select(q4, k4, cfg, sigma, lam, nbc, candidates=True)
    idx = fs_fsl_select(q4, k4, cfg, sigma, lam, nbc)
    return (idx, None) if candidates else idx


def select_cells(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, chunk_tokens=None, chunk_bytes=None):
    """Selected cells, int64 [B, T, Hq, K] by descending final score, -1 padded (spec §7).

    Args:
        q: [B, T, Hq, D]; k: [B, T, Hkv, D] (same device and dtype).
        chunk_tokens / chunk_bytes: query chunk size, or its memory budget (default by device).
    """
    _check(q, k, None, None)
    B, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    cdt = compute_dtype(q.dtype)
    with torch.no_grad():
        idx = _select(_heads_first(q, Hkv, cdt), _heads_first(k, Hkv, cdt)[:, :, 0], cfg, chunk_tokens, chunk_bytes)
    return idx.reshape(B, Hq, T, cfg.top_k).permute(0, 2, 1, 3).contiguous()  # (B, T, Hq, K)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: FreeSoloConfig,
    beta: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    chunk_bytes: int | None = None,
    long_path: str | None = None,
) -> torch.Tensor:
    """FreeSolo attention with autograd to q, k, v, beta (spec §7, §8).

    Args:
        q: [B, T, Hq, D] unrotated queries; k, v: [B, T, Hkv, D]; beta: [Hq] or None (ones).
        idx: optional int64 [B, T, Hq, K] selection to read instead of computing it (-1 padded).
        chunk_tokens / chunk_bytes: query chunk size, or its memory budget (default by device).
        long_path: the long branch's layout mode, "auto", "union", "gather" or "wide" (see
            attention.py); None: the environment variable FREESOLO_TORCH_READOUT, else "auto".
    Returns:
        o [B, T, Hq, D] in q's dtype.
    """
    _check(q, k, v, beta)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    cdt = compute_dtype(q.dtype)
    q4 = _heads_first(q, Hkv, q.dtype)  # (B, Hkv, G, T, D), the input dtype: chunks are cast on entry
    k4 = _heads_first(k, Hkv, q.dtype)[:, :, 0]  # (B, Hkv, T, D)
    v4 = _heads_first(v, Hkv, q.dtype)[:, :, 0]
    cand = None  # FS-L's candidate sets: the readout's union buffers (see attention.py)
    if idx is None:
        with torch.no_grad():
            idx4, cand = _select(q4.detach().to(cdt), k4.detach().to(cdt), cfg, chunk_tokens, chunk_bytes, True)
    else:
        if tuple(idx.shape) != (B, T, Hq, cfg.top_k):
            raise ValueError(f"idx shape {tuple(idx.shape)} must be [B={B}, T={T}, Hq={Hq}, K={cfg.top_k}]")
        if idx.device != q.device:
            raise ValueError(f"idx is on {idx.device} but q is on {q.device}: move it (the backend never moves data)")
        idx4 = idx.to(torch.int64).permute(0, 2, 1, 3).reshape(B, Hkv, G, T, cfg.top_k)
        avail = (torch.arange(T, device=q.device) // cfg.block * cfg.block // cfg.cell).view(1, 1, 1, T, 1)
        late = idx4 >= avail  # a cell the query's block may not read: the readout's buffers exclude it
        if bool(late.any()):
            b_, h_, g_, i_, _ = (int(x) for x in late.nonzero()[0])
            cell = int(idx4[b_, h_, g_, i_].max())
            raise ValueError(
                f"idx[{b_}, {i_}, {h_ * G + g_}] selects cell {cell}, not available to query {i_} "
                f"(cells < {int(avail.view(-1)[i_])} are: spec §3)"
            )
    b = torch.ones(Hq, dtype=cdt, device=q.device) if beta is None else beta.to(cdt)
    idx4 = idx4.contiguous()
    long_path = readout_mode(long_path)  # validated; the environment's mode when None
    per_query = readout_bytes_per_query(Hq, D, cfg, torch.finfo(cdt).bits // 8, cand is not None, long_path)
    nbc = chunk_blocks(per_query, cfg.block, q.device, chunk_tokens, chunk_bytes)
    T_pad = padded_length(T, cfg.block, nbc)
    rows = []
    for r in range(B):  # one row at a time, padded to whole chunks (L12)
        qr = pad_time(q4[r : r + 1], T_pad, 3)  # (1, Hkv, G, T_pad, D), zeros after T
        kr, vr = pad_time(k4[r : r + 1], T_pad, 2), pad_time(v4[r : r + 1], T_pad, 2)  # (1, Hkv, T_pad, D)
        ir = pad_time(idx4[r : r + 1], T_pad, 3, value=-1)
        nbp = T_pad // cfg.block  # (1, Hkv, nbp, P+W): FS-L's candidate sets, padded blocks have none
        cr = None if cand is None else pad_time(cand[r : r + 1], nbp, 2, value=-1)
        o = FreeSoloReadout.apply(qr, kr, vr, b.view(Hkv, G), ir, cr, cfg, nbc, long_path)
        rows.append(o[:, :, :, :T])  # (1, Hkv, G, T, D)
    o = torch.cat(rows) if B > 1 else rows[0]
    return o.reshape(B, Hq, T, D).permute(0, 2, 1, 3).contiguous()  # (B, T, Hq, D), q's dtype


class TorchBackend(Backend):
    """Vectorized PyTorch implementation of every variant, CPU and CUDA, with autograd.

    Args:
        chunk_tokens: query positions per chunk (rounded up to whole blocks); default: by budget.
        chunk_bytes: memory budget of one chunk's transient tensors (default DEFAULT_CHUNK_BYTES).
    """

    name = "torch"
    array_kind = "torch"

    def __init__(self, chunk_tokens: int | None = None, chunk_bytes: int | None = None):
        self.chunk_tokens, self.chunk_bytes = chunk_tokens, chunk_bytes

    def unsupported_reasons(self, info, cfg: FreeSoloConfig) -> list[str]:
        reasons = []
        if info.kind == "torch" and info.dtype not in tuple(str(d) for d in _DTYPES):
            reasons.append(f"torch backend computes float16/bfloat16/float32/float64, got {info.dtype}")
        return reasons

    def attention(self, q, k, v, cfg, beta):
        return attention(q, k, v, cfg, beta, chunk_tokens=self.chunk_tokens, chunk_bytes=self.chunk_bytes)

    def select_cells(self, q, k, cfg):
        return select_cells(q, k, cfg, chunk_tokens=self.chunk_tokens, chunk_bytes=self.chunk_bytes)
