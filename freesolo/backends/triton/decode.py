"""Fused Triton decode step (n = 1 new token per row) for FS-L, FS and FS-B over `FreeSoloCache`'s
torch state (`freesolo.streaming.torch_state.TorchCacheState`, FS-B: `streaming.torch_fsb`, spec §9).

Two implementations, chosen by `state.decode_tiles` (`DecodeTiles`; A/B timing in
benchmarks/gpu_decode.py):

"split" (default): two kernels per step, the work of one (row, head) spread over several programs.
- `_split_partials_kernel`, grid (B * Hkv, NW + NL), program (row * Hkv + kv head, j):
  j < NW: window chunk j (`window_chunk` ring slots) for the G query heads of the kv head, read
  once: RoPE at `pos` (read on the device: no host sync), a partial online softmax (m, l, acc);
  chunk 0 also writes the new token into the ring (rotated) and the block buffer (raw) and counts
  it in its partial (slot pos % w still holds token pos - w: masked everywhere).
  j >= NW, FS-L: the long branch of query head j - NW (scores of the <= P+W held cells = C_j,
  top-K by K argmax passes, ties to the larger c, the chosen cells' raw tokens read as one tile,
  softmax, RMSNorm, beta). FS: archive chunk j - NW (`fs_chunk` cells): per query head the
  chunk's cell scores (position prior included) and the chunk's top-K (split-K over cells).
- `_split_finish_kernel`, grid (B * Hq,): merges the window partials; FS-L adds the long
  partial; FS merges the chunks' candidates (the top-K of the union of per-chunk top-K is the
  global top-K: a total order) and does the readout; writes o = o_loc + beta * rmsnorm(o_long);
  then advances the position (nothing else in this kernel reads it), so a step is two launches.
  Rows at different positions: `pos` [B] (one per row) and an optional int8 `active` [B] (rows
  with 0 are left untouched and get zeros).

"single" (the first version): `_fs_score_kernel` (FS only) then `_decode_kernel`, one program per
(row, kv head) doing the window and the long branch of its G heads in sequence; pos += 1 after.
FS-B runs it after its Triton search (`fsb_search.decode_select_cells`): `_decode_kernel` with
CHOSEN reads the K chosen cells instead of taking a top-K.

Rounding points follow the torch path: rotated q / k and the two branch outputs are rounded to
the storage dtype (the torch path runs SDPA in the storage dtype), everything else is float32.
Split sizes are constexprs, never functions of B, T or data (L12: each program touches only its
own batch row).

The block-boundary state update (cells becoming available, FS-L pool) is the torch state's
`_advance` (torch ops, no host sync for FS-L, captured in `DecodeGraph`'s boundary graph), or
with `DecodeTiles(boundary="triton")` (FS-L) one launch of `_fsl_boundary_kernel` (`fsl_boundary`),
which writes only the new cells (same slot layout) and is a no-op for rows not at a boundary.
No `.item()`, no host branch on tensor values: the launch depends only on host-known sizes
(FS: the archive's capacity, which changes only when the store grows at a block boundary).

Use: `FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", decode_kernel="triton")` (or "auto":
triton on CUDA); every `extend` of one token then runs this step, and `cache.decode_graph()`
captures it in a CUDA graph. Rows at different positions (`FreeSoloCache.extend(..., lengths=)`):
FS-L rows are views of one batched state with a position per row, so a decode step of all rows is
still one batched launch (`decode_step(..., pos=, active=)`); FS keeps one batch-1 state per row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import launch
from .backend import on_device_of

__all__ = ["decode_step", "decode_supported_reasons", "fsl_boundary"]


# ---- kernels --------------------------------------------------------------------------------
# Reductions call `tl.reduce` with triton's own combine functions: the same code as tl.sum /
# tl.max when compiled, and the interpreter's numpy fast path (tl.sum / tl.max are jit functions
# whose every call costs the interpreter ~10 ms of patching).
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _fs_score_kernel(
    q_ptr,
    pos_ptr,
    kbar_ptr,
    a_ptr,
    sigma_ptr,
    lam_ptr,
    part_score_ptr,
    part_id_ptr,
    stride_qb,
    stride_qh,
    scale,
    CAP: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    QBLOCK: tl.constexpr,
    TOPK: tl.constexpr,
    NCHUNK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """FS: per (b, kv head, chunk of CHUNK cells) and query head, the chunk's top-K candidates.

    q [B, 1, Hq, D] (strides stride_qb, stride_qh, 1); kbar [B, Hkv, CAP, D], a [B, Hkv, CAP]
    (float32); sigma, lam [Hq] float32. Writes part_score [B, Hq, NCHUNK*TOPK] float32 (-inf = none)
    and part_id [B, Hq, NCHUNK*TOPK] int64 (cell id, -1 = none). Available cells:
    c < n_avail = (pos // QBLOCK) * QBLOCK // CELL.
    """
    pid = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    b = pid // HKV
    kvh = pid % HKV
    pos = tl.load(pos_ptr)
    n_avail = (pos // QBLOCK) * QBLOCK // CELL
    cells = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)  # [CHUNK]
    valid = (cells < n_avail) & (cells < CAP)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = pid * CAP + cells  # [CHUNK]
    kbar = tl.load(kbar_ptr + row[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    a = tl.load(a_ptr + row, mask=valid, other=0.0)
    dist = (pos - cells * CELL).to(tl.float32)  # i - p_c
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        sigma = tl.load(sigma_ptr + h)
        lam = tl.load(lam_ptr + h)
        dots = tl.reduce(kbar * q[None, :], 1, _ADD)  # [CHUNK]
        prior = tl.math.erf(sigma * dist / (2.0 * CELL))
        sc = dots * scale + lam * a * prior
        sc = tl.where(valid, sc, float("-inf"))
        base = (b * (HKV * G) + h) * (NCHUNK * TOPK) + chunk * TOPK
        for kk in tl.static_range(TOPK):
            # argmax pass: best score, then the larger cell; then remove it
            best = tl.reduce(sc, 0, _MAX)
            best_id = tl.reduce(tl.where(sc == best, cells, -1), 0, _MAX)
            sc = tl.where(cells == best_id, float("-inf"), sc)
            ok = best > float("-inf")
            tl.store(part_score_ptr + base + kk, best)
            tl.store(part_id_ptr + base + kk, tl.where(ok, best_id, -1))


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    out_ptr,
    pos_ptr,
    inv_freq_ptr,
    sigma_ptr,
    lam_ptr,
    ring_k_ptr,
    ring_v_ptr,
    block_k_ptr,
    block_v_ptr,
    ids_ptr,
    kbar_ptr,
    a_ptr,
    cell_k_ptr,
    cell_v_ptr,
    part_score_ptr,
    part_id_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_ob,
    stride_oh,
    scale,
    eps,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    QBLOCK: tl.constexpr,
    CELL: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    SLOTS: tl.constexpr,
    FS: tl.constexpr,
    NPART: tl.constexpr,
    CHOSEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
):
    """One decode token for (b, kv head) = program 0 axis and its G query heads.

    q [B, 1, Hq, D], k / v [B, 1, Hkv, D] (storage dtype, last stride 1); beta [Hq]; out
    [B, 1, Hq, D]; pos [] int64; inv_freq [D/2] float64; sigma, lam [Hq] float32;
    ring_k / ring_v [B, Hkv, WINDOW, D]; block_k / block_v [B, Hkv, QBLOCK, D];
    ids [B, Hkv, SLOTS] int64; kbar [B, Hkv, SLOTS, D], a [B, Hkv, SLOTS] float32;
    cell_k / cell_v [B, Hkv, SLOTS, CELL, D].
    FS-L (FS=False): candidates = the SLOTS held cells (id >= 0). FS (FS=True): candidates =
    part_score / part_id [B, Hq, NPART] from `_fs_score_kernel`, slot = cell id.
    FS-B (FS=True, CHOSEN=True): part_id [B, Hq, TOPK] holds the chosen cells themselves (the
    Triton search's, by rank, -1 padded; slot = cell id); part_score is not read.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    kvh = pid % HKV
    dtype = ring_k_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    pos = tl.load(pos_ptr)

    # RoPE at pos: element d pairs with d +- D/2 (rotate_half); angles in float64
    dh = tl.where(d < HALF, d, d - HALF)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    inv_freq = tl.load(inv_freq_ptr + dh, mask=dmask, other=0.0)
    angle = pos.to(tl.float64) * inv_freq
    cos = tl.cos(angle).to(tl.float32)
    sin = tl.sin(angle).to(tl.float32)

    # the new token: rotated key into the ring, raw key / value into the block buffer
    k_row = k_ptr + b * stride_kb + kvh * stride_kh
    k_new = tl.load(k_row + d, mask=dmask, other=0.0)
    k_par = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask, other=0.0)
    k_rot = (k_new.to(tl.float32) * cos + sign * k_par * sin).to(dtype)
    w_slot = pos % WINDOW
    b_slot = pos % QBLOCK
    tl.store(ring_k_ptr + (pid * WINDOW + w_slot) * D + d, k_rot, mask=dmask)
    tl.store(ring_v_ptr + (pid * WINDOW + w_slot) * D + d, v_new.to(dtype), mask=dmask)
    tl.store(block_k_ptr + (pid * QBLOCK + b_slot) * D + d, k_new.to(dtype), mask=dmask)
    tl.store(block_v_ptr + (pid * QBLOCK + b_slot) * D + d, v_new.to(dtype), mask=dmask)
    k_rot = k_rot.to(tl.float32)
    v_new = v_new.to(tl.float32)

    slots = tl.arange(0, BLOCK_S)
    rows = tl.arange(0, TOPK_P2 * BLOCK_CELL)
    row_cell = rows // BLOCK_CELL  # which chosen cell (0 .. TOPK-1; >= TOPK: padding): FS-B's chosen rows

    for g in range(G):
        h = kvh * G + g
        q_row = q_ptr + b * stride_qb + h * stride_qh
        q_raw = tl.load(q_row + d, mask=dmask, other=0.0)
        q_par = tl.load(q_row + partner, mask=dmask, other=0.0).to(tl.float32)
        q_rot = (q_raw.to(tl.float32) * cos + sign * q_par * sin).to(dtype).to(tl.float32)
        q = q_raw.to(tl.float32)

        # ---- local branch: the new token, then the ring's other slots --------------------------
        m_i = tl.reduce(q_rot * k_rot, 0, _ADD) * scale
        l_i = tl.full([], 1.0, tl.float32)
        acc = v_new
        for w0 in range(0, WINDOW, BLOCK_W):
            u = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
            held_pos = pos - ((pos - u) % WINDOW + WINDOW) % WINDOW  # position in slot u
            ok = (u < WINDOW) & (u != w_slot) & (held_pos >= 0)
            off = (pid * WINDOW + u)[:, None] * D + d[None, :]
            kt = tl.load(ring_k_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            vt = tl.load(ring_v_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            logit = tl.where(ok, tl.reduce(kt * q_rot[None, :], 1, _ADD) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(logit, 0, _MAX))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(logit - m_new)
            l_i = l_i * alpha + tl.reduce(p, 0, _ADD)
            acc = acc * alpha + tl.reduce(p[:, None] * vt, 0, _ADD)
            m_i = m_new
        o_loc = (acc / l_i).to(dtype).to(tl.float32)

        # ---- long branch: candidates' scores, top-K, sparse NoPE readout -------------------------
        if FS:
            pbase = (b * (HKV * G) + h) * NPART
            if not CHOSEN:
                sc = tl.load(part_score_ptr + pbase + slots, mask=slots < NPART, other=float("-inf"))
                cid = tl.load(part_id_ptr + pbase + slots, mask=slots < NPART, other=-1)
        else:  # FS-L: the held cells (loaded per head: fewer live registers in the window loop)
            sc, cid = _fsl_cell_scores(ids_ptr, kbar_ptr, a_ptr, sigma_ptr, lam_ptr, pid, SLOTS, slots, q, pos, h, scale, D, CELL, BLOCK_D)
        # selection: TOPK argmax passes; the chosen cells' slots go to the rows of one token tile
        # (row r = token r % BLOCK_CELL of the (r // BLOCK_CELL)-th chosen cell), read in one load
        if CHOSEN:  # FS-B: the cells are chosen already; -1 = none
            row_slot = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int64)
            row_len = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int32)  # tokens of the row's cell: CELL, 0 = none
            for kk in tl.static_range(TOPK):
                chosen = tl.load(part_id_ptr + pbase + kk)
                row_slot = tl.where(row_cell == kk, tl.maximum(chosen, 0), row_slot)
                row_len = tl.where(row_cell == kk, tl.where(chosen >= 0, CELL, 0), row_len)
        else:
            row_slot, row_len = _top_k_rows(sc, cid, slots, FS, CELL, TOPK, TOPK_P2, BLOCK_CELL)
        beta = tl.load(beta_ptr + h).to(tl.float32)
        out = o_loc + _cells_readout(
            row_slot, row_len, q, cell_k_ptr, cell_v_ptr, pid, beta, scale, eps, SLOTS, dtype, D, CELL, TOPK_P2,
            BLOCK_D, BLOCK_CELL,
        )  # fmt: skip
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


# ---- the long branch of one query head (the single and the split step) -------------------------
@triton.jit
def _fsl_cell_scores(ids_ptr, kbar_ptr, a_ptr, sigma_ptr, lam_ptr, kv_row, n_slots, slots, q, pos, h, scale,
                     D: tl.constexpr, CELL: tl.constexpr, BLOCK_D: tl.constexpr):
    """FS-L: (scores [BLOCK_S] float32, -inf = an empty slot; cell ids [BLOCK_S] int64) of the
    n_slots held cells of store row kv_row = b * Hkv + kv head for query head h: q . kbar * scale +
    lam * a * erf(sigma * (pos - c * CELL) / (2 * CELL)) (spec §4). q [BLOCK_D] float32 unrotated."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    ids = tl.load(ids_ptr + kv_row * n_slots + slots, mask=slots < n_slots, other=-1)
    held = ids >= 0
    kbar = tl.load(
        kbar_ptr + (kv_row * n_slots + slots)[:, None] * D + d[None, :],
        mask=held[:, None] & dmask[None, :],
        other=0.0,
    )
    a = tl.load(a_ptr + kv_row * n_slots + slots, mask=held, other=0.0)
    dist = (pos - ids * CELL).to(tl.float32)
    sigma = tl.load(sigma_ptr + h)
    lam = tl.load(lam_ptr + h)
    dots = tl.reduce(kbar * q[None, :], 1, _ADD)
    prior = tl.math.erf(sigma * dist / (2.0 * CELL))
    return tl.where(held, dots * scale + lam * a * prior, float("-inf")), ids


@triton.jit
def _top_k_rows(sc, cid, slots, SLOT_IS_ID: tl.constexpr, CELL: tl.constexpr, TOPK: tl.constexpr,
                TOPK_P2: tl.constexpr, BLOCK_CELL: tl.constexpr):
    """Top-K of the candidates by K argmax passes (score desc, then the larger cell) as the rows of
    one token tile: row r holds token r % BLOCK_CELL of the (r // BLOCK_CELL)-th chosen cell.
    sc [BLOCK_S] float32 scores (-inf = none), cid [BLOCK_S] int64 cell ids, slots [BLOCK_S] their
    store slots (SLOT_IS_ID: the slot is the cell id). Returns (row_slot int64, row_len int32:
    CELL, or 0 where the row's cell is none) [TOPK_P2 * BLOCK_CELL]."""
    rows = tl.arange(0, TOPK_P2 * BLOCK_CELL)
    row_cell = rows // BLOCK_CELL  # which chosen cell (0 .. TOPK-1; >= TOPK: padding)
    row_slot = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int64)
    row_len = tl.zeros([TOPK_P2 * BLOCK_CELL], tl.int32)
    for kk in tl.static_range(TOPK):
        best = tl.reduce(sc, 0, _MAX)  # best score, then the larger cell
        best_id = tl.reduce(tl.where(sc == best, cid, -1), 0, _MAX)
        sc = tl.where((cid == best_id) & (sc == best), float("-inf"), sc)
        ok = best > float("-inf")
        if SLOT_IS_ID:
            slot = best_id
        else:
            slot = tl.reduce(tl.where(cid == best_id, slots.to(tl.int64), -1), 0, _MAX)
        row_slot = tl.where(row_cell == kk, tl.where(ok, slot, 0), row_slot)
        row_len = tl.where(row_cell == kk, tl.where(ok, CELL, 0), row_len)
    return row_slot, row_len


@triton.jit
def _cells_readout(row_slot, row_len, q, cell_k_ptr, cell_v_ptr, kv_row, beta, scale, eps, n_slots,
                   dtype: tl.constexpr, D: tl.constexpr, CELL: tl.constexpr, TOPK_P2: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_CELL: tl.constexpr):
    """beta * rmsnorm(o_long) [BLOCK_D] float32: the sparse NoPE readout of the chosen cells' raw
    tokens (`_top_k_rows`' tile, one softmax; q [BLOCK_D] float32 unrotated) from the store row
    kv_row = b * Hkv + kv head of n_slots slots; o_long rounded to the storage dtype as the torch
    path's SDPA output."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row_tok = tl.arange(0, TOPK_P2 * BLOCK_CELL) % BLOCK_CELL  # token inside the row's cell
    live = row_tok < row_len
    off = ((kv_row * n_slots + row_slot) * CELL + row_tok)[:, None] * D + d[None, :]
    lmask = live[:, None] & dmask[None, :]
    kt = tl.load(cell_k_ptr + off, mask=lmask, other=0.0).to(tl.float32)
    vt = tl.load(cell_v_ptr + off, mask=lmask, other=0.0).to(tl.float32)
    logit = tl.where(live, tl.reduce(kt * q[None, :], 1, _ADD) * scale, float("-inf"))
    m_l = tl.maximum(tl.reduce(logit, 0, _MAX), -1.0e30)  # finite when no cell is chosen
    p = tl.exp(logit - m_l)
    l_l = tl.reduce(p, 0, _ADD)
    acc_l = tl.reduce(p[:, None] * vt, 0, _ADD)
    o_long = tl.where(l_l > 0.0, acc_l / tl.maximum(l_l, 1e-30), 0.0).to(dtype).to(tl.float32)
    ms = tl.reduce(o_long * o_long, 0, _ADD) / D
    return beta * (o_long * (1.0 / tl.sqrt(ms + eps)))


@triton.jit
def _long_branch(
    sc,
    cid,
    slots,
    q,
    cell_k_ptr,
    cell_v_ptr,
    kv_row,
    beta,
    scale,
    eps,
    n_slots,
    dtype: tl.constexpr,
    SLOT_IS_ID: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
):
    """beta * rmsnorm(o_long) [BLOCK_D] float32 of one query head: `_top_k_rows` of the candidates
    (sc, cid, slots), then `_cells_readout` of the chosen cells (kv_row = b * Hkv + kv head,
    n_slots: the store's slots)."""
    row_slot, row_len = _top_k_rows(sc, cid, slots, SLOT_IS_ID, CELL, TOPK, TOPK_P2, BLOCK_CELL)
    return _cells_readout(
        row_slot, row_len, q, cell_k_ptr, cell_v_ptr, kv_row, beta, scale, eps, n_slots, dtype, D, CELL, TOPK_P2,
        BLOCK_D, BLOCK_CELL,
    )  # fmt: skip


# ---- split step: the work of one (row, head) spread over several programs ---------------------
@triton.jit
def _split_partials_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    pos_ptr,
    inv_freq_ptr,
    sigma_ptr,
    lam_ptr,
    ring_k_ptr,
    ring_v_ptr,
    block_k_ptr,
    block_v_ptr,
    ids_ptr,
    kbar_ptr,
    a_ptr,
    cell_k_ptr,
    cell_v_ptr,
    win_ml_ptr,
    win_acc_ptr,
    long_ptr,
    part_score_ptr,
    part_id_ptr,
    active_ptr,
    pos_stride,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    scale,
    eps,
    n_slots,
    n_chunk,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    QBLOCK: tl.constexpr,
    CELL: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    FS: tl.constexpr,
    NW: tl.constexpr,
    WCHUNK: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
):
    """Split step, part 1. Grid (B * Hkv, NW + NL); program (b * Hkv + kv head, j):

    - j < NW: window chunk j, ring slots [j * WCHUNK, (j + 1) * WCHUNK), for the G query heads of
      the kv head (the chunk's keys / values are read once): partial online softmax (m, l, acc)
      -> win_ml [B * Hq, NW, 2], win_acc [B * Hq, NW, D] (float32). Chunk 0 also holds the new
      token (from registers) and writes it into the ring (rotated) and the block buffer (raw).
    - j >= NW, FS-L: the long branch of query head kv head * G + (j - NW): scores of the <= P+W
      held cells, top-K, sparse readout, RMSNorm, beta -> long [B * Hq, D] float32.
    - j >= NW, FS: archive cells [(j - NW) * CHUNK, ...): per query head the chunk's top-K
      candidates -> part_score / part_id [B * Hq, n_chunk * TOPK] (-inf / -1 = none).

    Rows at different positions: pos [B] (pos_stride 1; 0: one pos [] for every row) and, with
    HAS_ACTIVE, active [B] int8: a row with 0 writes nothing (its ring and block buffer stay).
    Shapes as `_decode_kernel`, with n_slots store slots (a runtime int: FS's capacity changes
    without a recompile). The split sizes are constexprs (never B, T or data): L12-safe.
    """
    pid = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b = pid // HKV
    kvh = pid % HKV
    HQ: tl.constexpr = HKV * G
    dtype = ring_k_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    pos = tl.load(pos_ptr + b * pos_stride)
    if j < NW:
        HALF: tl.constexpr = D // 2
        dh = tl.where(d < HALF, d, d - HALF)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
        inv_freq = tl.load(inv_freq_ptr + dh, mask=dmask, other=0.0)
        angle = pos.to(tl.float64) * inv_freq
        cos = tl.cos(angle).to(tl.float32)
        sin = tl.sin(angle).to(tl.float32)
        first = j == 0
        k_row = k_ptr + b * stride_kb + kvh * stride_kh
        k_new = tl.load(k_row + d, mask=dmask, other=0.0)
        k_par = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
        v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=dmask, other=0.0)
        k_rot = (k_new.to(tl.float32) * cos + sign * k_par * sin).to(dtype)
        w_slot = pos % WINDOW
        b_slot = pos % QBLOCK
        smask = dmask & first
        if HAS_ACTIVE:
            smask = smask & (tl.load(active_ptr + b) != 0)
        tl.store(ring_k_ptr + (pid * WINDOW + w_slot) * D + d, k_rot, mask=smask)
        tl.store(ring_v_ptr + (pid * WINDOW + w_slot) * D + d, v_new.to(dtype), mask=smask)
        tl.store(block_k_ptr + (pid * QBLOCK + b_slot) * D + d, k_new.to(dtype), mask=smask)
        tl.store(block_v_ptr + (pid * QBLOCK + b_slot) * D + d, v_new.to(dtype), mask=smask)
        k_rot = k_rot.to(tl.float32)
        v_new = v_new.to(tl.float32)
        # the chunk's ring slots (slot pos % w holds token pos - w, outside the window: masked;
        # the other programs never read the slot chunk 0 writes)
        u = j * WCHUNK + tl.arange(0, WCHUNK).to(tl.int64)
        held_pos = pos - ((pos - u) % WINDOW + WINDOW) % WINDOW  # position in slot u
        ok = (u < WINDOW) & (u != w_slot) & (held_pos >= 0)
        off = (pid * WINDOW + u)[:, None] * D + d[None, :]
        kt = tl.load(ring_k_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        vt = tl.load(ring_v_ptr + off, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        for g in range(G):
            h = kvh * G + g
            q_row = q_ptr + b * stride_qb + h * stride_qh
            q_raw = tl.load(q_row + d, mask=dmask, other=0.0)
            q_par = tl.load(q_row + partner, mask=dmask, other=0.0).to(tl.float32)
            q_rot = (q_raw.to(tl.float32) * cos + sign * q_par * sin).to(dtype).to(tl.float32)
            m0 = tl.where(first, tl.reduce(q_rot * k_rot, 0, _ADD) * scale, -1.0e30)  # finite: no inf - inf
            logit = tl.where(ok, tl.reduce(kt * q_rot[None, :], 1, _ADD) * scale, float("-inf"))
            m = tl.maximum(m0, tl.reduce(logit, 0, _MAX))
            alpha = tl.exp(m0 - m)
            p = tl.exp(logit - m)
            l_i = tl.where(first, 1.0, 0.0) * alpha + tl.reduce(p, 0, _ADD)
            acc = tl.where(first, v_new, 0.0) * alpha + tl.reduce(p[:, None] * vt, 0, _ADD)
            row = (b * HQ + h) * NW + j
            tl.store(win_ml_ptr + row * 2, m)
            tl.store(win_ml_ptr + row * 2 + 1, l_i)
            tl.store(win_acc_ptr + row * D + d, acc, mask=dmask)
    else:
        if FS:  # score a chunk of the archive for the G query heads, keep each head's top-K
            chunk = (j - NW).to(tl.int64)
            n_avail = (pos // QBLOCK) * QBLOCK // CELL
            cells = chunk * CHUNK + tl.arange(0, CHUNK).to(tl.int64)  # [CHUNK]
            valid = (cells < n_avail) & (cells < n_slots)
            crow = pid * n_slots + cells
            kbar = tl.load(kbar_ptr + crow[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            a = tl.load(a_ptr + crow, mask=valid, other=0.0)
            dist = (pos - cells * CELL).to(tl.float32)  # i - p_c
            for g in range(G):
                h = kvh * G + g
                q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
                sigma = tl.load(sigma_ptr + h)
                lam = tl.load(lam_ptr + h)
                dots = tl.reduce(kbar * q[None, :], 1, _ADD)  # [CHUNK]
                prior = tl.math.erf(sigma * dist / (2.0 * CELL))
                sc = tl.where(valid, dots * scale + lam * a * prior, float("-inf"))
                base = (b * HQ + h) * (n_chunk * TOPK) + chunk * TOPK
                for kk in tl.static_range(TOPK):
                    best = tl.reduce(sc, 0, _MAX)  # best score, then the larger cell
                    best_id = tl.reduce(tl.where(sc == best, cells, -1), 0, _MAX)
                    sc = tl.where(cells == best_id, float("-inf"), sc)
                    tl.store(part_score_ptr + base + kk, best)
                    tl.store(part_id_ptr + base + kk, tl.where(best > float("-inf"), best_id, -1))
        else:  # FS-L: the long branch of one query head over the held cells
            h = kvh * G + (j - NW)
            q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
            slots = tl.arange(0, BLOCK_S)
            sc, ids = _fsl_cell_scores(
                ids_ptr, kbar_ptr, a_ptr, sigma_ptr, lam_ptr, pid, n_slots, slots, q, pos, h, scale, D, CELL, BLOCK_D
            )
            beta = tl.load(beta_ptr + h).to(tl.float32)
            out = _long_branch(
                sc, ids, slots, q, cell_k_ptr, cell_v_ptr, pid, beta, scale, eps, n_slots,
                dtype, False, D, CELL, TOPK, TOPK_P2, BLOCK_D, BLOCK_CELL,
            )  # fmt: skip
            tl.store(long_ptr + (b * HQ + h) * D + d, out, mask=dmask)


@triton.jit
def _split_finish_kernel(
    q_ptr,
    beta_ptr,
    out_ptr,
    pos_ptr,
    cell_k_ptr,
    cell_v_ptr,
    win_ml_ptr,
    win_acc_ptr,
    long_ptr,
    part_score_ptr,
    part_id_ptr,
    active_ptr,
    pos_stride,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    scale,
    eps,
    n_slots,
    n_part,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    CELL: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    FS: tl.constexpr,
    NW: tl.constexpr,
    NW_P2: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
):
    """Split step, part 2. Grid (B * Hq,); program b * Hq + h: merges the NW window partials
    (o_loc rounded to the storage dtype, as the torch path's SDPA output); FS-L: adds the long
    partial; FS: merges the chunks' candidates (top-K of the union of per-chunk top-K = the
    global top-K: a total order), reads the chosen cells, RMSNorm, beta. Writes out [B, 1, Hq, D]; then advances
    pos (pos [] by program 0; pos [B] (pos_stride 1) by each row's head 0; nothing else in this
    kernel reads it). With HAS_ACTIVE, an inactive row gets zeros and keeps its pos."""
    pid = tl.program_id(0).to(tl.int64)
    HQ: tl.constexpr = HKV * G
    b = pid // HQ
    h = pid % HQ
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    dtype = out_ptr.dtype.element_ty
    r = tl.arange(0, NW_P2)
    rmask = r < NW
    m = tl.load(win_ml_ptr + (pid * NW + r) * 2, mask=rmask, other=-1.0e30)
    l_r = tl.load(win_ml_ptr + (pid * NW + r) * 2 + 1, mask=rmask, other=0.0)
    acc_off = (pid * NW + r)[:, None] * D + d[None, :]
    acc = tl.load(win_acc_ptr + acc_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_all = tl.reduce(m, 0, _MAX)
    wgt = tl.exp(m - m_all)
    l_all = tl.reduce(l_r * wgt, 0, _ADD)
    o_loc = (tl.reduce(acc * wgt[:, None], 0, _ADD) / l_all).to(dtype).to(tl.float32)
    if FS:
        slots = tl.arange(0, BLOCK_S)
        pmask = slots < n_part
        sc = tl.load(part_score_ptr + pid * n_part + slots, mask=pmask, other=float("-inf"))
        cid = tl.load(part_id_ptr + pid * n_part + slots, mask=pmask, other=-1)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + h).to(tl.float32)
        long = _long_branch(
            sc, cid, slots, q, cell_k_ptr, cell_v_ptr, b * HKV + h // G, beta, scale, eps, n_slots,
            dtype, True, D, CELL, TOPK, TOPK_P2, BLOCK_D, BLOCK_CELL,
        )  # fmt: skip
    else:
        long = tl.load(long_ptr + pid * D + d, mask=dmask, other=0.0)
    out = o_loc + long
    advance = (h == 0) & ((b == 0) | (pos_stride != 0))
    if HAS_ACTIVE:
        act = tl.load(active_ptr + b) != 0
        out = tl.where(act, out, 0.0)
        advance = advance & act
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(dtype), mask=dmask)
    if advance:
        tl.store(pos_ptr + b * pos_stride, tl.load(pos_ptr + b * pos_stride) + 1)


@triton.jit
def _fsl_boundary_kernel(
    pos_ptr,
    active_ptr,
    pos_stride,
    block_k_ptr,
    block_v_ptr,
    ids_ptr,
    kbar_ptr,
    a_ptr,
    cell_k_ptr,
    cell_v_ptr,
    n_slots,
    HKV: tl.constexpr,
    D: tl.constexpr,
    QBLOCK: tl.constexpr,
    CELL: tl.constexpr,
    RECENT: tl.constexpr,
    M: tl.constexpr,
    M_P2: tl.constexpr,
    S_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_CELL: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    """FS-L block boundary on the device, grid (B * Hkv,): a no-op unless the row's pos > 0 is a
    multiple of QBLOCK (and the row is active). Then the M = QBLOCK / CELL cells of the finished
    block (block buffer [B, Hkv, QBLOCK, D], raw keys / values) get their statistics (kbar = mean,
    a = max norm, float32), the union of the n_slots held cells and the new ones is ranked by
    (recent first, then a, then larger id; spec §5; empty slots by slot, as torch's stable sorts)
    and the top n_slots are kept, with the torch state's slot-stable layout
    (`TorchCacheState._advance`): kept cells stay, the kept new cells
    (in id order) fill the freed slots (in slot order), other freed slots get id -1. Only the new
    cells' tokens move (block buffer -> store). pos / active as `_split_partials_kernel`.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    pos = tl.load(pos_ptr + b * pos_stride)
    go = (pos > 0) & (pos % QBLOCK == 0)
    if HAS_ACTIVE:
        go = go & (tl.load(active_ptr + b) != 0)
    if go:
        n_avail = pos // CELL
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        t = tl.arange(0, BLOCK_CELL)
        tmask = t < CELL
        jm = tl.arange(0, M_P2)
        jvalid = jm < M
        new_ids = n_avail - M + jm.to(tl.int64)  # [M_P2]
        new_a = tl.zeros([M_P2], tl.float32)
        for j in tl.static_range(M):
            off = (pid * QBLOCK + j * CELL + t)[:, None] * D + d[None, :]
            x = tl.load(block_k_ptr + off, mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            norm = tl.sqrt(tl.reduce(x * x, 1, _ADD))  # [BLOCK_CELL] (padding rows: 0 <= any norm)
            new_a = tl.where(jm == j, tl.reduce(norm, 0, _MAX), new_a)
        s = tl.arange(0, S_P2)
        svalid = s < n_slots
        ids = tl.load(ids_ptr + pid * n_slots + s, mask=svalid, other=-1)
        a = tl.load(a_ptr + pid * n_slots + s, mask=svalid, other=0.0)
        thr = n_avail - RECENT
        # The key of `TorchCacheState._advance`: recent inf, then a, empty -inf; but while
        # n_avail < RECENT (paper config: the first boundary, n_avail = 4 < 8) an empty slot's id -1
        # is >= thr, so empty slots key inf too (every cell still outranks them by id). Padding
        # slots (s >= n_slots) key -inf.
        key_s = tl.where(svalid & (ids >= thr), float("inf"), tl.where(svalid & (ids >= 0), a, float("-inf")))
        key_n = tl.where(jvalid, tl.where(new_ids >= thr, float("inf"), new_a), float("-inf"))  # [M_P2]
        # rank in the union = entries ahead by (key desc, id desc, slot asc): a total order, as torch's
        # stable sorts. Cell ids are unique, so equal (key, id) only occurs between empty slots; without
        # the slot tie-break (issue 12) those got one shared rank: none ranked >= n_slots, so at a
        # boundary with n_avail < RECENT no slot was freed and the new cells were dropped for ever.
        ahead_ss = (key_s[None, :] > key_s[:, None]) | (
            (key_s[None, :] == key_s[:, None])
            & ((ids[None, :] > ids[:, None]) | ((ids[None, :] == ids[:, None]) & (s[None, :] < s[:, None])))
        )
        ahead_sn = (key_n[None, :] > key_s[:, None]) | (
            (key_n[None, :] == key_s[:, None]) & (new_ids[None, :] > ids[:, None])
        )
        rank_s = tl.reduce(ahead_ss.to(tl.int32), 1, _ADD) + tl.reduce(ahead_sn.to(tl.int32), 1, _ADD)
        ahead_ns = (key_s[None, :] > key_n[:, None]) | (
            (key_s[None, :] == key_n[:, None]) & (ids[None, :] > new_ids[:, None])
        )
        ahead_nn = (key_n[None, :] > key_n[:, None]) | (
            (key_n[None, :] == key_n[:, None]) & (new_ids[None, :] > new_ids[:, None])
        )
        rank_n = tl.reduce(ahead_ns.to(tl.int32), 1, _ADD) + tl.reduce(ahead_nn.to(tl.int32), 1, _ADD)
        freed = svalid & ((rank_s >= n_slots) | (key_s == float("-inf")))
        kept_n = jvalid & (rank_n < n_slots)
        fidx = tl.cumsum(freed.to(tl.int32), 0) - 1  # order of a freed slot among the freed
        nidx = tl.cumsum(kept_n.to(tl.int32), 0) - 1  # order of a kept new cell among them
        match = freed[:, None] & kept_n[None, :] & (fidx[:, None] == nidx[None, :])  # [S_P2, M_P2]
        got = tl.reduce(tl.where(match, jm[None, :], -1), 1, _MAX) >= 0  # the slot receives a new cell
        got_id = tl.reduce(tl.where(match, new_ids[None, :], -1), 1, _MAX)
        got_a = tl.reduce(tl.where(match, new_a[None, :], 0.0), 1, _ADD)
        tl.store(ids_ptr + pid * n_slots + s, tl.where(freed, got_id, ids), mask=svalid)
        tl.store(a_ptr + pid * n_slots + s, tl.where(got, got_a, a), mask=svalid)
        dest = tl.reduce(tl.where(match, s[:, None], -1), 0, _MAX)  # [M_P2]: slot of each kept new cell
        for j in tl.static_range(M):
            dj = tl.reduce(tl.where(jm == j, dest, -1), 0, _MAX).to(tl.int64)
            ok = dj >= 0
            lmask = tmask[:, None] & dmask[None, :] & ok
            src = (pid * QBLOCK + j * CELL + t)[:, None] * D + d[None, :]
            dst = ((pid * n_slots + dj) * CELL + t)[:, None] * D + d[None, :]
            x = tl.load(block_k_ptr + src, mask=lmask, other=0.0)
            y = tl.load(block_v_ptr + src, mask=lmask, other=0.0)
            tl.store(cell_k_ptr + dst, x, mask=lmask)
            tl.store(cell_v_ptr + dst, y, mask=lmask)
            kbar = tl.reduce(x.to(tl.float32), 0, _ADD) / CELL
            tl.store(kbar_ptr + (pid * n_slots + dj) * D + d, kbar, mask=dmask & ok)


# ---- host launcher --------------------------------------------------------------------------
def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def decode_supported_reasons(state) -> list[str]:
    """Why the fused step cannot run this torch state ([] when it can)."""
    reasons = []
    if state.cfg.variant not in ("fs", "fsl", "fsb"):
        reasons.append(f"variant={state.cfg.variant!r}: the fused decode implements 'fs', 'fsl' and 'fsb'")
    if state.cfg.variant == "fsb" and state.decode_tiles.impl != "single":
        reasons.append(f"variant='fsb' runs DecodeTiles(impl='single'), not {state.decode_tiles.impl!r}")
    if state.allocated:
        if state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype={state.dtype}: the fused decode runs float32 / bfloat16 / float16")
        if state.device.type != "cuda" and not _interpreting():
            reasons.append(f"device={state.device}: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU tensors)")
    return reasons


def _interpreting() -> bool:
    from .backend import interpreting

    return interpreting()


def _fs_chunk(cap: int) -> int:
    """Cells per program of `_fs_score_kernel`: 128, more when the archive would need > 2048 chunks."""
    return max(min(128, _pow2(cap)), _pow2(-(-cap // 2048)))


def _scratch(state, n_part: int):
    """FS partial candidates [B, Hq, n_part] (score float32, id int64), reused while the size holds."""
    cached = getattr(state, "_triton_fs_scratch", None)
    shape = (state.B, state.Hq, n_part)
    if cached is None or tuple(cached[0].shape) != shape or cached[0].device != state.device:
        score = torch.empty(state.B, state.Hq, n_part, dtype=torch.float32, device=state.device)
        ids = torch.empty(state.B, state.Hq, n_part, dtype=torch.int64, device=state.device)
        cached = (score, ids)
        state._triton_fs_scratch = cached
    return cached


def _float32_params(state):
    """sigma, lam [Hq] float32 (cached on the state: they never change)."""
    cached = getattr(state, "_triton_params", None)
    if cached is None or cached[0].device != state.device:  # (a re-allocated state may move)
        cached = tuple(x.reshape(-1).to(torch.float32).contiguous() for x in (state.sigma, state.lam))
        state._triton_params = cached
    return cached


def decode_step(
    state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, out=None, pos=None, active=None
) -> torch.Tensor:
    """The fused one-token step of a `TorchCacheState` (FS-L or FS), without host sync.

    Args:
        state: an allocated `TorchCacheState` whose block boundary (if any) was applied already;
            `state.decode_tiles` (a `DecodeTiles`) picks the kernels ("split" or "single").
        q: [B, 1, Hq, D]; k, v: [B, 1, Hkv, D] (storage dtype, last dim contiguous).
        beta: [Hq] long-range mixing coefficient (any float dtype, same device).
        out: optional [B, 1, Hq, D] tensor of the storage dtype to write (default: a new one).
        pos: optional int64 [B] on the device: each row's position (rows at different positions;
            "split" only); default `state.pos` [] for every row.
        active: optional int8 [B] on the device (with pos): rows with 0 are left untouched
            (nothing written, pos kept) and get zero outputs.
    Returns:
        o [B, 1, Hq, D] in the storage dtype. Writes the token into the ring and block buffers
        and advances the position(s) by one (on the device).
    """
    B, Hq, Hkv, D = state.B, state.Hq, state.Hkv, state.D
    reasons = decode_supported_reasons(state)
    if reasons:
        raise ValueError("fused Triton decode unavailable: " + "; ".join(reasons))
    if q.shape != (B, 1, Hq, D) or k.shape != (B, 1, Hkv, D) or v.shape != (B, 1, Hkv, D):
        raise ValueError(f"decode_step takes one token: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")
    if state.cell_kbar.dtype != torch.float32:
        raise ValueError(f"cell statistics dtype {state.cell_kbar.dtype}: the fused decode reads float32")
    if out is None:
        out = torch.empty(B, 1, Hq, D, dtype=state.dtype, device=state.device)
    elif out.shape != (B, 1, Hq, D) or out.dtype != state.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be ({B}, 1, {Hq}, {D}) {state.dtype}, last dim contiguous"
        )
    tiles = state.decode_tiles
    if pos is not None:
        if tiles.impl != "split":
            raise ValueError(f"rows at different positions (pos [B]) need DecodeTiles(impl='split'), not {tiles.impl}")
        if pos.shape != (B,) or pos.dtype != torch.int64 or pos.stride(0) != 1 or pos.device != state.device:
            raise ValueError(f"pos must be a contiguous int64 [{B}] tensor on {state.device}, got {tuple(pos.shape)}")
    if active is not None:
        if pos is None:
            raise ValueError("active needs pos (rows at different positions)")
        if active.shape != (B,) or active.dtype != torch.int8 or active.device != state.device:
            raise ValueError(f"active must be an int8 [{B}] tensor on {state.device}")
    with on_device_of(state.pos):  # the cache's device current while the kernels launch
        if tiles.impl == "single":
            _single_step(state, q, k, v, beta.contiguous(), out, tiles)
            state.pos += 1
        else:
            _split_step(state, q, k, v, beta.contiguous(), out, tiles, pos, active)
    return out


def fsl_boundary(state, pos=None, active=None) -> None:
    """FS-L block boundary of a `TorchCacheState` on the device (`_fsl_boundary_kernel`): one launch,
    no host sync, a no-op for rows not at a boundary (so it can sit in a CUDA graph).

    Args:
        state: an allocated FS-L `TorchCacheState`; its block buffer holds the finished block.
        pos: optional int64 [B] per-row positions (default `state.pos` [] for every row).
        active: optional int8 [B] (with pos): rows with 0 are left alone.
    """
    cfg, B, Hkv, D = state.cfg, state.B, state.Hkv, state.D
    if cfg.variant != "fsl":
        raise ValueError(f"fsl_boundary updates the FS-L pool, not variant={cfg.variant!r}")
    if state.cell_kbar.dtype != torch.float32:
        raise ValueError(f"cell statistics dtype {state.cell_kbar.dtype}: the fused boundary writes float32")
    slots = state.cell_ids.shape[2]
    m = cfg.block // cfg.cell
    pos_t, pos_stride = (state.pos, 0) if pos is None else (pos, 1)
    with on_device_of(state.pos):  # the cache's device current while the kernel launches
        launch(_fsl_boundary_kernel, (B * Hkv,),
            pos_t,
            pos_t if active is None else active,
            pos_stride,
            state.block_k,
            state.block_v,
            state.cell_ids,
            state.cell_kbar,
            state.cell_a,
            state.cell_k,
            state.cell_v,
            slots,
            HKV=Hkv,
            D=D,
            QBLOCK=cfg.block,
            CELL=cfg.cell,
            RECENT=cfg.recent,
            M=m,
            M_P2=_pow2(m),
            S_P2=_pow2(slots),
            BLOCK_D=_pow2(D),
            BLOCK_CELL=_pow2(cfg.cell),
            HAS_ACTIVE=active is not None,
            num_warps=8,
        )


def _split_scratch(state, nw: int, n_part: int):
    """Partials of the split step (float32 window m / l / acc, FS-L long outputs, FS candidates),
    reused while the sizes hold (a CUDA graph keeps their addresses)."""
    key = (state.B, state.Hq, state.D, nw, n_part, state.device)
    cached = getattr(state, "_triton_split_scratch", None)
    if cached is None or cached[0] != key:
        rows = state.B * state.Hq
        f32 = dict(dtype=torch.float32, device=state.device)
        cached = (
            key,
            torch.empty(rows, nw, 2, **f32),  # window partial (m, l)
            torch.empty(rows, nw, state.D, **f32),  # window partial acc
            torch.empty(rows, state.D, **f32),  # FS-L: beta * rmsnorm(o_long)
            torch.empty(rows, max(1, n_part), **f32),  # FS: chunk candidates' scores
            torch.empty(rows, max(1, n_part), dtype=torch.int64, device=state.device),  # and cell ids
        )
        state._triton_split_scratch = cached
    return cached[1:]


def _split_step(state, q, k, v, beta, out, tiles, pos=None, active=None) -> None:
    """Launch the split step: `_split_partials_kernel` then `_split_finish_kernel` (advances pos)."""
    cfg, B, Hq, Hkv, G, D = state.cfg, state.B, state.Hq, state.Hkv, state.group, state.D
    sigma, lam = _float32_params(state)
    scale = 1.0 / math.sqrt(D)  # rounded to float32 at the launch, as the torch path's python scalar
    slots = state.cell_ids.shape[2]
    fs = cfg.variant == "fs"
    wchunk = min(tiles.window_chunk, _pow2(cfg.window))
    nw = -(-cfg.window // wchunk)
    if fs:
        chunk = tiles.fs_chunk or _fs_chunk(slots)
        nchunk = -(-slots // chunk)
        n_part = nchunk * cfg.top_k
        n_long = nchunk
    else:
        chunk, nchunk, n_part, n_long = 1, 1, 0, G
    win_ml, win_acc, long, part_score, part_id = _split_scratch(state, nw, n_part)
    pos_t, pos_stride = (state.pos, 0) if pos is None else (pos, 1)
    act_t = pos_t if active is None else active  # placeholder pointer when every row moves
    BLOCK_D = _pow2(D)
    common = dict(
        HKV=Hkv,
        G=G,
        D=D,
        CELL=cfg.cell,
        TOPK=cfg.top_k,
        TOPK_P2=_pow2(cfg.top_k),
        FS=fs,
        NW=nw,
        HAS_ACTIVE=active is not None,
        BLOCK_D=BLOCK_D,
        BLOCK_CELL=_pow2(cfg.cell),
        num_warps=tiles.num_warps,
    )
    launch(_split_partials_kernel, (B * Hkv, nw + n_long),
        q,
        k,
        v,
        beta,
        pos_t,
        state.inv_freq,
        sigma,
        lam,
        state.ring_k,
        state.ring_v,
        state.block_k,
        state.block_v,
        state.cell_ids,
        state.cell_kbar,
        state.cell_a,
        state.cell_k,
        state.cell_v,
        win_ml,
        win_acc,
        long,
        part_score,
        part_id,
        act_t,
        pos_stride,
        q.stride(0),
        q.stride(2),
        k.stride(0),
        k.stride(2),
        v.stride(0),
        v.stride(2),
        scale,
        float(cfg.eps),
        slots,
        nchunk,
        WINDOW=cfg.window,
        QBLOCK=cfg.block,
        WCHUNK=wchunk,
        CHUNK=chunk,
        BLOCK_S=16 if fs else _pow2(slots),  # FS-L only
        **common,
    )
    launch(_split_finish_kernel, (B * Hq,),
        q,
        beta,
        out,
        pos_t,
        state.cell_k,
        state.cell_v,
        win_ml,
        win_acc,
        long,
        part_score,
        part_id,
        act_t,
        pos_stride,
        q.stride(0),
        q.stride(2),
        out.stride(0),
        out.stride(2),
        scale,
        float(cfg.eps),
        slots,
        max(1, n_part),
        NW_P2=_pow2(nw),
        BLOCK_S=_pow2(max(1, n_part)),
        **common,
    )


def _single_step(state, q, k, v, beta, out, tiles) -> None:
    """Launch the first version ("single"): `_fs_score_kernel` (FS) or the FS-B search
    (`fsb_search.decode_select_cells`), then `_decode_kernel` with `tiles.num_warps` warps and
    window tiles of at most `tiles.window_chunk` slots; the caller advances pos."""
    cfg, B, Hq, Hkv, G, D = state.cfg, state.B, state.Hq, state.Hkv, state.group, state.D
    sigma, lam = _float32_params(state)
    scale = 1.0 / math.sqrt(D)
    slots = state.cell_ids.shape[2]
    fs = cfg.variant in ("fs", "fsb")  # the archive: slot = cell id
    chosen = cfg.variant == "fsb"
    BLOCK_D = _pow2(D)
    if chosen:
        from .fsb_search import decode_select_cells

        n_part = cfg.top_k
        part_score, part_id = _scratch(state, n_part)  # part_score: unused
        decode_select_cells(state, q.reshape(B, Hkv, G, D), out=part_id.view(B, Hkv, G, n_part))
        block_s = 16
    elif fs:
        chunk = _fs_chunk(slots)
        nchunk = -(-slots // chunk)
        n_part = nchunk * cfg.top_k
        part_score, part_id = _scratch(state, n_part)
        launch(_fs_score_kernel, (B * Hkv, nchunk),
            q,
            state.pos,
            state.cell_kbar,
            state.cell_a,
            sigma,
            lam,
            part_score,
            part_id,
            q.stride(0),
            q.stride(2),
            scale,
            CAP=slots,
            HKV=Hkv,
            G=G,
            D=D,
            CELL=cfg.cell,
            QBLOCK=cfg.block,
            TOPK=cfg.top_k,
            NCHUNK=nchunk,
            CHUNK=chunk,
            BLOCK_D=BLOCK_D,
            num_warps=4,
        )
        block_s = _pow2(n_part)
    else:
        n_part = 1
        part_score, part_id = sigma, state.cell_ids  # unused placeholders
        block_s = _pow2(slots)
    launch(_decode_kernel, (B * Hkv,),
        q,
        k,
        v,
        beta,
        out,
        state.pos,
        state.inv_freq,
        sigma,
        lam,
        state.ring_k,
        state.ring_v,
        state.block_k,
        state.block_v,
        state.cell_ids,
        state.cell_kbar,
        state.cell_a,
        state.cell_k,
        state.cell_v,
        part_score,
        part_id,
        q.stride(0),
        q.stride(2),
        k.stride(0),
        k.stride(2),
        v.stride(0),
        v.stride(2),
        out.stride(0),
        out.stride(2),
        scale,
        float(cfg.eps),
        HKV=Hkv,
        G=G,
        D=D,
        WINDOW=cfg.window,
        QBLOCK=cfg.block,
        CELL=cfg.cell,
        TOPK=cfg.top_k,
        TOPK_P2=_pow2(cfg.top_k),
        SLOTS=slots,
        FS=fs,
        NPART=n_part,
        CHOSEN=chosen,
        BLOCK_D=BLOCK_D,
        BLOCK_W=min(_pow2(cfg.window), tiles.window_chunk, max(16, 8192 // BLOCK_D)),
        BLOCK_S=block_s,
        BLOCK_CELL=_pow2(cfg.cell),
        num_warps=tiles.num_warps,
    )

