"""Triton selection kernels for FS and FS-L (spec §3-§5, §7): cell statistics, FS-L candidate
pools, scoring + per-query top-K.

The kernels, launched in this order by `select_cells`:

1. `_cell_stats_kernel`: one pass over K. One program per (b, kv head, group of CELLS_PER_PROG
   cells): kbar_c = mean key (fp32), a_c = max key norm (fp32).
2. FS-L only, `_fsl_pool_scan_kernel` then `_fsl_cand_kernel` (see `fsl_candidates`): one program
   per (b, kv head) runs the streaming form of §5 over the older cells, `chunk` cells per step
   with the pool in registers (cells compete with the kept pool on (a_c desc, c desc), losers are
   dropped for ever; the pool keeps its members' ranks so a step costs O(P * chunk), never a
   scan of older cells), recording the pool at chunk boundaries; then one program per (chunk,
   b, kv head), all in parallel, continues the same stream from its chunk's recorded pool
   through the query blocks whose older cells end in that chunk (a block adds at most Bq / s
   cells), writing each block's pool. Linear in T, sequential depth C / chunk (+ chunk / (Bq / s)).
   Writes cand int32 [B, Hkv, nblocks, P + W]: the pool's P slots (unordered, -1 for an empty
   slot), then the W recent cells [m_j, n_j) (-1 past n_j).
3. `_score_topk_kernel`: one program per (b, query head, tile of BLOCK_M queries inside one query
   block). Streams over the block's candidates in chunks of BLOCK_N (FS: every available cell
   [0, n_j), FS-L: the P + W cand entries), scores [BLOCK_M, BLOCK_N] in fp32
   (score = scale * q . kbar + lam_h * a_c * erf(sigma_h * (i - c*s) / (2s)); the dot is an fp32
   `tl.dot` with input_precision="ieee"; 16-bit inputs: a split tensor-core dot, see below) and
   keeps a running top-K per query of (fp32 score, cell) pairs ordered by (score desc, c desc)
   (spec §7's tie rule), sorted once at the end. No [T, cells] tensor exists.

Row independence (L12): tile sizes depend on the config and D only; a query's result depends on
its row's cells c < n_j (whose statistics are functions of their own tokens) and on nothing else;
the loop bounds of a program depend on its block index only.

All pointer offsets are int64 (program ids and indices are cast before any multiply).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ...config import FreeSoloConfig
from ._common import cdiv, launch, next_pow2, store_union  # (importing _common also patches the interpreter's dynamic loop bounds for NumPy >= 2.4)

__all__ = [
    "ERF_ONE",
    "MAX_POOL",
    "ScoreTiles",
    "cell_stats",
    "fsl_tail_width",
    "fsl_candidates",
    "fsl_direct_max_cells",
    "fuses_unions",
    "head_params",
    "pool_chunk",
    "score_tiles",
    "select_cells",
]

# The FS-L pool lives in registers: P rounded up to a power of two lanes per program (with
# [P, chunk] comparison tiles; 256 x 16 compiles for sm_90 without spills at 8 warps).
MAX_POOL = 256
# Below every real a_c (a norm, >= 0): the key of an empty pool slot, and of a padding new cell.
_EMPTY_A = tl.constexpr(-1.0)
_PAD_A = tl.constexpr(-2.0)
# Reductions through tl.reduce / tl.associative_scan with triton's own combine functions: the same
# code as tl.max / tl.sum / tl.cumsum when compiled, but the interpreter (TRITON_INTERPRET=1) runs
# them as one NumPy call instead of re-patching triton.language for every nested @jit call
# (about 10 ms each): this keeps the CPU tests of these kernels in CI's budget.
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_SUM = tl.standard._sum_combine
# The running top-K orders (fp32 score desc, with -0.0 == +0.0, then cell desc): spec §7's tie rule.
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT32_MIN = tl.constexpr(-(2**31))
# erf(x) is exactly 1.0 in fp32 from here on (erfc(4) = 1.5e-8 < 2^-25, half an ulp below 1.0):
# the scoring kernel skips erf for a chunk whose every prior argument reaches it (ScoreTiles.erf_skip).
ERF_ONE = 4.0
_ERF_ONE = tl.constexpr(ERF_ONE)


# ---- kernels ---------------------------------------------------------------------------------


@triton.jit
def _cell_stats_kernel(
    K,  # [B, T, Hkv, D] any strides
    KBAR,  # fp32 [B, Hkv, C, D] contiguous
    AMAX,  # fp32 [B, Hkv, C] contiguous
    C,
    HKV,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    D: tl.constexpr,
    CELL: tl.constexpr,
    CELLS_PER_PROG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_c = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HKV
    g = pid_bh % HKV
    c = pid_c * CELLS_PER_PROG + tl.arange(0, CELLS_PER_PROG).to(tl.int64)  # [CPP] cells
    t_off = tl.arange(0, BLOCK_T).to(tl.int64)
    d_off = tl.arange(0, BLOCK_D).to(tl.int64)
    c_ok = c < C
    d_ok = d_off < D
    k_base = K + b * stride_kb + g * stride_kh + d_off[None, None, :] * stride_kd
    acc = tl.zeros([CELLS_PER_PROG, BLOCK_D], dtype=tl.float32)
    best = tl.zeros([CELLS_PER_PROG], dtype=tl.float32)  # squared norms are >= 0
    for t0 in range(0, CELL, BLOCK_T):
        t = t0 + t_off  # [BLOCK_T] token offsets inside the cell
        tok = c[:, None] * CELL + t[None, :]  # [CPP, BLOCK_T]
        ok = (c_ok[:, None] & (t[None, :] < CELL))[:, :, None] & d_ok[None, None, :]
        x = tl.load(k_base + tok[:, :, None] * stride_kt, mask=ok, other=0.0).to(tl.float32)
        acc += tl.reduce(x, 1, _SUM)
        best = tl.maximum(best, tl.reduce(tl.reduce(x * x, 2, _SUM), 1, _MAX))
    rows = pid_bh * C + c  # [CPP] rows of KBAR / AMAX
    tl.store(KBAR + rows[:, None] * D + d_off[None, :], acc / CELL, mask=c_ok[:, None] & d_ok[None, :])
    # sqrt is monotone and correctly rounded: max of sqrt == sqrt of max
    tl.store(AMAX + rows, tl.sqrt_rn(best), mask=c_ok)


@triton.jit
def _pool_merge(pool_a, pool_c, pool_r, live, new_a, new_c, POOL: tl.constexpr):
    """One step of the streaming pool (spec §5): the new cells (`new_a` / `new_c` [N]; padding
    lanes with a = _PAD_A and distinct c below every real cell) compete with the pool's members
    (`pool_a` / `pool_c` / `pool_r` [P_PAD]: key and rank in (a desc, c desc) order; lanes where
    `live` is False are never members) on (a desc, c desc); the union's best POOL stay. Keys are
    distinct, so ranks are a permutation. Costs O(P_PAD * N + N^2): no scan of older cells."""
    # beats[x, y]: new y beats pool x on (a desc, c desc)
    beats = (new_a[None, :] > pool_a[:, None]) | ((new_a[None, :] == pool_a[:, None]) & (new_c[None, :] > pool_c[:, None]))
    beats = beats & live[:, None]
    union_r_pool = pool_r + tl.reduce(beats.to(tl.int32), 1, _SUM)  # [P_PAD] rank in pool + new
    beaten_by_pool = tl.reduce((live[:, None] & ~beats).to(tl.int32), 0, _SUM)  # [N]
    nn_beats = (new_a[None, :] > new_a[:, None]) | ((new_a[None, :] == new_a[:, None]) & (new_c[None, :] > new_c[:, None]))
    union_r_new = beaten_by_pool + tl.reduce(nn_beats.to(tl.int32), 1, _SUM)  # [N]
    dropped = live & (union_r_pool >= POOL)
    survives = union_r_new < POOL
    # the k-th dropped slot (in slot order) takes the k-th surviving new cell
    drop_k = tl.associative_scan(dropped.to(tl.int32), 0, _SUM) - 1
    surv_k = tl.associative_scan(survives.to(tl.int32), 0, _SUM) - 1
    take = dropped[:, None] & survives[None, :] & (drop_k[:, None] == surv_k[None, :])  # [P_PAD, N]
    take_a = tl.reduce(tl.where(take, new_a[None, :], 0.0), 1, _SUM)
    take_c = tl.reduce(tl.where(take, new_c[None, :], 0), 1, _SUM)
    take_r = tl.reduce(tl.where(take, union_r_new[None, :], 0), 1, _SUM)
    pool_a = tl.where(dropped, take_a, pool_a)
    pool_c = tl.where(dropped, take_c, pool_c)
    pool_r = tl.where(dropped, take_r, union_r_pool)
    return pool_a, pool_c, pool_r


@triton.jit
def _merge_cells(pool_a, pool_c, pool_r, live, amax_row, lo, hi, N: tl.constexpr, POOL: tl.constexpr, P_PAD: tl.constexpr):
    """Merge the cells [lo, hi) (hi - lo <= N) of one row of AMAX into the pool (top-P by key)."""
    new_i = tl.arange(0, N)
    new_c = lo + new_i
    new_ok = new_c < hi
    new_a = tl.load(amax_row + new_c, mask=new_ok, other=_PAD_A)
    new_c = tl.where(new_ok, new_c, -2 - P_PAD - new_i)  # padding: distinct, below everything
    return _pool_merge(pool_a, pool_c, pool_r, live, new_a, new_c, POOL)


@triton.jit
def _fsl_pool_scan_kernel(
    AMAX,  # fp32 [B, Hkv, C]
    BASE,  # int32 [B, Hkv, NCHUNKS + 1, POOL]: BASE[t] = top-P of cells [0, t * CHUNK), -1 = empty
    C,
    M_LAST,  # older cells of the last query block: cells [0, M_LAST) are scanned
    NCHUNKS,  # ceil(M_LAST / CHUNK)
    POOL: tl.constexpr,
    P_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * Hkv + g
    a_base = AMAX + pid * C
    base_rows = BASE + pid * (NCHUNKS + 1) * POOL
    slot = tl.arange(0, P_PAD)
    live = slot < POOL  # lanes past POOL are never part of the pool
    # The pool: POOL members, empty ones with key (_EMPTY_A, -1 - slot) so that every key is
    # distinct; rank = position in (a desc, c desc) order among the members (a permutation).
    pool_a = tl.full([P_PAD], _EMPTY_A, tl.float32)
    pool_c = -1 - slot
    pool_r = slot
    tl.store(base_rows + slot, tl.full([P_PAD], -1, tl.int32), mask=live)
    for t in range(NCHUNKS):
        pool_a, pool_c, pool_r = _merge_cells(pool_a, pool_c, pool_r, live, a_base, t * CHUNK, M_LAST, CHUNK, POOL, P_PAD)
        tl.store(base_rows + (t + 1) * POOL + slot, tl.where(pool_a >= 0.0, pool_c, -1).to(tl.int32), mask=live)


@triton.jit
def _base_pool(AMAX, BASE, pid, t, C, NCHUNKS, POOL: tl.constexpr, P_PAD: tl.constexpr):
    """The pool BASE[t] of row pid = b * Hkv + g (top-P of the cells [0, t * CHUNK), from
    `_fsl_pool_scan_kernel`) as the scan holds it: (pool_a, pool_c, pool_r) [P_PAD], members'
    keys a_c and cells with their ranks in (a desc, c desc) order; empty slots as in the scan."""
    slot = tl.arange(0, P_PAD)
    live = slot < POOL
    c_base = tl.load(BASE + (pid * (NCHUNKS + 1) + t) * POOL + slot, mask=live, other=-1).to(tl.int64)
    member = live & (c_base >= 0)
    amax_row = AMAX + pid * C
    pool_a = tl.where(member, tl.load(amax_row + tl.where(member, c_base, 0), mask=member, other=0.0), _EMPTY_A)
    pool_c = tl.where(member, c_base, -1 - slot)
    beats = (pool_a[None, :] > pool_a[:, None]) | ((pool_a[None, :] == pool_a[:, None]) & (pool_c[None, :] > pool_c[:, None]))
    pool_r = tl.reduce((beats & live[None, :]).to(tl.int32), 1, _SUM)  # [P_PAD] members beating x
    return pool_a, pool_c, pool_r


@triton.jit
def _store_cand_row(CAND, pid, j, NBLOCKS, pool_a, pool_c, m_j, n_j,
                    POOL: tl.constexpr, P_PAD: tl.constexpr, RECENT: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
    """cand[pid, j]: the pool's P slots (cells, -1 for an empty slot), then the recent cells [m_j, n_j) (-1 past n_j)."""
    slot = tl.arange(0, P_PAD)
    row = CAND + (pid * NBLOCKS + j) * (POOL + RECENT)
    tl.store(row + slot, tl.where(pool_a >= 0.0, pool_c, -1).to(tl.int32), mask=slot < POOL)
    _store_recent_cells(row, m_j, n_j, POOL, RECENT, R_PAD)


@triton.jit
def _store_recent_cells(row, m_j, n_j, POOL: tl.constexpr, RECENT: tl.constexpr, R_PAD: tl.constexpr):
    """The recent part of one cand row (`row` points at its first slot): cells [m_j, n_j) after the
    POOL slots, -1 past n_j."""
    r_off = tl.arange(0, R_PAD)
    rc = m_j + r_off
    tl.store(row + POOL + r_off, tl.where(rc < n_j, rc, -1).to(tl.int32), mask=r_off < RECENT)


@triton.jit
def _fsl_cand_kernel(
    AMAX,  # fp32 [B, Hkv, C]
    BASE,  # int32 [B, Hkv, NCHUNKS + 1, POOL] from _fsl_pool_scan_kernel
    CAND,  # int32 [B, Hkv, NBLOCKS, POOL + RECENT]
    C,
    NBLOCKS,
    NCHUNKS,
    POOL: tl.constexpr,
    P_PAD: tl.constexpr,
    RECENT: tl.constexpr,
    CELLS_PER_BLOCK: tl.constexpr,  # Bq / s
    NEW_PAD: tl.constexpr,  # next power of two >= CELLS_PER_BLOCK (cells added per block at most)
    CHUNK: tl.constexpr,
    R_PAD: tl.constexpr,
):
    """The candidate rows of the query blocks, from the scan's chunk pools BASE (see `fsl_candidates`):
    one program per chunk t continues the stream through the blocks j with m_j // CHUNK == t, one
    merge of at most Bq / s cells per block (sequential depth CHUNK / (Bq / s)).

    (s36 tried one program per block j, loading BASE[m_j // CHUNK] and merging the rest of [0, m_j)
    in one step: the same pools, but slower on an H100 (s37 call1, H16 D64): 19.7 vs 13.0 us at 4k,
    299 vs 32 us at 64k, where each of its 16k programs ranks up to CHUNK new cells. Removed.)"""
    pid = tl.program_id(1).to(tl.int64)  # b * Hkv + g
    amax_row = AMAX + pid * C
    slot = tl.arange(0, P_PAD)
    live = slot < POOL
    t = tl.program_id(0).to(tl.int64)  # chunk: the query blocks j with m_j // CHUNK == t
    x0 = t * CHUNK
    pool_a, pool_c, pool_r = _base_pool(AMAX, BASE, pid, t, C, NCHUNKS, POOL, P_PAD)  # top-P of cells [0, x0)
    # Blocks of this chunk: m_j = max(0, j * CPB - RECENT) in [x0, x0 + CHUNK).
    j_lo = tl.where(t == 0, 0, (x0 + RECENT + CELLS_PER_BLOCK - 1) // CELLS_PER_BLOCK)
    j_hi = tl.minimum((x0 + CHUNK + RECENT + CELLS_PER_BLOCK - 1) // CELLS_PER_BLOCK, NBLOCKS)
    prev = x0  # the pool holds the top-P of cells [0, prev)
    for j in range(j_lo, j_hi):
        n_j = j * CELLS_PER_BLOCK
        m_j = tl.maximum(n_j - RECENT, 0)  # older cells [0, m_j); m_j - prev <= CELLS_PER_BLOCK
        if m_j > prev:
            pool_a, pool_c, pool_r = _merge_cells(pool_a, pool_c, pool_r, live, amax_row, prev, m_j, NEW_PAD, POOL, P_PAD)
            prev = m_j
        _store_cand_row(CAND, pid, j, NBLOCKS, pool_a, pool_c, m_j, n_j, POOL, P_PAD, RECENT, R_PAD)


@triton.jit
def _fsl_cand_direct_kernel(
    AMAX,  # fp32 [B, Hkv, C]
    CAND,  # int32 [B, Hkv, NBLOCKS, POOL + RECENT]
    C,
    NBLOCKS,
    POOL: tl.constexpr,
    RECENT: tl.constexpr,
    CELLS_PER_BLOCK: tl.constexpr,  # Bq / s
    N_PAD: tl.constexpr,  # a power of two >= max(C, POOL)
    R_PAD: tl.constexpr,
):
    """The candidate row of query block j straight from the definition of spec §5 (one program per
    (j, b * Hkv + g), all in parallel, no pool stream): the older cells [0, m_j) sorted on
    (a_c desc, c desc) as one int64 key each, (bits of a_c) << 32 | c (a_c >= 0, so its float32
    bits order like its value; a tie in a_c is decided by the larger c), the first POOL of them
    stored, then the recent cells. O(N_PAD log^2 N_PAD) per block: for short sequences only
    (`fsl_candidates`: C <= `fsl_direct_max_cells()`), where it replaces the scan's two launches."""
    j = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1).to(tl.int64)  # b * Hkv + g
    n_j = j * CELLS_PER_BLOCK
    m_j = tl.maximum(n_j - RECENT, 0)  # older cells [0, m_j)
    c = tl.arange(0, N_PAD)
    older = c < m_j
    a = tl.load(AMAX + pid * C + c, mask=older, other=0.0)
    key = (a.to(tl.int32, bitcast=True).to(tl.int64) << 32) | c.to(tl.int64)
    key = tl.sort(tl.where(older, key, -1), descending=True)  # absent cells (-1) last
    slot_cell = tl.where(key >= 0, (key & 0xFFFFFFFF).to(tl.int32), -1)
    row = CAND + (pid * NBLOCKS + j) * (POOL + RECENT)
    tl.store(row + c, slot_cell, mask=c < POOL)
    _store_recent_cells(row, m_j, n_j, POOL, RECENT, R_PAD)


@triton.jit
def _lex_max(s, c):
    """Per row of s [M, N] fp32 and c [M, N] or [1, N] int32 cells (distinct in a row): the largest
    pair in the order (s desc, then c desc), as (best_s [M], best_c [M])."""
    best_s = tl.reduce(s, 1, _MAX)
    best_c = tl.reduce(tl.where(s == best_s[:, None], c, _INT32_MIN), 1, _MAX)
    return best_s, best_c


@triton.jit
def _lex_min(s, c):
    """Per row: the smallest (s, c) pair in the same order, as (low_s [M], low_c [M])."""
    low_s = tl.reduce(s, 1, _MIN)
    low_c = tl.reduce(tl.where(s == low_s[:, None], c, _INT32_MAX), 1, _MIN)
    return low_s, low_c


@triton.jit
def _lex_better(cs, cc, kth_s, kth_c):
    """[M]: the pair (cs, cc) is a real candidate (cs > -inf) that beats (kth_s, kth_c)."""
    return (cs > float("-inf")) & ((cs > kth_s) | ((cs == kth_s) & (cc > kth_c)))


@triton.jit
def _topk_round(top_s, top_c, kth_s, kth_c, s, cells, cs, cc):
    """One round of the running top-K: where a row's best remaining pair (cs, cc) beats its K-th pair
    (kth_s, kth_c), it takes that pair's lane in (top_s, top_c) [M, K_PAD]; the pair leaves s [M, N]."""
    better = _lex_better(cs, cc, kth_s, kth_c)
    lane = (top_s == kth_s[:, None]) & (top_c == kth_c[:, None]) & better[:, None]
    top_s = tl.where(lane, cs[:, None], top_s)
    top_c = tl.where(lane, cc[:, None], top_c)
    kth_s, kth_c = _lex_min(top_s, top_c)
    s = tl.where(cells[None, :] == cc[:, None], float("-inf"), s)
    cs, cc = _lex_max(s, cells[None, :])
    return top_s, top_c, kth_s, kth_c, s, cs, cc


@triton.jit
def _gather_cells(kbar_rows, amax_row, cells, d_off32, d_ok, D: tl.constexpr):
    """(kbar [N, BLOCK_D] fp32, a [N] fp32, c_ok [N]) of the cells [N] (int32, -1 or negative: none,
    zeros) from one (b, kv head)'s rows of KBAR / AMAX (int32 offsets inside them)."""
    c_ok = cells >= 0
    c_safe = tl.where(c_ok, cells, 0)
    kb = tl.load(kbar_rows + c_safe[:, None] * D + d_off32[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    a = tl.load(amax_row + c_safe, mask=c_ok, other=0.0)
    return kb, a, c_ok


@triton.jit
def _score_chunk(
    top_s, top_c, kth_s, kth_c,  # the running top-K [BLOCK_M, K_PAD] and its K-th pair [BLOCK_M]
    q,  # [BLOCK_M, BLOCK_D] queries (q's dtype with SPLIT_DOT, else fp32)
    kb,  # fp32 [BLOCK_N, BLOCK_D] mean keys of the chunk's cells (0 where masked)
    a,  # fp32 [BLOCK_N] max key norms
    cells,  # int32 [BLOCK_N] the chunk's cells (any value where not c_ok)
    c_ok,  # [BLOCK_N] real cells
    c_max,  # scalar: the largest real cell of the chunk (erf skip)
    i_f, i_f0, coef, lam, scale,  # fp32 query positions [BLOCK_M], the tile's first, sigma / (2s), lam, 1/sqrt(D)
    CELL: tl.constexpr,
    TOP_K: tl.constexpr,
    SPLIT_DOT: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    COUNT_ROUNDS: tl.constexpr,
    ERF_SKIP: tl.constexpr,
    MASKED: tl.constexpr,  # False: every cell of the chunk is real (no masking of the scores)
):
    """Score one chunk of cells for a tile of queries and merge it into the running top-K."""
    if SPLIT_DOT:
        # 16-bit q is exact; kbar = hi + lo in q's dtype (+ ~2^-17 relative residual): two
        # tensor-core dots with fp32 accumulation, as accurate as an fp32 dot for selection.
        kb_hi = kb.to(q.dtype)
        kb_lo = (kb - kb_hi.to(tl.float32)).to(q.dtype)
        dot = tl.dot(q, tl.trans(kb_lo), acc=tl.dot(q, tl.trans(kb_hi)))
    else:
        dot = tl.dot(q, tl.trans(kb), input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32
    dist = i_f[:, None] - (cells * CELL).to(tl.float32)[None, :]
    if ERF_SKIP:
        # erf(x) rounds to exactly 1.0 in fp32 for x >= ERF_ONE (a CUDA test checks the compiled
        # erf on every fp32 x in [ERF_ONE, 8) and a sweep past it). coef * dist is monotone in dist,
        # so when the chunk's smallest x reaches ERF_ONE every prior factor is 1.0 and erf is not
        # evaluated: the same bits, most chunks (sigma 4: every cell 2 cells or more before the
        # query) skip it.
        x_min = coef * (i_f0 - (c_max * CELL).to(tl.float32))
        if (coef > 0.0) & (x_min >= _ERF_ONE):
            prior = tl.full(dist.shape, 1.0, tl.float32)
        else:
            prior = tl.math.erf(coef * dist)
    else:
        prior = tl.math.erf(coef * dist)
    score = scale * dot + lam * a[None, :] * prior
    if MASKED:
        s_chunk = tl.where(c_ok[None, :], score, float("-inf"))
    else:
        s_chunk = score
    # no key is built: the pairs compare as (score, cell), a round's reductions are 32-bit. A round
    # where a row does not improve leaves its top-K as it is, so the schedules below (EARLY_EXIT: skip
    # a round once no row of the tile improves, a cross-row reduction per round; COUNT_ROUNDS: as many
    # rounds as the most pairs any row has above its K-th, one cross-row reduction per chunk; else
    # TOP_K rounds) give the same result.
    if COUNT_ROUNDS:
        cs, cc = _lex_max(s_chunk, cells[None, :])
        beats = (s_chunk > kth_s[:, None]) | ((s_chunk == kth_s[:, None]) & (cells[None, :] > kth_c[:, None]))
        better = tl.reduce((beats & (s_chunk > float("-inf"))).to(tl.int32), 1, _SUM)
        n_rounds = tl.minimum(tl.reduce(better, 0, _MAX), TOP_K)
        for r in range(0, n_rounds):
            top_s, top_c, kth_s, kth_c, s_chunk, cs, cc = _topk_round(top_s, top_c, kth_s, kth_c, s_chunk, cells, cs, cc)
    else:
        cs, cc = _lex_max(s_chunk, cells[None, :])
        for r in tl.static_range(TOP_K):
            if EARLY_EXIT:
                if tl.reduce(_lex_better(cs, cc, kth_s, kth_c).to(tl.int32), 0, _MAX) > 0:
                    top_s, top_c, kth_s, kth_c, s_chunk, cs, cc = _topk_round(
                        top_s, top_c, kth_s, kth_c, s_chunk, cells, cs, cc
                    )
            else:
                top_s, top_c, kth_s, kth_c, s_chunk, cs, cc = _topk_round(
                    top_s, top_c, kth_s, kth_c, s_chunk, cells, cs, cc
                )
    return top_s, top_c, kth_s, kth_c


@triton.jit
def _score_cand_chunk(
    top_s, top_c, kth_s, kth_c, q, cand_row, pos, kbar_rows, amax_row, d_off32, d_ok, i_f, i_f0, coef, lam, scale,
    D: tl.constexpr, N_CAND: tl.constexpr, CELL: tl.constexpr, TOP_K: tl.constexpr, SPLIT_DOT: tl.constexpr,
    EARLY_EXIT: tl.constexpr, COUNT_ROUNDS: tl.constexpr, ERF_SKIP: tl.constexpr,
):  # fmt: skip
    """FS-L: the candidate slots pos [N] of one query block's list (cand_row; -1 or pos >= N_CAND: no
    cell) gathered, scored and merged into the running top-K (`_score_chunk`, masked)."""
    cells = tl.load(cand_row + pos, mask=pos < N_CAND, other=-1)  # int32, -1: an empty slot
    kb, a, c_ok = _gather_cells(kbar_rows, amax_row, cells, d_off32, d_ok, D)
    c_max = tl.reduce(tl.where(c_ok, cells, 0), 0, _MAX)
    return _score_chunk(
        top_s, top_c, kth_s, kth_c, q, kb, a, cells, c_ok, c_max, i_f, i_f0, coef, lam, scale,
        CELL, TOP_K, SPLIT_DOT, EARLY_EXIT, COUNT_ROUNDS, ERF_SKIP, True,
    )


@triton.jit
def _score_topk_kernel(
    Q,  # [B, T, Hq, D] any strides
    KBAR,  # fp32 [B, Hkv, C, D]
    AMAX,  # fp32 [B, Hkv, C]
    CAND,  # int32 [B, Hkv, NBLOCKS, N_CAND] (FS-L) or a dummy (FS)
    SIGMA,  # fp32 [Hq]
    LAM,  # fp32 [Hq]
    IDX,  # int64 / int32 [B, T, Hq, TOP_K] contiguous (tl.store casts the int64 cells)
    UNION,  # int32 [B * Hq, NT, U_MAX] (out, UNION_OUT): each tile's distinct cells ascending, -1 padded
    COUNT,  # int32 [B * Hq, NT] (out, UNION_OUT)
    T,
    C,
    NBLOCKS,
    NT,  # UNION_OUT: union tiles per (b, h), ceil(T / BLOCK_M); a program pid_t >= NT (past T) writes none
    HQ,
    HKV,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    scale,
    D: tl.constexpr,
    CELL: tl.constexpr,
    QBLOCK: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    FSL: tl.constexpr,
    N_CAND: tl.constexpr,
    N_MAIN: tl.constexpr,  # FS-L: candidates scored in BLOCK_N-wide chunks (N_CAND unless a tail follows)
    TAIL_N: tl.constexpr,  # FS-L: width of the tail chunk covering [N_MAIN, N_CAND) (`fsl_tail_width`; 0: none)
    SPLIT_DOT: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    COUNT_ROUNDS: tl.constexpr,
    ERF_SKIP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNION_OUT: tl.constexpr = False,  # also write the tile's union (BLOCK_M divides QBLOCK: program pid_t = tile pid_t)
    U_MAX: tl.constexpr = 1,  # BLOCK_M * TOP_K
    U_P: tl.constexpr = 1,  # next_pow2(U_MAX), at least the program's thread count
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    j = pid_t // TILES_PER_BLOCK  # query block
    tile = pid_t % TILES_PER_BLOCK
    b = pid_bh // HQ
    h = pid_bh % HQ
    g = h // (HQ // HKV)
    m_off = tl.arange(0, BLOCK_M).to(tl.int64)
    i_in_block = tile * BLOCK_M + m_off
    i = j * QBLOCK + i_in_block  # [BLOCK_M] query positions
    row_ok = (i_in_block < QBLOCK) & (i < T)
    d_off = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d_off < D
    q = tl.load(
        Q + b * stride_qb + i[:, None] * stride_qt + h * stride_qh + d_off[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if not SPLIT_DOT:
        q = q.to(tl.float32)
    sigma = tl.load(SIGMA + h)
    lam = tl.load(LAM + h)
    coef = sigma / (2.0 * CELL)
    i_f = i.to(tl.float32)
    i_f0 = (j * QBLOCK + tile * BLOCK_M).to(tl.float32)  # the tile's first (smallest) query position
    kv_row = (b * HKV + g) * C  # first cell row of (b, g) in KBAR / AMAX
    n_j = j * (QBLOCK // CELL)  # available cells
    # Running top-K per query: an unordered set of TOP_K distinct (fp32 score, cell) pairs in lanes
    # < TOP_K; an empty lane holds (-inf, -1 - lane) (distinct, below every real pair); lanes >= TOP_K
    # hold (+inf, INT32_MAX) and are never the minimum. Sorted once at the end.
    k_lane = tl.arange(0, K_PAD)
    lane_real = k_lane < TOP_K
    top_s = tl.where(lane_real, tl.full([K_PAD], float("-inf"), tl.float32), tl.full([K_PAD], float("inf"), tl.float32))
    top_c = tl.where(lane_real, -1 - k_lane, tl.full([K_PAD], _INT32_MAX, tl.int32))
    top_s = tl.broadcast_to(top_s[None, :], [BLOCK_M, K_PAD])
    top_c = tl.broadcast_to(top_c[None, :], [BLOCK_M, K_PAD])
    kth_s, kth_c = _lex_min(top_s, top_c)  # [BLOCK_M]: the K-th best pair so far
    n_off = tl.arange(0, BLOCK_N)
    # (b, g)'s rows of KBAR / AMAX: int64 bases, int32 offsets inside them (C * D < 2^31, checked on the host)
    kbar_rows = KBAR + kv_row * D
    amax_row = AMAX + kv_row
    d_off32 = d_off.to(tl.int32)
    if FSL:
        cand_row = CAND + ((b * HKV + g) * NBLOCKS + j) * N_CAND
        # BLOCK_N candidates per chunk over [0, N_MAIN); with a tail, one TAIL_N-wide chunk the rest
        for n0 in range(0, N_MAIN, BLOCK_N):
            top_s, top_c, kth_s, kth_c = _score_cand_chunk(
                top_s, top_c, kth_s, kth_c, q, cand_row, n0 + n_off, kbar_rows, amax_row, d_off32, d_ok,
                i_f, i_f0, coef, lam, scale, D, N_CAND, CELL, TOP_K, SPLIT_DOT, EARLY_EXIT, COUNT_ROUNDS, ERF_SKIP,
            )  # fmt: skip
        if TAIL_N > 0:
            top_s, top_c, kth_s, kth_c = _score_cand_chunk(
                top_s, top_c, kth_s, kth_c, q, cand_row, N_MAIN + tl.arange(0, TAIL_N), kbar_rows, amax_row, d_off32,
                d_ok, i_f, i_f0, coef, lam, scale, D, N_CAND, CELL, TOP_K, SPLIT_DOT, EARLY_EXIT, COUNT_ROUNDS, ERF_SKIP,
            )  # fmt: skip
    else:
        # every available cell [0, n_j), most recent first, BLOCK_N per chunk: a chunk is the contiguous
        # rows [c0, c0 + BLOCK_N) of KBAR (c0 = n_j - n0 - BLOCK_N) read backwards, so its offsets are a
        # loop-invariant int32 tile plus one scalar; the full chunks need no masks, the last one
        # (c0 < 0) is masked
        reversed_rows = BLOCK_N - 1 - n_off  # int32 [BLOCK_N]: chunk row -> cell - c0
        kb_offsets = reversed_rows[:, None] * D + d_off32[None, :]  # [BLOCK_N, BLOCK_D] int32
        n_full = n_j // BLOCK_N
        for chunk in range(0, n_full):
            c0 = n_j - (chunk + 1) * BLOCK_N  # >= 0
            cells = c0.to(tl.int32) + reversed_rows
            kb_base = kbar_rows + c0 * D
            if BLOCK_D == D:
                kb = tl.load(kb_base + kb_offsets)
            else:
                kb = tl.load(kb_base + kb_offsets, mask=d_ok[None, :], other=0.0)
            a = tl.load(amax_row + c0 + reversed_rows)
            top_s, top_c, kth_s, kth_c = _score_chunk(
                top_s, top_c, kth_s, kth_c, q, kb, a, cells, cells >= 0, c0 + BLOCK_N - 1, i_f, i_f0, coef, lam,
                scale, CELL, TOP_K, SPLIT_DOT, EARLY_EXIT, COUNT_ROUNDS, ERF_SKIP, False,
            )
        if n_j % BLOCK_N != 0:
            c0 = n_j % BLOCK_N - BLOCK_N  # < 0: the oldest cells [0, n_j % BLOCK_N)
            cells = c0.to(tl.int32) + reversed_rows
            kb, a, c_ok = _gather_cells(kbar_rows, amax_row, cells, d_off32, d_ok, D)
            top_s, top_c, kth_s, kth_c = _score_chunk(
                top_s, top_c, kth_s, kth_c, q, kb, a, cells, c_ok, c0 + BLOCK_N - 1, i_f, i_f0, coef, lam,
                scale, CELL, TOP_K, SPLIT_DOT, EARLY_EXIT, COUNT_ROUNDS, ERF_SKIP, True,
            )
    # sort: lane r of the output = the r-th largest pair (pairs are distinct), its cell
    cell_out = tl.full([BLOCK_M, K_PAD], -1, tl.int64)
    top_s = tl.where(k_lane[None, :] < TOP_K, top_s, float("-inf"))
    top_c = tl.where(k_lane[None, :] < TOP_K, top_c, _INT32_MIN)
    for r in tl.static_range(TOP_K):
        bs, bc = _lex_max(top_s, top_c)  # [BLOCK_M]
        cell = tl.where(bs > float("-inf"), bc, -1).to(tl.int64)  # -inf: an empty lane
        cell_out = tl.where(k_lane[None, :] == r, cell[:, None], cell_out)
        top_s = tl.where((top_s == bs[:, None]) & (top_c == bc[:, None]), float("-inf"), top_s)
    out = IDX + ((b * T + i) * HQ + h)[:, None] * TOP_K + k_lane[None, :]
    tl.store(out, cell_out, mask=row_ok[:, None] & (k_lane[None, :] < TOP_K))
    if UNION_OUT:
        # the long branch's tile union of these BLOCK_M queries (`attention.tile_unions`' consecutive
        # tiles), read back from IDX as one flat vector after a barrier (the program's own stores are
        # then visible to all its threads). Not a tl.reshape of cell_out: sorting the reshaped tile gave
        # unsorted, duplicated output on an H100 (s48 call2; the interpreter was right).
        tl.debug_barrier()
        e = tl.arange(0, U_P)
        row = j * QBLOCK + tile * BLOCK_M + e // TOP_K
        ok = (e < U_MAX) & (row < T)
        got = tl.load(IDX + ((b * T + row) * HQ + h) * TOP_K + e % TOP_K, mask=ok, other=-1).to(tl.int32)
        store_union(tl.where(got < 0, _INT32_MAX, got), UNION + (pid_bh * NT + pid_t) * U_MAX,
                    COUNT + pid_bh * NT + pid_t, U_MAX, pid_t < NT)  # fmt: skip


# ---- host launchers --------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, T, H, D], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    if Hq % k.shape[2] != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={k.shape[2]}")
    if cfg.variant not in ("fs", "fsl"):
        raise ValueError(f"the triton selection kernels serve variant 'fs' and 'fsl', not {cfg.variant!r}")
    if cfg.variant == "fsl" and cfg.pool > MAX_POOL:
        raise ValueError(
            f"pool={cfg.pool} exceeds the triton FS-L kernel's register pool ({MAX_POOL}); use backend='torch'"
        )
    if q.device != k.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}")
    if q.dtype != k.dtype:
        raise ValueError(f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    if D > 256:
        raise ValueError(f"head dim D={D} exceeds the triton selection kernels' limit 256")
    if (T // cfg.cell) * D >= 2**31:
        raise ValueError(
            f"T={T} is too long for the triton scoring kernel: (T // cell) * D = {(T // cfg.cell) * D} must stay "
            "below 2^31 (int32 offsets inside one head's cell statistics)"
        )


def cell_stats(k: torch.Tensor, cell: Union[int, FreeSoloConfig]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cell statistics in one pass over K (spec §3).

    Args:
        k: [B, T, Hkv, D] unrotated keys (fp16 / bf16 / fp32, any strides).
        cell: tokens per cell s (or a config, whose `cell` is used).
    Returns:
        kbar fp32 [B, Hkv, C, D] (mean key), amax fp32 [B, Hkv, C] (max key norm); C = T // cell.
    """
    if isinstance(cell, FreeSoloConfig):
        cell = cell.cell
    B, T, Hkv, D = k.shape
    C = T // cell
    kbar = torch.empty((B, Hkv, C, D), dtype=torch.float32, device=k.device)
    amax = torch.empty((B, Hkv, C), dtype=torch.float32, device=k.device)
    if C == 0 or B * Hkv == 0:
        return kbar, amax
    BLOCK_D = next_pow2(D)
    BLOCK_T = min(next_pow2(cell), max(1, 4096 // BLOCK_D))
    cells_per_prog = max(1, min(64, 8192 // (BLOCK_T * BLOCK_D)))
    grid = (cdiv(C, cells_per_prog), B * Hkv)
    launch(_cell_stats_kernel, grid,
        k,
        kbar,
        amax,
        C,
        Hkv,
        *k.stride(),
        D=D,
        CELL=cell,
        CELLS_PER_PROG=cells_per_prog,
        BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D,
    )
    return kbar, amax


def pool_chunk(pool: int) -> int:
    """Cells merged per step of the sequential pool scan: 64 for pools up to 64, then fewer
    (the step holds [pool, chunk] comparisons in registers). The pools do not depend on it.
    H200 (bf16, H 16, P 64, s23 `score_tiles_sweep.py`, scan + per-chunk candidate kernel): at 64k
    0.187 / 0.148 ms with 64 in two calls against 0.161 / 0.160 with 32 (0.291 with 16); at 1M
    2.21 ms with 64, 2.39 with 32 (results/session_2026-12-02_s23/)."""
    return max(16, min(64, 4096 // next_pow2(pool)))


# Short sequences: FS-L candidates straight from spec §5's definition (`_fsl_cand_direct_kernel`,
# one launch, a sort of the older cells per block) up to this many cells, instead of the pool scan
# and its continuation (two launches whose sequential depth is the critical path of the side stream
# at 4k: 8.7 + 13.0 us on the H100, s41 profile). The sort is O(C log C) per block, so it is kept to
# short sequences (a constant cap: the forward stays linear in T beyond it). Default 512 cells (16k
# tokens at s = 32) since s47, H100, bf16 H16 D64, FS-L forward replayed in a user CUDA graph, same
# run, same bits: 4k 0.1270 vs 0.1378 ms (-8 %), 8k 0.2327 vs 0.2469 (-6 %), 16k 0.4649 vs 0.4648
# (the window kernel dominates); at 32k (1024 cells, s48 call1, API) the sort costs 1.049 ms against
# the scan's 0.886: the default stops at 512 (`results/session_2026-12-06_s47/`,
# `session_2026-12-07_s48/`). 0 = always the scan. FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS
# overrides it (process-wide, read at each call; at most DIRECT_CELLS_CAP).
FSL_DIRECT_MAX_CELLS = 512
DIRECT_CELLS_CAP = 1024
ENV_FSL_DIRECT_MAX_CELLS = "FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS"


def fsl_direct_max_cells() -> int:
    """The most cells C = T // s for which `fsl_candidates` sorts each block's older cells (one
    launch) instead of scanning: FSL_DIRECT_MAX_CELLS or the environment's override."""
    raw = os.environ.get(ENV_FSL_DIRECT_MAX_CELLS, "").strip()
    if raw == "":
        return FSL_DIRECT_MAX_CELLS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= DIRECT_CELLS_CAP:
        raise ValueError(
            f"environment variable {ENV_FSL_DIRECT_MAX_CELLS}={raw!r} must be an integer in [0, {DIRECT_CELLS_CAP}]"
        )
    return value


def fsl_candidates(
    amax: torch.Tensor, T: int, cfg: FreeSoloConfig, chunk: Optional[int] = None, direct: Optional[bool] = None
) -> torch.Tensor:
    """FS-L candidate cells of every query block (spec §5). Short sequences (C <= `fsl_direct_max_cells()`,
    or direct=True) take one kernel, `_fsl_cand_direct_kernel`: each block sorts its older cells on
    (a_c desc, c desc) and keeps the first P (the pool slots in that order). Otherwise, linear in T, two kernels:

    1. `_fsl_pool_scan_kernel`, one program per (b, kv head): the streaming form of §5 over the
       older cells in chunks of `chunk` cells (the cells leaving the recent window compete with the
       kept pool on (a_c desc, c desc), losers dropped for ever; the pool keeps its members' ranks
       so a step costs O(P * chunk)); it records the pool at every chunk boundary,
       BASE[t] = top-P of cells [0, t * chunk). Sequential depth: C / chunk steps (not T / Bq).
    2. `_fsl_cand_kernel`, one program per (chunk t, b, kv head), all in parallel: it loads
       BASE[t] (with the members' ranks) and continues the stream through the query blocks j
       with t = m_j // chunk, m_j = max(0, n_j - W): block j adds the cells [m_{j-1}, m_j) (at
       most Bq / s, one `_pool_merge` step) and stores pool_j = top-P of [0, m_j) (top-P of a
       union is associative), then the W recent cells [m_j, n_j). O(P * Bq / s) per block
       (the s22 kernel ranked BASE[t] + up to chunk cells per block: O((P + chunk)^2)).

    Both give the same sets, for a_c >= 0 (norms; NaN norms give unspecified candidates).

    Args:
        amax: fp32 [B, Hkv, C] max key norms (from `cell_stats`).
        T: sequence length (nblocks = ceil(T / block)).
        chunk: scan step in cells (default `pool_chunk(pool)`; a power of two; tests use small ones).
        direct: True / False force the sorting kernel / the scan (True needs C <= DIRECT_CELLS_CAP);
            None: the sort up to `fsl_direct_max_cells()` cells.
    Returns:
        cand int32 [B, Hkv, nblocks, pool + recent]: the pool's slots (unordered, -1 = empty),
        then the recent cells [max(0, n_j - W), n_j) (-1 past n_j).
    """
    B, Hkv, C = amax.shape
    nblocks = cdiv(T, cfg.block)
    P, W = cfg.pool, cfg.recent
    cpb = cfg.block // cfg.cell
    chunk = chunk or pool_chunk(P)
    if chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two")
    if direct is None:
        direct = C <= fsl_direct_max_cells()
    elif direct and C > DIRECT_CELLS_CAP:
        raise ValueError(f"direct=True sorts every block's cells: C={C} must be <= {DIRECT_CELLS_CAP}")
    cand = torch.empty((B, Hkv, nblocks, P + W), dtype=torch.int32, device=amax.device)
    if B * Hkv * nblocks == 0:
        return cand
    amax = amax.contiguous()
    if direct:
        launch(_fsl_cand_direct_kernel, (nblocks, B * Hkv),
            amax, cand, C, nblocks,
            POOL=P, RECENT=W, CELLS_PER_BLOCK=cpb, N_PAD=max(2, next_pow2(max(C, P))), R_PAD=next_pow2(W),
            num_warps=4 if max(C, P) >= 256 else 1,
        )  # fmt: skip
        return cand
    m_last = max(0, (nblocks - 1) * cpb - W)
    nchunks = cdiv(m_last, chunk)
    base = torch.empty((B, Hkv, nchunks + 1, P), dtype=torch.int32, device=amax.device)
    P_PAD = next_pow2(P)
    warps = max(1, min(8, P_PAD * chunk // 512))  # P 64, chunk 64: 8 warps, 194 registers on sm_90
    launch(_fsl_pool_scan_kernel, (B * Hkv,), amax, base, C, m_last, nchunks, POOL=P, P_PAD=P_PAD, CHUNK=chunk, num_warps=warps)
    launch(_fsl_cand_kernel, (nchunks + 1, B * Hkv),
        amax, base, cand, C, nblocks, nchunks,
        POOL=P, P_PAD=P_PAD, RECENT=W, CELLS_PER_BLOCK=cpb, NEW_PAD=max(2, next_pow2(cpb)), CHUNK=chunk,
        R_PAD=next_pow2(W), num_warps=min(warps, 4),
    )  # fmt: skip
    return cand


@dataclass(frozen=True)
class ScoreTiles:
    """Tile sizes of the scoring + top-K kernel. They may depend on the config, D and the dtype,
    never on B, T or the data (L12: a query's bits must not depend on other rows)."""

    block_m: int  # queries per program (power of two >= 16), inside one query block
    block_n: int  # candidate cells scored per step (power of two >= 16)
    num_warps: int = 4
    early_exit: bool = True  # skip a top-K round when no row of the tile improves (a cross-row reduction)
    # run per chunk as many rounds as the most keys a row has above its K-th key (one cross-row
    # reduction per chunk instead of one per round; early_exit is then not used). Same result.
    count_rounds: bool = False
    erf_skip: bool = True  # a chunk whose prior arguments all reach ERF_ONE takes prior 1.0 without erf (same bits)
    # software-pipelining depth of the cell loop (triton's num_stages). sm_90, FS bf16 D 64: 3 stages
    # need 157 registers per thread (3 programs of 4 warps per SM), 1 stage 117 (4 programs).
    num_stages: int = 1
    # FS-L: the candidates past the last full chunk of block_n (P + W = 72 with block_n 32 or 64: the
    # 8 recent cells) are scored in one chunk of the smallest power of two >= 16 that holds them
    # (`fsl_tail_width`) instead of a full block_n chunk that is mostly masked. Same selections.
    fsl_tail: bool = False


def fsl_tail_width(n_cand: int, block_n: int, fsl_tail: bool) -> int:
    """Width of the FS-L scoring kernel's tail chunk: 0 (no tail: every chunk is block_n wide, the
    last one masked) unless fsl_tail and n_cand % block_n needs a chunk narrower than block_n."""
    rest = n_cand % block_n
    if not fsl_tail or rest == 0:
        return 0
    width = max(16, next_pow2(rest))
    return width if width < block_n else 0


def score_tiles(cfg: FreeSoloConfig, D: int, dtype: torch.dtype) -> ScoreTiles:
    """Default tiles: BLOCK_M = the query block (16..64), 4 warps, one pipeline stage (sm_90: 117
    registers per thread for FS bf16 D 64, 102 for FS-L; no spills, for D 64 / 128 and every dtype).
    FS: 32 cells per step, the top-K rounds counted per chunk (count_rounds);
    FS-L (72 candidates): 64 per step and a narrower tail chunk (fsl_tail), every round run. H200 (bf16 H16 D64, select_cells, same-run
    sweeps, every variant's selection bitwise equal): FS at 64k 4.42 ms (s23 tiles) -> 3.71
    (erf_skip) -> 3.40 (the top-K on fp32 score + cell pairs instead of int64 keys) -> 3.31
    (count_rounds) -> 2.49 (s25: unmasked full chunks, int32 offsets, three stages; a gate that skipped
    the count where no row's chunk maximum reached its K-th, 2.66, was removed) -> 2.48 (one stage);
    FS-L at 64k 0.783 -> 0.653 -> 0.612 ms (s25, one stage) -> 0.596 (32 per step) -> 0.532 (s28: 64
    per step, the 8 recent cells past the 64 pool slots in one 16-wide tail chunk, `fsl_tail`; 128k
    1.172 -> 1.039, 16k 0.173 -> 0.156) (results/session_2026-12-02_s24/call2, call3, call6;
    session_2026-12-02_s25/call2, call3, call4; session_2026-12-03_s28/call1)."""
    block_m = min(64, max(16, next_pow2(cfg.block)))
    if cfg.variant == "fsl":
        tail = os.environ.get(ENV_FSL_TAIL, "").strip()
        if tail not in ("", "0", "1"):
            raise ValueError(f"environment variable {ENV_FSL_TAIL}={tail!r} must be 0 or 1")
        if tail == "0":  # the s25 .. s27 FS-L tiles: chunks of 32, the last one mostly masked
            return ScoreTiles(block_m, 32, 4, early_exit=False, num_stages=1)
        return ScoreTiles(block_m, 64, 4, early_exit=False, num_stages=1, fsl_tail=True)
    return ScoreTiles(block_m, 32, 4, early_exit=False, count_rounds=True, num_stages=1)


# FREESOLO_TRITON_FSL_TAIL=0 gives FS-L the tiles before s28 (32 candidates per chunk, no tail chunk);
# unset or 1: the default (`score_tiles`). Process-wide, read at each call (an A/B switch).
ENV_FSL_TAIL = "FREESOLO_TRITON_FSL_TAIL"

_HEAD_PARAMS: dict = {}


def head_params(cfg: FreeSoloConfig, Hq: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """sigma, lam as fp32 [Hq] tensors on `device`, cached per (sigma, lam, Hq, device): a call
    does not copy host values to the GPU (two synchronous H2D copies per forward before). Never
    evicted: a CUDA graph may have captured their addresses (two small vectors per config)."""
    key = (cfg.sigma, cfg.lam, Hq, str(device))
    hit = _HEAD_PARAMS.get(key)
    if hit is None:
        hit = tuple(
            torch.as_tensor(cfg.per_head(name, Hq), dtype=torch.float32, device=device) for name in ("sigma", "lam")
        )
        _HEAD_PARAMS[key] = hit
    return hit


def fuses_unions(cfg: FreeSoloConfig, D: int, dtype: torch.dtype, union_rows: int, tiles: Optional[ScoreTiles] = None) -> bool:
    """Whether `select_cells(..., union_rows=union_rows)` can write the tile unions from the scoring
    kernel: a scoring tile is one union tile (tiles.block_m == union_rows, dividing the query block)."""
    tiles = tiles or score_tiles(cfg, D, dtype)
    return cfg.variant in ("fs", "fsl") and tiles.block_m == union_rows and cfg.block % union_rows == 0


def select_cells(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: FreeSoloConfig,
    tiles: Optional[ScoreTiles] = None,
    out_dtype: torch.dtype = torch.int64,
    union_rows: Optional[int] = None,
):
    """FS / FS-L selection (spec §3-§5, §7) by the Triton kernels.

    Args:
        q: [B, T, Hq, D] unrotated queries; k: [B, T, Hkv, D] unrotated keys (fp16 / bf16 / fp32
            on CUDA, or CPU float32 under TRITON_INTERPRET=1). Scores are computed in fp32.
        cfg: variant "fs" or "fsl"; sigma / lam scalars or per query head [Hq].
        tiles: scoring tile sizes (default `score_tiles(cfg, D, q.dtype)`; benchmarks sweep them).
        out_dtype: torch.int64 (default) or torch.int32 (half the bytes: the triton forward keeps
            its selections in int32 for the backward).
        union_rows: None, or the long tiles' rows (`fuses_unions` must hold): the scoring kernel
            also writes each tile's union, what `attention.tile_unions(idx, union_rows)` gives for
            consecutive tiles, without a launch of its own.
    Returns:
        idx out_dtype [B, T, Hq, top_k]: cells by descending score (ties: larger c first), -1 padded;
        with union_rows, (idx, union int32 [B * Hq, NT, union_rows * top_k], count int32 [B * Hq, NT]),
        NT = ceil(T / union_rows).
    """
    _check_inputs(q, k, cfg)
    if out_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"out_dtype {out_dtype} must be torch.int32 or torch.int64")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    K = cfg.top_k
    fsl = cfg.variant == "fsl"
    nblocks = cdiv(T, cfg.block)
    C = T // cfg.cell
    tiles = tiles or score_tiles(cfg, D, q.dtype)
    if union_rows is not None and not fuses_unions(cfg, D, q.dtype, union_rows, tiles):
        raise ValueError(
            f"union_rows={union_rows}: the scoring tiles ({tiles.block_m} queries) must be the union tiles and "
            f"divide the query block ({cfg.block}); use attention.tile_unions on the selection instead"
        )
    n_tiles = cdiv(T, union_rows) if union_rows else 0
    u_max = (union_rows or 0) * K
    if B * T * Hq == 0 or nblocks <= 1 or C == 0:  # no query has an older cell
        idx = torch.full((B, T, Hq, K), -1, dtype=out_dtype, device=q.device)
        if not union_rows:
            return idx
        union = torch.full((B * Hq, n_tiles, u_max), -1, dtype=torch.int32, device=q.device)
        return idx, union, torch.zeros((B * Hq, n_tiles), dtype=torch.int32, device=q.device)
    # every tile's row is written by the kernel (its grid covers the NT tiles)
    union = torch.empty((B * Hq, n_tiles, u_max), dtype=torch.int32, device=q.device)
    count = torch.empty((B * Hq, n_tiles), dtype=torch.int32, device=q.device)
    kbar, amax = cell_stats(k, cfg.cell)
    n_cand = cfg.pool + cfg.recent if fsl else 0
    cand = fsl_candidates(amax, T, cfg) if fsl else torch.empty(1, dtype=torch.int32, device=q.device)
    sigma, lam = head_params(cfg, Hq, q.device)
    idx = torch.empty((B, T, Hq, K), dtype=out_dtype, device=q.device)
    BLOCK_M, BLOCK_N, BLOCK_D = tiles.block_m, tiles.block_n, max(16, next_pow2(D))
    tiles_per_block = cdiv(cfg.block, BLOCK_M)
    grid = (nblocks * tiles_per_block, B * Hq)
    tail_n = fsl_tail_width(n_cand, BLOCK_N, tiles.fsl_tail) if fsl else 0
    launch(_score_topk_kernel, grid,
        q,
        kbar,
        amax,
        cand,
        sigma,
        lam,
        idx,
        union,
        count,
        T,
        C,
        nblocks,
        n_tiles,
        Hq,
        Hkv,
        *q.stride(),
        1.0 / math.sqrt(D),
        D=D,
        CELL=cfg.cell,
        QBLOCK=cfg.block,
        TILES_PER_BLOCK=tiles_per_block,
        TOP_K=K,
        K_PAD=max(2, next_pow2(K)),
        FSL=fsl,
        N_CAND=max(n_cand, 1),
        N_MAIN=max(n_cand, 1) - (n_cand % BLOCK_N if tail_n else 0),
        TAIL_N=tail_n,
        SPLIT_DOT=q.dtype in (torch.float16, torch.bfloat16),
        EARLY_EXIT=tiles.early_exit,
        COUNT_ROUNDS=tiles.count_rounds,
        ERF_SKIP=tiles.erf_skip,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
        UNION_OUT=bool(union_rows),
        U_MAX=max(u_max, 1),
        U_P=max(next_pow2(max(u_max, 1)), 32 * tiles.num_warps),  # >= one element per thread (no replicated sort)
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return (idx, union, count) if union_rows else idx
