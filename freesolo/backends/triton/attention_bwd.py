"""Backward of the fused FreeSolo attention (spec §2, §7, §8): gradients to q, k, v and beta.

Forward (see attention.py), per batch row b, query i, query head h (kv head g = h // G):

    o_loc[i]  = sum_{i-w < t <= i} softmax_t(scale * rope(q_i, i) . rope(k_t, t)) v_t   (lse_loc[i] saved)
    o_long[i] = sum_{t in S_h(i)}  softmax_t(scale * q_i . k_t) v_t                       (lse_long[i] saved)
    y[i]      = o_long[i] * rstd[i]                                                       (rstd[i] saved)
    o[i]      = o_loc[i] + beta_h * y[i]

Backward, no gradient through statistics, scores or indices (spec §8):

    dy        = beta_h * do;  dbeta_h = sum_{b, i} do . y
    d_olong   = rstd * (dy - y * mean_d(dy * y))                                (RMSNorm)
    Delta_loc = do . o_loc (o_loc = o - beta_h * y);  Delta_long = d_olong . o_long
    p = exp(s - lse);  ds = p * (dO . v_t - Delta)   (flash-attention 2, per branch)

Long branch, `BwdTiles.long_mode` (A/B switch; default "cell"; the environment variable
FREESOLO_TRITON_BWD_LONG=cell|gather|union|legacy sets the default, "legacy" = the backward before issue 11):
- "cell" (`_long_branch_cells`): everything over the inverted selection, so a cell's 32 keys / values are
  loaded once per segment of its readers and every product is a tl.dot over a block of readers (the GQA
  group's heads included); no per-query gather. Per chunk of `long_chunk` positions: a stable sort of
  the chunk's idx entries by cell (`inverted_slots`: O(T*Hq*K), no host sync), work items of `seg`
  readers (`segment_plan`), then
  1. `_bwd_cell_olong_kernel`: each reader's share of o_long from this cell, exp(s - lse_long) v (the
     saved lse_long normalises it, so the K shares add up to o_long), fp32 part per (query, slot);
  2. `_bwd_long_rows_kernel`: o_long = the row's parts summed in slot order; y, d_olong, Delta_loc,
     Delta_long, dbeta partial (no q, k, v read);
  3. `_bwd_cell_grad_kernel`: dq part per (query, slot) (into the same parts buffer) and dk / dv of the
     cell summed over its readers in their fixed order; a cell split over several segments writes
     partials reduced in order by `_bwd_long_reduce_kernel` (atomic mode: tl.atomic_add);
  4. dq_long = the row's dq parts in slot order (`_bwd_local_dq_kernel` with LONG_PARTS when one chunk,
     else `_bwd_sum_parts_kernel`).
- "gather" (the deterministic default before issue 11): `_bwd_long_query_kernel`, one program per
  (query head h, `block_q` rows): gathers the K*s selected tokens as one [K*s, D] tile, recomputes
  o_long and writes d_olong, deltas, dbeta partial, dq_long; dk / dv by per-query atomics (atomic
  mode) or `_bwd_long_cell_kernel` over `inverted_selection` + `_bwd_long_reduce_kernel`.
- "union" (the atomic default before issue 11): `_bwd_long_tile_kernel`, query tiles over their cell
  union with tl.dot, per-(tile, cell) atomics for dk / dv.
Local branch (`prerotate`: q, k rotated once by `_common.rope_rotate`, else in every tile as before):
- `_bwd_local_dkdv_kernel`, one program per (key tile, b, kv head): loops over the G query heads
  and the query tiles whose window sees the tile (rotated tiles loaded, or rotated in-kernel with the
  cos / sin tables), the rotated dk is rotated back with the transpose rotation; the long branch's
  fp32 dk / dv are added before the single cast to k's dtype.
- `_bwd_local_dq_kernel`, one program per (query tile, b, query head): loops over the window's key
  tiles, rotates dq back and adds the long branch's dq (dense, or its K parts).
No atomics anywhere in the deterministic mode: same bits run to run.

Vectors of the local branch are handled as two halves of D/2 (the half-split RoPE pairs x[m] with
x[m + D/2]); each half is padded to a power of two >= 16 (tl.dot's minimum), so any even D works.
Offsets: program ids are cast to int64 before any multiplication (T*H*D > 2^31 works); inside a
local tile, a per-program int64 base plus int32 tile offsets (bounded by tile * H * D).

Transient memory (backward only; nothing of it is saved by the forward): d_olong [B, T, Hq, D] in q's
dtype, fp32 dk / dv of the long branch [B, T, Hkv, D], fp32 [B, Hq, T] deltas and dbeta partials,
rope(q), rope(k) (prerotate); "cell": fp32 parts [B, min(T, long_chunk), Hq, K, D] (1 GiB at B=1,
T=64k, Hq=16, K=4, D=64), the sorted slots (int64, B*T*Hq*K per chunk), partials of split cells
(<= 2*entries/seg + 1 slots of [s, D] fp32, twice), dense fp32 dq_long only with several chunks;
"gather" / "union": fp32 dq_long [B, T, Hq, D] and the inverted selection.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cdiv, launch, next_pow2, rope_rotate

__all__ = [
    "LONG_MODES",
    "LONG_MODE_ENV",
    "BwdTiles",
    "attention_backward",
    "default_bwd_tiles",
    "default_long_mode",
    "inverted_selection",
    "inverted_slots",
    "cell_plan",
    "segment_plan",
    "tiles_prerotate_default",
]


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_long_query_kernel(
    DO,
    Q,
    K,
    V,
    O,
    IDX,
    BETA,
    LSE_LONG,
    RSTD,
    DOLONG,
    DQLONG,
    DELTA_LOC,
    DELTA_LONG,
    DBETA_PART,
    DK_ACC,
    DV_ACC,
    T,
    NROWS,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Grid (cdiv(B*T, BLOCK_Q), HQ): BLOCK_Q rows b*T + i of head h (BLOCK_Q = 1 on the GPU).
    q/do/o/d_olong/dq_long [B, T, HQ, D], k/v [B, T, HKV, D], idx [B, T, HQ, TOPK],
    lse/rstd/delta/dbeta_part [B, HQ, T]; dk/dv_acc fp32 [B, T, HKV, D] (ATOMIC only)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # b * T + i
    h = tl.program_id(1).to(tl.int64)
    qmask = rows < NROWS
    b = rows // T
    i = rows - b * T
    g = h // (HQ // HKV)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qrow = (rows * HQ + h) * D  # [BLOCK_Q] offsets of [b, i, h, 0]
    stat = (b * HQ + h) * T + i  # [BLOCK_Q] offsets of [b, h, i]
    qm2 = qmask[:, None] & dmask[None, :]
    qd = qrow[:, None] + offs_d[None, :]
    q = tl.load(Q + qd, mask=qm2, other=0.0).to(tl.float32)  # [BLOCK_Q, BLOCK_D]
    do = tl.load(DO + qd, mask=qm2, other=0.0).to(tl.float32)
    o = tl.load(O + qd, mask=qm2, other=0.0).to(tl.float32)
    beta = tl.load(BETA + h).to(tl.float32)
    lse = tl.load(LSE_LONG + stat, mask=qmask, other=0.0)
    rstd = tl.load(RSTD + stat, mask=qmask, other=0.0)
    # selected tokens: slot j = kk * CELL + u reads token idx[kk] * CELL + u
    offs_j = tl.arange(0, BLOCK_KS)
    kk = offs_j // CELL
    u = offs_j - kk * CELL
    cell = tl.load(
        IDX + ((rows * HQ + h) * TOPK)[:, None] + kk[None, :],
        mask=qmask[:, None] & (kk < TOPK)[None, :],
        other=-1,
    ).to(tl.int64)  # [BLOCK_Q, BLOCK_KS]
    valid = cell >= 0
    tok = tl.where(valid, cell * CELL + u[None, :], 0)
    kv_off = ((b[:, None] * T + tok) * HKV + g) * D  # [BLOCK_Q, BLOCK_KS]
    kvp = kv_off[:, :, None] + offs_d[None, None, :]  # [BLOCK_Q, BLOCK_KS, BLOCK_D]
    m3 = valid[:, :, None] & dmask[None, None, :]
    kt = tl.load(K + kvp, mask=m3, other=0.0).to(tl.float32)
    vt = tl.load(V + kvp, mask=m3, other=0.0).to(tl.float32)
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    s = tl.sum(kt * q[:, None, :], axis=2) * scale  # [BLOCK_Q, BLOCK_KS]
    p = tl.where(valid, tl.exp(s - lse_safe[:, None]), 0.0)
    o_long = tl.sum(p[:, :, None] * vt, axis=1)  # [BLOCK_Q, BLOCK_D]
    y = o_long * rstd[:, None]
    dy = beta * do
    d_olong = rstd[:, None] * (dy - y * (tl.sum(dy * y, axis=1) / D)[:, None])
    delta_long = tl.sum(d_olong * o_long, axis=1)
    delta_loc = tl.sum(do * (o - beta * y), axis=1)
    tl.store(DBETA_PART + stat, tl.sum(do * y, axis=1), mask=qmask)
    tl.store(DELTA_LOC + stat, delta_loc, mask=qmask)
    tl.store(DELTA_LONG + stat, delta_long, mask=qmask)
    tl.store(DOLONG + qd, d_olong.to(DOLONG.dtype.element_ty), mask=qm2)  # the cell kernel's dot dtype
    dp = tl.sum(vt * d_olong[:, None, :], axis=2)
    ds = p * (dp - delta_long[:, None])
    dq = tl.sum(ds[:, :, None] * kt, axis=1) * scale
    tl.store(DQLONG + qd, dq, mask=qm2)
    if ATOMIC:
        tl.atomic_add(DK_ACC + kvp, (ds * scale)[:, :, None] * q[:, None, :], mask=m3)
        tl.atomic_add(DV_ACC + kvp, p[:, :, None] * d_olong[:, None, :], mask=m3)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """tl.dot with fp32 accumulation; IEEE: exact fp32 products (no tf32) for fp32 inputs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _bwd_long_tile_kernel(
    DO,
    Q,
    K,
    V,
    O,
    IDX,
    UNION,
    COUNT,
    BETA,
    LSE_LONG,
    RSTD,
    DOLONG,
    DQLONG,
    DELTA_LOC,
    DELTA_LONG,
    DBETA_PART,
    DK_ACC,
    DV_ACC,
    T,
    NT,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    K_P: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Same outputs as `_bwd_long_query_kernel`, with tensor cores: grid (NT, B * HQ), one program per
    tile of BLOCK_M queries of head h, looping over the tile's cell union (UNION int32 [B*HQ, NT,
    BLOCK_M*TOPK] ascending, COUNT int32 [B*HQ, NT]: `attention.tile_unions`); each step is a
    [BLOCK_M, CELL] score tile masked to the queries that selected the cell. Two passes (o_long,
    then dq). ATOMIC: the cell's dk / dv of the tile are added with one atomic per element."""
    DOT_DTYPE = K.dtype.element_ty
    tile = tl.program_id(0).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HQ
    h = bh - b * HQ
    g = h // (HQ // HKV)
    m0 = tile * BLOCK_M
    ar_m = tl.arange(0, BLOCK_M)
    mmask = m0 + ar_m < T
    rows = b * T + m0 + ar_m  # [BLOCK_M] int64
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qm2 = mmask[:, None] & dmask[None, :]
    qd = ((rows * HQ + h) * D)[:, None] + offs_d[None, :]
    q = tl.load(Q + qd, mask=qm2, other=0.0)
    qc = q.to(DOT_DTYPE)
    q = q.to(tl.float32)
    do = tl.load(DO + qd, mask=qm2, other=0.0).to(tl.float32)
    o = tl.load(O + qd, mask=qm2, other=0.0).to(tl.float32)
    beta = tl.load(BETA + h).to(tl.float32)
    stat = (b * HQ + h) * T + m0 + ar_m
    lse = tl.load(LSE_LONG + stat, mask=mmask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # rows without cells: every p is masked to 0
    rstd = tl.load(RSTD + stat, mask=mmask, other=0.0)
    kk = tl.arange(0, K_P)
    sel_idx = tl.load(
        IDX + ((rows * HQ + h) * TOPK)[:, None] + kk[None, :], mask=mmask[:, None] & (kk < TOPK)[None, :], other=-1
    ).to(tl.int64)  # [BLOCK_M, K_P]
    ubase = (bh * NT + tile) * (BLOCK_M * TOPK)
    cnt = tl.load(COUNT + bh * NT + tile)
    offs_u = tl.arange(0, BLOCK_C)
    umask = offs_u < CELL
    cm2 = umask[:, None] & dmask[None, :]
    o_long = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j = cnt * 0
    while j < cnt:
        c = tl.load(UNION + ubase + j).to(tl.int64)
        sel = tl.sum((sel_idx == c).to(tl.int32), axis=1) > 0  # [BLOCK_M]
        kv = (((b * T + c * CELL + offs_u) * HKV + g) * D)[:, None] + offs_d[None, :]
        kc = tl.load(K + kv, mask=cm2, other=0.0).to(DOT_DTYPE)
        vc = tl.load(V + kv, mask=cm2, other=0.0).to(DOT_DTYPE)
        sc = _dot(qc, tl.trans(kc), IEEE)
        p = tl.where(sel[:, None] & umask[None, :], tl.exp(sc * scale - lse[:, None]), 0.0)
        o_long += _dot(p.to(DOT_DTYPE), vc, IEEE)
        j += 1
    y = o_long * rstd[:, None]
    dy = beta * do
    d_olong = rstd[:, None] * (dy - y * (tl.sum(dy * y, axis=1) / D)[:, None])
    delta_long = tl.sum(d_olong * o_long, axis=1)
    tl.store(DBETA_PART + stat, tl.sum(do * y, axis=1), mask=mmask)
    tl.store(DELTA_LOC + stat, tl.sum(do * (o - beta * y), axis=1), mask=mmask)
    tl.store(DELTA_LONG + stat, delta_long, mask=mmask)
    tl.store(DOLONG + qd, d_olong.to(DOLONG.dtype.element_ty), mask=qm2)
    dlc = d_olong.to(DOT_DTYPE)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    j = cnt * 0
    while j < cnt:
        c = tl.load(UNION + ubase + j).to(tl.int64)
        sel = tl.sum((sel_idx == c).to(tl.int32), axis=1) > 0
        kv = (((b * T + c * CELL + offs_u) * HKV + g) * D)[:, None] + offs_d[None, :]
        kc = tl.load(K + kv, mask=cm2, other=0.0).to(DOT_DTYPE)
        vc = tl.load(V + kv, mask=cm2, other=0.0).to(DOT_DTYPE)
        sc = _dot(qc, tl.trans(kc), IEEE)
        p = tl.where(sel[:, None] & umask[None, :], tl.exp(sc * scale - lse[:, None]), 0.0)
        dp = _dot(dlc, tl.trans(vc), IEEE)
        ds = p * (dp - delta_long[:, None])
        dq += _dot(ds.to(DOT_DTYPE), kc, IEEE)
        if ATOMIC:
            tl.atomic_add(DK_ACC + kv, _dot(tl.trans(ds.to(DOT_DTYPE)), qc, IEEE) * scale, mask=cm2)
            tl.atomic_add(DV_ACC + kv, _dot(tl.trans(p.to(DOT_DTYPE)), dlc, IEEE), mask=cm2)
        j += 1
    tl.store(DQLONG + qd, dq * scale, mask=qm2)


@triton.jit
def _cell_work_item(WORK_CELL, WORK_SEG, OFFSETS, K, V, T, C, NCELLS, HKV: tl.constexpr, D: tl.constexpr,
                    CELL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, SEG: tl.constexpr):
    """The cell and reader range of this program's work item (the "cell" mode's passes 1 and 3):
    WORK_CELL[w] = cell key (b*HKV + g)*C + c (>= NCELLS: idle, an empty range), WORK_SEG[w] = its
    segment j of SEG readers. Returns (active, key, j, b, offs_d, dmask, offs_u, umask, m2, kvp,
    kc, vc, start, end): kvp int64 [BLOCK_C, BLOCK_D] element offsets of the cell's rows in K / V
    (mask m2), kc / vc those rows in K's dtype, the readers SLOTS[start:end]."""
    DOT_DTYPE = K.dtype.element_ty
    w = tl.program_id(0).to(tl.int64)
    key_raw = tl.load(WORK_CELL + w)
    active = key_raw < NCELLS
    key = tl.where(active, key_raw, 0)
    j = tl.load(WORK_SEG + w)
    bg = key // C
    c = key - bg * C
    b = bg // HKV
    g = bg - b * HKV
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    offs_u = tl.arange(0, BLOCK_C)
    umask = offs_u < CELL
    kv_off = ((b * T + c * CELL + offs_u) * HKV + g) * D
    m2 = umask[:, None] & dmask[None, :]
    kvp = kv_off[:, None] + offs_d[None, :]
    kc = tl.load(K + kvp, mask=m2, other=0.0).to(DOT_DTYPE)  # [BLOCK_C, BLOCK_D]
    vc = tl.load(V + kvp, mask=m2, other=0.0).to(DOT_DTYPE)
    cell_end = tl.load(OFFSETS + key + 1)
    start = tl.load(OFFSETS + key) + j * SEG
    end = tl.where(active, tl.minimum(cell_end, start + SEG), start)
    return active, key, j, b, offs_d, dmask, offs_u, umask, m2, kvp, kc, vc, start, end


@triton.jit
def _bwd_long_cell_kernel(
    Q,
    K,
    V,
    DOLONG,
    LSE_LONG,
    DELTA_LONG,
    READERS,
    OFFSETS,
    WORK_CELL,
    WORK_SEG,
    NSEG,
    PART_BASE,
    DK_ACC,
    DV_ACC,
    PART_DK,
    PART_DV,
    T,
    C,
    NCELLS,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEG: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program per work item w: segment j = WORK_SEG[w] (readers j*SEG .. (j+1)*SEG - 1) of cell
    key = WORK_CELL[w] = (b * HKV + g) * C + c (key >= NCELLS: idle item). READERS int64: flat
    (b*T + i)*HQ + h of every reader of the cell, READERS[OFFSETS[key] : OFFSETS[key+1]] (fixed order).
    A cell of one segment writes dk/dv_acc fp32 [B, T, HKV, D] directly; a cell of NSEG[key] > 1
    segments writes its partial sums to slot PART_BASE[key] + j of PART_DK/DV fp32 [P, CELL, D]."""
    DOT_DTYPE = K.dtype.element_ty  # tl.dot inputs in the inputs' dtype, fp32 accumulation
    active, key, j, b, offs_d, dmask, offs_u, umask, m2, kvp, kc, vc, start, end = _cell_work_item(
        WORK_CELL, WORK_SEG, OFFSETS, K, V, T, C, NCELLS, HKV, D, CELL, BLOCK_D, BLOCK_C, SEG
    )
    dk = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    r0 = start
    while r0 < end:  # (a while loop: the interpreter cannot range over loaded bounds)
        rmask = (r0 + offs_r) < end
        rd = tl.load(READERS + r0 + offs_r, mask=rmask, other=0)  # flat (b*T + i)*HQ + h
        rh = rd % HQ
        ri = (rd // HQ) % T
        stat = (b * HQ + rh) * T + ri
        rm2 = rmask[:, None] & dmask[None, :]
        qr = tl.load(Q + rd[:, None] * D + offs_d[None, :], mask=rm2, other=0.0).to(DOT_DTYPE)  # [BLOCK_R, BLOCK_D]
        dor = tl.load(DOLONG + rd[:, None] * D + offs_d[None, :], mask=rm2, other=0.0).to(DOT_DTYPE)
        lse = tl.load(LSE_LONG + stat, mask=rmask, other=0.0)
        dl = tl.load(DELTA_LONG + stat, mask=rmask, other=0.0)
        s = _dot(qr, tl.trans(kc), IEEE)  # [BLOCK_R, BLOCK_C]
        p = tl.where(rmask[:, None] & umask[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        dp = _dot(dor, tl.trans(vc), IEEE)
        dv += _dot(tl.trans(p.to(DOT_DTYPE)), dor, IEEE)
        ds = p * (dp - dl[:, None])
        dk += _dot(tl.trans(ds.to(DOT_DTYPE)), qr, IEEE)
        r0 += BLOCK_R
    dk = dk * scale
    nseg = tl.load(NSEG + key)
    direct = active & (nseg == 1)
    tl.store(DK_ACC + kvp, dk, mask=m2 & direct)
    tl.store(DV_ACC + kvp, dv, mask=m2 & direct)
    slot = (tl.load(PART_BASE + key) + j) * (CELL * D) + offs_u[:, None] * D + offs_d[None, :]
    split = active & (nseg > 1)
    tl.store(PART_DK + slot, dk, mask=m2 & split)
    tl.store(PART_DV + slot, dv, mask=m2 & split)


@triton.jit
def _bwd_long_reduce_kernel(
    NSEG,
    PART_BASE,
    PART_DK,
    PART_DV,
    DK_ACC,
    DV_ACC,
    T,
    C,
    accum,
    HKV: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per cell key: a cell of NSEG > 1 segments sums its partial slots in order (fixed),
    plus the previous dk / dv_acc when `accum` (a later chunk of queries of the "cell" mode)."""
    key = tl.program_id(0).to(tl.int64)
    nseg = tl.load(NSEG + key)
    bg = key // C
    c = key - bg * C
    b = bg // HKV
    g = bg - b * HKV
    offs_d = tl.arange(0, BLOCK_D)
    offs_u = tl.arange(0, BLOCK_C)
    m2 = (offs_u < CELL)[:, None] & (offs_d < D)[None, :]
    base = tl.load(PART_BASE + key)
    dk = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    n = tl.where(nseg > 1, nseg, 0)  # cells of one segment were written by the cell kernel
    j = n * 0
    while j < n:
        slot = (base + j) * (CELL * D) + offs_u[:, None] * D + offs_d[None, :]
        dk += tl.load(PART_DK + slot, mask=m2, other=0.0)
        dv += tl.load(PART_DV + slot, mask=m2, other=0.0)
        j += 1
    kv_off = ((b * T + c * CELL + offs_u) * HKV + g) * D
    wmask = m2 & (nseg > 1)
    if accum:
        dk += tl.load(DK_ACC + kv_off[:, None] + offs_d[None, :], mask=wmask, other=0.0)
        dv += tl.load(DV_ACC + kv_off[:, None] + offs_d[None, :], mask=wmask, other=0.0)
    tl.store(DK_ACC + kv_off[:, None] + offs_d[None, :], dk, mask=wmask)
    tl.store(DV_ACC + kv_off[:, None] + offs_d[None, :], dv, mask=wmask)


# ---- long branch, "cell" mode: everything over the inverted selection (cells outer, readers inner)


@triton.jit
def _cell_slots(SLOTS, r0, end, BLOCK_R: tl.constexpr):
    """(rmask, slot) of the BLOCK_R reader slots SLOTS[r0:end] (int64 chunk-local flat entry index
    ((b*TC + ii)*HQ + h)*TOPK + kk; masked entries 0)."""
    rmask = (r0 + tl.arange(0, BLOCK_R)) < end
    return rmask, tl.load(SLOTS + r0 + tl.arange(0, BLOCK_R), mask=rmask, other=0)


@triton.jit
def _slot_rows(sl, b, T, T0, TC, HQ: tl.constexpr, TOPK: tl.constexpr):
    """q row (b*T + T0 + ii)*HQ + h and stat offset (b*HQ + h)*T + T0 + ii of reader slots (int64); the
    cell's batch row b is the reader's."""
    rl = sl // TOPK  # chunk-local query-head row (b*TC + ii)*HQ + h
    h = rl % HQ
    pos = T0 + (rl // HQ) % TC
    return (b * T + pos) * HQ + h, (b * HQ + h) * T + pos


@triton.jit
def _bwd_cell_olong_kernel(
    Q,
    K,
    V,
    LSE_LONG,
    SLOTS,
    OFFSETS,
    WORK_CELL,
    WORK_SEG,
    OPART,
    T,
    T0,
    TC,
    C,
    NCELLS,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEG: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Pass 1 of the "cell" mode: the part of o_long that each selected cell contributes to each reader,
    o_part[slot] = sum_{t in cell} exp(scale * q . k_t - lse_long) v_t (lse_long saved by the forward,
    so the K parts of a query add up to o_long without a rescaling). One program per work item
    (WORK_CELL[w] = cell key (b*HKV + g)*C + c, >= NCELLS: idle; WORK_SEG[w] = segment of SEG readers);
    readers SLOTS[OFFSETS[key]:OFFSETS[key+1]] (`inverted_slots`). OPART fp32 [B*TC*HQ*TOPK, D]
    (slots of unselected entries are not written)."""
    DOT_DTYPE = K.dtype.element_ty
    active, key, j, b, offs_d, dmask, offs_u, umask, m2, kvp, kc, vc, start, end = _cell_work_item(
        WORK_CELL, WORK_SEG, OFFSETS, K, V, T, C, NCELLS, HKV, D, CELL, BLOCK_D, BLOCK_C, SEG
    )
    # software prefetch (a while loop is not pipelined): slots two blocks ahead, q rows one block ahead
    r0 = start
    rmask, sl = _cell_slots(SLOTS, r0, end, BLOCK_R)
    rmask1, sl1 = _cell_slots(SLOTS, r0 + BLOCK_R, end, BLOCK_R)
    qrow, stat = _slot_rows(sl, b, T, T0, TC, HQ, TOPK)
    qr = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    lse = tl.load(LSE_LONG + stat, mask=rmask, other=0.0)
    while r0 < end:
        rmask2, sl2 = _cell_slots(SLOTS, r0 + 2 * BLOCK_R, end, BLOCK_R)
        qrow1, stat1 = _slot_rows(sl1, b, T, T0, TC, HQ, TOPK)
        qr1 = tl.load(Q + qrow1[:, None] * D + offs_d[None, :], mask=rmask1[:, None] & dmask[None, :], other=0.0)
        lse1 = tl.load(LSE_LONG + stat1, mask=rmask1, other=0.0)
        s = _dot(qr.to(DOT_DTYPE), tl.trans(kc), IEEE)  # [BLOCK_R, BLOCK_C]
        p = tl.where(rmask[:, None] & umask[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        o = _dot(p.to(DOT_DTYPE), vc, IEEE)  # [BLOCK_R, BLOCK_D]
        tl.store(OPART + sl[:, None] * D + offs_d[None, :], o, mask=rmask[:, None] & dmask[None, :])
        rmask, sl, qr, lse = rmask1, sl1, qr1, lse1
        rmask1, sl1 = rmask2, sl2
        r0 += BLOCK_R


@triton.jit
def _chunk_rows(rl, T, T0, TC, HQ: tl.constexpr):
    """(h, b, pos, q row (b*T + pos)*HQ + h) of chunk-local query-head rows rl = (b*TC + ii)*HQ + h, pos = T0 + ii."""
    h = rl % HQ
    bi = rl // HQ
    b = bi // TC
    pos = T0 + bi - b * TC
    return h, b, pos, (b * T + pos) * HQ + h


@triton.jit
def _bwd_long_rows_kernel(
    DO,
    O,
    IDX,
    OPART,
    BETA,
    RSTD,
    DOLONG,
    DELTA_LOC,
    DELTA_LONG,
    DBETA_PART,
    T,
    T0,
    TC,
    NR,
    HQ: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Pass 2 of the "cell" mode, one program per BLOCK_Q chunk-local rows rl = (b*TC + ii)*HQ + h (NR rows):
    o_long = the sum of the row's TOPK parts in slot order (unselected slots skipped: fixed order), then
    the RMSNorm backward: d_olong (DOLONG, q's dtype), Delta_loc, Delta_long, the dbeta partial (as
    `_bwd_long_query_kernel`)."""
    rl = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rmask = rl < NR
    h, b, pos, grow = _chunk_rows(rl, T, T0, TC, HQ)
    stat = (b * HQ + h) * T + pos
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    m2 = rmask[:, None] & dmask[None, :]
    o_long = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for kk in tl.static_range(TOPK):
        cell = tl.load(IDX + grow * TOPK + kk, mask=rmask, other=-1)
        o_long += tl.load(OPART + (rl * TOPK + kk)[:, None] * D + offs_d[None, :], mask=m2 & (cell >= 0)[:, None], other=0.0)
    qd = grow[:, None] * D + offs_d[None, :]
    do = tl.load(DO + qd, mask=m2, other=0.0).to(tl.float32)
    o = tl.load(O + qd, mask=m2, other=0.0).to(tl.float32)
    beta = tl.load(BETA + h, mask=rmask, other=0.0).to(tl.float32)[:, None]
    rstd = tl.load(RSTD + stat, mask=rmask, other=0.0)
    y = o_long * rstd[:, None]
    dy = beta * do
    d_olong = rstd[:, None] * (dy - y * (tl.sum(dy * y, axis=1) / D)[:, None])
    tl.store(DBETA_PART + stat, tl.sum(do * y, axis=1), mask=rmask)
    tl.store(DELTA_LOC + stat, tl.sum(do * (o - beta * y), axis=1), mask=rmask)
    tl.store(DELTA_LONG + stat, tl.sum(d_olong * o_long, axis=1), mask=rmask)
    tl.store(DOLONG + qd, d_olong.to(DOLONG.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_cell_grad_kernel(
    Q,
    K,
    V,
    DOLONG,
    LSE_LONG,
    DELTA_LONG,
    SLOTS,
    OFFSETS,
    WORK_CELL,
    WORK_SEG,
    NSEG,
    PART_BASE,
    QPART,
    DK_ACC,
    DV_ACC,
    PART_DK,
    PART_DV,
    T,
    T0,
    TC,
    C,
    NCELLS,
    accum,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEG: tl.constexpr,
    IEEE: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Pass 3 of the "cell" mode (work items and readers as `_bwd_cell_olong_kernel`): per reader block
    p, dp = d_olong . v, ds = p * (dp - Delta_long); the reader's dq part (ds @ k * scale) goes to
    QPART fp32 [B*TC*HQ*TOPK, D] at its slot, and the cell accumulates dv += p^T d_olong,
    dk += ds^T q over its readers in their fixed order. dk / dv_acc fp32 [B, T, HKV, D]: a cell of one
    segment stores (+ the previous value when `accum`, a later chunk of queries); a cell of NSEG > 1
    segments writes partial slot PART_BASE[key] + j (reduced by `_bwd_long_reduce_kernel`), or with
    ATOMIC adds itself with tl.atomic_add (dk / dv_acc then zeroed first)."""
    DOT_DTYPE = K.dtype.element_ty
    active, key, j, b, offs_d, dmask, offs_u, umask, m2, kvp, kc, vc, start, end = _cell_work_item(
        WORK_CELL, WORK_SEG, OFFSETS, K, V, T, C, NCELLS, HKV, D, CELL, BLOCK_D, BLOCK_C, SEG
    )
    dk = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    # software prefetch as in `_bwd_cell_olong_kernel`: slots two blocks ahead, rows one block ahead
    r0 = start
    rmask, sl = _cell_slots(SLOTS, r0, end, BLOCK_R)
    rmask1, sl1 = _cell_slots(SLOTS, r0 + BLOCK_R, end, BLOCK_R)
    qrow, stat = _slot_rows(sl, b, T, T0, TC, HQ, TOPK)
    rm2 = rmask[:, None] & dmask[None, :]
    qr_n = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=rm2, other=0.0)
    dor_n = tl.load(DOLONG + qrow[:, None] * D + offs_d[None, :], mask=rm2, other=0.0)
    lse_n = tl.load(LSE_LONG + stat, mask=rmask, other=0.0)
    dl_n = tl.load(DELTA_LONG + stat, mask=rmask, other=0.0)
    while r0 < end:
        qr = qr_n.to(DOT_DTYPE)
        dor = dor_n.to(DOT_DTYPE)
        lse = lse_n
        dl = dl_n
        rmask2, sl2 = _cell_slots(SLOTS, r0 + 2 * BLOCK_R, end, BLOCK_R)
        qrow1, stat1 = _slot_rows(sl1, b, T, T0, TC, HQ, TOPK)
        rm2n = rmask1[:, None] & dmask[None, :]
        qr_n = tl.load(Q + qrow1[:, None] * D + offs_d[None, :], mask=rm2n, other=0.0)
        dor_n = tl.load(DOLONG + qrow1[:, None] * D + offs_d[None, :], mask=rm2n, other=0.0)
        lse_n = tl.load(LSE_LONG + stat1, mask=rmask1, other=0.0)
        dl_n = tl.load(DELTA_LONG + stat1, mask=rmask1, other=0.0)
        rm2 = rmask[:, None] & dmask[None, :]
        s = _dot(qr, tl.trans(kc), IEEE)  # [BLOCK_R, BLOCK_C]
        p = tl.where(rmask[:, None] & umask[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        dp = _dot(dor, tl.trans(vc), IEEE)
        dv += _dot(tl.trans(p.to(DOT_DTYPE)), dor, IEEE)
        ds = (p * (dp - dl[:, None])).to(DOT_DTYPE)
        dk += _dot(tl.trans(ds), qr, IEEE)
        tl.store(QPART + sl[:, None] * D + offs_d[None, :], _dot(ds, kc, IEEE) * scale, mask=rm2)
        rmask, sl = rmask1, sl1
        rmask1, sl1 = rmask2, sl2
        r0 += BLOCK_R
    dk = dk * scale
    nseg = tl.load(NSEG + key)
    direct = active & (nseg == 1)
    dmask2 = m2 & direct
    if accum:
        dk += tl.load(DK_ACC + kvp, mask=dmask2, other=0.0)
        dv += tl.load(DV_ACC + kvp, mask=dmask2, other=0.0)
    split = active & (nseg > 1)
    if ATOMIC:
        tl.store(DK_ACC + kvp, dk, mask=dmask2)
        tl.store(DV_ACC + kvp, dv, mask=dmask2)
        tl.atomic_add(DK_ACC + kvp, dk, mask=m2 & split)
        tl.atomic_add(DV_ACC + kvp, dv, mask=m2 & split)
    else:
        tl.store(DK_ACC + kvp, dk, mask=dmask2)
        tl.store(DV_ACC + kvp, dv, mask=dmask2)
        slot = (tl.load(PART_BASE + key) + j) * (CELL * D) + offs_u[:, None] * D + offs_d[None, :]
        tl.store(PART_DK + slot, dk, mask=m2 & split)
        tl.store(PART_DV + slot, dv, mask=m2 & split)


@triton.jit
def _bwd_sum_parts_kernel(
    IDX,
    QPART,
    DQLONG,
    T,
    T0,
    TC,
    NR,
    HQ: tl.constexpr,
    D: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """dq_long fp32 [B, T, HQ, D] of the chunk's rows = the sum of their TOPK dq parts in slot order."""
    rl = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rmask = rl < NR
    _h, _b, _pos, grow = _chunk_rows(rl, T, T0, TC, HQ)
    offs_d = tl.arange(0, BLOCK_D)
    m2 = rmask[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for kk in tl.static_range(TOPK):
        cell = tl.load(IDX + grow * TOPK + kk, mask=rmask, other=-1)
        acc += tl.load(QPART + (rl * TOPK + kk)[:, None] * D + offs_d[None, :], mask=m2 & (cell >= 0)[:, None], other=0.0)
    tl.store(DQLONG + grow[:, None] * D + offs_d[None, :], acc, mask=m2)


@triton.jit
def _load_halves(X, rows, row_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """X (a scalar pointer) + rows[:, None] (int32 offsets) + cols: the two halves [BLOCK_R, BLOCK_H]
    (fp32) of D = 2*HALF vectors. A per-program int64 base and int32 tile offsets keep 64-bit pointer
    tiles out of the registers."""
    offs_h = tl.arange(0, BLOCK_H)
    m = row_mask[:, None] & (offs_h < HALF)[None, :]
    x1 = tl.load(X + rows[:, None] + offs_h[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + rows[:, None] + HALF + offs_h[None, :], mask=m, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _rope_tables(COS, SIN, p0, pos, pos_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """cos, sin [BLOCK_R, BLOCK_H] fp32 at positions p0 + pos (p0 int64 scalar, pos int32; tables [T, HALF])."""
    offs_h = tl.arange(0, BLOCK_H)
    m = pos_mask[:, None] & (offs_h < HALF)[None, :]
    cs = tl.load(COS + p0 * HALF + pos[:, None] * HALF + offs_h[None, :], mask=m, other=0.0)
    sn = tl.load(SIN + p0 * HALF + pos[:, None] * HALF + offs_h[None, :], mask=m, other=0.0)
    return cs, sn


@triton.jit
def _rotated_halves(X, rows, row_mask, COS, SIN, p0, pos, DT_REF, PREROT: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr):  # fmt: skip
    """The halves of rope(x) for rows of a [*, D] tensor (`_load_halves(X, rows, row_mask)`), in
    the dtype of the DT_REF pointer (tl.dot's inputs): loaded as they are when PREROT (X holds
    rope(x) already), else rotated at positions p0 + pos (`_rope_tables`)."""
    x1, x2 = _load_halves(X, rows, row_mask, HALF, BLOCK_H)
    DOT_DTYPE = DT_REF.dtype.element_ty
    if PREROT:
        r1 = x1.to(DOT_DTYPE)
        r2 = x2.to(DOT_DTYPE)
    else:
        cs, sn = _rope_tables(COS, SIN, p0, pos, row_mask, HALF, BLOCK_H)
        r1 = (x1 * cs - x2 * sn).to(DOT_DTYPE)
        r2 = (x2 * cs + x1 * sn).to(DOT_DTYPE)
    return r1, r2


@triton.jit
def _unrotated_grad(g1, g2, COS, SIN, p0, pos, pos_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """The gradient with respect to x of one with respect to rope(x) (the transposed rotation:
    g1 c + g2 s, g2 c - g1 s) at positions p0 + pos; the tables loaded here (fewer live registers
    than keeping them from the rotation)."""
    cs, sn = _rope_tables(COS, SIN, p0, pos, pos_mask, HALF, BLOCK_H)
    return g1 * cs + g2 * sn, g2 * cs - g1 * sn


@triton.jit
def _bwd_local_dkdv_kernel(
    DO,
    Q,
    K,
    V,
    COS,
    SIN,
    LSE_LOC,
    DELTA_LOC,
    DK_LONG,
    DV_LONG,
    DK,
    DV,
    T,
    W,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_LONG: tl.constexpr,
    NUM_M: tl.constexpr,
    PREROT: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_N), B * HKV). dk/dv [B, T, HKV, D] (k's dtype) = local + long (fp32 dk/dv_long).
    PREROT: Q and K hold rope(q), rope(k) already (`_common.rope_rotate`: the same values as rotating
    here), so the loop loads no cos / sin tables and does no rotation; otherwise q, k are rotated here."""
    DOT_DTYPE = K.dtype.element_ty  # tl.dot inputs in the inputs' dtype, fp32 accumulation
    n0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    bg = tl.program_id(1).to(tl.int64)
    b = bg // HKV
    g = bg - b * HKV
    G: tl.constexpr = HQ // HKV
    D: tl.constexpr = 2 * HALF
    ar_n = tl.arange(0, BLOCK_N)
    nmask = n0 + ar_n < T
    kv_base = ((b * T + n0) * HKV + g) * D  # int64 scalar; tile offsets are int32
    kv_rows = ar_n * (HKV * D)
    kr1, kr2 = _rotated_halves(K + kv_base, kv_rows, nmask, COS, SIN, n0, ar_n, K, PREROT, HALF, BLOCK_H)
    v1, v2 = _load_halves(V + kv_base, kv_rows, nmask, HALF, BLOCK_H)
    v1 = v1.to(DOT_DTYPE)
    v2 = v2.to(DOT_DTYPE)
    dk1 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    dv1 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    dv2 = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    m_lo = (n0 // BLOCK_M) * BLOCK_M  # queries t <= i < t + w: NUM_M tiles from m_lo (masked past T)
    for hh in range(G):
        h = g * G + hh
        for it in range(NUM_M):
            m0 = m_lo + it * BLOCK_M
            ar_m = tl.arange(0, BLOCK_M)
            mmask = m0 + ar_m < T
            q_base = ((b * T + m0) * HQ + h) * D
            q_rows = ar_m * (HQ * D)
            qr1, qr2 = _rotated_halves(Q + q_base, q_rows, mmask, COS, SIN, m0, ar_m, K, PREROT, HALF, BLOCK_H)
            do1, do2 = _load_halves(DO + q_base, q_rows, mmask, HALF, BLOCK_H)
            do1 = do1.to(DOT_DTYPE)
            do2 = do2.to(DOT_DTYPE)
            stat = (b * HQ + h) * T + m0
            lse = tl.load(LSE_LOC + stat + ar_m, mask=mmask, other=0.0)
            delta = tl.load(DELTA_LOC + stat + ar_m, mask=mmask, other=0.0)
            # transposed scores: sT[n, m] = scale * kr_n . qr_m
            sT = _dot(kr1, tl.trans(qr1), IEEE) + _dot(kr2, tl.trans(qr2), IEEE)
            # i - t in int32 (an int64 [BLOCK_N, BLOCK_M] tile would cost registers; |i - t| < 2^31)
            diff = (m0 - n0).to(tl.int32) + tl.arange(0, BLOCK_M)[None, :] - tl.arange(0, BLOCK_N)[:, None]
            vis = (diff >= 0) & (diff < W) & mmask[None, :] & nmask[:, None]
            pT = tl.where(vis, tl.exp(sT * scale - lse[None, :]), 0.0)  # [BLOCK_N, BLOCK_M]
            pTc = pT.to(DOT_DTYPE)
            dv1 += _dot(pTc, do1, IEEE)
            dv2 += _dot(pTc, do2, IEEE)
            dpT = _dot(v1, tl.trans(do1), IEEE) + _dot(v2, tl.trans(do2), IEEE)
            dsT = (pT * (dpT - delta[None, :])).to(DOT_DTYPE)
            dk1 += _dot(dsT, qr1, IEEE)
            dk2 += _dot(dsT, qr2, IEEE)
    dk1 = dk1 * scale
    dk2 = dk2 * scale
    gk1, gk2 = _unrotated_grad(dk1, dk2, COS, SIN, n0, ar_n, nmask, HALF, BLOCK_H)
    offs_h = tl.arange(0, BLOCK_H)
    m2 = nmask[:, None] & (offs_h < HALF)[None, :]
    p1 = kv_base + kv_rows[:, None] + offs_h[None, :]
    if HAS_LONG:
        gk1 += tl.load(DK_LONG + p1, mask=m2, other=0.0)
        gk2 += tl.load(DK_LONG + p1 + HALF, mask=m2, other=0.0)
        dv1 += tl.load(DV_LONG + p1, mask=m2, other=0.0)
        dv2 += tl.load(DV_LONG + p1 + HALF, mask=m2, other=0.0)
    tl.store(DK + p1, gk1.to(DK.dtype.element_ty), mask=m2)
    tl.store(DK + p1 + HALF, gk2.to(DK.dtype.element_ty), mask=m2)
    tl.store(DV + p1, dv1.to(DV.dtype.element_ty), mask=m2)
    tl.store(DV + p1 + HALF, dv2.to(DV.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_local_dq_kernel(
    DO,
    Q,
    K,
    V,
    COS,
    SIN,
    LSE_LOC,
    DELTA_LOC,
    DQ_LONG,
    IDX,
    DQ,
    T,
    W,
    scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    NUM_N: tl.constexpr,
    PREROT: tl.constexpr,
    LONG_PARTS: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_M), B * HQ). dq [B, T, HQ, D] (q's dtype) = local + long (fp32 dq_long).
    PREROT: Q and K hold rope(q), rope(k) (as `_bwd_local_dkdv_kernel`).
    LONG_PARTS = 0: DQ_LONG is dense fp32 [B, T, HQ, D]; LONG_PARTS = K > 0: DQ_LONG holds the "cell"
    mode's fp32 dq parts [B, T, HQ, K, D] (one chunk) and the parts of selected cells (IDX >= 0) are
    added in slot order, as `_bwd_sum_parts_kernel` (same bits)."""
    DOT_DTYPE = K.dtype.element_ty  # tl.dot inputs in the inputs' dtype, fp32 accumulation
    m0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HQ
    h = bh - b * HQ
    g = h // (HQ // HKV)
    D: tl.constexpr = 2 * HALF
    ar_m = tl.arange(0, BLOCK_M)
    mmask = m0 + ar_m < T
    q_base = ((b * T + m0) * HQ + h) * D  # int64 scalar; tile offsets are int32
    q_rows = ar_m * (HQ * D)
    qr1, qr2 = _rotated_halves(Q + q_base, q_rows, mmask, COS, SIN, m0, ar_m, K, PREROT, HALF, BLOCK_H)
    do1, do2 = _load_halves(DO + q_base, q_rows, mmask, HALF, BLOCK_H)
    do1 = do1.to(DOT_DTYPE)
    do2 = do2.to(DOT_DTYPE)
    stat = (b * HQ + h) * T + m0
    lse = tl.load(LSE_LOC + stat + ar_m, mask=mmask, other=0.0)
    delta = tl.load(DELTA_LOC + stat + ar_m, mask=mmask, other=0.0)
    dq1 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    # keys i - w < t <= i: NUM_N tiles ending with the one holding m0 + BLOCK_M - 1 (masked before 0)
    n_last = ((m0 + BLOCK_M - 1) // BLOCK_N) * BLOCK_N
    for it in range(NUM_N):
        n0 = n_last - (NUM_N - 1 - it) * BLOCK_N
        ar_n = tl.arange(0, BLOCK_N)
        nmask = (n0 + ar_n < T) & (n0 + ar_n >= 0)
        kv_base = ((b * T + n0) * HKV + g) * D  # may point before the row: masked
        kv_rows = ar_n * (HKV * D)
        kr1, kr2 = _rotated_halves(K + kv_base, kv_rows, nmask, COS, SIN, n0, ar_n, K, PREROT, HALF, BLOCK_H)
        v1, v2 = _load_halves(V + kv_base, kv_rows, nmask, HALF, BLOCK_H)
        s = _dot(qr1, tl.trans(kr1), IEEE) + _dot(qr2, tl.trans(kr2), IEEE)  # [BLOCK_M, BLOCK_N]
        diff = (m0 - n0).to(tl.int32) + tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :]  # i - t
        vis = (diff >= 0) & (diff < W) & mmask[:, None] & nmask[None, :]
        p = tl.where(vis, tl.exp(s * scale - lse[:, None]), 0.0)
        dp = _dot(do1, tl.trans(v1.to(DOT_DTYPE)), IEEE) + _dot(do2, tl.trans(v2.to(DOT_DTYPE)), IEEE)
        ds = (p * (dp - delta[:, None])).to(DOT_DTYPE)
        dq1 += _dot(ds, kr1, IEEE)
        dq2 += _dot(ds, kr2, IEEE)
    dq1 = dq1 * scale
    dq2 = dq2 * scale
    gq1, gq2 = _unrotated_grad(dq1, dq2, COS, SIN, m0, ar_m, mmask, HALF, BLOCK_H)
    offs_h = tl.arange(0, BLOCK_H)
    m2 = mmask[:, None] & (offs_h < HALF)[None, :]
    p1 = q_base + q_rows[:, None] + offs_h[None, :]
    if LONG_PARTS > 0:
        grow = (b * T + m0 + ar_m) * HQ + h  # [BLOCK_M] int64
        lq1 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        lq2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for kk in tl.static_range(LONG_PARTS):
            sel = tl.load(IDX + grow * LONG_PARTS + kk, mask=mmask, other=-1) >= 0
            pp = (grow * LONG_PARTS + kk)[:, None] * D + offs_h[None, :]
            lq1 += tl.load(DQ_LONG + pp, mask=m2 & sel[:, None], other=0.0)
            lq2 += tl.load(DQ_LONG + pp + HALF, mask=m2 & sel[:, None], other=0.0)
        gq1 += lq1
        gq2 += lq2
    else:
        gq1 += tl.load(DQ_LONG + p1, mask=m2, other=0.0)
        gq2 += tl.load(DQ_LONG + p1 + HALF, mask=m2, other=0.0)
    tl.store(DQ + p1, gq1.to(DQ.dtype.element_ty), mask=m2)
    tl.store(DQ + p1 + HALF, gq2.to(DQ.dtype.element_ty), mask=m2)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


LONG_MODES = ("cell", "gather", "union")
LONG_MODE_ENV = "FREESOLO_TRITON_BWD_LONG"  # A/B switch of the default: cell | gather | union | legacy


def _env_mode() -> str:
    mode = os.environ.get(LONG_MODE_ENV, "cell").strip().lower() or "cell"
    if mode != "legacy" and mode not in LONG_MODES:
        raise ValueError(f"{LONG_MODE_ENV}={mode!r} must be one of {LONG_MODES + ('legacy',)}")
    return mode


def default_long_mode(deterministic: bool) -> str:
    """The long branch's mode when no tiles are given: "cell", unless the environment variable
    FREESOLO_TRITON_BWD_LONG says "gather", "union" or "legacy" (the whole backward as before issue 11:
    "gather" when deterministic, "union" otherwise, and `prerotate=False`). Read at every call, so the
    old and new paths can be timed in one process."""
    mode = _env_mode()
    if mode == "legacy":
        return "gather" if deterministic else "union"
    return mode


def tiles_prerotate_default() -> bool:
    """False when FREESOLO_TRITON_BWD_LONG=legacy (the local kernels rotate every tile, as before issue 11)."""
    return _env_mode() != "legacy"


@dataclass(frozen=True)
class BwdTiles:
    """Tile sizes of the backward kernels (they depend on D, dtype and device only, never on B or T).

    Defaults chosen from the sm_90 register / spill counts of `triton.compile` for D = 64, bf16
    (FA2-like shapes: the dk/dv kernel steps over thin query tiles of a wide key tile, the dq kernel
    over thin key tiles of a wide query tile); to be confirmed by `benchmarks/triton_backward_bench.py --sweep`.
    """

    kv_block_n: int = 64  # keys per program of the local dk/dv kernel (>= 16 on the GPU: tl.dot's minimum)
    kv_block_m: int = 32  # queries per step of the local dk/dv kernel
    q_block_m: int = 64  # queries per program of the local dq kernel
    q_block_n: int = 32  # keys per step of the local dq kernel
    block_r: int = 32  # readers per step of the deterministic cell kernel (>= 16 on the GPU)
    block_q: int = 1  # queries per program of the per-query long-branch kernel ("gather" mode)
    long_mode: str = "cell"  # the long branch's backward:
    # "cell" (default): three passes over the inverted selection, cells outer and the readers of a cell
    #   inner with tl.dot (o_long parts, then the RMSNorm rows, then dq parts + dk / dv); no gather;
    # "gather" (before issue 11): one program per query gathers its K*s tokens (CUDA cores), then dk / dv
    #   per cell ("deterministic") or per-query atomics;
    # "union": a tile of block_u queries loops over its cell union with tl.dot (per-(tile, cell) atomics)
    block_u: int = 64  # queries per program of the "union" mode (>= 16 on the GPU)
    block_rows: int = 16  # query-head rows per program of the "cell" mode's row kernels (8 warps)
    long_chunk: int = 65536  # "cell" mode: positions per chunk of queries (its fp32 parts hold
    # B * long_chunk * Hq * K * D floats; a longer sequence runs chunk after chunk, in order)
    prerotate: bool = True  # local kernels read rope(q), rope(k) made once by `rope_rotate` (+ q and k's
    # size in memory) instead of rotating every tile they load (False: the path before issue 11)
    seg: int = 1024  # readers per work item of the cell kernel: a cell read more often is split (fixed order)
    num_warps: int = 8  # warps of the local kernels
    num_stages: int = 2  # software pipelining depth of the local kernels' loops
    num_warps_long: int = 8  # warps of the per-query and per-cell kernels

    def __post_init__(self):
        if self.long_mode not in LONG_MODES:
            raise ValueError(f"long_mode={self.long_mode!r} must be one of {LONG_MODES}")
        if self.long_chunk < 1:
            raise ValueError(f"long_chunk={self.long_chunk} must be positive")
        names = ("kv_block_n", "kv_block_m", "q_block_m", "q_block_n", "block_r", "block_q", "block_u", "block_rows")
        for name in names:
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise ValueError(f"{name}={x} must be a power of two")
        if self.seg < self.block_r or self.seg % self.block_r:
            raise ValueError(f"seg={self.seg} must be a positive multiple of block_r={self.block_r}")


def default_bwd_tiles(D: int, dtype: torch.dtype, device: torch.device) -> BwdTiles:
    """Tiles by device (and later head dim / dtype); the interpreter (CPU) gets small tiles and many
    queries per program (it runs programs one after the other)."""
    if device.type != "cuda":
        return BwdTiles(
            32, 32, 32, 32, block_r=16, block_q=16, seg=64, block_rows=16, num_warps=1, num_stages=1, num_warps_long=1
        )
    if D > 64 or dtype == torch.float32:  # wider rows: thinner tiles keep the local kernels from spilling
        return BwdTiles(kv_block_n=32, kv_block_m=16, q_block_m=64, q_block_n=16)
    # 16-bit, D <= 64: 4 warps and 3 stages for the local kernels, 4 warps for the cell kernels
    # (s21 sweep at 64k, benchmarks/triton_backward_bench.py --sweep-only, results/session_2026-12-01_s21/
    # call3/: backward 9.22 ms with the class defaults; local 4 warps / 3 stages 7.49, long 4 warps 7.64)
    return BwdTiles(num_warps=4, num_stages=3, num_warps_long=4)


_CALL_TILES: dict = {}


def _call_bwd_tiles(D: int, dtype: torch.dtype, device: torch.device, deterministic: bool) -> BwdTiles:
    """`default_bwd_tiles` with the call's long mode (`default_long_mode`) and prerotation
    (`tiles_prerotate_default`), cached per (D, dtype, device type, deterministic, the value of
    FREESOLO_TRITON_BWD_LONG): the variable is still read at every call."""
    key = (D, dtype, device.type, deterministic, os.environ.get(LONG_MODE_ENV))
    hit = _CALL_TILES.get(key)
    if hit is None:
        hit = _CALL_TILES[key] = dataclasses.replace(
            default_bwd_tiles(D, dtype, device),
            long_mode=default_long_mode(deterministic),
            prerotate=tiles_prerotate_default(),
        )
    return hit


def _pow2(x: int, floor: int = 1) -> int:
    return max(floor, next_pow2(max(1, int(x))))


def inverted_selection(idx: torch.Tensor, num_kv_heads: int, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Readers of every (b, kv head, cell): a stable sort of the saved indices, O(B*T*Hq*K) (linear in T).

    Args:
        idx: int [B, T, Hq, K] selected cells, -1 padded.
        num_kv_heads: Hkv (query head h reads kv head h // (Hq // Hkv)).
        cell: tokens per cell; C = T // cell complete cells per kv head.
    Returns:
        readers int64 [B*T*Hq*K]: flat query-head index (b*T + i)*Hq + h, grouped by cell key
            (b*Hkv + g)*C + c and inside a group in increasing (i, h) order (entries of -1 last);
        offsets int64 [B*Hkv*C + 1]: readers of key c are readers[offsets[c]:offsets[c+1]].
    No host synchronization (sizes are static).
    """
    B, T, Hq, K = idx.shape
    C = T // cell
    G = Hq // num_kv_heads
    ncells = B * num_kv_heads * C
    dev = idx.device
    b = torch.arange(B, device=dev, dtype=torch.int64).view(B, 1, 1, 1)
    g = (torch.arange(Hq, device=dev, dtype=torch.int64) // G).view(1, 1, Hq, 1)
    c = idx.to(torch.int64)
    key = torch.where(c >= 0, (b * num_kv_heads + g) * C + c, ncells).reshape(-1)  # (B*T*Hq*K,)
    order = torch.sort(key, stable=True).indices  # ties keep the flat (b, i, h, k) order
    readers = order // K
    counts = torch.bincount(key, minlength=ncells + 1)[:ncells]
    offsets = torch.zeros(ncells + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=offsets[1:])
    return readers, offsets


def inverted_slots(idx: torch.Tensor, num_kv_heads: int, num_cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of `idx` grouped by the cell they read (the "cell" mode's inverted selection).

    Args:
        idx: int [B, T', Hq, K] selected cells, -1 padded (T' may be a chunk of the positions: any view).
        num_kv_heads: Hkv; num_cells: C, cells per kv head of the whole sequence (every idx < C).
    Returns:
        slots int64 [B*T'*Hq*K]: flat entry index ((b*T' + i)*Hq + h)*K + k, grouped by cell key
            (b*Hkv + g)*C + c, inside a group in increasing flat order (-1 entries last);
        offsets int64 [B*Hkv*C + 1]: the entries reading key c are slots[offsets[c]:offsets[c+1]].
    One stable sort of int32 keys (int64 past 2^31 cells), no host synchronization.
    """
    B, T, Hq, K = idx.shape
    G = Hq // num_kv_heads
    ncells = B * num_kv_heads * num_cells
    dev = idx.device
    kdt = torch.int32 if ncells < 2**31 - 1 else torch.int64
    b = torch.arange(B, device=dev, dtype=kdt).view(B, 1, 1, 1)
    g = (torch.arange(Hq, device=dev, dtype=kdt) // G).view(1, 1, Hq, 1)
    c = idx.to(kdt)
    key = torch.where(c >= 0, (b * num_kv_heads + g) * num_cells + c, ncells).reshape(-1)  # (B*T'*Hq*K,)
    sorted_key, slots = torch.sort(key, stable=True)  # ties keep the flat (b, i, h, k) order
    offsets = torch.searchsorted(sorted_key, torch.arange(ncells + 1, device=dev, dtype=kdt))
    return slots, offsets


def segment_plan(offsets: torch.Tensor, num_entries: int, seg: int, min_seg: int = 1):
    """Work items of the cell kernel: each cell's readers cut into segments of `seg` (no host sync).

    Args:
        offsets: int64 [NCELLS + 1] from `inverted_selection`; num_entries: B*T*Hq*K (a bound on readers).
        min_seg: 1: every cell gets a work item (an unread cell writes zeros); 0: unread cells get none.
    Returns:
        work_cell int64 [W]: cell key of each work item (NCELLS: idle), W = NCELLS + ceil(num_entries / seg);
        work_seg int64 [W]: segment index inside the cell;
        nseg int64 [NCELLS]: segments per cell (>= 1: an unread cell writes zeros);
        part_base int64 [NCELLS]: first partial slot of a cell of nseg > 1 segments;
        num_slots: partial slots to allocate (static bound 2 * ceil(num_entries / seg) + 1).
    """
    ncells = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    nseg = torch.clamp((counts + seg - 1) // seg, min=min_seg)
    incl = torch.cumsum(nseg, 0)
    W = ncells + -(-num_entries // seg)
    w = torch.arange(W, device=offsets.device, dtype=torch.int64)
    cell = torch.searchsorted(incl, w, right=True)  # first cell whose inclusive end exceeds w
    safe = cell.clamp(max=max(ncells - 1, 0))
    work_seg = w - (incl[safe] - nseg[safe])
    work_cell = torch.where(cell < ncells, cell, torch.full_like(cell, ncells))
    multi = torch.where(nseg > 1, nseg, torch.zeros_like(nseg))
    part_base = torch.cumsum(multi, 0) - multi
    num_slots = 2 * -(-num_entries // seg) + 1  # cells of > 1 segments have > seg readers each
    return work_cell, work_seg, nseg, part_base, num_slots


@triton.jit
def _plan_key_kernel(
    IDX,  # int32 / int64 [B, T, HQ, TOPK] selected cells (-1: none), contiguous
    KEY,  # int16 / int32 / int64 [B * TC * HQ * TOPK] (out): the cell key of every entry of positions T0 .. T0 + TC - 1
    N,  # B * TC * HQ * TOPK
    T,
    T0,
    TC,
    C,  # cells per kv head of the whole sequence
    NCELLS,  # B * HKV * C: the key of an entry that selected no cell
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per BLOCK entries e = ((b * TC + i) * HQ + h) * TOPK + k of the chunk: its key
    (b * HKV + h // G) * C + idx[b, T0 + i, h, k], NCELLS where that is -1 (`inverted_slots`' keys)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = e < N
    kk = e % TOPK
    row = e // TOPK
    h = row % HQ
    bi = row // HQ
    i = bi % TC
    b = bi // TC
    c = tl.load(IDX + ((b * T + T0 + i) * HQ + h) * TOPK + kk, mask=ok, other=-1).to(tl.int64)
    key = tl.where(c >= 0, (b * HKV + h // (HQ // HKV)) * C + c, NCELLS)
    tl.store(KEY + e, key.to(KEY.dtype.element_ty), mask=ok)


@triton.jit
def _search_sorted(SORTED, n, target, STEPS: tl.constexpr, BLOCK: tl.constexpr, RIGHT: tl.constexpr):
    """int64 [BLOCK]: for each target, the number of SORTED[0 .. n) (ascending) below it (RIGHT
    False: torch.searchsorted left) or at most it (RIGHT True: right); a binary search of STEPS
    steps (2**STEPS > n). target: int64 [BLOCK]."""
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + n
    for _ in range(STEPS):
        searching = lo < hi
        mid = (lo + hi) // 2
        value = tl.load(SORTED + mid, mask=searching, other=0).to(tl.int64)
        if RIGHT:
            go_right = value <= target
        else:
            go_right = value < target
        lo = tl.where(searching & go_right, mid + 1, lo)
        hi = tl.where(searching & ~go_right, mid, hi)
    return lo


@triton.jit
def _plan_offsets_kernel(
    SORTED_KEY,  # int16 / int32 / int64 [N] the keys, ascending
    OFFSETS,  # int64 [NCELLS + 1] (out): OFFSETS[c] = the first p with SORTED_KEY[p] >= c
    N,
    NCELLS,
    STEPS: tl.constexpr,  # binary-search steps: 2**STEPS > N
    BLOCK: tl.constexpr,
):
    """One program per BLOCK cell keys c in [0, NCELLS]: a binary search (torch.searchsorted, left)."""
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(OFFSETS + c, _search_sorted(SORTED_KEY, N, c, STEPS, BLOCK, RIGHT=False), mask=c <= NCELLS)


@triton.jit
def _plan_scan_kernel(
    OFFSETS,  # int64 [NCELLS + 1]
    NSEG,  # int64 [NCELLS] (out): segments of SEG readers per cell, at least MIN_SEG
    INCL,  # int64 [NCELLS] (out): inclusive prefix sum of NSEG
    PART_BASE,  # int64 [NCELLS] (out): exclusive prefix sum of NSEG over the cells of NSEG > 1
    NCELLS,
    SEG,
    MIN_SEG,
    BLOCK: tl.constexpr,
):
    """One program: the prefix sums of `segment_plan`, BLOCK cells per step with a running carry
    (sequential in NCELLS / BLOCK steps: 32 at T 64k, H 16, cell 32; integer sums, exact)."""
    carry_seg = tl.zeros([], dtype=tl.int64)
    carry_multi = tl.zeros([], dtype=tl.int64)
    for c0 in range(0, NCELLS, BLOCK):
        c = c0 + tl.arange(0, BLOCK).to(tl.int64)
        ok = c < NCELLS
        counts = tl.load(OFFSETS + c + 1, mask=ok, other=0) - tl.load(OFFSETS + c, mask=ok, other=0)
        nseg = tl.where(ok, tl.maximum((counts + SEG - 1) // SEG, MIN_SEG), 0)
        multi = tl.where(nseg > 1, nseg, 0)
        tl.store(NSEG + c, nseg, mask=ok)
        tl.store(INCL + c, carry_seg + tl.cumsum(nseg, 0), mask=ok)
        tl.store(PART_BASE + c, carry_multi + tl.cumsum(multi, 0) - multi, mask=ok)
        carry_seg += tl.sum(nseg, 0)
        carry_multi += tl.sum(multi, 0)


@triton.jit
def _plan_work_kernel(
    INCL,  # int64 [NCELLS] from `_plan_scan_kernel`
    NSEG,  # int64 [NCELLS]
    WORK_CELL,  # int64 [W] (out): cell key of each work item (NCELLS: idle)
    WORK_SEG,  # int64 [W] (out): segment index inside the cell
    W,
    NCELLS,
    STEPS: tl.constexpr,  # binary-search steps: 2**STEPS > NCELLS
    BLOCK: tl.constexpr,
):
    """One program per BLOCK work items w: the first cell whose inclusive end exceeds w
    (torch.searchsorted(INCL, w, right=True)), its segment w - (INCL[cell] - NSEG[cell])."""
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    lo = _search_sorted(INCL, NCELLS, w, STEPS, BLOCK, RIGHT=True)
    safe = tl.minimum(lo, NCELLS - 1)
    ok = w < W
    seg = w - (tl.load(INCL + safe, mask=ok, other=0) - tl.load(NSEG + safe, mask=ok, other=0))
    tl.store(WORK_CELL + w, tl.where(lo < NCELLS, lo, NCELLS), mask=ok)
    tl.store(WORK_SEG + w, seg, mask=ok)


def cell_plan(idx: torch.Tensor, t0: int, tc: int, num_kv_heads: int, num_cells: int, seg: int, min_seg: int = 1):
    """The "cell" mode's inverted selection and work items of positions t0 .. t0 + tc - 1, in
    Triton kernels around one torch.sort: the tensors of `inverted_slots(idx[:, t0:t0 + tc], ...)`
    and `segment_plan(offsets, B * tc * Hq * K, seg, min_seg)` (the torch references, equal to
    them element for element: integers only) with 4 launches and 1 sort instead of ~30 torch ops
    (~1.2 ms of host time per backward at 4k on the H200's host, s29 call2 profile). No host sync.

    Args:
        idx: int32 / int64 [B, T, Hq, K] selected cells (-1 padded), contiguous; every idx < num_cells.
        num_kv_heads: Hkv; num_cells: C, cells per kv head of the whole sequence (>= 1).
    Returns:
        (slots, offsets, work_cell, work_seg, nseg, part_base, num_slots), as the two references.
    """
    B, T, Hq, K = idx.shape
    Hkv = num_kv_heads
    ncells = B * Hkv * num_cells
    n = B * tc * Hq * K
    dev = idx.device
    # the narrowest key that holds 0 .. ncells: a radix sort makes one pass per key byte (int16 at up to
    # 32767 cells: 2 passes instead of int32's 4; T <= 32k at H 16, cell 32), the same order in every width
    kdt = torch.int16 if ncells < 2**15 else torch.int32 if ncells < 2**31 else torch.int64
    key = torch.empty(n, dtype=kdt, device=dev)
    block = 1024
    if n:
        launch(_plan_key_kernel, (cdiv(n, block),),
            idx, key, n, T, t0, tc, num_cells, ncells, HQ=Hq, HKV=Hkv, TOPK=K, BLOCK=block, num_warps=4,
        )  # fmt: skip
    sorted_key, slots = torch.sort(key, stable=True)  # ties keep the flat (b, i, h, k) order
    offsets = torch.empty(ncells + 1, dtype=torch.int64, device=dev)
    launch(_plan_offsets_kernel, (cdiv(ncells + 1, block),),
        sorted_key, offsets, n, ncells, STEPS=max(1, n.bit_length()), BLOCK=block, num_warps=4,
    )  # fmt: skip
    nseg = torch.empty(ncells, dtype=torch.int64, device=dev)
    incl = torch.empty(ncells, dtype=torch.int64, device=dev)
    part_base = torch.empty(ncells, dtype=torch.int64, device=dev)
    launch(_plan_scan_kernel, (1,), offsets, nseg, incl, part_base, ncells, seg, min_seg, BLOCK=block, num_warps=4)
    W = ncells + cdiv(n, seg)
    work_cell = torch.empty(W, dtype=torch.int64, device=dev)
    work_seg = torch.empty(W, dtype=torch.int64, device=dev)
    launch(_plan_work_kernel, (cdiv(W, block),),
        incl, nseg, work_cell, work_seg, W, ncells, STEPS=max(1, ncells.bit_length()), BLOCK=block, num_warps=4,
    )  # fmt: skip
    num_slots = 2 * cdiv(n, seg) + 1  # as `segment_plan`
    return slots, offsets, work_cell, work_seg, nseg, part_base, num_slots


def _long_branch_cells(
    do, q, k, v, o, idx, beta, lse_long, rstd, d_olong, delta_loc, delta_long, dbeta_part,
    dk_long, dv_long, C, s, scale, deterministic, tiles,
):  # fmt: skip
    """The long branch's backward in the "cell" mode (writes d_olong, dq_long, the deltas, the dbeta
    partials and dk / dv_long: zeroed beforehand unless deterministic), chunk of `tiles.long_chunk`
    positions after chunk, in order:
    1. `inverted_slots` of the chunk's idx; work items (cell, segment of `seg` readers);
    2. `_bwd_cell_olong_kernel`: each cell's part of o_long for each of its readers (fp32 parts);
    3. `_bwd_long_rows_kernel`: o_long = sum of a row's K parts, RMSNorm backward, deltas, dbeta;
    4. `_bwd_cell_grad_kernel`: dq parts per reader, dk / dv per cell (+ `_bwd_long_reduce_kernel` for
       cells split into segments, deterministic mode);
    5. with more than one chunk, `_bwd_sum_parts_kernel`: dq_long = sum of a row's K dq parts (the o_long
       parts' buffer reused); with one chunk the local dq kernel sums the parts itself (same order).
    Sums run in fixed orders (slots, readers, segments, chunks): the same bits run to run (no atomics
    unless not deterministic, where split cells add with tl.atomic_add).
    Returns (dq source, LONG_PARTS) for `_bwd_local_dq_kernel`: (parts, K) or (dense fp32 dq_long, 0).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    K = idx.shape[-1]
    ieee = q.dtype == torch.float32
    f32 = dict(device=q.device, dtype=torch.float32)
    ncells = B * Hkv * C
    tc_max = min(T, tiles.long_chunk)
    parts = torch.empty(B * tc_max * Hq * K, D, **f32)  # o_long parts, then dq parts, per (row, slot)
    blocks = dict(BLOCK_D=_pow2(D, 16), BLOCK_C=_pow2(s, 16))
    common = dict(HQ=Hq, HKV=Hkv, D=D, TOPK=K, CELL=s, BLOCK_R=tiles.block_r, SEG=tiles.seg, IEEE=ieee, **blocks)
    rows = dict(HQ=Hq, D=D, TOPK=K, BLOCK_D=blocks["BLOCK_D"], BLOCK_Q=tiles.block_rows, num_warps=8)
    part_dk = part_dv = None
    one_chunk = tc_max == T
    dq_long = None if one_chunk else torch.empty(B, T, Hq, D, **f32)
    for t0 in range(0, T, tc_max):
        tc = min(tc_max, T - t0)
        nr = B * tc * Hq
        if ncells:
            first = t0 == 0 and deterministic  # writes every cell (zeros where unread); later chunks add
            slots, offsets, work_cell, work_seg, nseg, part_base, num_slots = cell_plan(
                idx, t0, tc, Hkv, C, tiles.seg, int(first)
            )
            grid = (work_cell.numel(),)
            launch(_bwd_cell_olong_kernel, grid,
                q, k, v, lse_long, slots, offsets, work_cell, work_seg, parts, T, t0, tc, C, ncells, scale,
                num_warps=tiles.num_warps_long, **common,
            )  # fmt: skip
        launch(_bwd_long_rows_kernel, (cdiv(nr, tiles.block_rows),),
            do, o, idx, parts, beta, rstd, d_olong, delta_loc, delta_long, dbeta_part, T, t0, tc, nr, **rows
        )  # fmt: skip
        if ncells:
            if deterministic and part_dk is None:
                part_dk = torch.empty(num_slots, s, D, **f32)  # num_slots: largest for the first (longest) chunk
                part_dv = torch.empty(num_slots, s, D, **f32)
            accum = int(not first)
            launch(_bwd_cell_grad_kernel, grid,
                q, k, v, d_olong, lse_long, delta_long, slots, offsets, work_cell, work_seg, nseg, part_base, parts,
                dk_long, dv_long, part_dk if deterministic else parts, part_dv if deterministic else parts,
                T, t0, tc, C, ncells, accum, scale, ATOMIC=not deterministic, num_warps=tiles.num_warps_long, **common,
            )  # fmt: skip
            if deterministic:
                launch(_bwd_long_reduce_kernel, (ncells,),
                    nseg, part_base, part_dk, part_dv, dk_long, dv_long, T, C, accum,
                    HKV=Hkv, D=D, CELL=s, num_warps=4, **blocks,
                )  # fmt: skip
        if not one_chunk:
            launch(_bwd_sum_parts_kernel, (cdiv(nr, tiles.block_rows),), idx, parts, dq_long, T, t0, tc, nr, **rows)
    return (parts, K) if one_chunk else (dq_long, 0)


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    idx: torch.Tensor,
    beta: torch.Tensor,
    lse_loc: torch.Tensor,
    lse_long: torch.Tensor,
    rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg,
    deterministic: bool = True,
    tiles: BwdTiles | None = None,
    need_dbeta: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the fused FreeSolo attention (spec §8); a pure function (no autograd.Function).

    Args:
        do: [B, T, Hq, D] gradient of o (any float dtype; read as fp32).
        q: [B, T, Hq, D] unrotated queries; k, v: [B, T, Hkv, D]; same dtype (fp16 / bf16 / fp32).
        o: [B, T, Hq, D] the forward's output.
        idx: int64 / int32 [B, T, Hq, K] selected cells (-1 padded), the forward's.
        beta: fp32 [Hq].
        lse_loc, lse_long, rstd: fp32 [B, Hq, T] saved by the forward (lse_long = -inf: no cell).
        cos, sin: fp32 [T, D/2] half-split RoPE tables (`rope_tables(T, D, cfg.rope_theta, ...)`).
        cfg: FreeSoloConfig (window, cell, top_k, eps are read).
        deterministic: True: inverted selection, no atomics, same bits run to run (default);
            False: the long branch's dk / dv by tl.atomic_add into fp32 buffers (default tiles then
            use long_mode="union": one atomic per element of a query tile's cell, not per query).
        tiles: BwdTiles (default `default_bwd_tiles(D, dtype, device)`).
        need_dbeta: False skips dbeta's reduction (beta needs no gradient: one reduction kernel
            fewer, ~15 us at 4k on the H200) and returns None for it.
    Returns:
        dq [B, T, Hq, D] q.dtype; dk, dv [B, T, Hkv, D] k.dtype; dbeta fp32 [Hq] (None: need_dbeta=False).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    K = idx.shape[-1]
    if D % 2:
        raise ValueError(f"head dim D={D} must be even (RoPE)")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hkv={Hkv}")
    if k.shape != (B, T, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={B}, T={T}, Hkv, D={D}]")
    if q.dtype not in _TL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be one of fp16/bf16/fp32 and equal")
    if idx.shape != (B, T, Hq, K) or K != cfg.top_k:
        raise ValueError(f"idx shape {tuple(idx.shape)} must be [B={B}, T={T}, Hq={Hq}, K={cfg.top_k}]")
    for name, x in (("lse_loc", lse_loc), ("lse_long", lse_long), ("rstd", rstd)):
        if x.shape != (B, Hq, T) or x.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [B={B}, Hq={Hq}, T={T}], got {x.dtype} {tuple(x.shape)}")
    if cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
        raise ValueError(f"cos / sin must be [T={T}, D/2={D // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if tiles is None:
        tiles = _call_bwd_tiles(D, q.dtype, q.device, deterministic)
    dev = q.device
    q, k, v, o, do = (x.contiguous() for x in (q, k, v, o, do))
    idx = idx.contiguous()
    beta = beta.to(device=dev, dtype=torch.float32).contiguous()
    lse_loc, lse_long, rstd = (x.contiguous() for x in (lse_loc, lse_long, rstd))
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    scale = 1.0 / math.sqrt(D)
    s = cfg.cell
    C = T // s
    f32 = dict(device=dev, dtype=torch.float32)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    d_olong = torch.empty_like(q)  # q's dtype: the cell kernel feeds it to tl.dot in that dtype anyway
    delta_loc = torch.empty(B, Hq, T, **f32)
    delta_long = torch.empty(B, Hq, T, **f32)
    dbeta_part = torch.empty(B, Hq, T, **f32)
    has_long = C > 0
    if has_long:
        dk_long = torch.zeros(B, T, Hkv, D, **f32) if not deterministic else torch.empty(B, T, Hkv, D, **f32)
        dv_long = torch.zeros(B, T, Hkv, D, **f32) if not deterministic else torch.empty(B, T, Hkv, D, **f32)
        if deterministic and C * s < T:  # tokens past the last complete cell belong to no cell
            dk_long[:, C * s :].zero_()
            dv_long[:, C * s :].zero_()
    else:
        dk_long = dv_long = d_olong  # placeholders, never read (HAS_LONG False)
    ieee = q.dtype == torch.float32
    dq_long, long_parts = d_olong, 0  # (placeholder when B * T * Hq == 0: no program runs)
    if tiles.long_mode == "cell":
        if B * T * Hq > 0:
            dq_long, long_parts = _long_branch_cells(
                do, q, k, v, o, idx, beta, lse_long, rstd, d_olong, delta_loc, delta_long, dbeta_part,
                dk_long, dv_long, C, s, scale, deterministic, tiles,
            )  # fmt: skip
    elif B * T * Hq > 0:
        dq_long = torch.empty(B, T, Hq, D, **f32)
    if tiles.long_mode == "gather" and B * T * Hq > 0:
        bq = tiles.block_q
        launch(_bwd_long_query_kernel, (cdiv(B * T, bq), Hq),
            do,
            q,
            k,
            v,
            o,
            idx,
            beta,
            lse_long,
            rstd,
            d_olong,
            dq_long,
            delta_loc,
            delta_long,
            dbeta_part,
            dk_long,
            dv_long,
            T,
            B * T,
            scale,
            HQ=Hq,
            HKV=Hkv,
            D=D,
            TOPK=K,
            CELL=s,
            BLOCK_D=_pow2(D),
            BLOCK_KS=_pow2(K * s),
            BLOCK_Q=bq,
            ATOMIC=(not deterministic) and has_long,
            num_warps=tiles.num_warps_long,
        )
    elif tiles.long_mode == "union" and B * T * Hq > 0:
        from .attention import tile_unions

        bu = tiles.block_u
        union, count, _ = tile_unions(idx, bu)
        nt = union.shape[1]
        launch(_bwd_long_tile_kernel, (nt, B * Hq),
            do,
            q,
            k,
            v,
            o,
            idx,
            union,
            count,
            beta,
            lse_long,
            rstd,
            d_olong,
            dq_long,
            delta_loc,
            delta_long,
            dbeta_part,
            dk_long,
            dv_long,
            T,
            nt,
            scale,
            HQ=Hq,
            HKV=Hkv,
            D=D,
            TOPK=K,
            K_P=_pow2(K),
            CELL=s,
            BLOCK_D=_pow2(D, 16),
            BLOCK_C=_pow2(s, 16),
            BLOCK_M=bu,
            IEEE=ieee,
            ATOMIC=(not deterministic) and has_long,
            num_warps=tiles.num_warps_long,
        )
    if has_long and deterministic and tiles.long_mode != "cell":
        readers, offsets = inverted_selection(idx, Hkv, s)
        ncells = B * Hkv * C
        work_cell, work_seg, nseg, part_base, num_slots = segment_plan(offsets, B * T * Hq * K, tiles.seg)
        part_dk = torch.empty(num_slots, s, D, **f32)
        part_dv = torch.empty(num_slots, s, D, **f32)
        blocks = dict(BLOCK_D=_pow2(D, 16), BLOCK_C=_pow2(s, 16))
        launch(_bwd_long_cell_kernel, (work_cell.numel(),),
            q,
            k,
            v,
            d_olong,
            lse_long,
            delta_long,
            readers,
            offsets,
            work_cell,
            work_seg,
            nseg,
            part_base,
            dk_long,
            dv_long,
            part_dk,
            part_dv,
            T,
            C,
            ncells,
            scale,
            HQ=Hq,
            HKV=Hkv,
            D=D,
            CELL=s,
            BLOCK_R=tiles.block_r,
            SEG=tiles.seg,
            IEEE=ieee,
            num_warps=tiles.num_warps_long,
            **blocks,
        )
        launch(_bwd_long_reduce_kernel, (ncells,),
            nseg, part_base, part_dk, part_dv, dk_long, dv_long, T, C, 0, HKV=Hkv, D=D, CELL=s, num_warps=4, **blocks
        )
    half = D // 2
    common = dict(
        HQ=Hq,
        HKV=Hkv,
        HALF=half,
        BLOCK_H=_pow2(half, 16),
        IEEE=ieee,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    w = min(cfg.window, T)  # a window longer than the sequence sees the same keys
    bm, bn = tiles.kv_block_m, tiles.kv_block_n
    # query tiles seeing a key tile [n0, n0+bn): i in [n0, n0+bn-1+w-1], tiles from floor(n0/bm)*bm
    num_m = (bm - 1 + bn - 1 + w - 1) // bm + 1
    if tiles.prerotate:  # rope(q), rope(k) once (fp32 math, one rounding: the values the kernels would make)
        qr, kr = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
    else:
        qr, kr = q, k
    launch(_bwd_local_dkdv_kernel, (cdiv(T, bn), B * Hkv),
        do, qr, kr, v, cos, sin, lse_loc, delta_loc, dk_long, dv_long, dk, dv, T, w, scale,
        BLOCK_M=bm, BLOCK_N=bn, HAS_LONG=has_long, NUM_M=num_m, PREROT=tiles.prerotate, **common,
    )
    bm, bn = tiles.q_block_m, tiles.q_block_n
    # key tiles seen by a query tile [m0, m0+bm): t in [m0-w+1, m0+bm-1], tiles ending at floor((m0+bm-1)/bn)*bn
    num_n = (bn - 1 + bm - 1 + w - 1) // bn + 1
    launch(_bwd_local_dq_kernel, (cdiv(T, bm), B * Hq),
        do, qr, kr, v, cos, sin, lse_loc, delta_loc, dq_long, idx, dq, T, w, scale,
        BLOCK_M=bm, BLOCK_N=bn, NUM_N=num_n, PREROT=tiles.prerotate, LONG_PARTS=long_parts, **common,
    )
    dbeta = dbeta_part.sum(dim=(0, 2)) if need_dbeta else None  # fixed-order reduction (no atomics)
    return dq, dk, dv, dbeta
