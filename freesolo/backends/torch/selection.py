"""Cell selection of the torch backend for FS and FS-L (spec §3-§5, §7), under torch.no_grad.

Vectorized over heads and the queries of a chunk of query blocks; Python loops run over batch
rows and chunks. Row independence (spec L12): each row is selected alone, its queries padded to
whole chunks of `nblocks_per_chunk` blocks, and the candidate width of a chunk is a function of
the chunk's position only (FS: the cells available to its last block; FS-L: P + W), so the
scores of query i are computed by ops of the same shapes whatever B, T and the data are.
Memory per chunk: scores [Hq, chunk, candidates] (FS: candidates = the available cells, O(T/s)
per query; FS-L: P + W).

Exact tie-breaks without relying on `topk` ordering among equal values:
- FS-L pool: cells are ranked once per (b, kv head) by (a_c desc, c desc) with two stable sorts;
  the pool of a block is the P smallest *ranks* (distinct integers) among its older cells.
- top-K: candidates are listed by decreasing c, then a stable descending sort on the score keeps
  larger c first among equal scores.
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig
from ._ops import cell_stats, pad_time, padded_length, take_rows

__all__ = ["fs_fsl_select", "rank_by_norm", "topk_cells"]


def rank_by_norm(a: torch.Tensor) -> torch.Tensor:
    """a [B, Hkv, C] -> rank [B, Hkv, C] int64: 0 = largest a_c, ties to the larger c (a total order)."""
    C = a.shape[-1]
    rev = torch.flip(a, dims=[-1])  # position p holds cell C-1-p: larger c first
    order = torch.sort(rev, dim=-1, descending=True, stable=True).indices  # (B, Hkv, C)
    cells = C - 1 - order  # cells by (a desc, c desc)
    ranks = torch.arange(C, device=a.device).expand_as(cells)
    return torch.empty_like(cells).scatter_(-1, cells, ranks)


def topk_cells(scores: torch.Tensor, cand: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k candidates of largest score, ties to the earlier candidate (list candidates by
    decreasing c so that ties go to the larger cell). scores [..., N] (-inf = invalid),
    cand [..., N] broadcastable -> int64 [..., top_k], by descending score, -1 padded."""
    N = scores.shape[-1]
    kk = min(top_k, N)
    vals, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, order = vals[..., :kk], order[..., :kk]
    cand = cand.expand(*scores.shape[:-1], N)
    cells = torch.gather(cand, -1, order)
    cells = torch.where(torch.isneginf(vals), torch.full_like(cells, -1), cells)
    if kk < top_k:
        cells = torch.cat([cells, cells.new_full((*cells.shape[:-1], top_k - kk), -1)], dim=-1)
    return cells


def _fsl_block_candidates(rank, pool, j0: int, j1: int, cfg: FreeSoloConfig):
    """FS-L candidates of blocks j0..j1-1 and the pool of block j1 (the next chunk's first).

    rank [B, Hkv, C]; pool [B, Hkv, P] = top-P older cells of block j0 (-1 padded).
    Returns cand [B, Hkv, nb, P+W] by decreasing cell (-1 last) and the next pool [B, Hkv, P].
    Top-P of a prefix == top-P of (top-P of a shorter prefix + the cells added since): linear.
    """
    s, P, W = cfg.cell, cfg.pool, cfg.recent
    B, Hkv, C = rank.shape
    dev = rank.device
    n_py = [min(j * cfg.block // s, C) for j in range(j0, j1 + 1)]  # available cells (after the end: C)
    m_py = [max(0, x - W) for x in n_py]  # older cells are c < m
    n = (torch.arange(j0, j1 + 1, device=dev) * cfg.block // s).clamp(max=C)  # (nb+1,) == n_py, no host copy
    m = (n - W).clamp(min=0)  # == m_py
    nj = len(n_py)
    new = torch.arange(m_py[0], m_py[-1], device=dev)  # (Nn,) cells turning old during the chunk
    X = torch.cat([pool, new.expand(B, Hkv, -1)], dim=-1)  # (B, Hkv, P+Nn)
    valid = torch.cat(
        [(pool >= 0)[:, :, None, :].expand(B, Hkv, nj, P), (new[None, :] < m[:, None]).expand(B, Hkv, -1, -1)],
        dim=-1,
    )  # (B, Hkv, nb+1, P+Nn)
    big = C + 1
    key = torch.gather(rank, -1, X.clamp(min=0))[:, :, None, :].expand_as(valid)
    key = torch.where(valid, key, torch.full_like(key, big))
    kvals, kidx = torch.topk(key, P, dim=-1, largest=False)  # distinct ranks: exact
    pooled = torch.gather(X[:, :, None, :].expand(-1, -1, nj, -1), -1, kidx)
    pooled = torch.where(kvals >= big, torch.full_like(pooled, -1), pooled)  # (B, Hkv, nb+1, P)
    recent = m[:-1, None] + torch.arange(W, device=dev)[None, :]  # (nb, W)
    recent = torch.where(recent < n[:-1, None], recent, torch.full_like(recent, -1))
    cand = torch.cat([pooled[:, :, :-1], recent.expand(B, Hkv, -1, -1)], dim=-1)  # (B, Hkv, nb, P+W)
    cand = torch.sort(cand, dim=-1, descending=True).values  # distinct cells, -1 pads last
    return cand, pooled[:, :, -1]


@torch.no_grad()
def fs_fsl_select(q, k, cfg: FreeSoloConfig, sigma, lam, nblocks_per_chunk: int, candidates: bool = False):
    """FS / FS-L selection.

    Args:
        q: [B, Hkv, G, T, D] unrotated queries (compute dtype); k: [B, Hkv, T, D] unrotated keys.
        sigma, lam: [Hkv, G] per query head (compute dtype).
        nblocks_per_chunk: query blocks scored together (a constant of the config, never of B, T
            or the data: see the module docstring).
        candidates: also return FS-L's candidate set of every query block (FS-L only).
    Returns:
        idx int64 [B, Hkv, G, T, top_k], by descending score, -1 padded; with `candidates`, also
        cand int64 [B, Hkv, ceil(T / block), P + W]: block j's candidate cells C_j (spec §5),
        decreasing, -1 padded (a function of the cells available to block j alone).
    """
    if candidates and cfg.variant != "fsl":
        raise ValueError(f"candidates=True needs variant 'fsl', got {cfg.variant!r}")
    B, T = q.shape[0], q.shape[3]
    if B != 1:  # one row at a time: no shape depends on the other rows (L12)
        rows = [
            fs_fsl_select(q[b : b + 1], k[b : b + 1], cfg, sigma, lam, nblocks_per_chunk, candidates) for b in range(B)
        ]
        return tuple(torch.cat(x) for x in zip(*rows)) if candidates else torch.cat(rows)
    T_pad = padded_length(T, cfg.block, nblocks_per_chunk)  # whole chunks; padded cells are
    # available to padded blocks only (a cell ending after T is never before a real block's start)
    idx, cand = _fs_fsl_select_row(pad_time(q, T_pad, 3), pad_time(k, T_pad, 2), cfg, sigma, lam, nblocks_per_chunk)
    idx = idx[:, :, :, :T].contiguous()
    return (idx, cand[:, :, : -(-T // cfg.block)].contiguous()) if candidates else idx


def _fs_fsl_select_row(q, k, cfg: FreeSoloConfig, sigma, lam, nblocks_per_chunk: int):
    """fs_fsl_select of one row whose length is a whole number of chunks -> (idx, cand); cand is
    [B, Hkv, nblocks, P + W] (FS-L's candidate sets; -1 for FS)."""
    B, Hkv, G, T, D = q.shape
    s, Bq, K = cfg.cell, cfg.block, cfg.top_k
    dev = q.device
    nblocks = -(-T // Bq)
    scale = D**-0.5
    kbar, a = cell_stats(k, s)  # (B, Hkv, C, D), (B, Hkv, C)
    idx = torch.full((B, Hkv, G, T, K), -1, dtype=torch.int64, device=dev)
    fsl = cfg.variant == "fsl"
    cands = torch.full((B, Hkv, nblocks, cfg.pool + cfg.recent if fsl else 1), -1, dtype=torch.int64, device=dev)
    if kbar.shape[2] == 0:
        return idx, cands  # no complete cell: nothing to select
    if fsl:
        rank = rank_by_norm(a)
        pool = torch.full((B, Hkv, cfg.pool), -1, dtype=torch.int64, device=dev)
    sig = sigma.view(1, Hkv, G, 1, 1, 1)
    lm = lam.view(1, Hkv, G, 1, 1, 1)
    for j0 in range(0, nblocks, nblocks_per_chunk):
        j1 = min(nblocks, j0 + nblocks_per_chunk)
        nb = j1 - j0
        jj = torch.arange(j0, j1 + 1, device=dev)
        n_last = (j1 - 1) * Bq // s
        if fsl:
            cand, pool = _fsl_block_candidates(rank, pool, j0, j1, cfg)  # (B, Hkv, nb, N)
            cands[:, :, j0:j1] = cand
            if n_last == 0:
                continue
            cc = cand.clamp(min=0)
            kb = take_rows(kbar, cc)  # (B, Hkv, nb, N, D)
            ac = torch.gather(a[:, :, None, :].expand(-1, -1, nb, -1), -1, cc)  # (B, Hkv, nb, N)
            valid = (cand >= 0)[:, :, None, :, None, :]  # (B, Hkv, 1, nb, 1, N)
            cand_b = cand[:, :, None, :, None, :]
            ac_b = ac[:, :, None, :, None, :]
        else:
            if n_last == 0:
                continue
            cand = torch.arange(n_last - 1, -1, -1, device=dev)  # (N,) decreasing cells
            kb = kbar[:, :, :n_last].flip(dims=[2])  # (B, Hkv, N, D)
            n = jj[:-1] * Bq // s  # (nb,)
            valid = (cand[None, :] < n[:, None])[None, None, None, :, None, :]  # (1, 1, 1, nb, 1, N)
            cand_b = cand.view(1, 1, 1, 1, 1, -1)
            ac_b = a[:, :, :n_last].flip(dims=[2])[:, :, None, None, None, :]
        i0, i1 = j0 * Bq, min(T, j1 * Bq)
        qc = q[:, :, :, i0:i1]
        if i1 - i0 < nb * Bq:
            qc = torch.nn.functional.pad(qc, (0, 0, 0, nb * Bq - (i1 - i0)))
        qc = qc.reshape(B, Hkv, G, nb, Bq, D)  # (B, Hkv, G, nb, Bq, D)
        if fsl:
            dot = torch.einsum("bhgnqd,bhncd->bhgnqc", qc, kb)
        else:
            dot = torch.einsum("bhgnqd,bhcd->bhgnqc", qc, kb)
        pos = torch.arange(i0, i0 + nb * Bq, device=dev, dtype=q.dtype).view(1, 1, 1, nb, Bq, 1)
        dist = pos - (cand_b * s).to(q.dtype)
        score = scale * dot + lm * ac_b * torch.erf(sig * dist / (2.0 * s))  # (B, Hkv, G, nb, Bq, N)
        score = score.masked_fill(~valid, float("-inf"))
        cells = topk_cells(score, cand_b, K)  # (B, Hkv, G, nb, Bq, K)
        idx[:, :, :, i0:i1] = cells.reshape(B, Hkv, G, nb * Bq, K)[:, :, :, : i1 - i0]
    return idx, cands
