"""FS-B prefill beam search for a tile of queries at once, level by level (spec §6.4; issue 12).

`fsb_search._fsb_search_kernel` searches one (query, query head) per program: at 1M tokens (H 16,
D 64) its programs load ~15 G node rows between them, and s44's Nsight Compute found the L1 data
pipe 82-92 % busy and the schedulers issuing most cycles. The queries of one query block share their
forests (the same n), and their beams overlap: 64 of them evaluate ~50-70 distinct nodes a level
between them where each alone evaluates up to 2 * beam (`benchmarks/fsb_prefill_floor.py`,
`level_union_stats`). This kernel runs the same search for TILE_Q consecutive queries of one block
and one query head per program, keeping the tile's frontier as a union:

- U: the distinct nodes of the tile's frontiers (<= UNION nodes: int32 flat id p, tree key tk,
  index in level g, as `_search_forest` holds them) and F [TILE_Q, WP]: each query's frontier
  slots as indices into U (-1 = empty), slot order = the beam's rank order.
- A level: the children of U are the columns 2j + b (node j's child b); their node rows are loaded
  once per tile (CHUNK columns at a time, only as many chunks as U has children) and scored against
  the whole tile with one dot ([TILE_Q, D] x [D, CHUNK], fp32 inputs, "tf32x3" on the GPU); each
  query gathers its own children's dots (columns 2 F + b), adds the radius and prior terms of its
  children, and takes its W best with the root of height l by the one-query kernel's selection
  (one descending sort of packed int64 keys: key bits, index in level, lane), 2D.
- The new union: the columns picked by any query (a histogram of the picked columns, a prefix sum
  for their new indices, a sort for the list), at most UNION; a tile whose union would outgrow it
  raises its overflow flag and `fsb_search` searches its queries again with the one-query kernel.

The keys are the one-query kernel's up to float32 rounding (another order of the dot's sums), so
beams and selections equal it except at float32 near-ties. All pointer offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fsb_search import _INT64_MIN, _sort_key

__all__ = ["TILE_Q", "UNION", "CHUNK"]

TILE_Q = 32  # queries a program (a divisor of the query block)
UNION = 128  # distinct frontier nodes a tile may hold a level (s43 level_union_stats, 32 iid queries: up to ~90)
CHUNK = 64  # children columns scored per dot


@triton.jit
def _tile_search_forest(n, base_ptr, q_tile, qnorm, pos, row_ok, sig, lm, node0, mu_ptr, rad_ptr, a_ptr, e_ptr,
                        cell_ptr, scale, radius_weight, two_cell, D, N, TQ: tl.constexpr, BLOCK_D: tl.constexpr,
                        W: tl.constexpr, WP: tl.constexpr, UP: tl.constexpr, CH: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Beam search of one forest over its first n elements for a tile of TQ queries.

    q_tile fp32 [TQ, BLOCK_D] (zero past D and on rows past T), qnorm / pos fp32 [TQ], row_ok [TQ];
    sig / lm the query head's sigma / lambda; node0 the kv head's first row in the tables; base_ptr
    as `_search_forest`'s (seg_scale 1). Returns (cells int64 [TQ, WP] (-1 = none), overflow int32:
    1 when some level's union exceeded UP nodes, and then the cells are not the search's)."""
    NB: tl.constexpr = 4 * UP  # histogram bins: children columns [0, 2 UP), the root 2 UP, the empty bin NB - 1
    slots = tl.arange(0, WP)
    lane = tl.arange(0, 2 * WP)
    u = tl.arange(0, UP)
    bins = tl.arange(0, NB)
    d = tl.arange(0, BLOCK_D)
    u_p = tl.zeros([UP], dtype=tl.int32)
    u_tk = tl.zeros([UP], dtype=tl.int32)
    u_g = tl.zeros([UP], dtype=tl.int32)
    u_n = tl.full([], 0, tl.int32)
    f = tl.full([TQ, WP], -1, tl.int32)
    overflow = tl.full([], 0, tl.int32)
    top = -1
    while (n >> (top + 1)) > 0:
        top += 1
    for t in range(0, top + 1):
        lvl = top - t
        # the union's children: column 2j + b
        first = 2 * u_p - u_tk
        c_p = tl.reshape(tl.join(first, first + 1), [2 * UP])
        c_tk = tl.reshape(tl.join(u_tk, u_tk), [2 * UP])
        c_g = tl.reshape(tl.join(2 * u_g, 2 * u_g + 1), [2 * UP])
        # each query's candidate children: lane 2s + b = child b of its slot s
        f_ok = f >= 0
        cols = tl.reshape(tl.join(2 * f, 2 * f + 1), [TQ, 2 * WP])
        c_ok = tl.reshape(tl.join(f_ok, f_ok), [TQ, 2 * WP])
        cols = tl.where(c_ok, cols, 0)
        flat_cols = tl.reshape(cols, [TQ * 2 * WP])
        ch_p = tl.reshape(tl.gather(c_p, flat_cols, 0), [TQ, 2 * WP])
        ch_g = tl.reshape(tl.gather(c_g, flat_cols, 0), [TQ, 2 * WP])
        # q . mu of every child of the union for the whole tile, CH columns a dot; each query keeps its own
        dot = tl.zeros([TQ, 2 * WP], dtype=tl.float32)
        for c0 in range(0, 2 * u_n, CH):
            col = c0 + tl.arange(0, CH)
            col_ok = col < 2 * u_n
            rows = node0 + tl.gather(c_p, tl.minimum(col, 2 * UP - 1), 0)
            mu = tl.load(mu_ptr + rows[:, None] * D + d[None, :], mask=col_ok[:, None] & (d[None, :] < D), other=0.0)
            s = tl.dot(q_tile, tl.trans(mu), input_precision=DOT_PRECISION)  # [TQ, CH]
            in_chunk = (cols >= c0) & (cols < c0 + CH)
            picked = tl.gather(s, tl.minimum(tl.maximum(cols - c0, 0), CH - 1), 1)
            dot = tl.where(in_chunk, picked, dot)
        ch_rows = node0 + ch_p
        rad = tl.load(rad_ptr + ch_rows, mask=c_ok, other=0.0)
        amax = tl.load(a_ptr + ch_rows, mask=c_ok, other=0.0)
        e = tl.load(e_ptr + ch_rows, mask=c_ok, other=0).to(tl.float32)
        prior = lm * amax * tl.math.erf(sig * (pos[:, None] - e) / two_cell)
        c_key = scale * (dot + radius_weight * qnorm[:, None] * rad) + prior
        # the root of the tree of height lvl (bit lvl of n), the same node for every query of the tile
        has_root = ((n >> lvl) & 1) == 1
        r_start = ((n >> (lvl + 1)) << (lvl + 1)).to(tl.int32)
        r_tb = (tl.load(base_ptr + lvl) + (r_start >> lvl) * ((2 << lvl) - 1)).to(tl.int32)
        r_tk = r_tb + (2 << lvl)
        r_p = r_tk - 2
        r_g = r_start >> lvl
        r_row = node0 + tl.where(has_root, r_p, 0)
        r_mu = tl.load(mu_ptr + r_row * D + d, mask=has_root & (d < D), other=0.0)
        r_rad = tl.load(rad_ptr + r_row, mask=has_root, other=0.0)
        r_amax = tl.load(a_ptr + r_row, mask=has_root, other=0.0)
        r_e = tl.load(e_ptr + r_row, mask=has_root, other=0).to(tl.float32)
        r_key = scale * (tl.sum(q_tile * r_mu[None, :], 1) + radius_weight * qnorm * r_rad) + lm * r_amax * tl.math.erf(
            sig * (pos - r_e) / two_cell
        )  # [TQ]
        # each query's new frontier: `_search_forest`'s selection, one row per query
        c_packed = tl.where(c_ok, _sort_key(c_key, ch_g) | lane[None, :].to(tl.int64), _INT64_MIN)
        ranked = tl.sort(c_packed, 1, descending=True)  # [TQ, 2 WP]
        r_packed = _sort_key(r_key, r_g)  # [TQ]
        best = tl.gather(ranked, tl.broadcast_to(slots[None, :], [TQ, WP]), 1)
        rank = tl.sum(((best > r_packed[:, None]) & (slots[None, :] < W)).to(tl.int32), 1)  # [TQ]
        take_root = has_root & (rank < W) & row_ok
        is_root = take_root[:, None] & (slots[None, :] == rank[:, None])
        pick = tl.gather(ranked, tl.where(take_root[:, None] & (slots[None, :] > rank[:, None]), slots[None, :] - 1,
                                          slots[None, :]), 1)  # fmt: skip
        from_child = (pick != _INT64_MIN) & ~is_root
        at = (pick & (2 * WP - 1)).to(tl.int32)
        new_ok = (slots[None, :] < W) & (is_root | from_child) & row_ok[:, None]
        new_col = tl.where(is_root, 2 * UP, tl.gather(cols, at, 1))
        new_col = tl.where(new_ok, new_col, NB - 1)  # [TQ, WP]: a child column, the root (2 UP) or empty (NB - 1)
        # the new union: the picked columns in column order
        flat_new = tl.reshape(new_col, [TQ * WP])
        used = (tl.histogram(flat_new, NB) > 0) & (bins < NB - 1)
        new_index = tl.cumsum(used.to(tl.int32), 0) - 1  # [NB]
        n_new = tl.sum(used.to(tl.int32), 0)
        overflow = tl.maximum(overflow, (n_new > UP).to(tl.int32))
        order = tl.sort(tl.where(used, bins, NB + bins), 0)  # the used bins first, ascending
        take = tl.gather(order, u, 0)  # [UP]
        take_child = tl.minimum(take, 2 * UP - 1)
        is_r = take == 2 * UP
        u_ok = u < n_new
        u_p = tl.where(u_ok, tl.where(is_r, r_p, tl.gather(c_p, take_child, 0)), 0)
        u_tk = tl.where(u_ok, tl.where(is_r, r_tk, tl.gather(c_tk, take_child, 0)), 0)
        u_g = tl.where(u_ok, tl.where(is_r, r_g, tl.gather(c_g, take_child, 0)), 0)
        u_n = tl.minimum(n_new, UP)
        f = tl.reshape(tl.gather(new_index, flat_new, 0), [TQ, WP])
        f = tl.where(new_ok & (f < UP), f, -1)
    leaf = tl.reshape(tl.gather(u_p, tl.reshape(tl.maximum(f, 0), [TQ * WP]), 0), [TQ, WP])
    tl.device_assert(((leaf >= 0) & (leaf < N)) | (f < 0), "FS-B tile search: leaf id out of its table")
    cells = tl.load(cell_ptr + node0 + leaf, mask=f >= 0, other=-1)
    return cells, overflow


@triton.jit
def _fsb_tile_search_kernel(
    q_ptr,  # fp32 [Hq, T, D]: one row, heads first (query head hq = h * G + g)
    mu_ptr,  # fp32 [Hkv, N, D]: both forests' node tables (SearchTables)
    rad_ptr,  # fp32 [Hkv, N]
    a_ptr,  # fp32 [Hkv, N]
    e_ptr,  # int64 [Hkv, N]
    cell_ptr,  # int64 [Hkv, N]
    base_ptr,  # int64 [2, HB]
    hp_ptr,  # int64 [Hkv, C + 1]: high-norm cells among the first c
    sigma_ptr,  # fp32 [Hq]
    lam_ptr,  # fp32 [Hq]
    found_ptr,  # int32 [T, Hq, 2 W]: each forest's beam (slot = rank), as the one-query kernel stores it
    overflow_ptr,  # int32 [NT, Hq]: 1 where the tile's union outgrew UP (its beams are then not written)
    T,
    N,
    C1,
    HB,
    G,
    Hq,
    scale,
    radius_weight,
    two_cell,
    D,
    BLOCK_D: tl.constexpr,
    CELL: tl.constexpr,
    QBLOCK: tl.constexpr,
    TQ: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    UP: tl.constexpr,
    CH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    h = hq // G
    i0 = tile * TQ
    i = i0 + tl.arange(0, TQ)
    row_ok = i < T
    d = tl.arange(0, BLOCK_D)
    q_tile = tl.load(q_ptr + (hq * T + i)[:, None] * D + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    qnorm = tl.sqrt(tl.sum(q_tile * q_tile, 1))
    pos = i.to(tl.float32)
    sig = tl.load(sigma_ptr + hq)
    lm = tl.load(lam_ptr + hq)
    node0 = h * N
    n_all = (i0 // QBLOCK) * QBLOCK // CELL  # cells available to the tile's block (TQ divides QBLOCK)
    n_high = tl.load(hp_ptr + h * C1 + n_all)
    found_all, over_all = _tile_search_forest(n_all, base_ptr, q_tile, qnorm, pos, row_ok, sig, lm, node0, mu_ptr,
                                              rad_ptr, a_ptr, e_ptr, cell_ptr, scale, radius_weight, two_cell, D, N, TQ,
                                              BLOCK_D, W, WP, UP, CH, DOT_PRECISION)  # fmt: skip
    found_high, over_high = _tile_search_forest(n_high, base_ptr + HB, q_tile, qnorm, pos, row_ok, sig, lm, node0,
                                                mu_ptr, rad_ptr, a_ptr, e_ptr, cell_ptr, scale, radius_weight, two_cell,
                                                D, N, TQ, BLOCK_D, W, WP, UP, CH, DOT_PRECISION)  # fmt: skip
    overflow = tl.maximum(over_all, over_high)
    tl.store(overflow_ptr + tile * Hq + hq, overflow)
    slots = tl.arange(0, WP)
    ok = row_ok[:, None] & (slots[None, :] < W) & (overflow == 0)
    row = found_ptr + (i * Hq + hq)[:, None] * (2 * W) + slots[None, :]
    tl.store(row, found_all.to(tl.int32), mask=ok)
    tl.store(row + W, found_high.to(tl.int32), mask=ok)
