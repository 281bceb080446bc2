"""Fused FreeSolo forward in Triton: local RoPE window + sparse NoPE readout + RMSNorm + beta (spec §2, §7).

Host side (`attention_forward`): the keys are rotated (`_common.rope_rotate`, fp32 math, one
rounding to the input dtype) one chunk of query tiles at a time into a reused buffer (the
forward never holds a rotated copy of all of k; `rotation_chunk_tiles`), the cells selected by each tile of BLOCK_M queries are gathered
into a sorted, deduplicated, fixed-width list (`tile_unions`: one Triton launch on CUDA), then one
fused kernel runs. One program per (query tile, batch row b, query head h); kv head
g = h // (Hq // Hkv). The program
1. rotates its queries (RoPE in fp32, half-split) and runs an online softmax (flash-attention
   style, exp2 domain, fp32 accumulation) over the rotated key tiles of its window, keys
   i - w < t <= i: a masked tile where the window starts, unmasked tiles inside every query's
   window, masked tiles on the diagonal;
2. loops over the tile's cell union, one cell per step: logits [BLOCK_M, cell] = q . k
   (unrotated, tensor cores), masked to the queries that selected that cell, online softmax;
3. writes o = o_loc + beta_h * o_long * rstd and the statistics the backward needs
   (lse_loc, lse_long, rstd).
With `AttentionTiles.long_block > 0` (the 16-bit default) step 2 runs in its own kernel
(`_long_fwd_kernel`) over tiles of long_block queries whose unions are computed per long_block
queries (fewer masked steps per query, smaller programs, more of them resident). By default
(`window_first`) the window kernel runs first and writes o = o_loc while the selection and the
unions run on a side stream (`forward_with_selection`; from OVERLAP_MIN_T positions or under
CUDA-graph capture, on the current stream otherwise), then the long kernel adds
beta_h * rmsnorm(o_long) to o; otherwise the long kernel writes its term first (into o, or an
fp32 buffer) and the window kernel adds o_loc. `AttentionTiles.maxnreg` caps the window
kernel's registers (occupancy). With `AttentionTiles.sorted_long` (the 16-bit default from
T = SORTED_LONG_MIN_T) a long tile holds queries sorted by their selected cells
(`long_query_order`, within chunks of ORDER_CHUNK positions) instead of consecutive positions:
queries that read the same cells share a tile, and its union shrinks (H200, iid keys, FS-L 64k:
~13 cells against ~23).
Why a tile union and not a per-query gather: per-query-head selections leave no group of
queries sharing one selection (NSA's trick: fla's parallel_nsa puts the G heads of a GQA group
on the M side of the dot); the union keeps the tensor cores busy at the price of masked work
(on iid keys a 64-query tile's FS-L union holds ~24 cells, ~6x the 4 each query reads, ~13 with
sorted tiles; on keys with norm spread ~5), and needs no second pass or partial-result buffer
(Flash Sparse Attention's inverted loop does).

Row independence (spec L12, bitwise). A query's steps in the long loop are its own cells in
ascending order, whatever the other queries selected: a cell selected only by other queries
is a fully masked step (logits -inf, running max starting at the finite NEG_BIG), so
m_new = m, alpha = exp2(0) = 1, p = 0, and (m, l, acc) keep every bit. One cell per step
(never two cells grouped in one step) keeps the grouping of a query's tokens independent of
the others. The window phases depend on the tile start only; tile sizes (block_m, long_block)
depend on (D, dtype, device) and process-wide switches only, never on B or T.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import NEG_BIG, launch, next_pow2, padded_dims, rope_rotate, store_union

__all__ = [
    "ENV_LONG_BLOCK",
    "ENV_LONG_INTO_OUT",
    "ENV_WINDOW_FIRST",
    "ENV_SORTED_LONG",
    "ENV_MAXNREG",
    "ENV_LONG_MAXNREG",
    "ENV_WINDOW_TILES",
    "window_tiles_env",
    "AttentionTiles",
    "attention_forward",
    "default_tiles",
    "forward_unions",
    "forward_with_selection",
    "launch_forward",
    "long_query_order",
    "order_key_layout",
    "ORDER_CHUNK",
    "SORTED_LONG_MIN_T",
    "ENV_SORTED_LONG_MIN_T",
    "ENV_FUSED_UNIONS",
    "FUSED_UNIONS_DEFAULT",
    "fused_unions_on",
    "sorts_long_tiles",
    "ROTATION_CHUNK_BYTES",
    "ROTATION_CHUNK_MIN_POSITIONS",
    "rotation_chunk_tiles",
    "tile_unions",
    "TileUnions",
]

LOG2E = 1.4426950408889634


@triton.jit
def _window_steps(
    acc, l_i, m_i, qr, m0, kr_base, v_base, n_lo, n_hi, T, W, kv_stride, qk_scale,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Online-softmax steps of the local branch over the key tiles n0 in [n_lo, n_hi), BLOCK_N apart.

    qr [BLOCK_M, D_P]: the rotated queries m0 + [0, BLOCK_M); kr_base / v_base: the rotated keys
    and the values of this (b, kv head) (rows kv_stride apart). MASKED: apply the window mask
    i - W < t <= i and t < T; without it every key of the tiles is in every query's window and
    < T (no mask, no bounds). Pointers: one int64 scalar base per tile plus int32 offsets."""
    dtype = qr.dtype
    dd = tl.arange(0, D_P)
    rn = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    tile_offs = rn[:, None] * kv_stride + dd[None, :]  # [BLOCK_N, D_P] int32
    for n0 in range(n_lo, n_hi, BLOCK_N):
        if MASKED:
            col_ok = rn < tl.minimum(T - n0, BLOCK_N).to(tl.int32)  # keys of the tile before T
            kv_mask = col_ok[:, None] & (dd[None, :] < D)
            kr = tl.load(kr_base + n0 * kv_stride + tile_offs, mask=kv_mask, other=0.0)
        elif D == D_P:
            kr = tl.load(kr_base + n0 * kv_stride + tile_offs)
        else:
            kv_mask = (rn[:, None] >= 0) & (dd[None, :] < D)
            kr = tl.load(kr_base + n0 * kv_stride + tile_offs, mask=kv_mask, other=0.0)
        s = tl.dot(qr, tl.trans(kr), input_precision="ieee")
        if MASKED:
            delta = (m0 - n0).to(tl.int32) + rm[:, None] - rn[None, :]  # i - t
            s = tl.where((delta >= 0) & (delta < W) & col_ok[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED or D != D_P:
            v = tl.load(v_base + n0 * kv_stride + tile_offs, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_base + n0 * kv_stride + tile_offs)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _load_sel(IDX, b, T, Hq, h, offs_m, row_ok, KSEL: tl.constexpr, K_P: tl.constexpr):
    """int32 [M, K_P]: the selected cells of the queries offs_m [M] (query head h, batch row b), -1 padded."""
    kk = tl.arange(0, K_P)
    return tl.load(
        IDX + ((b * T + offs_m) * Hq + h)[:, None] * KSEL + kk[None, :],
        mask=row_ok[:, None] & (kk[None, :] < KSEL),
        other=-1,
    ).to(tl.int32)


@triton.jit
def _cell_kv(k_base, v_base, cell, ok, cell_offs, kv_mask, kv_stride, CELL: tl.constexpr):
    """(k, v) [CELL_P, D_P] of one cell's tokens (rows kv_stride apart from k_base / v_base); zeros
    where not `ok` (a scalar: a prefetch past the union reads nothing) or outside kv_mask."""
    cb = cell.to(tl.int64) * (CELL * kv_stride)  # element offset of the cell's first token
    kc = tl.load(k_base + cb + cell_offs, mask=kv_mask & ok, other=0.0)
    vc = tl.load(v_base + cb + cell_offs, mask=kv_mask & ok, other=0.0)
    return kc, vc


@triton.jit
def _cell_step(acc, l_j, m_j, q, sel, cell, kc, vc, c_ok, qk_scale, CELL: tl.constexpr, CELL_P: tl.constexpr):
    """One online-softmax step of the long branch over one cell: logits [M, CELL_P] = q . kc
    (tensor cores), masked to the rows whose selections sel [M, K_P] hold `cell`; a row without it
    keeps every bit of (acc, l_j, m_j) (m_j starts at the finite NEG_BIG)."""
    hit = tl.sum((sel == cell).to(tl.int32), 1) > 0  # [M]: queries that selected this cell
    s = tl.dot(q, tl.trans(kc), input_precision="ieee")
    if CELL == CELL_P:
        s = tl.where(hit[:, None], s * qk_scale, float("-inf"))
    else:
        s = tl.where(hit[:, None] & c_ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_j, tl.max(s, 1))
    alpha = tl.math.exp2(m_j - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_j = l_j * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vc, input_precision="ieee")
    return acc, l_j, m_new


@triton.jit
def _long_steps(
    q, IDX, urow, NU_PTR, k_base, v_base, b, h, T, Hq, offs_m, row_ok, kv_stride, qk_scale,
    D: tl.constexpr, D_P: tl.constexpr, CELL: tl.constexpr, CELL_P: tl.constexpr, KSEL: tl.constexpr,
    K_P: tl.constexpr, BLOCK_M: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr = False, col=0,
):  # fmt: skip
    """Online-softmax steps of the long branch for the queries offs_m [BLOCK_M] (q [BLOCK_M, D_P]
    unrotated, q's dtype) over their tile's cell union: urow points at the union's sorted cell ids,
    NU_PTR at its length. One cell per step (`_cell_step`). Returns (acc [BLOCK_M, D_P], l [BLOCK_M],
    m [BLOCK_M]), fp32, exp2 domain (m starts at the finite NEG_BIG: a fully masked step keeps every bit).
    TMA (AttentionTiles.long_tma; CELL == CELL_P, D == D_P, no PREFETCH): k_base / v_base are tensor
    descriptors of k / v viewed as [B, T, Hkv * D] with [1, CELL, D] boxes, a cell's tile the box at
    (b, cell * CELL, col = g * D): the same values as the pointer loads, moved by the copy engine and
    pipelined by the compiler (the kernel's num_stages)."""
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    sel = _load_sel(IDX, b, T, Hq, h, offs_m, row_ok, KSEL, K_P)  # [BLOCK_M, K_P]
    n_u = tl.load(NU_PTR)
    offs_c = tl.arange(0, CELL_P)
    c_ok = offs_c < CELL
    cell_offs = offs_c[:, None] * kv_stride + dd[None, :]  # [CELL_P, D_P] int32 inside one cell
    kv_mask = c_ok[:, None] & d_ok[None, :]
    m_j = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_j = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    if PREFETCH:
        # software pipelining by hand: the cell ids two steps ahead and the keys / values one
        # step ahead are loaded before the current step computes (the loop is latency-bound:
        # id -> address -> k -> dot -> v -> dot; the compiler's pipeliner does not hoist the
        # id-dependent loads). Out-of-union prefetches are masked (no reads past the union).
        cell = tl.load(urow, mask=n_u > 0, other=0)
        cell_n = tl.load(urow + 1, mask=n_u > 1, other=0)
        kc, vc = _cell_kv(k_base, v_base, cell, n_u > 0, cell_offs, kv_mask, kv_stride, CELL)
    for u in range(0, n_u):
        if TMA:
            cell = tl.load(urow + u)
            kc = k_base.load([b.to(tl.int32), cell * CELL, col]).reshape(CELL, D)
            vc = v_base.load([b.to(tl.int32), cell * CELL, col]).reshape(CELL, D)
        elif PREFETCH:
            cell_nn = tl.load(urow + u + 2, mask=u + 2 < n_u, other=0)
            kc_n, vc_n = _cell_kv(k_base, v_base, cell_n, u + 1 < n_u, cell_offs, kv_mask, kv_stride, CELL)
        else:
            cell = tl.load(urow + u)
            cb = cell.to(tl.int64) * (CELL * kv_stride)  # element offset of the cell's first token
            if CELL == CELL_P and D == D_P:
                kc = tl.load(k_base + cb + cell_offs)
                vc = tl.load(v_base + cb + cell_offs)
            else:
                kc = tl.load(k_base + cb + cell_offs, mask=kv_mask, other=0.0)
                vc = tl.load(v_base + cb + cell_offs, mask=kv_mask, other=0.0)
        acc, l_j, m_j = _cell_step(acc, l_j, m_j, q, sel, cell, kc, vc, c_ok, qk_scale, CELL, CELL_P)
        if PREFETCH:
            cell = cell_n
            cell_n = cell_nn
            kc = kc_n
            vc = vc_n
    return acc, l_j, m_j


@triton.jit
def _long_finish(acc, l_j, m_j, beta_ptr, eps, D: tl.constexpr):
    """(beta_h * rmsnorm(o_long) [M, D_P] fp32, lse_long [M] natural log (-inf: no cell),
    rstd [M]) from the long loop's state; o_long = 0 where no cell was selected."""
    has = l_j > 0
    o_long = tl.where(has[:, None], acc / tl.where(has, l_j, 1.0)[:, None], 0.0)
    lse_long = tl.where(has, (m_j + tl.math.log2(tl.where(has, l_j, 1.0))) * 0.6931471805599453, float("-inf"))
    rstd = 1.0 / tl.sqrt_rn(tl.sum(o_long * o_long, 1) / D + eps)
    beta = tl.load(beta_ptr)
    return beta * (o_long * rstd[:, None]), lse_long, rstd


@triton.jit(do_not_specialize=["stats_on"])
def _long_fwd_kernel(
    Q,  # [B, T, Hq, D]
    K,  # [B, T, Hkv, D] unrotated keys (TMA: a tensor descriptor of K viewed as [B, T, Hkv * D], box [1, CELL, D])
    V,  # [B, T, Hkv, D] (TMA: a descriptor as K's)
    IDX,  # int32 / int64 [B, T, Hq, KSEL], -1 padded
    UNION,  # int32 [B * Hq, NT, U_MAX]: sorted cells of each tile of BLOCK_M queries, -1 padded
    NUNION,  # int32 [B * Hq, NT]
    ORDER,  # int32 [B * Hq, T]: tile t holds the positions ORDER[b * Hq + h, t * BLOCK_M:][:BLOCK_M] (HAS_ORDER)
    BETA,  # fp32 [Hq]
    LONG_TERM,  # fp32 [B, T, Hq, D] (out): beta_h * rmsnorm(o_long); or O itself (long_into_out)
    LSE_LONG,  # fp32 [B, Hq, T] (out)
    RSTD,  # fp32 [B, Hq, T] (out)
    T,
    Hq,
    Hkv,
    NT,
    qk_scale,  # scale * log2(e)
    eps,
    stats_on,  # 0: store no LSE_LONG / RSTD (nothing to save); a runtime value, so both modes run one compiled kernel
    D: tl.constexpr,
    D_P: tl.constexpr,
    CELL: tl.constexpr,
    CELL_P: tl.constexpr,
    KSEL: tl.constexpr,
    K_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    U_MAX: tl.constexpr,
    PREFETCH: tl.constexpr,
    ADD_TO_OUT: tl.constexpr,  # AttentionTiles.window_first: LONG_TERM is O holding o_loc; add the long term to it
    HAS_ORDER: tl.constexpr,  # AttentionTiles.sorted_long: the tiles' positions come from ORDER (else consecutive)
    TMA: tl.constexpr = False,  # AttentionTiles.long_tma on a call that allows it (`_long_tma_ok`): K, V are descriptors
):
    """The long branch alone (AttentionTiles.long_block > 0): one program per (tile of BLOCK_M
    queries, b * Hq + h), the same steps as the fused kernel's long loop over this smaller tile's
    smaller union; writes beta_h * rmsnorm(o_long) in fp32 for `_attention_fwd_kernel` to add."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    g = h // (Hq // Hkv)
    kv_stride = Hkv * D
    if TMA:
        k_base = K
        v_base = V
    else:
        k_base = K + (b * T * Hkv + g) * D
        v_base = V + (b * T * Hkv + g) * D
    urow = UNION + (pid_bh * NT + pid_m) * U_MAX
    nu_ptr = NUNION + pid_bh * NT + pid_m
    offs_m = _tile_positions(ORDER, pid_bh, pid_m, T, BLOCK_M, HAS_ORDER)
    q, row_ok = _load_rows(Q, b, h, T, Hq, offs_m, D, D_P)
    acc, l_j, m_j = _long_steps(
        q, IDX, urow, nu_ptr, k_base, v_base, b, h, T, Hq, offs_m, row_ok, kv_stride, qk_scale,
        D, D_P, CELL, CELL_P, KSEL, K_P, BLOCK_M, PREFETCH, TMA, (g * D).to(tl.int32),
    )  # fmt: skip
    _long_store(acc, l_j, m_j, offs_m, b, h, T, Hq, BETA, eps, LONG_TERM, LSE_LONG, RSTD, stats_on, D, D_P, ADD_TO_OUT)


@triton.jit
def _tile_positions(ORDER, pid_bh, tile, T, BLOCK_M: tl.constexpr, HAS_ORDER: tl.constexpr):
    """int64 [BLOCK_M]: the query positions of long tile `tile` of row pid_bh = b * Hq + h:
    ORDER[pid_bh, tile * BLOCK_M:][:BLOCK_M] (HAS_ORDER) or consecutive; T (no query) past the end."""
    slot = tile * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    if HAS_ORDER:
        return tl.load(ORDER + pid_bh * T + slot, mask=slot < T, other=T).to(tl.int64)
    return slot


@triton.jit
def _load_rows(Q, b, h, T, Hq, offs_m, D: tl.constexpr, D_P: tl.constexpr):
    """(q [M, D_P] of query head h at positions offs_m [M] (zeros past T or D), row_ok [M])."""
    dd = tl.arange(0, D_P)
    row_ok = offs_m < T
    rows = ((b * T + offs_m) * Hq + h)[:, None] * D + dd[None, :]
    return tl.load(Q + rows, mask=row_ok[:, None] & (dd < D)[None, :], other=0.0), row_ok


@triton.jit
def _long_store(acc, l_j, m_j, offs_m, b, h, T, Hq, BETA, eps, LONG_TERM, LSE_LONG, RSTD, stats_on,
                D: tl.constexpr, D_P: tl.constexpr, ADD_TO_OUT: tl.constexpr):  # fmt: skip
    """Writes beta_h * rmsnorm(o_long) of the rows offs_m [M] into LONG_TERM (cast to its dtype: q's
    with long_into_out; ADD_TO_OUT: LONG_TERM is o holding o_loc, and the fp32 sum o_loc + long term
    is written back) and, unless stats_on == 0, their lse_long, rstd (masked stores: the same
    arithmetic either way)."""
    dd = tl.arange(0, D_P)
    row_ok = offs_m < T
    rows = ((b * T + offs_m) * Hq + h)[:, None] * D + dd[None, :]
    long_term, lse_long, rstd = _long_finish(acc, l_j, m_j, BETA + h, eps, D)
    row_mask = row_ok[:, None] & (dd < D)[None, :]
    if ADD_TO_OUT:
        long_term = tl.load(LONG_TERM + rows, mask=row_mask, other=0.0).to(tl.float32) + long_term
    tl.store(LONG_TERM + rows, long_term, mask=row_mask)
    stat = (b * Hq + h) * T + offs_m
    tl.store(LSE_LONG + stat, lse_long, mask=row_ok & (stats_on != 0))
    tl.store(RSTD + stat, rstd, mask=row_ok & (stats_on != 0))


@triton.jit(do_not_specialize=["stats_on"])
def _attention_fwd_kernel(
    Q,  # [B, T, Hq, D]
    K,  # [B, T, Hkv, D] unrotated keys (long branch)
    KR,  # [B, KR_T, Hkv, D] rotated keys of positions KR_START.. (local branch, `_common.rope_rotate`)
    V,  # [B, T, Hkv, D]
    IDX,  # int32 / int64 [B, T, Hq, KSEL], -1 padded
    UNION,  # int32 [B * Hq, NT, U_MAX]: sorted cells of each tile, -1 padded (HAS_LONG)
    NUNION,  # int32 [B * Hq, NT]: cells in each tile's union (HAS_LONG)
    BETA,  # fp32 [Hq]
    LONG_TERM,  # fp32 [B, T, Hq, D]: beta_h * rmsnorm(o_long) of `_long_fwd_kernel` (not HAS_LONG); or O (long_into_out)
    COS,  # fp32 [T, HALF]
    SIN,  # fp32 [T, HALF]
    O,  # [B, T, Hq, D], q's dtype
    LSE_LOC,  # fp32 [B, Hq, T]
    LSE_LONG,  # fp32 [B, Hq, T] (written here when HAS_LONG)
    RSTD,  # fp32 [B, Hq, T] (written here when HAS_LONG)
    T,
    Hq,
    Hkv,
    NT,
    TILE0,  # the query tile of program 0 (a launch covers the tiles TILE0 .. TILE0 + grid[0] - 1)
    KR_T,  # positions per batch row in KR
    KR_START,  # the position of KR's first row (every key tile the launch's tiles read lies in KR)
    W,
    qk_scale,  # scale * log2(e)
    eps,
    stats_on,  # 0: store no LSE_LOC (nor LSE_LONG / RSTD with HAS_LONG); a runtime value: one compiled kernel
    D: tl.constexpr,
    HALF: tl.constexpr,
    D_P: tl.constexpr,
    CELL: tl.constexpr,
    CELL_P: tl.constexpr,
    KSEL: tl.constexpr,
    K_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    U_MAX: tl.constexpr,
    PREFETCH: tl.constexpr,
    WINDOW_PHASES: tl.constexpr,
    HAS_LONG: tl.constexpr,  # the long loop here (else LONG_TERM is read, unless not READ_LONG)
    READ_LONG: tl.constexpr,  # without HAS_LONG: add LONG_TERM (False: AttentionTiles.window_first, o = o_loc)
):
    pid_m = tl.program_id(0).to(tl.int64) + TILE0
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    g = h // (Hq // Hkv)
    dtype = Q.dtype.element_ty
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)  # query positions
    row_ok = offs_m < T
    dd = tl.arange(0, D_P)
    d_ok = dd < D
    q_rows = Q + ((b * T + offs_m) * Hq + h) * D  # [BLOCK_M] row pointers
    kv_stride = Hkv * D  # one position to the next in k / v
    k_base = K + (b * T * Hkv + g) * D
    v_base = V + (b * T * Hkv + g) * D

    # ---- local branch: RoPE window i - W < t <= i, online softmax over key tiles
    # rope(q)[d] = q[d] * cos[d % HALF] -/+ q[d +/- HALF] * sin[d % HALF] (full width: one dot per tile)
    d_half = tl.where(dd < HALF, dd, dd - HALF)
    partner = tl.where(dd < HALF, dd + HALF, dd - HALF)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_rows[:, None] + dd[None, :], mask=q_mask, other=0.0)
    q_swap = tl.load(q_rows[:, None] + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    rope_offs = offs_m[:, None] * HALF + d_half[None, :]
    cq = tl.load(COS + rope_offs, mask=q_mask, other=0.0)
    sq = tl.load(SIN + rope_offs, mask=q_mask, other=0.0)
    qr = (q.to(tl.float32) * cq + tl.where((dd < HALF)[None, :], -q_swap, q_swap) * sq).to(dtype)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    # key tiles [n0, n0 + BLOCK_N) from the first one any query of the tile sees, in three
    # phases that depend on m0 alone (never on T: spec L12): tiles that cut some query's window
    # start (masked), tiles inside every query's window (no mask), tiles on the diagonal (masked)
    lo = (tl.maximum(m0 - W + 1, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(((m0 + BLOCK_M - W + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)  # n0 >= i_max - W + 1
    full_hi = tl.maximum(((m0 + 1) // BLOCK_N) * BLOCK_N, full_lo)  # n0 + BLOCK_N - 1 <= m0
    hi = tl.minimum(m0 + BLOCK_M, T)
    kr_base = KR + ((b * KR_T - KR_START) * Hkv + g) * D  # rotated key of position t: kr_base + t * kv_stride
    if WINDOW_PHASES:
        acc, l_i, m_i = _window_steps(
            acc, l_i, m_i, qr, m0, kr_base, v_base, lo, tl.minimum(full_lo, hi), T, W, kv_stride, qk_scale,
            D, D_P, BLOCK_M, BLOCK_N, True,
        )  # fmt: skip
        acc, l_i, m_i = _window_steps(
            acc, l_i, m_i, qr, m0, kr_base, v_base, full_lo, full_hi, T, W, kv_stride, qk_scale,
            D, D_P, BLOCK_M, BLOCK_N, False,
        )  # fmt: skip
        acc, l_i, m_i = _window_steps(
            acc, l_i, m_i, qr, m0, kr_base, v_base, full_hi, hi, T, W, kv_stride, qk_scale,
            D, D_P, BLOCK_M, BLOCK_N, True,
        )  # fmt: skip
    else:  # one masked, software-pipelined loop over every key tile
        acc, l_i, m_i = _window_steps(
            acc, l_i, m_i, qr, m0, kr_base, v_base, lo, hi, T, W, kv_stride, qk_scale,
            D, D_P, BLOCK_M, BLOCK_N, True,
        )  # fmt: skip
    l_i = tl.where(row_ok, l_i, 1.0)  # every real query sees its own key: l_i >= 1; padding rows: 1
    o_loc = acc / l_i[:, None]
    lse_loc = (m_i + tl.math.log2(l_i)) * 0.6931471805599453

    o_offs = ((b * T + offs_m) * Hq + h)[:, None] * D + dd[None, :]  # [BLOCK_M, D_P] int64
    stat = (b * Hq + h) * T + offs_m
    if HAS_LONG:
        # ---- long branch: NoPE softmax over the tokens of each query's selected cells
        acc, l_j, m_j = _long_steps(
            q, IDX, UNION + (pid_bh * NT + pid_m) * U_MAX, NUNION + pid_bh * NT + pid_m, k_base, v_base,
            b, h, T, Hq, offs_m, row_ok, kv_stride, qk_scale,
            D, D_P, CELL, CELL_P, KSEL, K_P, BLOCK_M, PREFETCH,
        )  # fmt: skip
        long_term, lse_long, rstd = _long_finish(acc, l_j, m_j, BETA + h, eps, D)
        tl.store(LSE_LONG + stat, lse_long, mask=row_ok & (stats_on != 0))
        tl.store(RSTD + stat, rstd, mask=row_ok & (stats_on != 0))
        out = o_loc + long_term
    elif READ_LONG:  # beta_h * rmsnorm(o_long), written by _long_fwd_kernel (fp32, or q's dtype in O)
        long_term = tl.load(LONG_TERM + o_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # + fp32 o_loc: fp32 sum
        out = o_loc + long_term
    else:  # window_first: the long kernel adds its term afterwards
        out = o_loc
    tl.store(O + o_offs, out.to(dtype), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE_LOC + stat, lse_loc, mask=row_ok & (stats_on != 0))


@triton.jit
def _tile_union_kernel(
    IDX,  # int32 / int64 [B, T, Hq, KSEL]
    ORDER,  # int32 [B * Hq, T]: the positions of the tiles, BLOCK_M after BLOCK_M (HAS_ORDER)
    UNION,  # int32 [B * Hq, NT, U_MAX] (out)
    COUNT,  # int32 [B * Hq, NT] (out)
    T,
    Hq,
    NT,
    KSEL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    U_MAX: tl.constexpr,
    U_P: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    """One program per (tile, b * Hq + h): the tile's BLOCK_M * KSEL selections, distinct and
    ascending (`store_union`); the rest of the row is -1."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    e = tl.arange(0, U_P)
    row = pid_m * BLOCK_M + e // KSEL
    if HAS_ORDER:
        row = tl.load(ORDER + pid_bh * T + row, mask=(e < U_MAX) & (row < T), other=T).to(tl.int64)
    ok = (e < U_MAX) & (row < T)
    x = tl.load(IDX + ((b * T + row) * Hq + h) * KSEL + e % KSEL, mask=ok, other=-1).to(tl.int32)
    store_union(tl.where(x < 0, 2147483647, x), UNION + (pid_bh * NT + pid_m) * U_MAX, COUNT + pid_bh * NT + pid_m,
                U_MAX, True)  # fmt: skip


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes of the fused forward. They depend on (D, dtype, device) only, never on B or T
    (spec L12: a row's bits may not depend on the shape of the batch or the sequence length)."""

    block_m: int  # queries per program (window tile rows, and the width of a tile's cell union / K)
    block_n: int  # keys per step of the local window loop
    num_warps: int  # warps per program (GPU only)
    num_stages: int  # software pipelining depth of the loops (GPU only)
    prefetch: bool = True  # long loop: cell ids 2 steps and k / v 1 step ahead, loaded by hand
    window_phases: bool = True  # window loop split in masked / unmasked / diagonal loops (else one masked loop)
    # 0: the long branch runs inside the window kernel over the union of its block_m queries' cells
    # (one launch). > 0: a separate kernel (`_long_fwd_kernel`) runs it over tiles of long_block
    # queries, each with its own, smaller union (on iid keys ~13 cells for 16 queries vs ~20 for
    # 64: less masked work, more programs in flight), and hands beta_h * rmsnorm(o_long) to the
    # window kernel through an fp32 [B, T, Hq, D] buffer (one more launch, 8 bytes per element
    # more traffic). A power of two >= 16 (tl.dot's minimum M).
    long_block: int = 0
    long_warps: int = 4  # warps per program of the separate long kernel (GPU only)
    # register cap per thread for the window kernel (ptxas -maxrregcount; GPU only). The default
    # bf16 D 64 tiles use 129 registers x 256 threads: one program per SM; 128 fits two.
    maxnreg: Optional[int] = None
    # long_block > 0 only. True (`default_tiles` sets it whenever long_block > 0): the long kernel
    # writes beta_h * rmsnorm(o_long) into the output `o` itself, in q's dtype, and the window
    # kernel adds its o_loc there (each program reads and rewrites only its own rows). False: it
    # hands the term over in an fp32 [B, T, Hq, D] buffer (0.5 GiB at 128k, H 16, D 64). For 16-bit
    # dtypes the long term is rounded once more (to q's dtype) before the sum; float32: the same
    # bits either way. H200 (s24 call1, bf16 H16 D64): FS-L forward 2.39 -> 2.34 ms at 64k, peak
    # 1.117 -> 0.617 GiB at 128k; the CUDA forward / backward / API / L11-L12 / model tests pass.
    long_into_out: bool = False
    # long_into_out only (`default_tiles` sets it with long_into_out since s26; the environment
    # switch FREESOLO_TRITON_WINDOW_FIRST=0 turns it off): the window kernel writes o = o_loc first
    # (q's dtype) and the long kernel then adds its term (fp32 sum, one rounding). The window does
    # not need the selection, so `forward_with_selection` runs the selection and the unions on a side
    # stream while the window runs (CUDA): the FS-L pool scan (16 programs at 64k, H 16) and the
    # small kernels then overlap the window instead of idling the GPU. The streams change no bits;
    # the output differs from long_into_out's by one rounding order (16-bit dtypes; fp32: the same
    # bits). H200 (s26 call2, bf16 H16 D64, FS-L through the API, benchmarks/forward_overlap_ab.py):
    # 64k 2.20 -> 2.04 ms, 128k 4.48 -> 4.23; GPU time in a CUDA graph at 16k 0.544 -> 0.493; about
    # 0.1 ms more host time per call (4k: 0.50 -> 0.65 ms, the call is host-bound there). The side
    # stream at priority -1 instead of 0 changed nothing (2.04 vs 2.02 ms at 64k).
    window_first: bool = False
    # long_block > 0 only (`default_tiles` sets it whenever long_block > 0 since s27; the environment
    # switch FREESOLO_TRITON_SORTED_LONG=0 turns it off; applied from T = SORTED_LONG_MIN_T): the
    # long kernel's tiles hold the queries of each (b, h) sorted by their selected cells within
    # chunks of positions (`long_query_order`) instead of consecutive positions, so a tile's union
    # holds few cells. The order changes no output bit (row independence, L12). H200 (s27 call4,
    # bf16 H16 D64, FS-L through the API): union 23.3 -> 12.7 cells at 64k, long kernel 0.868 ->
    # 0.532 ms, order + unions 0.064 -> 0.196, API 2.09 -> 1.97 ms (128k 4.32 -> 3.75). Sorted tiles
    # of 32 / 16 queries hold fewer cells (9.4 / 7.1) but their long kernel is slower (0.98-1.12 /
    # 0.77 ms at 64k, s27 call6): long_block stays 64.
    sorted_long: bool = False
    # long_block > 0 only (`default_tiles` sets it on sm_90+ when LONG_TMA_DEFAULT or
    # FREESOLO_TRITON_LONG_TMA=1 asks for it): the long kernel loads each union cell's keys /
    # values with the tensor-memory accelerator (host tensor descriptors of k / v viewed as
    # [B, T, Hkv * D], one [1, cell, D] box per cell) instead of pointer tensors and the hand
    # prefetch, pipelined LONG_TMA_STAGES deep by the compiler. The same loaded values, so the same
    # bits (tested). A call that TMA cannot serve (`_long_tma_ok`: a GPU below sm_90, cell or D not
    # a power of two >= 16, a head stride other than D, strides or base not 16-byte aligned) runs
    # the pointer loads. H100 (s37
    # call1, bf16 H16 D64, FS-L; the kernel's copy in benchmarks/tma_ab.py, the same loop): long
    # kernel 63.8 -> 58.5 us at 4k, 221.6 -> 192.3 at 16k, 620.1 -> 536.1 at 64k, bitwise equal.
    long_tma: bool = False
    # register cap per thread of the separate long kernel (ptxas -maxrregcount; GPU only; None: no
    # cap). More programs resident per SM for a kernel whose steps are latency-bound at short T (s48:
    # sorted tiles with half the union gained the 4k long kernel 10 %). FREESOLO_TRITON_LONG_MAXNREG
    # sets it (an A/B switch; 0 = none). The same arithmetic, so the same bits. Not measured yet: the
    # s48 device time ran out before `gpu_session_run.sh`'s step s48_lreg (ptxas registers and
    # programs per SM by `benchmarks/long_kernel_regs.py`, then an A/B of caps 96 / 80 / 72).
    long_maxnreg: Optional[int] = None
    # (s26 also tried the long kernel over aligned pairs of cells, one softmax step per pair, which
    # keeps row independence: on iid keys a 64-query tile's pair union held 22.8 pairs against 23.3
    # cells (the pool's high-norm cells are rarely neighbours), so every step doubled for nothing:
    # 64k 2.20 -> 2.79 ms (results/session_2026-12-02_s26/call2); removed.)
    # (s24 also tried four 16-row sub-tiles of the long tile sharing one load of each union cell,
    # a sub-tile stepping only over the cells its rows selected: 2.5x slower at 64k on the H200,
    # results/session_2026-12-02_s25/call1; removed.)

    def __post_init__(self):
        if self.long_block and (self.long_block < 16 or self.long_block & (self.long_block - 1)):
            raise ValueError(f"long_block={self.long_block} must be 0 or a power of two >= 16")
        for name in ("maxnreg", "long_maxnreg"):
            value = getattr(self, name)
            if value is not None and not 24 <= value <= 255:
                raise ValueError(f"{name}={value} must be None or in [24, 255]")
        if self.long_maxnreg is not None and not self.long_block:
            raise ValueError("long_maxnreg needs the separate long kernel (long_block > 0)")
        if self.long_into_out and not self.long_block:
            raise ValueError("long_into_out=True needs the separate long kernel (long_block > 0)")
        if self.window_first and not self.long_into_out:
            raise ValueError("window_first=True needs the long term written into o (long_into_out=True)")
        if self.sorted_long and not self.long_block:
            raise ValueError("sorted_long=True needs the separate long kernel (long_block > 0)")
        if self.long_tma and not self.long_block:
            raise ValueError("long_tma=True needs the separate long kernel (long_block > 0)")

    @property
    def union_rows(self) -> int:
        """Queries per long tile (`forward_unions(idx, cfg, tiles)` feeds `launch_forward`)."""
        return self.long_block or self.block_m


# A/B switches for the default tiles (benchmarks/triton_forward_ab.py passes tiles explicitly):
# FREESOLO_TRITON_LONG_BLOCK=16 (AttentionTiles.long_block; 0 = the fused kernel), FREESOLO_TRITON_MAXNREG=128 (0 = no cap).
ENV_LONG_BLOCK = "FREESOLO_TRITON_LONG_BLOCK"
ENV_MAXNREG = "FREESOLO_TRITON_MAXNREG"
ENV_LONG_INTO_OUT = "FREESOLO_TRITON_LONG_INTO_OUT"  # 0: the fp32 hand-over buffer instead of o (split kernels only)
ENV_WINDOW_FIRST = "FREESOLO_TRITON_WINDOW_FIRST"  # 0: window_first off (on by default with long_into_out)
ENV_SORTED_LONG = "FREESOLO_TRITON_SORTED_LONG"  # 0: sorted_long off (on by default with long_block > 0)
ENV_LONG_TMA = "FREESOLO_TRITON_LONG_TMA"  # 1: long_tma on (with long_block > 0, on sm_90+), 0: off; unset: LONG_TMA_DEFAULT
# N: the long kernel's register cap (long_block > 0, 16-bit dtypes); 0 / unset: none
ENV_LONG_MAXNREG = "FREESOLO_TRITON_LONG_MAXNREG"
# s50, an A/B switch: the window kernel's tile "BLOCK_MxBLOCK_NxWARPSxSTAGES" (e.g. 64x64x4x2; the
# interpreter ignores warps and stages); unset: `_base_tiles`. With the long branch in its own kernel
# (long_block > 0) it changes the window kernel alone; with the fused kernel BLOCK_M is also the long
# tile (`union_rows`).
ENV_WINDOW_TILES = "FREESOLO_TRITON_WINDOW_TILES"
# On by default since s39: its production path passed compute-sanitizer memcheck + racecheck (s39 call1,
# H100, `benchmarks/sanitize_triton.py forward_backward` with it on: 0 errors, 0 hazards), and through the
# API the FS-L forward took 0.179 vs 0.191 ms at 4k, 1.651 vs 1.744 ms at 64k (same run, on / off; bf16 H16 D64).
LONG_TMA_DEFAULT = True
# Pipeline depth of the long kernel with TMA loads (s37 call1, H100, 4k / 16k / 64k: 3 stages
# 0.92 / 0.87 / 0.86 of the pointer kernel's time, 2 stages 0.97 / 0.90 / 0.90, 1 stage 1.22 / 1.08 / 1.06).
LONG_TMA_STAGES = 3


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def window_tiles_env() -> Optional[Tuple[int, int, int, int]]:
    """(block_m, block_n, num_warps, num_stages) from ENV_WINDOW_TILES, or None when it is unset or
    empty. ValueError unless it is four 'x'-separated integers: block_m and block_n powers of two in
    [16, 256], num_warps a power of two in [1, 16], num_stages in [1, 4]."""
    text = os.environ.get(ENV_WINDOW_TILES, "").strip()
    if not text:
        return None
    try:
        values = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        values = ()

    def pow2(x: int, low: int, high: int) -> bool:
        return low <= x <= high and x & (x - 1) == 0

    if not (
        len(values) == 4
        and pow2(values[0], 16, 256)
        and pow2(values[1], 16, 256)
        and pow2(values[2], 1, 16)
        and 1 <= values[3] <= 4
    ):
        raise ValueError(
            f"environment variable {ENV_WINDOW_TILES}={text!r} must be BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 64x64x4x2 "
            "(block sizes powers of two in [16, 256], warps a power of two in [1, 16], stages 1 to 4)"
        )
    return values


_DEFAULT_TILES: dict = {}


def default_tiles(D: int, dtype: torch.dtype, device: torch.device) -> AttentionTiles:
    """`_default_tiles`, cached per (D, dtype, device, the tile variables' values): the
    variables are still read at every call (an A/B switch takes effect at the next call)."""
    names = (
        ENV_LONG_BLOCK, ENV_MAXNREG, ENV_LONG_INTO_OUT, ENV_WINDOW_FIRST, ENV_SORTED_LONG, ENV_LONG_TMA, ENV_LONG_MAXNREG,
        ENV_WINDOW_TILES,
    )  # fmt: skip
    env = tuple(os.environ.get(name) for name in names)
    key = (D, dtype, device, env)
    hit = _DEFAULT_TILES.get(key)
    if hit is None:
        if len(_DEFAULT_TILES) >= 64:
            _DEFAULT_TILES.clear()
        hit = _DEFAULT_TILES[key] = _default_tiles(D, dtype, device)
    return hit


def _default_tiles(D: int, dtype: torch.dtype, device: torch.device) -> AttentionTiles:
    """Tile sizes by head dim and dtype (see AttentionTiles). On the CPU (interpreter) small tiles.
    With long_block > 0 the long term goes into o (long_into_out), the window kernel first
    (window_first), the long tiles sorted by selection (sorted_long). The environment variables
    ENV_LONG_BLOCK / ENV_MAXNREG / ENV_LONG_INTO_OUT (0: the fp32 buffer) / ENV_WINDOW_FIRST (0:
    off; it needs long_into_out) / ENV_SORTED_LONG (0: off) override long_block / maxnreg /
    long_into_out / window_first / sorted_long, ENV_LONG_TMA (1: on, 0: off, unset:
    LONG_TMA_DEFAULT; only with long_block on a device of compute capability 9 or more) long_tma,
    ENV_WINDOW_TILES (`window_tiles_env`) the window kernel's block_m / block_n / num_warps / num_stages
    (process-wide, read at each call; they never depend on B or T). ENV_MAXNREG applies to 16-bit
    dtypes only (fp32 D 128 at 128 registers spills ~1.2 kB per thread on sm_90)."""
    tiles = _base_tiles(D, dtype, device)
    window = window_tiles_env()
    if window is not None:
        block_m, block_n, num_warps, num_stages = window
        tiles = dataclasses.replace(tiles, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    long_block, maxnreg = _env_int(ENV_LONG_BLOCK), _env_int(ENV_MAXNREG)
    if long_block is not None:
        tiles = dataclasses.replace(tiles, long_block=long_block)
    if maxnreg is not None and dtype != torch.float32:
        tiles = dataclasses.replace(tiles, maxnreg=maxnreg or None)
    into_out = _env_int(ENV_LONG_INTO_OUT)
    if tiles.long_block:
        tiles = dataclasses.replace(tiles, long_into_out=True if into_out is None else bool(into_out))
    window_first = _env_int(ENV_WINDOW_FIRST)
    if tiles.long_into_out:
        tiles = dataclasses.replace(tiles, window_first=True if window_first is None else bool(window_first))
    sorted_long = _env_int(ENV_SORTED_LONG)
    if tiles.long_block:
        tiles = dataclasses.replace(tiles, sorted_long=True if sorted_long is None else bool(sorted_long))
    long_tma = _env_int(ENV_LONG_TMA)
    long_tma = LONG_TMA_DEFAULT if long_tma is None else bool(long_tma)
    if tiles.long_block and long_tma and device.type == "cuda":
        tiles = dataclasses.replace(tiles, long_tma=torch.cuda.get_device_capability(device)[0] >= 9)
    long_maxnreg = _env_int(ENV_LONG_MAXNREG)
    if tiles.long_block and long_maxnreg is not None and dtype != torch.float32:
        tiles = dataclasses.replace(tiles, long_maxnreg=long_maxnreg or None)
    return tiles


def _base_tiles(D: int, dtype: torch.dtype, device: torch.device) -> AttentionTiles:
    if device.type != "cuda":
        return AttentionTiles(block_m=32, block_n=32, num_warps=1, num_stages=1)
    d_p, _ = padded_dims(D)
    wide = dtype == torch.float32
    # register pressure measured with ptxas for sm_90 (no or < 100 bytes of spills at these sizes)
    # 16-bit: the long branch in its own kernel over 64-query tiles, the window kernel capped at 128
    # registers. H200 (bf16, H16 D64, benchmarks/results/triton_forward_ab.json): FS-L kernels 4.14 ->
    # 1.98 ms at 64k, API 5.75 -> 3.55 ms, outputs within 1.1e-5 RMS of the fused kernel; the CUDA
    # forward / backward / API / L11-L12 tests passed with it (results/session_2026-12-01_s17/tests_split.log).
    # fp32 keeps the fused kernel (its "ieee" dots; 128 registers would spill at D 128).
    # D <= 64, 16-bit: the window kernel on 4 warps (s21 sweep, benchmarks/triton_forward_ab.py
    # --sweep-only, results/session_2026-12-01_s21/call2/: FS-L kernels at 64k 1.99 -> 1.56 ms).
    split: dict = {} if wide else dict(long_block=64, maxnreg=128)
    if d_p <= 64:
        return AttentionTiles(block_m=64, block_n=32 if wide else 64, num_warps=8 if wide else 4, num_stages=2, **split)
    if d_p <= 128 and not wide:
        # D 128, 16-bit: 64 keys per step on 4 warps, no register cap (s50 call8, H100, FS-L fwd through the
        # API, GQA-Hq32-Hkv8-D128, same run, `FREESOLO_TRITON_WINDOW_TILES` A/B: 0.345 / 5.217 ms at 4k / 64k
        # against 0.421 / 6.344 for the s21 tile 64x32 on 8 warps capped at 128 registers; the CUDA tests
        # ran on it in s51, `gpu_session_run.sh` step s51_tests).
        return AttentionTiles(block_m=64, block_n=64, num_warps=4, num_stages=2, long_block=64)
    # D 256, and fp32 past D 64 (its "ieee" dots run on FMA units, not tensor cores): some spills
    return AttentionTiles(block_m=32, block_n=32, num_warps=8, num_stages=1)


class TileUnions(NamedTuple):
    """The long tiles of a forward: which queries each tile holds and the cells they selected.

    union int32 [B * Hq, NT, block_m * K]: each tile's distinct cells ascending, -1 padded
    (NT = ceil(T / block_m)); count int32 [B * Hq, NT]: the number of cells in each union;
    order int32 [B * Hq, T] or None: tile t of row b * Hq + h holds the positions
    order[b * Hq + h, t * block_m:][:block_m] (`long_query_order`); None: consecutive positions."""

    union: torch.Tensor
    count: torch.Tensor
    order: Optional[torch.Tensor]


def tile_unions(idx: torch.Tensor, block_m: int, use_kernel: bool | None = None, order=None) -> TileUnions:
    """The cells selected by the queries of each tile of `block_m` positions, per (b, h).

    Args:
        idx: int [B, T, Hq, K] selected cells, -1 padded, any order (contiguous).
        use_kernel: one Triton launch (`_tile_union_kernel`) instead of torch sorts; default: on
            CUDA (the interpreter runs tl.sort slowly, so CPU uses torch unless asked).
        order: int32 [B * Hq, T] (`long_query_order`): the tiles hold these positions, block_m
            after block_m; None: consecutive positions.
    Returns:
        TileUnions(union, count, order).
    """
    B, T, Hq, K = idx.shape
    NT = -(-T // block_m)
    if order is not None and (
        tuple(order.shape) != (B * Hq, T) or order.dtype != torch.int32 or order.device != idx.device
    ):
        raise ValueError(
            f"order must be int32 [B * Hq={B * Hq}, T={T}] on {idx.device}, "
            f"got {order.dtype} {tuple(order.shape)} on {order.device}"
        )
    if use_kernel is None:
        use_kernel = idx.is_cuda
    if use_kernel:
        union = torch.empty(B * Hq, NT, block_m * K, dtype=torch.int32, device=idx.device)
        count = torch.empty(B * Hq, NT, dtype=torch.int32, device=idx.device)
        if union.numel():
            u_p = next_pow2(block_m * K)
            launch(_tile_union_kernel, (NT, B * Hq),
                idx, order if order is not None else count, union, count, T, Hq, NT, KSEL=K, BLOCK_M=block_m,
                U_MAX=block_m * K, U_P=u_p, HAS_ORDER=order is not None, num_warps=4 if u_p >= 256 else 1,
            )  # fmt: skip
        return TileUnions(union, count, order)
    x = idx.permute(0, 2, 1, 3).reshape(B * Hq, T, K).to(torch.int32)  # (B*Hq, T, K)
    if order is not None:
        x = x.gather(1, order.long()[:, :, None].expand(-1, -1, K))
    x = torch.nn.functional.pad(x, (0, 0, 0, NT * block_m - T), value=-1)
    x = x.reshape(B * Hq, NT, block_m * K)  # (B*Hq, NT, block_m*K)
    big = torch.iinfo(torch.int32).max
    x = torch.where(x < 0, big, x)
    x = torch.sort(x, dim=-1).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.sort(torch.where(dup, big, x), dim=-1).values
    count = (x != big).sum(dim=-1, dtype=torch.int32)
    return TileUnions(torch.where(x == big, -1, x).contiguous(), count.contiguous(), order)


@triton.jit
def _order_key_kernel(
    IDX,  # int32 / int64 [B, T, Hq, KSEL]
    KEY,  # int64 [B * Hq, T_PAD] (out), T_PAD = T rounded up to a multiple of the chunk
    T,
    T_PAD,
    Hq,
    BITS,  # bits per cell in the key (`order_key_layout`)
    SLOTS,  # cells packed into the key
    KSEL: tl.constexpr,
    K_P: tl.constexpr,
    POS_BITS: tl.constexpr,  # log2(chunk)
    BLOCK: tl.constexpr,
):
    """One program per (BLOCK positions, b * Hq + h): the sort key of each query of `long_query_order`:
    its cells ascending (absent as the largest id), the first SLOTS packed BITS apart above its
    position in the chunk (unique keys); past T the largest int64 (sorts last)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    pos = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = pos < T
    kk = tl.arange(0, K_P)
    x = tl.load(IDX + ((b * T + pos) * Hq + h)[:, None] * KSEL + kk[None, :],
                mask=ok[:, None] & (kk < KSEL)[None, :], other=-1).to(tl.int32)  # fmt: skip
    x = tl.sort(tl.where(x < 0, (1 << BITS) - 1, x), 1)
    shift = tl.where(kk < SLOTS, (SLOTS - 1 - kk) * BITS + POS_BITS, 0).to(tl.int64)
    key = tl.sum(tl.where((kk < SLOTS)[None, :], x.to(tl.int64) << shift[None, :], 0), 1)
    key = key | (pos & ((1 << POS_BITS) - 1))
    tl.store(KEY + pid_bh * T_PAD + pos, tl.where(ok, key, 9223372036854775807), mask=pos < T_PAD)


@triton.jit
def _order_decode_kernel(
    KEY,  # int64 [ROWS, T_PAD]: the keys of `_order_key_kernel`, sorted within each chunk
    ORDER,  # int32 [ROWS, T] (out)
    T,
    T_PAD,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (BLOCK slots, row): the position of each sorted key, its chunk's first
    position + its low log2(CHUNK) bits."""
    slot = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    ok = slot < T
    key = tl.load(KEY + row * T_PAD + slot, mask=ok, other=0)
    tl.store(ORDER + row * T + slot, ((slot // CHUNK) * CHUNK + (key & (CHUNK - 1))).to(tl.int32), mask=ok)


# Positions whose order `long_query_order` sorts together (torch.sort's in-block path holds at most
# 4096 per row): on iid keys (FS-L, T 65536, H 4 on the CPU) 64-query unions of ~9 cells, against ~7
# with one sort of all T positions and ~19 without sorting.
ORDER_CHUNK = 4096
# Below this many positions the forward keeps consecutive long tiles (AttentionTiles.sorted_long is
# not applied): the order costs what the smaller unions save, and the call is host-bound there
# (H200, s27 call3, FS-L 16k: long kernel 0.197 -> 0.139 ms, order + unions 0.021 -> 0.129, GPU time
# in a CUDA graph 0.494 -> 0.493, API 0.64 -> 0.91 ms; at 64k the API gains 2.09 -> 1.97 ms). Output
# bits do not depend on it (the order never changes a bit). FREESOLO_TRITON_SORTED_LONG_MIN_T overrides it
# (an A/B switch, read at each call). Re-measured with the selection on a side stream (H100, s48 call1,
# FS-L fwd through the API, sorted at every length vs the default): 4k 0.1779 vs 0.1337 ms, 8k 0.2762
# vs 0.2445, 16k 0.5121 vs 0.4968. The 4k timeline (call2) shows why: the order's torch radix sort takes
# 37 us on the selection chain, and the long kernel gains 4 us (40 vs 44 us; at 4k it is bound by
# the latency of its steps, not by the union's masked work).
SORTED_LONG_MIN_T = 32768
ENV_SORTED_LONG_MIN_T = "FREESOLO_TRITON_SORTED_LONG_MIN_T"


def order_key_layout(n_cells: int, top_k: int, chunk: int) -> tuple[int, int]:
    """(bits per cell, cells packed) of the sort key of `long_query_order`: the cell ids
    0 .. n_cells - 1 need BITS bits (an absent cell counts as 2**BITS - 1), the position in the
    chunk log2(chunk) bits; as many of a query's top_k cells as fit in 62 bits."""
    bits = max(1, int(n_cells - 1).bit_length())
    return bits, max(1, min(top_k, (62 - (chunk.bit_length() - 1)) // bits))


def long_query_order(
    idx: torch.Tensor, cell: int, use_kernel: bool | None = None, chunk: int | None = None
) -> torch.Tensor:
    """The positions of each (b, h), sorted by their selections within chunks: int32 [B * Hq, T].

    The long kernel's tiles then hold queries that selected the same or nearly the same cells, so a
    tile's union is small (H200, iid keys, FS-L, T 65536: ~13 cells per 64-query tile against ~23
    for consecutive positions). Within each chunk of `chunk` positions (default ORDER_CHUNK, at
    most the next power of two >= T), the queries are sorted by their cells ascending (absent
    last), lexicographic over as many cells as `order_key_layout` packs (with cell 32 and chunk
    4096: all 4 up to T = 2**17, 3 up to 2**21), ties in position order. A row's bits never depend on the tile it
    lands in (spec L12, see the module docstring): the order changes which queries share a tile,
    no output bit.

    Args:
        idx: int32 / int64 [B, T, Hq, K] selected cells (-1: none), contiguous.
        cell: tokens per cell (the number of cells is ceil(T / cell)).
        use_kernel: the keys and the positions in one Triton launch each (`_order_key_kernel`,
            `_order_decode_kernel`) around one torch.sort of the keys per chunk; default: on CUDA
            (torch ops otherwise, the same order).
        chunk: positions sorted together, a power of two (default ORDER_CHUNK, at most next_pow2(T)).
    """
    B, T, Hq, K = idx.shape
    chunk = chunk or min(ORDER_CHUNK, next_pow2(max(T, 16)))
    if chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two")
    bits, slots = order_key_layout(-(-T // cell), K, chunk)
    pos_bits = chunk.bit_length() - 1
    rows = B * Hq
    n_chunks = -(-T // chunk)
    if rows * T == 0:
        return torch.empty(rows, T, dtype=torch.int32, device=idx.device)
    if use_kernel is None:
        use_kernel = idx.is_cuda
    if use_kernel:
        key = torch.empty(rows, n_chunks * chunk, dtype=torch.int64, device=idx.device)
        block = 256
        launch(_order_key_kernel, (-(-n_chunks * chunk // block), rows),
            idx, key, T, n_chunks * chunk, Hq, bits, slots, KSEL=K, K_P=next_pow2(K), POS_BITS=pos_bits, BLOCK=block,
            num_warps=4,
        )  # fmt: skip
    else:
        x = idx.permute(0, 2, 1, 3).reshape(rows, T, K).to(torch.int64)
        x = torch.where(x < 0, (1 << bits) - 1, x).sort(dim=-1).values
        key = torch.full((rows, n_chunks * chunk), torch.iinfo(torch.int64).max, dtype=torch.int64, device=idx.device)
        key[:, :T] = torch.arange(T, device=idx.device) % chunk  # padding (past T) sorts last
        for i in range(slots):
            key[:, :T] |= x[..., i] << ((slots - 1 - i) * bits + pos_bits)
    key = key.view(rows, n_chunks, chunk).sort(dim=-1).values.view(rows, n_chunks * chunk)
    if use_kernel:
        order = torch.empty(rows, T, dtype=torch.int32, device=idx.device)
        block = 1024
        launch(_order_decode_kernel, (-(-T // block), rows),
            key, order, T, n_chunks * chunk, CHUNK=chunk, BLOCK=block, num_warps=4
        )  # fmt: skip
        return order
    starts = torch.arange(T, device=idx.device) // chunk * chunk
    return (starts + (key[:, :T] & (chunk - 1))).to(torch.int32)


def forward_unions(idx: torch.Tensor, cfg, tiles: "AttentionTiles") -> TileUnions:
    """The long tiles `launch_forward` expects for these tiles: tiles.union_rows queries per tile,
    sorted by selection (`long_query_order`) when `sorts_long_tiles(tiles, T)`."""
    order = long_query_order(idx, cfg.cell) if sorts_long_tiles(tiles, idx.shape[1]) else None
    return tile_unions(idx, tiles.union_rows, order=order)


def sorts_long_tiles(tiles: "AttentionTiles", T: int) -> bool:
    """Whether the forward's long tiles are sorted by selection: tiles.sorted_long and T >= SORTED_LONG_MIN_T
    (or the environment's FREESOLO_TRITON_SORTED_LONG_MIN_T)."""
    min_t = _env_int(ENV_SORTED_LONG_MIN_T)
    return tiles.sorted_long and T >= (SORTED_LONG_MIN_T if min_t is None else min_t)


# Bytes of rotated keys the forward holds at once (`rotation_chunk_tiles`): with H 16, D 64, bf16
# and B 1, 8192 positions; at 128k the forward's peak is then o + 0.016 GiB of keys + the saved
# statistics, selection, unions and long order, against o + 0.25 GiB with every key rotated at
# once. (32 MiB until s27: the long order's 8 MiB at 128k took the peak to 1.51x SDPA's.)
ROTATION_CHUNK_BYTES = 16 << 20
ROTATION_CHUNK_MIN_POSITIONS = 4096
# A sequence whose rotated keys take at most this many times the chunk's budget is rotated in one
# chunk (one RoPE and one window launch: H 16, D 64, bf16, B 1 up to T = 16384, where an eager call
# is host bound and two launches fewer save ~50-100 us of host time), so the keys held at once
# exceed the chunked design's by at most one budget (16 MiB) and only at such short T; longer
# sequences (the 128k peak-memory bar) are chunked as before.
ROTATION_ONE_CHUNK_FACTOR = 2


def rotation_chunk_tiles(
    B: int, Hkv: int, D: int, element_size: int, block_m: int, extra_bytes: int = 0, T: Optional[int] = None
) -> int:
    """Query tiles per window-kernel launch: as many as keep the chunk's rotated keys within
    ROTATION_CHUNK_BYTES + extra_bytes (the forward passes the bytes of the statistics it does not
    save, in a forward without gradients), at least ROTATION_CHUNK_MIN_POSITIONS positions' worth
    (few launches at any shape); with T given, every tile of the sequence when all its rotated keys
    fit in ROTATION_ONE_CHUNK_FACTOR budgets. Depends on the shape only; a query's bits do not
    depend on it (see `launch_forward`)."""
    budget = ROTATION_CHUNK_BYTES + extra_bytes
    row_bytes = max(1, B * Hkv * D * element_size)  # rotated keys of one position
    if T is not None and T * row_bytes <= ROTATION_ONE_CHUNK_FACTOR * budget:
        return max(1, -(-T // block_m))
    positions = max(ROTATION_CHUNK_MIN_POSITIONS, budget // row_bytes)
    return max(1, positions // block_m)


def _check_inputs(q, k, v, idx, beta, cos, sin, cfg) -> None:
    """Shapes, dtypes, devices and layouts of the forward's inputs (idx None: not checked)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if tuple(k.shape) != (B, T, Hkv, D) or tuple(v.shape) != (B, T, Hkv, D):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B={B}, T={T}, Hkv, D={D}]")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q dtype {q.dtype} must be float16, bfloat16 or float32 for the triton kernels")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} dtype {x.dtype} must equal q dtype {q.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("cos", cos), ("sin", sin)):
        _check_placed(name, x, q)
    padded_dims(D)  # ValueError on odd or too large D
    if idx is not None:
        _check_idx(idx, q, cfg)
    if tuple(beta.shape) != (Hq,) or beta.dtype != torch.float32:
        raise ValueError(f"beta must be float32 [Hq={Hq}], got {beta.dtype} {tuple(beta.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        if tuple(x.shape) != (T, D // 2) or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [T={T}, D/2={D // 2}], got {x.dtype} {tuple(x.shape)}")


def _check_placed(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(x.shape)}, strides {x.stride()})")


def _check_idx(idx: torch.Tensor, q: torch.Tensor, cfg) -> None:
    """idx: int32 / int64 [B, T, Hq, K] contiguous, on q's device."""
    B, T, Hq, _ = q.shape
    _check_placed("idx", idx, q)
    if tuple(idx.shape) != (B, T, Hq, cfg.top_k):
        raise ValueError(f"idx shape {tuple(idx.shape)} must be [B={B}, T={T}, Hq={Hq}, K={cfg.top_k}]")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx dtype {idx.dtype} must be int32 or int64")


def attention_forward(q, k, v, idx, beta, cos, sin, cfg, tiles: AttentionTiles | None = None, save_stats: bool = True):
    """Fused FreeSolo forward (spec §2, §7) on given selections.

    Args:
        q: [B, T, Hq, D] unrotated queries; k, v: [B, T, Hkv, D] (same dtype: fp16 / bf16 / fp32,
            contiguous; CUDA, or CPU float32 under TRITON_INTERPRET=1).
        idx: int64 or int32 [B, T, Hq, K] selected cells, -1 padded, any order; each cell of
            query i is available to it (ends at or before its block's first token).
        beta: fp32 [Hq]. cos, sin: fp32 [T, D/2] (`freesolo.backends.torch._ops.rope_tables`).
        cfg: FreeSoloConfig (window, cell, top_k, eps are read).
        tiles: tile sizes (default `default_tiles(D, dtype, device)`).
        save_stats: False: a forward without gradients; the statistics are neither stored nor
            returned (None), and the rotated keys may take their bytes (`rotation_chunk_tiles`).
    Returns:
        o [B, T, Hq, D] in q's dtype: o_loc + beta_h * rmsnorm(o_long);
        lse_loc fp32 [B, Hq, T]: natural-log logsumexp over the window of scale * rope(q_i) . rope(k_t);
        lse_long fp32 [B, Hq, T]: logsumexp over the selected tokens of scale * q_i . k_t (-inf: no cell);
        rstd fp32 [B, Hq, T]: 1 / sqrt(mean_d(o_long^2) + eps) of the fp32 o_long (0 where no cell).
    """
    _check_inputs(q, k, v, idx, beta, cos, sin, cfg)
    tiles = tiles or default_tiles(q.shape[3], q.dtype, q.device)
    return launch_forward(q, k, v, idx, forward_unions(idx, cfg, tiles), beta, cos, sin, cfg, tiles, save_stats)


def _check_union(unions: TileUnions, q, cfg, tiles: AttentionTiles) -> None:
    """unions must have the shapes `forward_unions(idx, cfg, tiles)` gives (an order exactly when
    `sorts_long_tiles`)."""
    B, T, Hq, _ = q.shape
    rows, K = tiles.union_rows, cfg.top_k
    NU = -(-T // rows)
    union, count, order = unions
    if tuple(union.shape) != (B * Hq, NU, rows * K) or tuple(count.shape) != (B * Hq, NU):
        raise ValueError(
            f"union {tuple(union.shape)} / count {tuple(count.shape)} must come from tile_unions(idx, {rows}): "
            f"[{B * Hq}, {NU}, {rows * K}] / [{B * Hq}, {NU}]"
        )
    if (order is not None) != sorts_long_tiles(tiles, T):
        raise ValueError(
            f"tiles.sorted_long={tiles.sorted_long} (T={T}, sorted from SORTED_LONG_MIN_T={SORTED_LONG_MIN_T} or "
            f"{ENV_SORTED_LONG_MIN_T}) but the unions were "
            f"made {'with' if order is not None else 'without'} an order: use forward_unions(idx, cfg, tiles)"
        )
    for name, x in (("union", union), ("count", count)) + ((("order", order),) if order is not None else ()):
        _check_placed(name, x, q)


def _outputs(q: torch.Tensor, tiles: AttentionTiles, save_stats: bool = True) -> tuple:
    """(o, lse_loc, lse_long, rstd, long_term) of the forward, uninitialized; long_term is o itself
    unless the split long kernel hands its term over in an fp32 buffer (not long_into_out). Without
    save_stats the three statistics are None (the kernels then store none: nothing to save)."""
    B, T, Hq, D = q.shape
    o = torch.empty_like(q)
    if save_stats:
        stats = [torch.empty(B, Hq, T, dtype=torch.float32, device=q.device) for _ in range(3)]
    else:
        stats = [None, None, None]
    split_buffer = tiles.long_block > 0 and not tiles.long_into_out
    long_term = torch.empty(B, T, Hq, D, dtype=torch.float32, device=q.device) if split_buffer else o
    return (o, *stats, long_term)


_PLACEHOLDERS: dict = {}


def _placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A cached 16-element tensor passed where a kernel takes a pointer it never dereferences: the
    statistics of a forward that saves none (fp32 like the real buffers, so both modes launch the
    same compiled kernel: a pointer's dtype is part of its specialization; the stores into it are
    all masked off, stats_on = 0), or the window kernel's idx / union / count with the split long
    kernel (int32, never read). Inside a CUDA-graph capture a fresh one (the graph's own memory)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(16, dtype=dtype, device=device)
    key = (str(device), dtype)
    hit = _PLACEHOLDERS.get(key)
    if hit is None:
        hit = _PLACEHOLDERS[key] = torch.zeros(16, dtype=dtype, device=device)
    return hit


def _common_constexprs(D: int, cfg, tiles: AttentionTiles) -> dict:
    d_p, _ = padded_dims(D)
    return dict(D=D, D_P=d_p, CELL=cfg.cell, CELL_P=max(16, next_pow2(cfg.cell)), KSEL=cfg.top_k,
                K_P=next_pow2(cfg.top_k), PREFETCH=tiles.prefetch)  # fmt: skip


def _long_tma_ok(k: torch.Tensor, v: torch.Tensor, cell: int) -> bool:
    """Whether tensor descriptors can describe the long kernel's cell tiles of k and v [B, T, Hkv, D]:
    a GPU of compute capability 9 or more (CPU tensors: the interpreter, which runs descriptors), the
    cell and D powers of two in [16, 256] (a box dimension; tl.dot's minimum width), each head's D
    elements contiguous and the heads D apart (the [B, T, Hkv * D] view), the base and the B / T
    strides 16-byte aligned (TMA's rules)."""
    D = k.shape[3]
    if cell & (cell - 1) or not 16 <= cell <= 256 or D & (D - 1) or not 16 <= D <= 256:
        return False
    if k.is_cuda and torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    for x in (k, v):
        size = x.element_size()
        if x.stride(3) != 1 or x.stride(2) != D or x.data_ptr() % 16:
            return False
        if (x.stride(0) * size) % 16 or (x.stride(1) * size) % 16:
            return False
    return True


def _kv_descriptor(x: torch.Tensor, cell: int):
    """A host tensor descriptor of x [B, T, Hkv, D] viewed as [B, T, Hkv * D] (strides kept), box [1, cell, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, T, Hkv, D = x.shape
    return TensorDescriptor(x, shape=[B, T, Hkv * D], strides=[x.stride(0), x.stride(1), 1], block_shape=[1, cell, D])


def _launch_long(q, k, v, idx, unions: TileUnions, beta, cfg, tiles: AttentionTiles, outputs) -> None:
    """The split long kernel (tiles.long_block > 0): writes the long term into outputs' long_term
    (adds it to o with window_first) and lse_long, rstd. With tiles.long_tma, and k / v that
    `_long_tma_ok` allows, its cell tiles come through tensor descriptors (the same bits)."""
    B, T, Hq, D = q.shape
    o, _, lse_long, rstd, long_term = outputs
    rows = tiles.union_rows
    NU = -(-T // rows)
    union, count, order = unions
    store_stats = lse_long is not None
    if not store_stats:  # the kernel stores no statistic (masked stores into an fp32 placeholder)
        lse_long = rstd = _placeholder(q.device)
    tma = tiles.long_tma and _long_tma_ok(k, v, cfg.cell)
    consts = _common_constexprs(D, cfg, tiles)
    if tma:
        consts["PREFETCH"] = False  # the compiler pipelines the descriptor loads
    launch(_long_fwd_kernel, (NU, B * Hq),
        q, _kv_descriptor(k, cfg.cell) if tma else k, _kv_descriptor(v, cfg.cell) if tma else v, idx, union, count,
        order if order is not None else count, beta, long_term, lse_long, rstd, T, Hq, k.shape[2], NU,
        LOG2E / math.sqrt(D), cfg.eps, int(store_stats), BLOCK_M=rows, U_MAX=rows * cfg.top_k,
        ADD_TO_OUT=tiles.window_first, HAS_ORDER=order is not None, TMA=tma,
        num_warps=tiles.long_warps, num_stages=LONG_TMA_STAGES if tma else 1, **consts,
        **({} if tiles.long_maxnreg is None else {"maxnreg": tiles.long_maxnreg}),
    )  # fmt: skip


def _launch_window(q, k, v, idx, union, count, beta, cos, sin, cfg, tiles: AttentionTiles, outputs) -> None:
    """The window kernel (with the long loop inside it when tiles.long_block == 0), once per chunk
    of query tiles (`rotation_chunk_tiles`) after the RoPE of that chunk's keys. idx / union / count
    are read only by the fused kernel (placeholders otherwise)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    o, lse_loc, lse_long, rstd, long_term = outputs
    store_stats = lse_loc is not None
    if not store_stats:  # the kernel stores no statistic (masked stores into an fp32 placeholder)
        lse_loc = lse_long = rstd = _placeholder(q.device)
    split = tiles.long_block > 0
    NT = -(-T // tiles.block_m)
    extra = {} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}
    # The window reads rotated keys. They are made per chunk of query tiles into one reused buffer
    # (the chunk's keys plus the window before it), so that the forward never holds a rotated copy
    # of all of k (0.25 GiB at 128k, H 16, D 64, bf16). The values are the same whatever the
    # chunking (rotation is per row), and so are a query's bits (spec L12).
    # without saved statistics (12 bytes per query position and head) the rotated keys may use their bytes
    tiles_per_chunk = rotation_chunk_tiles(
        B, Hkv, D, q.element_size(), tiles.block_m, 0 if store_stats else 12 * B * Hq * T, T=T
    )
    span = tiles_per_chunk * tiles.block_m + cfg.window + 2 * tiles.block_n  # positions a chunk's window reads
    kr_buf = torch.empty(B * min(T, span) * Hkv * D, dtype=k.dtype, device=k.device)
    for tile0 in range(0, NT, tiles_per_chunk):
        n_tiles = min(tiles_per_chunk, NT - tile0)
        first = tile0 * tiles.block_m
        start = max(0, first - cfg.window - tiles.block_n)  # <= the first key tile any query of the chunk reads
        stop = min(T, first + n_tiles * tiles.block_m + tiles.block_n)  # > the last key any of its tiles loads
        if start == 0 and stop == T:  # one chunk holds the sequence (T <= 16k at H 16, D 64, B 1): no slices
            kr = kr_buf.view(B, T, Hkv, D)
            rope_rotate(k, cos, sin, out=kr)
        else:
            kr = kr_buf[: B * (stop - start) * Hkv * D].view(B, stop - start, Hkv, D)  # contiguous [B, stop - start, Hkv, D]
            rope_rotate(k[:, start:stop], cos[start:stop], sin[start:stop], out=kr)
        launch(_attention_fwd_kernel, (n_tiles, B * Hq),
            q, k, kr, v, idx, union, count, beta, long_term, cos, sin, o, lse_loc, lse_long, rstd,
            T, Hq, Hkv, NT, tile0, stop - start, start, cfg.window, LOG2E / math.sqrt(D), cfg.eps, int(store_stats),
            HALF=D // 2, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, U_MAX=tiles.union_rows * cfg.top_k,
            WINDOW_PHASES=tiles.window_phases, HAS_LONG=not split, READ_LONG=split and not tiles.window_first,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **_common_constexprs(D, cfg, tiles), **extra,
        )  # fmt: skip


def launch_forward(q, k, v, idx, unions: TileUnions, beta, cos, sin, cfg, tiles: AttentionTiles, save_stats: bool = True):
    """The kernel launches of `attention_forward` on validated inputs and
    `forward_unions(idx, cfg, tiles)` (exposed so that benchmarks can time the kernels apart
    from the union's sort): the fused kernel, or (tiles.long_block > 0) the long kernel and then
    the window kernel (window_first: the window kernel, then the long kernel adding its term)."""
    _check_union(unions, q, cfg, tiles)
    outputs = _outputs(q, tiles, save_stats)
    if tiles.long_block and not tiles.window_first:
        _launch_long(q, k, v, idx, unions, beta, cfg, tiles, outputs)
    _launch_window(q, k, v, idx, unions.union, unions.count, beta, cos, sin, cfg, tiles, outputs)
    if tiles.window_first:
        _launch_long(q, k, v, idx, unions, beta, cfg, tiles, outputs)
    return outputs[:4]


_SIDE_STREAMS: dict = {}

# From this many positions an eager CUDA forward with window_first tiles runs the selection on a side
# stream beside the window kernel (`forward_with_selection`); shorter eager calls run it on the
# current stream, and so does nothing else change (the streams change no bit). Below it an eager
# call is host bound on the H200's host, and the side stream's fork / join (two events, a stream
# switch) cost more host time than the overlap saves GPU time (s26: 4k 0.50 -> 0.65 ms of host per
# call with the side stream; GPU time in a CUDA graph at 16k 0.544 -> 0.493 ms). A CUDA-graph
# capture (CUDA graphs, torch.compile mode="reduce-overhead") always overlaps: its replay has no
# host work, so there only the GPU time counts. FREESOLO_TRITON_OVERLAP_MIN_T overrides it (A/B).
OVERLAP_MIN_T = 32768
ENV_OVERLAP_MIN_T = "FREESOLO_TRITON_OVERLAP_MIN_T"


def overlaps_selection(T: int, device: torch.device) -> bool:
    """Whether `forward_with_selection` (window_first tiles) runs the selection on a side stream:
    on CUDA, while a CUDA graph is being captured or from OVERLAP_MIN_T positions (or the
    environment's FREESOLO_TRITON_OVERLAP_MIN_T)."""
    if device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    min_t = _env_int(ENV_OVERLAP_MIN_T)
    return T >= (OVERLAP_MIN_T if min_t is None else min_t)


# Priority of that side stream (CUDA: lower is more urgent; torch clamps a value past the device's
# range to its end, so -100 asks for the highest). Graph kernels keep the priority of the stream they
# were captured on (PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority), so it
# also reaches the graphed short calls (`graphs.py`). An urgent side stream lets the block scheduler
# start the selection chain's blocks (statistics, pool scan, candidates, scoring, unions: the long
# kernel's critical path) before the window kernel's pending tiles. Measured on the H100 (s45 call1,
# bf16 H16 D64, `benchmarks/side_priority_ab.py`, now `switch_ab.py`; one user CUDA graph, priority 0 -> highest (-3)):
# FS-L 4k 0.1386 -> 0.1312 ms, 8k 0.2475 -> 0.2410, 16k 0.4638 -> 0.4555, 64k 1.654 -> 1.668 (eager
# 1.667 -> 1.713); FS 4k 0.1274 -> 0.1294. Mixed and at most 5 %, and the change's effect through the
# API (graph cache copies included) and the CUDA test suite at such a default could not be run this
# stop (no device machine would start), so the default stays torch's 0: FREESOLO_TRITON_SIDE_PRIORITY
# opts in. Streams and priorities change no bit (tested on CUDA, both priorities). Re-measured at the
# s47 defaults (H100, s48 call1, through the API, 3 rounds): FS-L 4k 0.1330 vs 0.1337 ms, 8k 0.2466 vs
# 0.2445, 16k 0.4952 vs 0.4968, 32k 0.8600 vs 0.8855; FS 4k 0.1381 vs 0.1359; 4k fwd+bwd 0.7597 vs
# 0.7616. The 4k timeline (call2): scoring starts at 24.5 us instead of 39.6, the window kernel it
# shares the GPU with stretches from 43.8 to 62.0 us, and the long kernel starts at 78.7 instead of
# 79.4: the kernels fill the GPU either way, so the order of their blocks moves little. Stays 0.
SIDE_PRIORITY = 0
ENV_SIDE_PRIORITY = "FREESOLO_TRITON_SIDE_PRIORITY"


def side_priority() -> int:
    """The priority asked for the selection's side stream: FREESOLO_TRITON_SIDE_PRIORITY, else SIDE_PRIORITY."""
    value = _env_int(ENV_SIDE_PRIORITY)
    return SIDE_PRIORITY if value is None else value


def _side_stream(device: torch.device, priority: int):
    """One side stream per CUDA device and priority, for the selection that `forward_with_selection` overlaps."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=priority)
    return _SIDE_STREAMS[key]


# FREESOLO_TRITON_FUSED_UNIONS=1: where the long tiles are consecutive (below the sorted tiles'
# threshold) and the caller passes `select_unions` (the backend does for FS / FS-L), the scoring kernel
# writes the tile unions itself (`selection.select_cells(..., union_rows=...)`): one launch less on the
# selection chain, the long kernel's critical path at short lengths (s47's 4k timeline: the union kernel
# 5.8 us + its launch gap). The same unions, so the same bits (tested; CUDA tests and compute-sanitizer
# clean, s48 calls 3-4). Off: slower on the H100 (s48 call3, FS-L fwd through the API, same run, same
# bits): 4k 0.1381 vs 0.1358 ms, 8k 0.2504 vs 0.2457, 16k 0.5096 vs 0.4976, FS 4k 0.1408 vs 0.1357;
# the union's sort (one barrier, a reload of the tile's selections) lengthens every scoring program
# by more than the separate launch costs.
FUSED_UNIONS_DEFAULT = False
ENV_FUSED_UNIONS = "FREESOLO_TRITON_FUSED_UNIONS"


def fused_unions_on() -> bool:
    """Whether `forward_with_selection` asks `select_unions` for the unions: FREESOLO_TRITON_FUSED_UNIONS
    (0 / 1), else FUSED_UNIONS_DEFAULT."""
    value = _env_int(ENV_FUSED_UNIONS)
    if value not in (None, 0, 1):
        raise ValueError(f"environment variable {ENV_FUSED_UNIONS}={value} must be 0 or 1")
    return FUSED_UNIONS_DEFAULT if value is None else bool(value)


def forward_with_selection(
    q, k, v, select, beta, cos, sin, cfg, tiles: AttentionTiles | None = None, save_stats: bool = True,
    select_unions=None,
):  # fmt: skip
    """The selection and the forward: (idx, (o, lse_loc, lse_long, rstd)).

    Args as `attention_forward`, except select: (q, k) -> idx (the selection, e.g.
    `selection.select_cells`), called once; select_unions: None, or (q, k, union_rows) ->
    (idx, union, count) as `selection.select_cells(..., union_rows=...)` gives, or None where it
    cannot: with window_first tiles, consecutive long tiles and `fused_unions_on()`, it is called
    instead of select (and the union launch). With tiles.window_first, the window kernel (it does
    not read the selection) and the selection + tile unions, then the long kernel adds its term;
    on CUDA when `overlaps_selection` (from OVERLAP_MIN_T positions, or under CUDA-graph capture)
    the selection and the unions run on a side stream while the window kernel runs on the current
    stream. Stream order: the side stream first waits for the current one (q, k ready; and every
    earlier use of memory the side stream reuses), the current stream waits for the side one
    before the long kernel, so no tensor is touched by both streams at once, and the result does
    not depend on the streams. Elsewhere: select, then `attention_forward`.
    """
    tiles = tiles or default_tiles(q.shape[3], q.dtype, q.device)
    if not tiles.window_first:
        idx = select(q, k)
        return idx, attention_forward(q, k, v, idx, beta, cos, sin, cfg, tiles, save_stats)
    _check_inputs(q, k, v, None, beta, cos, sin, cfg)
    outputs = _outputs(q, tiles, save_stats)
    unused = _placeholder(q.device, torch.int32)  # the window kernel's idx / union / count (not read)
    overlap = overlaps_selection(q.shape[1], q.device)
    main = torch.cuda.current_stream(q.device) if overlap else None
    side = _side_stream(q.device, side_priority()) if overlap else None
    if side is not None:
        side.wait_stream(main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        fused = None
        if select_unions is not None and fused_unions_on() and not sorts_long_tiles(tiles, q.shape[1]):
            fused = select_unions(q, k, tiles.union_rows)
        if fused is None:
            idx = select(q, k)
            unions = forward_unions(idx, cfg, tiles)
        else:
            idx, union, count = fused
            unions = TileUnions(union, count, None)
    _launch_window(q, k, v, unused, unused, unused, beta, cos, sin, cfg, tiles, outputs)
    if side is not None:
        main.wait_stream(side)
    _check_idx(idx, q, cfg)
    _launch_long(q, k, v, idx, unions, beta, cfg, tiles, outputs)
    return idx, outputs[:4]
