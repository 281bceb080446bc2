"""FS-B selection with a Triton beam search and rerank (spec §6.4-§6.5, §7).

The forests are built one row at a time (`row_forests`): by default (`forests_mode`, since s41) with
the torch backend's `build_row_forests` around Triton kernels for the cell statistics and the node
statistics (`fsb_forests`), or ("torch") wholly with torch ops. Then one launch of
`_fsb_search_kernel` per row, one program per (query, query head):

1. For each forest (all cells, high-norm cells): the level-wise beam search of spec §6.4 over the
   query block's element count n, from the tallest tree's root down to the leaves. The frontier
   (at most `beam` nodes) lives in registers as int32 (node id, tree key, index in level), see
   `_search_forest`; at level l the candidates are the frontier's children and the root of the
   tree of height l when bit l of n is set. Node key = scale * (q . mu + radius_weight * |q| *
   rad) + lam * A * erf(sigma * (i - e) / (2 s)), the node rows read SEARCH_DIM_CHUNK dims at a
   time; the new frontier is the `beam` candidates first by (key desc, index in level asc): the
   torch search's (sort by index, stable sort by key) order, by one descending `tl.sort` of int64
   keys (key bits, index, lane) over the children, the root merged in by its rank, the index read
   back from the sort key and the other fields gathered by lane (no host work).
2. Rerank: the <= 2 * beam found cells (duplicates dropped), rho = logsumexp over the cell's s
   tokens of scale * q . k, top-K by (rho desc, c desc), -1 padded. By default (since s39,
   `rerank_mode`) the search stores the beams and `_fsb_rerank_tile_kernel` reranks tiles of
   RERANK_TILE_ROWS queries: the union of a tile's found cells (`attention.tile_unions`) is scored
   once per cell with a tensor-core dot, each query keeping its own cells; "query" mode runs
   `_rerank` inside the search program instead. Either reads the keys in their storage dtype.

Decode (`decode_select_cells`): `_fsb_decode_search_kernel`, one program per (row, query head)
and forest (the two forests' searches side by side: half the sequential depth of a step), then
`_fsb_decode_rerank_kernel`, one program per (row, query head): the same `_search_forest` and
`_rerank` on the streaming state's forests (`streaming.torch_fsb.ForestTable`: one live tree per
height, `seg_scale` 0).

No [T, nodes] tensor and no gathered copy of node statistics exist: a level costs one
[2 * beam, D] load per program. Row independence (L12): a program reads its own row's tables and
its own query; the tables of a row are built from that row alone.

All pointer offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...config import FreeSoloConfig
from ._common import launch, next_pow2, same_device  # (importing _common also patches the interpreter's loop bounds for NumPy >= 2.4)

__all__ = ["MAX_BEAM", "MAX_FOREST_CELLS", "TRACE_LEVELS", "decode_select_cells", "forests_mode", "fsb_select_cells", "row_forests", "trace_search"]

MAX_BEAM = 64  # the frontier lives in registers: [2 * beam, D] node tiles; 2 * beam lanes fit the sort key's 7 lane bits


_INT64_MIN = tl.constexpr(-(2**63))
MAX_FOREST_CELLS = 2**25  # cells of one forest the search's sort keys can index (T < 2^30 tokens at cell 32)
MAX_TABLE_NODES = 2**31 - 1  # nodes of one kv head's table: the frontier holds node ids as int32 (`_search_forest`)
GIDX_MAX = tl.constexpr(MAX_FOREST_CELLS - 1)


@triton.jit
def _sort_key(key, gidx):
    """int64 sort key of (key desc, gidx asc) with 7 zero low bits (a lane): the float32 key's
    bits mapped to a signed order (high 32 bits), then GIDX_MAX - gidx (bits 7..31)."""
    bits = (key + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 -> +0.0 (equal keys, equal bits)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # integer order == float order
    return (bits.to(tl.int64) << 32) | ((tl.full([], GIDX_MAX, tl.int64) - gidx) << 7)


@triton.jit
def _node_keys(flat, ok, q, q_row_ptr, qnorm, pos, sig, lm, node0, mu_ptr, rad_ptr, a_ptr, e_ptr, scale, radius_weight,
               two_cell, D, N, BLOCK_D: tl.constexpr, DC: tl.constexpr):  # fmt: skip
    """Keys of the nodes `flat` (int [M], valid where `ok`, < N): scale * (q . mu + rw * |q| * rad) + prior.

    q: float32 [BLOCK_D] the query (zero past D); q_row_ptr: the same query in memory (any float
    dtype), read when DC < BLOCK_D. DC == BLOCK_D: one [M, BLOCK_D] tile, q . mu summed across the
    lanes that hold a row (16 lanes at D 64). DC < BLOCK_D: D in chunks of DC dims, [M, DC] tiles
    whose rows span fewer lanes (4 at DC 16: fewer shuffles, more of the sum inside a lane; q's
    chunk re-read from L1). The two orders of the sum agree up to float32 rounding."""
    tl.device_assert(((flat >= 0) & (flat < N)) | ~ok, "FS-B search: node id out of its table")
    rows = node0 + flat
    if DC == BLOCK_D:
        d = tl.arange(0, BLOCK_D)
        mu = tl.load(mu_ptr + rows[:, None] * D + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
        dot = tl.sum(mu * q[None, :], 1)
    else:
        dot = tl.zeros(flat.shape, dtype=tl.float32)
        for c0 in tl.static_range(0, BLOCK_D, DC):
            dd = c0 + tl.arange(0, DC)
            qc = tl.load(q_row_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
            mu = tl.load(mu_ptr + rows[:, None] * D + dd[None, :], mask=ok[:, None] & (dd[None, :] < D), other=0.0)
            dot += tl.sum(mu * qc[None, :], 1)
    rad = tl.load(rad_ptr + rows, mask=ok, other=0.0)
    amax = tl.load(a_ptr + rows, mask=ok, other=0.0)
    e = tl.load(e_ptr + rows, mask=ok, other=0).to(tl.float32)
    prior = lm * amax * tl.math.erf(sig * (pos - e) / two_cell)
    key = scale * (dot + radius_weight * qnorm * rad) + prior
    return tl.where(ok, key, float("-inf"))


@triton.jit
def _search_forest(n, base_ptr, seg_scale, q, q_row_ptr, qnorm, pos, sig, lm, node0, mu_ptr, rad_ptr, a_ptr, e_ptr,
                   cell_ptr, scale, radius_weight, two_cell, D, N, trace_idx_ptr, trace_key_ptr, tracing,
                   BLOCK_D: tl.constexpr, DC: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                   TRACE: tl.constexpr):  # fmt: skip
    """Beam search of one forest over its first n elements: element cells int64 [WP] (-1 = none).

    base_ptr: int64 [max_height + 2] flat id of tree 0 of height h (this forest, this kv head's
    table starting at node0); the tree of segment m at base[h] + m * nodes(h) * seg_scale
    (seg_scale 0: one tree per height, the streaming `ForestTable`). Slots >= W stay empty (WP: W
    rounded up to a power of two).
    A frontier slot holds three int32 fields: the node's flat id p in the table (levels 0..h of a
    tree of height h stored in order from its base tb, so level l starts at tb + 2^(h+1) - 2^(h-l+1)),
    its tree's key tk = tb + 2^(h+1) and its index g in the level across the forest (segment
    start >> level + index in the tree's level). Child b (0 / 1) of node (p, tk, g) is
    (2p - tk + b, tk, 2g + b); a root of height h is (tb + 2^(h+1) - 2, tb + 2^(h+1), start >> h);
    a leaf's p is its cell's slot. Table offsets are int64 (node0 + p).
    TRACE (a debugging aid, `trace_search`): where `tracing`, each level's beam is written as
    (index in level, key) to trace_idx_ptr / trace_key_ptr [levels, W], level t = top - lvl.
    """
    slots = tl.arange(0, WP)
    lane = tl.arange(0, 2 * WP)
    p = tl.zeros([WP], dtype=tl.int32)  # flat id of the node (relative to node0)
    tk = tl.zeros([WP], dtype=tl.int32)  # its tree's key
    g = tl.zeros([WP], dtype=tl.int32)  # its index in the level across the forest
    valid = tl.zeros([WP], dtype=tl.int32)
    top = -1
    while (n >> (top + 1)) > 0:  # top = floor(log2 n): no level above it holds a node for n
        top += 1
    for t in range(0, top + 1):
        lvl = top - t
        # the frontier's children, interleaved (slot s -> lanes 2s, 2s+1)
        first = 2 * p - tk
        c_p = tl.reshape(tl.join(first, first + 1), [2 * WP])
        c_tk = tl.reshape(tl.join(tk, tk), [2 * WP])
        c_g = tl.reshape(tl.join(2 * g, 2 * g + 1), [2 * WP])
        c_ok = tl.reshape(tl.join(valid, valid), [2 * WP]) != 0
        c_key = _node_keys(tl.where(c_ok, c_p, 0), c_ok, q, q_row_ptr, qnorm, pos, sig, lm, node0, mu_ptr, rad_ptr,
                           a_ptr, e_ptr, scale, radius_weight, two_cell, D, N, BLOCK_D, DC)  # fmt: skip
        # the root of the tree of height lvl (bit lvl of n), as a one-lane tensor
        one = tl.arange(0, 1)
        has_root = ((n >> lvl) & 1) == 1
        r_start = ((n >> (lvl + 1)) << (lvl + 1)).to(tl.int32)
        r_tb = (tl.load(base_ptr + lvl) + (r_start >> lvl) * ((2 << lvl) - 1) * seg_scale).to(tl.int32)
        r_tk = r_tb + (2 << lvl)
        r_p = r_tk - 2
        r_g = r_start >> lvl
        r_ok = (one == 0) & has_root
        # (one row: its key summed across the lanes from the q in registers, all of D at once; its rows in
        # chunks cost 67 more SASS instructions a level, 707 against 640 at D 64)
        r_key = _node_keys(tl.where(r_ok, r_p + one * 0, 0), r_ok, q, q_row_ptr, qnorm, pos, sig, lm, node0, mu_ptr,
                           rad_ptr, a_ptr, e_ptr, scale, radius_weight, two_cell, D, N, BLOCK_D, BLOCK_D)  # fmt: skip
        # the new frontier: the W best of the children and the root by (key desc, index in level
        # asc), a total order (indices in a level are distinct). Each child gets one int64 sort key:
        # order-preserving key bits (high 32), then GIDX_MAX - index (25 bits), then its lane (7
        # bits); one descending sort ranks the children, the root is merged in by its rank; a
        # picked child's index comes back from its sort key, its p and tk by its lane.
        tl.device_assert((c_g <= GIDX_MAX) | ~c_ok, "FS-B search: index in level past 2^25")
        c_packed = tl.where(c_ok, _sort_key(c_key, c_g) | lane.to(tl.int64), _INT64_MIN)
        ranked = tl.sort(c_packed, 0, descending=True)  # [2 * WP]: best child first
        r_key_s = tl.max(r_key, 0)
        r_packed = _sort_key(r_key_s, r_g)  # (its lane bits 0: keys differ in their index bits)
        best = tl.gather(ranked, slots, 0)  # [WP]: the WP best children
        rank = tl.sum(((best > r_packed) & (slots < W)).to(tl.int32), 0)  # children that beat the root
        take_root = has_root & (rank < W)
        is_root = take_root & (slots == rank)
        pick = tl.gather(ranked, tl.where(take_root & (slots > rank), slots - 1, slots), 0)  # [WP]
        from_child = (pick != _INT64_MIN) & ~is_root
        at = (pick & (2 * WP - 1)).to(tl.int32)  # the picked child's lane
        new_valid = (slots < W) & (is_root | from_child)
        p = tl.where(is_root, r_p, tl.gather(c_p, at, 0))
        tk = tl.where(is_root, r_tk, tl.gather(c_tk, at, 0))
        g = tl.where(is_root, r_g, (((pick >> 7) & GIDX_MAX) ^ GIDX_MAX).to(tl.int32))  # GIDX_MAX - x == x ^ GIDX_MAX
        valid = new_valid.to(tl.int32)
        if TRACE:
            k_sel = tl.where(is_root, r_key_s, tl.gather(c_key, at, 0))
            tl.store(trace_idx_ptr + t * W + slots, tl.where(new_valid, g, -1).to(tl.int64), mask=tracing & (slots < W))
            tl.store(trace_key_ptr + t * W + slots, k_sel, mask=tracing & new_valid)
    tl.device_assert(((p >= 0) & (p < N)) | (valid == 0), "FS-B search: leaf id out of its table")
    return tl.load(cell_ptr + node0 + tl.where(valid != 0, p, 0), mask=valid != 0, other=-1)


@triton.jit
def _rerank(found_all, found_high, q, k_ptr, row0, scale, D, BLOCK_D: tl.constexpr, CELL: tl.constexpr,
            WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):  # fmt: skip
    """Spec §6.5 / §7: the found cells of both forests (int64 [WP] each, -1 = none), each cell once,
    by rho = logsumexp over its CELL tokens of scale * q . k; top-K by (rho desc, c desc), -1
    padded: int64 [KP]. Cell c's token t is row row0 + c * CELL + t of k_ptr (rows of D; any
    float dtype, read as float32)."""
    d = tl.arange(0, BLOCK_D)
    cand = tl.reshape(tl.join(found_all, found_high), [2 * WP])
    ok = cand >= 0  # a cell found by both forests sits in two lanes: the selection below takes it once
    tok = tl.arange(0, CELL)
    logits = tl.zeros([2 * WP, CELL], dtype=tl.float32)
    krow0 = row0 + tl.where(ok, cand, 0) * CELL  # first token row of each candidate cell
    for t in range(CELL):
        kt = tl.load(k_ptr + (krow0 + t)[:, None] * D + d[None, :], mask=ok[:, None] & (d[None, :] < D), other=0.0)
        logits = tl.where(tok[None, :] == t, (tl.sum(kt.to(tl.float32) * q[None, :], 1) * scale)[:, None], logits)
    m = tl.max(logits, 1)
    rho = m + tl.log(tl.sum(tl.exp(logits - m[:, None]), 1))
    rho = tl.where(ok, rho, float("-inf"))
    # top-K by (rho desc, c desc): K times the best remaining lane, by reductions and scalar
    # comparisons (no rank tile); taking a cell drops every lane holding it
    kk = tl.arange(0, KP)
    picked = tl.full([KP], -1, dtype=tl.int64)
    for r in range(K):
        best = tl.max(tl.where(ok, rho, float("-inf")), 0)
        best_c = tl.max(tl.where(ok & (rho == best), cand, -1), 0)
        picked = tl.where(kk == r, best_c, picked)  # -1 once no cell is left
        ok = ok & (cand != best_c)
    return picked


@triton.jit
def _fsb_search_kernel(
    q_ptr,  # fp32 [Hq, T, D]: one row, heads first (query head hq = h * G + g)
    k_ptr,  # [Hkv, T, D] the keys in their storage dtype (read as float32: exact for 16-bit floats)
    mu_ptr,  # fp32 [Hkv, N, D]: both forests' node tables (SearchTables)
    rad_ptr,  # fp32 [Hkv, N]
    a_ptr,  # fp32 [Hkv, N]
    e_ptr,  # int64 [Hkv, N]
    cell_ptr,  # int64 [Hkv, N]
    base_ptr,  # int64 [2, HB]
    hp_ptr,  # int64 [Hkv, C + 1]: high-norm cells among the first c
    sigma_ptr,  # fp32 [Hq]
    lam_ptr,  # fp32 [Hq]
    out_ptr,  # int64 [Hq, T, K]
    found_ptr,  # int [T, Hq, 2 W] at strides (stride_ft, stride_fh, 1) (written when FOUND): each forest's beam, slot = rank
    trace_idx_ptr,  # int64 [2, TRACE_LEVELS, W] (written when TRACE, by program (trace_i, trace_h))
    trace_key_ptr,  # fp32 [2, TRACE_LEVELS, W]
    trace_i,
    trace_h,
    stride_ft,
    stride_fh,
    T,
    N,
    C1,
    HB,
    G,
    scale,
    radius_weight,
    two_cell,
    D,
    BLOCK_D: tl.constexpr,
    DC: tl.constexpr,
    CELL: tl.constexpr,
    QBLOCK: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    FOUND: tl.constexpr,
    TRACE: tl.constexpr,
    TRACE_LEVELS: tl.constexpr,
    RERANK: tl.constexpr = True,
):
    i = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    tracing = (i == trace_i) & (hq == trace_h)
    h = hq // G
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (hq * T + i) * D + d, mask=d < D, other=0.0)
    qnorm = tl.sqrt(tl.sum(q * q, 0))
    pos = i.to(tl.float32)
    sig = tl.load(sigma_ptr + hq)
    lm = tl.load(lam_ptr + hq)
    node0 = h * N
    n_all = (i // QBLOCK) * QBLOCK // CELL  # cells available to the query's block
    n_high = tl.load(hp_ptr + h * C1 + n_all)
    q_row = q_ptr + (hq * T + i) * D
    found_all = _search_forest(n_all, base_ptr, 1, q, q_row, qnorm, pos, sig, lm, node0, mu_ptr, rad_ptr, a_ptr, e_ptr,
                               cell_ptr, scale, radius_weight, two_cell, D, N, trace_idx_ptr, trace_key_ptr, tracing,
                               BLOCK_D, DC, W, WP, TRACE)  # fmt: skip
    found_high = _search_forest(n_high, base_ptr + HB, 1, q, q_row, qnorm, pos, sig, lm, node0, mu_ptr, rad_ptr, a_ptr,
                                e_ptr, cell_ptr, scale, radius_weight, two_cell, D, N, trace_idx_ptr + TRACE_LEVELS * W,
                                trace_key_ptr + TRACE_LEVELS * W, tracing, BLOCK_D, DC, W, WP, TRACE)  # fmt: skip
    if FOUND:
        slots = tl.arange(0, WP)
        tl.store(found_ptr + i * stride_ft + hq * stride_fh + slots, found_all, mask=slots < W)
        tl.store(found_ptr + i * stride_ft + hq * stride_fh + W + slots, found_high, mask=slots < W)
    if RERANK:  # off only to time the search alone (`_run(..., rerank=False)`, benchmarks/fsb_prefill_split.py)
        picked = _rerank(found_all, found_high, q, k_ptr, h * T, scale, D, BLOCK_D, CELL, WP, K, KP)
        kk = tl.arange(0, KP)
        tl.store(out_ptr + (hq * T + i) * K + kk, picked, mask=kk < K)


@triton.jit
def _fsb_rerank_tile_kernel(
    q_ptr,  # fp32 [Hq, T, D]: one row (hq = h * G + g)
    k_ptr,  # [Hkv, T, D] the keys in their storage dtype
    found_ptr,  # int32 [T, Hq, W2]: each query's found cells (both forests' beams), -1 = none
    union_ptr,  # int32 [Hq, NT, U_MAX]: each tile's distinct found cells ascending (`attention.tile_unions`)
    count_ptr,  # int32 [Hq, NT]: cells in each union
    out_ptr,  # int64 [Hq, T, K]
    T,
    NT,
    G,
    Hq,
    scale,
    D,
    BLOCK_D: tl.constexpr,
    CELL: tl.constexpr,
    CELL_P: tl.constexpr,
    TQ: tl.constexpr,
    CPI: tl.constexpr,
    W2: tl.constexpr,
    W2P: tl.constexpr,
    U_MAX: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    DOT16: tl.constexpr,
):
    """The rerank of spec §6.5 / §7 for a tile of TQ consecutive queries of one query head: the
    tile's union of found cells is read once, ascending, CPI cells per step, their keys scored
    against the whole tile by one tensor-core dot; a query keeps the cells it found itself.
    rho = logsumexp over the cell's tokens of scale * q . k; each query keeps its running top-K
    by (rho desc, c desc): a cell arrives after every smaller cell, so it goes before the kept
    cells whose rho it equals or beats. The same selection as `_rerank` up to the rounding of the
    dot products (fp32 sums in another order): selections may differ at float32 near-ties only.
    DOT16: q and k are 16-bit values (q widened exactly), so the dot takes them in k's dtype
    (exact products, fp32 sums); otherwise an fp32 "ieee" dot."""
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    h = hq // G
    rows = t * TQ + tl.arange(0, TQ).to(tl.int64)
    row_ok = rows < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + (hq * T + rows)[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT16:
        q_dot = q.to(k_ptr.dtype.element_ty)
    lanes = tl.arange(0, W2P)
    found = tl.load(found_ptr + (rows * Hq + hq)[:, None] * W2 + lanes[None, :],
                    mask=row_ok[:, None] & (lanes < W2)[None, :], other=-1)  # fmt: skip
    n = tl.load(count_ptr + hq * NT + t)
    union = union_ptr + (hq * NT + t) * U_MAX
    step = tl.arange(0, CPI)
    tok = tl.arange(0, CELL_P)
    tok_ok = tl.reshape(tl.broadcast_to((tok < CELL)[None, :], (CPI, CELL_P)), [CPI * CELL_P])
    kk = tl.arange(0, KP)
    shift = tl.broadcast_to(tl.maximum(kk - 1, 0)[None, :], (TQ, KP))  # entry j - 1 (for an insertion)
    best_rho = tl.full([TQ, KP], float("-inf"), dtype=tl.float32)
    best_c = tl.full([TQ, KP], -1, dtype=tl.int32)
    for u0 in range(0, n, CPI):
        cs = tl.load(union + u0 + step, mask=u0 + step < n, other=-1)  # [CPI] ascending, -1 past the union
        key_rows = h * T + tl.maximum(cs, 0).to(tl.int64)[:, None] * CELL + tok[None, :]  # [CPI, CELL_P]
        key_rows = tl.reshape(key_rows, [CPI * CELL_P])
        key_ok = tok_ok & tl.reshape(tl.broadcast_to((cs >= 0)[:, None], (CPI, CELL_P)), [CPI * CELL_P])
        kc = tl.load(k_ptr + key_rows[:, None] * D + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT16:
            logits = tl.dot(q_dot, tl.trans(kc))  # [TQ, CPI * CELL_P]
        else:
            logits = tl.dot(q, tl.trans(kc.to(tl.float32)), input_precision="ieee")
        logits = tl.where(tok_ok[None, :], logits * scale, float("-inf"))
        logits = tl.reshape(logits, [TQ, CPI, CELL_P])
        m = tl.max(logits, 2)
        rho_all = m + tl.log(tl.sum(tl.exp(logits - m[:, :, None]), 2))  # [TQ, CPI]
        mine_all = tl.max((found[:, :, None] == cs[None, None, :]).to(tl.int32), 1) > 0  # [TQ, CPI]
        mine_all = mine_all & (cs >= 0)[None, :]
        for j in tl.static_range(CPI):  # ascending cells
            rho = tl.max(tl.where(step[None, :] == j, rho_all, float("-inf")), 1)  # [TQ]
            mine = tl.max(tl.where(step[None, :] == j, mine_all.to(tl.int32), 0), 1) > 0
            c = tl.max(tl.where(step == j, cs, -1), 0)
            at = tl.sum((best_rho > rho[:, None]).to(tl.int32), 1)  # kept cells that stay ahead of c
            put = mine & (at < K)
            before = kk[None, :] < at[:, None]
            here = kk[None, :] == at[:, None]
            new_rho = tl.where(before, best_rho, tl.where(here, rho[:, None], tl.gather(best_rho, shift, 1)))
            new_c = tl.where(before, best_c, tl.where(here, c, tl.gather(best_c, shift, 1)))
            best_rho = tl.where(put[:, None], new_rho, best_rho)
            best_c = tl.where(put[:, None], new_c, best_c)
    tl.store(out_ptr + (hq * T + rows)[:, None] * K + kk[None, :], best_c.to(tl.int64),
             mask=row_ok[:, None] & (kk < K)[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["stride_qb", "stride_qh", "Na", "Nh"])  # sizes that grow with the cache: no recompile
def _fsb_decode_search_kernel(
    q_ptr,  # [B, Hq, D] any float dtype, last stride 1: the step's unrotated queries (hq = h * G + g)
    pos_ptr,  # int64 []: the step's position (read on the device: no host sync)
    mu_a_ptr, rad_a_ptr, a_a_ptr, e_a_ptr, cell_a_ptr, base_a_ptr,  # the all-cells forest (ForestTable)
    mu_h_ptr, rad_h_ptr, a_h_ptr, e_h_ptr, cell_h_ptr, base_h_ptr,  # the high-norm forest
    n_high_ptr,  # int64 [B, Hkv]: elements of each row's high-norm forest
    sigma_ptr, lam_ptr,  # fp32 [Hq]
    found_ptr,  # int64 [B * Hq, 2, WP]: each forest's found cells (-1 = none)
    stride_qb, stride_qh, Na, Nh, Hkv, G, scale, radius_weight, two_cell, D,
    BLOCK_D: tl.constexpr, CELL: tl.constexpr, QBLOCK: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    """One decode step's FS-B beam search, one program per (row, query head) and forest (grid axis
    1: 0 = all cells, 1 = high-norm cells; the two searches run side by side): `_search_forest`
    on the streaming state's tables (`streaming.torch_fsb`), the same code as the prefill kernel's.
    The all-cells forest's size, the available cells (pos // QBLOCK) * QBLOCK // CELL, comes from
    the position on the device, so a CUDA graph of the step stays valid across block boundaries."""
    bh = tl.program_id(0).to(tl.int64)  # b * Hq + hq
    forest = tl.program_id(1)
    b = bh // (Hkv * G)
    hq = bh % (Hkv * G)
    h = hq // G
    d = tl.arange(0, BLOCK_D)
    q_row = q_ptr + b * stride_qb + hq * stride_qh
    q = tl.load(q_row + d, mask=d < D, other=0.0).to(tl.float32)
    qnorm = tl.sqrt(tl.sum(q * q, 0))
    pos_i = tl.load(pos_ptr)  # int64
    pos = pos_i.to(tl.float32)
    sig = tl.load(sigma_ptr + hq)
    lm = tl.load(lam_ptr + hq)
    plane = b * Hkv + h
    no_trace = bh < 0  # TRACE is off: nothing is stored
    if forest == 0:
        n_all = (pos_i // QBLOCK) * (QBLOCK // CELL)
        found = _search_forest(n_all, base_a_ptr, 0, q, q_row, qnorm, pos, sig, lm, plane * Na, mu_a_ptr, rad_a_ptr,
                               a_a_ptr, e_a_ptr, cell_a_ptr, scale, radius_weight, two_cell, D, Na, found_ptr, found_ptr,
                               no_trace, BLOCK_D, BLOCK_D, W, WP, False)  # fmt: skip
    else:
        n_high = tl.load(n_high_ptr + plane)
        found = _search_forest(n_high, base_h_ptr, 0, q, q_row, qnorm, pos, sig, lm, plane * Nh, mu_h_ptr, rad_h_ptr,
                               a_h_ptr, e_h_ptr, cell_h_ptr, scale, radius_weight, two_cell, D, Nh, found_ptr, found_ptr,
                               no_trace, BLOCK_D, BLOCK_D, W, WP, False)  # fmt: skip
    tl.store(found_ptr + (bh * 2 + forest) * WP + tl.arange(0, WP), found)


@triton.jit(do_not_specialize=["stride_qb", "stride_qh", "S"])
def _fsb_decode_rerank_kernel(
    q_ptr,  # [B, Hq, D] as the search's
    k_ptr,  # [B, Hkv, S, CELL, D] (storage dtype): the archive's raw keys, slot = cell id
    found_ptr,  # int64 [B * Hq, 2, WP] from `_fsb_decode_search_kernel`
    out_ptr,  # int64 [B, Hq, K]
    stride_qb, stride_qh, S, Hkv, G, scale, D,
    BLOCK_D: tl.constexpr, CELL: tl.constexpr, WP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """The rerank of one decode step (`_rerank`), one program per (row, query head)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // (Hkv * G)
    hq = bh % (Hkv * G)
    h = hq // G
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + hq * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    lanes = tl.arange(0, WP)
    found_all = tl.load(found_ptr + bh * 2 * WP + lanes)
    found_high = tl.load(found_ptr + (bh * 2 + 1) * WP + lanes)
    picked = _rerank(found_all, found_high, q, k_ptr, (b * Hkv + h) * S * CELL, scale, D, BLOCK_D, CELL, WP, K, KP)
    kk = tl.arange(0, KP)
    tl.store(out_ptr + bh * K + kk, picked, mask=kk < K)


def _check(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig) -> None:
    if cfg.variant != "fsb":
        raise ValueError(f"fsb_select_cells runs variant 'fsb', got {cfg.variant!r}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [B, T, Hq, D] and k [B, T, Hkv, D] disagree: {tuple(q.shape)} vs {tuple(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"Hq={q.shape[2]} is not a multiple of Hkv={k.shape[2]}")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device}, k on {k.device}")
    if not 1 <= cfg.beam <= MAX_BEAM:
        raise ValueError(f"beam={cfg.beam}: the Triton FS-B search holds at most {MAX_BEAM} frontier nodes in registers")
    if q.shape[1] // cfg.cell > MAX_FOREST_CELLS:
        raise ValueError(f"T={q.shape[1]}: the Triton FS-B search indexes at most {MAX_FOREST_CELLS} cells per forest")


# History: the first compiled form (session 19) was wrong on the H200 although the interpreter
# agreed with the torch search bit for bit: on small configs beams lost a slot or two candidates
# shared one, and one case read out of bounds. It ranked the candidates with [candidates x
# candidates] comparison tiles. The kernel now takes the beam slot by slot by reductions over one
# candidate tensor and scalar comparisons (the rerank likewise); on the H200 (session 20) it
# equals the torch search on every small case at num_warps 1 / 2 / 4 and passes memcheck, and at
# paper sizes it differs from the torch search only at float32 near-ties (`fsb_audit`,
# benchmarks/fsb_search_bench.py; logs in benchmarks/results/session_2026-12-01_s20/). Those W
# slots cost 6 reductions each per level (W = 16: 96 a level); since session 21 one sort of packed
# keys ranks the level's children (unique keys: no rank ties): the decode search launch went from
# 194 / 248 us to 90 / 108 us at 64k / 1M on the H200, equal to the torch search on the CUDA tests.
TRACE_LEVELS = 64  # levels a trace holds (a forest over < 2^63 cells)


def fsb_select_cells(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: FreeSoloConfig,
    return_found: bool = False,
    num_warps: int = 1,
):
    """FS-B selection on the Triton search: int64 [B, T, Hq, K] by descending rho (ties larger c), -1 padded.

    Args:
        q: [B, T, Hq, D] unrotated queries; k: [B, T, Hkv, D] unrotated keys (same device; any
            float dtype: the search runs in float32, as the torch backend's for 16-bit inputs).
        cfg: variant "fsb" with tau set (`calibrate_tau`).
        return_found: also return the beams, int64 [B, T, Hq, 2 * beam]: the all-cells forest's
            found cells then the high-norm forest's, each in beam order (-1 = none): the layout
            of the torch backend's `beam_search_forests`.
        num_warps: warps per (query, head) program (a tuning knob: the result does not depend on
            it). 1 by default: on the H200 one warp took 27.8 / 68.4 / 227 ms at T = 4k / 16k / 64k
            (H 16, D 64) against 40.3 / 166 / 724 ms at 4 warps (no register spills at one warp).
    """
    return _run(q, k, cfg, return_found, num_warps, trace=None)


def trace_search(q, k, cfg: FreeSoloConfig, row: int, i: int, hq: int, num_warps: int = 1):
    """A debugging aid: the beams of query i, query head hq of batch row `row`, level by level.

    Returns (index, key): int64 [2, L, beam] and float32 [2, L, beam] for the two forests (all
    cells, high-norm cells) and the levels from the top (L = TRACE_LEVELS; rows past a forest's
    levels stay -1 / nan): each level's beam in order as (index in level, node key), -1 where a
    slot is empty. Compare with a float64 emulation of spec §6.4 (`fsb_audit.emulate_search`).
    """
    return _run(q, k, cfg, False, num_warps, trace=(row, i, hq))


RERANK_ENV = "FREESOLO_TRITON_FSB_RERANK"  # "tile": `_fsb_rerank_tile_kernel`; "query": the search kernel's `_rerank`
# The tile rerank by default since s39: H100 (s39 call9, bf16 H16 D64, benchmarks/fsb_prefill_split.py): the
# per-query rerank took 13 / 45 / 156 ms at 64k / 256k / 1M (select minus search), the tile rerank's unions
# + kernel 1.0 + 3.2 / 3.9 + 11.3 / 15.4 + 39.3 ms (32 queries, 1 cell a step); its selections differ from
# the per-query rerank's at 0.0001-0.0005 % of (query, head) entries, each audited at a float64 margin of
# at most 6.5e-7 (near-ties).
RERANK_DEFAULT = "tile"
RERANK_TILE_ROWS = 32  # queries per program of the tile rerank (its union holds up to 32 * 2 * beam cells)
# union cells per step of the tile rerank (one dot of RERANK_TILE_CELLS * cell keys); s39 call9 at 1M:
# 32 queries x 1 / 2 / 4 cells 39.3 / 64.0 / 77.7 ms; 64 x 4 68.4, 16 x 4 83.2
RERANK_TILE_CELLS = 1


# dims per step of the prefill search's node loads (`search_dim_chunk`; None: all of D at once).
# 16: sm_90 SASS of the search kernel (D 64, beam 16), per level: 707 instructions and 96 registers a
# thread, against 846 / 104 with all of D at once (the sum across lanes: shuffles) and 1046 / 160 before
# s40 (int64 frontier fields, four gathers a level). H100 (s40 call6, bf16 H16 D64, forests + search):
# 39.7 / 135.4 / 599.0 ms at 64k / 256k / 1M; all of D 42.9 / 148.9 / 658.9; chunks of 8
# 45.0 / 162.4 / 746.4, of 4 59.4 / 239.2 / 1126.6; the s39 kernel 52.3 / 195.5 / 872.1; the s39 opt-in
# search of 4 queries a program (removed in s40) 49.4 / 178.0 / 792.0. Same selections everywhere.
SEARCH_DIM_CHUNK = 16


# registers a thread the prefill search may use (the `maxnreg` launch option; None: the compiler's choice, 96
# at D 64). Offline (benchmarks/fsb_search_sass.py, s40): 88 registers keep the level at 697 instructions without
# spills (23 warps a SM instead of 21); 72 / 64 spill and take 739 / 783. On an H100 (s41 call1, bf16, H 16, D 64,
# search alone at 64k / 256k / 1M, same run): None 41.4 / 133.6 / 584.3 ms, 88: 42.7 / 134.0 / 588.4, 80: 40.6 /
# 133.1 / 581.4, 72: 38.8 / 131.0 / 574.5; the same selections at every cap. So 72: the spills cost less than the
# occupancy gains.
SEARCH_MAXNREG = 72


def search_dim_chunk(block_d: int) -> int:
    """Dims of D the one-query prefill search (`_node_keys`) loads per step: SEARCH_DIM_CHUNK
    (a power of two) capped at block_d, or block_d when unset."""
    return min(block_d, SEARCH_DIM_CHUNK or block_d)


def rerank_mode() -> str:
    """The prefill rerank: RERANK_ENV if set ("tile" / "query"), else RERANK_DEFAULT (read at each call)."""
    mode = os.environ.get(RERANK_ENV, "").strip() or RERANK_DEFAULT
    if mode not in ("tile", "query"):
        raise ValueError(f"{RERANK_ENV}={mode!r} must be 'tile' or 'query'")
    return mode


FORESTS_ENV = "FREESOLO_TRITON_FSB_FORESTS"  # "triton": `fsb_forests.row_forests`; "torch": `torch.fsb.build_row_forests`
# H100 (s41 call2, bf16, H 16, D 64): the torch build takes 116 ms at 1M, 84 of them in its per-level ops. The
# Triton node statistics sum the means in float64 and round once (the torch build averages in float32): the
# searches then differ at float32 near-ties only (`test_cuda_forests_differ_at_near_ties_only`).
FORESTS_DEFAULT = "triton"


def forests_mode() -> str:
    """The prefill forests' builder: FORESTS_ENV if set ("triton" / "torch"), else FORESTS_DEFAULT (read at each call)."""
    mode = os.environ.get(FORESTS_ENV, "").strip() or FORESTS_DEFAULT
    if mode not in ("triton", "torch"):
        raise ValueError(f"{FORESTS_ENV}={mode!r} must be 'triton' or 'torch'")
    return mode


def row_forests(k_row: torch.Tensor, cfg: FreeSoloConfig) -> tuple:
    """Both forests of one row, k_row [1, Hkv, T, D] unrotated keys in their storage dtype, by the
    `forests_mode` builder: (SearchTables with float32 statistics, high_prefix int64 [1, Hkv, C + 1])."""
    if forests_mode() == "triton":
        from .fsb_forests import row_forests as triton_row_forests

        return triton_row_forests(k_row, cfg)
    from ..torch.fsb import build_row_forests

    return build_row_forests(k_row.to(torch.float32), cfg, outward=True)


def _run(q, k, cfg: FreeSoloConfig, return_found: bool, num_warps: int, trace, rerank: bool = True):
    """fsb_select_cells / trace_search. rerank=False (a timing aid: the search alone) leaves the
    selection -1 and skips the rerank's loads."""
    from .attention import tile_unions

    _check(q, k, cfg)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    K = cfg.top_k
    q4 = q.detach().to(torch.float32).permute(0, 2, 1, 3).contiguous()  # (B, Hq, T, D)
    # the rerank reads the keys in their storage dtype (half the bytes of float32 for 16-bit keys;
    # widened in the kernel, exactly); so do the forests, one row at a time (`row_forests`)
    k_rows = k.detach().permute(0, 2, 1, 3).contiguous()  # (B, Hkv, T, D)
    sigma = torch.as_tensor(cfg.per_head("sigma", Hq), dtype=torch.float32, device=q.device)
    lam = torch.as_tensor(cfg.per_head("lam", Hq), dtype=torch.float32, device=q.device)
    out = torch.full((B, Hq, T, K), -1, dtype=torch.int64, device=q.device)
    found = torch.full((B, Hq, T, 2 * cfg.beam) if return_found else (B, 1, 1, 1), -1, dtype=torch.int64, device=q.device)
    trace_idx = torch.full((2, TRACE_LEVELS, cfg.beam), -1, dtype=torch.int64, device=q.device)
    trace_key = torch.full((2, TRACE_LEVELS, cfg.beam), float("nan"), dtype=torch.float32, device=q.device)

    def result():
        if trace is not None:
            return trace_idx, trace_key
        idx = out.permute(0, 2, 1, 3).contiguous()
        return (idx, found.permute(0, 2, 1, 3).contiguous()) if return_found else idx

    if T // cfg.block * cfg.block // cfg.cell == 0:
        return result()  # no query block has an available cell
    WP = next_pow2(cfg.beam)
    W2 = 2 * cfg.beam
    tiled = rerank and trace is None and rerank_mode() == "tile"
    # the tile rerank reads the beams from a [T, Hq, 2 * beam] buffer (the layout `tile_unions` takes);
    # without a rerank the beams are stored there too (else the compiler drops the unused search)
    keep = tiled or not rerank
    beams = torch.empty(T, Hq, W2, dtype=torch.int32, device=q.device) if keep else None
    rows = range(B) if trace is None else [trace[0]]
    for b in rows:  # one row at a time: its tables are built from its own keys (L12)
        tables, high_prefix = row_forests(k_rows[b : b + 1], cfg)
        N = tables.mu.shape[2]
        if N > MAX_TABLE_NODES:  # (a float32 mu table of 2^31 nodes is 512 GiB per kv head at D 64: not reached in practice)
            raise ValueError(f"FS-B search: {N} nodes per kv head's table, the int32 frontier indexes at most {MAX_TABLE_NODES}")
        found_b = beams if keep else found[b]
        stride_ft, stride_fh = (Hq * W2, W2) if keep else (W2, T * W2)
        launch(_fsb_search_kernel, (T, Hq),
            q4[b], k_rows[b], tables.mu[0].contiguous(), tables.rad[0].contiguous(), tables.A[0].contiguous(),
            tables.e[0].contiguous(), tables.cell[0].contiguous(), tables.base.contiguous(), high_prefix[0].contiguous(),
            sigma, lam, out[b], found_b, trace_idx, trace_key,
            -1 if trace is None else trace[1], -1 if trace is None else trace[2], stride_ft, stride_fh,
            T, max(N, 1), high_prefix.shape[-1], tables.base.shape[1], G,
            float(D**-0.5), float(cfg.radius_weight), float(2 * cfg.cell), D,
            BLOCK_D=next_pow2(D), DC=search_dim_chunk(next_pow2(D)), CELL=cfg.cell, QBLOCK=cfg.block, W=cfg.beam,
            WP=WP, K=K, KP=next_pow2(K), FOUND=return_found or keep, TRACE=trace is not None,
            TRACE_LEVELS=TRACE_LEVELS, RERANK=rerank and not tiled, num_warps=num_warps,
            **({} if SEARCH_MAXNREG is None else {"maxnreg": SEARCH_MAXNREG}),
        )  # fmt: skip
        if tiled:
            _rerank_tiles(q4[b], k_rows[b], beams, out[b], cfg, G, q.dtype, tile_unions)
        if keep and return_found:
            found[b] = beams.permute(1, 0, 2)
    return result()


def _rerank_tiles(q_row, k_row, beams, out_row, cfg: FreeSoloConfig, G: int, q_dtype, tile_unions) -> None:
    """`_fsb_rerank_tile_kernel` over one row: q_row fp32 [Hq, T, D], k_row [Hkv, T, D] (storage
    dtype), beams int32 [T, Hq, 2 * beam], out_row int64 [Hq, T, K] (written)."""
    T, Hq, W2 = beams.shape
    D = q_row.shape[-1]
    unions = tile_unions(beams[None], RERANK_TILE_ROWS)  # union int32 [Hq, NT, 32 * 2 * beam], count [Hq, NT]
    NT = unions.count.shape[1]
    dot16 = k_row.dtype in (torch.bfloat16, torch.float16) and q_dtype == k_row.dtype
    launch(_fsb_rerank_tile_kernel, (NT, Hq),
        q_row, k_row, beams, unions.union, unions.count, out_row, T, NT, G, Hq, float(D**-0.5), D,
        BLOCK_D=max(16, next_pow2(D)), CELL=cfg.cell, CELL_P=max(16, next_pow2(cfg.cell)), TQ=RERANK_TILE_ROWS,
        CPI=RERANK_TILE_CELLS,
        W2=W2, W2P=next_pow2(W2), U_MAX=unions.union.shape[-1], K=cfg.top_k, KP=next_pow2(cfg.top_k),
        DOT16=dot16, num_warps=4, num_stages=3,
    )  # fmt: skip


def decode_select_cells(state, qg: torch.Tensor, out=None, num_warps: int = 1) -> torch.Tensor:
    """FS-B selection of one decode step on the streaming state's forests (two launches: both
    forests' searches side by side, then the rerank; no host sync).

    Args:
        state: a `freesolo.streaming.torch_fsb.TorchFsbDeviceState` (float32 accumulation) whose
            position `state.pos` is the step's token (its block's forests built: the cells
            available to it, `(pos // block) * block // cell`, are read from `state.pos` on the device).
        qg: [B, Hkv, G, D] the step's unrotated queries (any float dtype; searched in float32).
        out: optional int64 [B, Hkv, G, K] contiguous tensor to write (default: a new one).
    Returns chosen cells int64 [B, Hkv, G, K] by (rho desc, c desc), -1 padded: the torch
    search's (`TorchFsbDeviceState._long_range`) except at float32 near-ties.
    """
    cfg, B, Hkv, G, D = state.cfg, state.B, state.Hkv, state.group, state.D
    if cfg.variant != "fsb":
        raise ValueError(f"decode_select_cells searches FS-B forests, the state's variant is {cfg.variant!r}")
    if state.acc != torch.float32:
        raise ValueError(f"the Triton FS-B decode search accumulates in float32, the state in {state.acc}")
    if tuple(qg.shape) != (B, Hkv, G, D) or not same_device(qg.device, state.device):
        raise ValueError(f"qg {tuple(qg.shape)} on {qg.device} must be [B={B}, Hkv={Hkv}, G={G}, D={D}] on {state.device}")
    K = cfg.top_k
    if state.cell_k.shape[2] > MAX_FOREST_CELLS:
        raise ValueError(f"the Triton FS-B search indexes at most {MAX_FOREST_CELLS} cells per forest")
    if out is None:
        out = torch.empty(B, Hkv, G, K, dtype=torch.int64, device=state.device)
    elif tuple(out.shape) != (B, Hkv, G, K) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous int64 [{B}, {Hkv}, {G}, {K}]")
    fa, fh = state.forest_all, state.forest_high
    base_a, base_h = fa.base_tensor(), fh.base_tensor()
    q_rows = qg.reshape(B, Hkv * G, D)  # a view for a step's q [B, 1, Hq, D]: read in place, no copy
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    WP = next_pow2(cfg.beam)
    found = torch.empty(B * Hkv * G, 2, WP, dtype=torch.int64, device=state.device)
    launch(_fsb_decode_search_kernel, (B * Hkv * G, 2),
        q_rows, state.pos,
        fa.mu, fa.rad, fa.A, fa.e, fa.cell, base_a, fh.mu, fh.rad, fh.A, fh.e, fh.cell, base_h,
        state.n_high, state.sigma.reshape(-1), state.lam.reshape(-1), found,
        q_rows.stride(0), q_rows.stride(1), fa.mu.shape[2], fh.mu.shape[2], Hkv, G,
        float(D**-0.5), float(cfg.radius_weight), float(2 * cfg.cell), D,
        BLOCK_D=next_pow2(D), CELL=cfg.cell, QBLOCK=cfg.block, W=cfg.beam, WP=WP, num_warps=num_warps,
    )  # fmt: skip
    launch(_fsb_decode_rerank_kernel, (B * Hkv * G,),
        q_rows, state.cell_k, found, out, q_rows.stride(0), q_rows.stride(1), state.cell_k.shape[2], Hkv, G,
        float(D**-0.5), D, BLOCK_D=next_pow2(D), CELL=cfg.cell, WP=WP, K=K,
        KP=next_pow2(K), num_warps=num_warps,
    )  # fmt: skip
    return out
