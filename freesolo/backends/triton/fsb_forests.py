"""The FS-B prefill forests built by Triton kernels (spec §6.2-§6.3), issue 12.

`row_forests(k_row, cfg)` is the torch backend's `build_row_forests` (its content codes, tau test,
high-norm cells and stable sorts per dyadic segment stay torch ops) with two pieces in Triton:

1. `_row_stats_kernel`: one pass over the keys in their storage dtype (no float32 or float64 copy
   of k): per cell the float64 mean key and max key norm (the content codes and the tau test, as
   the torch backend computes them from a float64 copy of k) and their float32 roundings, the
   tables' kbar and a. For 16-bit keys the float64 sums of a cell are exact, so kbar64 and a64 are
   the torch backend's bits and kbar is the correctly rounded mean.
2. The node statistics of every tree of height h, written straight into the flat node table
   (`torch.fsb.NodeTable` layout; no per-level torch ops and no concatenation), two passes over
   the leaves:
   - `_levels_kernel`: a program holds LEAF_BLOCK consecutive leaves (several whole trees when
     2^h < LEAF_BLOCK) and makes mu, A, e of levels 0 .. log2(LEAF_BLOCK), each level's float64
     sums from its children's (exact for the means of 16-bit keys, so in any order the bits of a
     direct sum); above that level `_upper_mu_kernel` (one launch per level, O(nodes)) does the
     same from the children's stored sums;
   - `_radius_kernel`: each program of LEAF_BLOCK leaves computes its leaves' distances to their
     ancestors' mu at every level, stores the radii of the nodes inside the block and merges its
     largest distance into each larger ancestor's radius by an atomic max (a max is the same in
     any order: deterministic bits).

Node statistics (spec §6.3): mu = mean of the leaves' kbar, summed in float64 and rounded once to
float32 (the torch backend averages in float32: the two differ in the last bits, so the searches
agree except at float32 near-ties); rad = max over the leaves of |kbar - mu| in float32, rounded
outward by (1 + 8 eps) as `build_segments(..., outward=True)`; A = max a; e = s * min cell.

H100 (s41 call2, bf16, H 16, D 64, FS-B defaults): the torch build took 116 ms at 1M (`benchmarks/
fsb_forest_phases.py`: 84 ms of it in the per-level ops of the two tables, 26 ms in the float32 and
float64 statistics).

Row independence (L12): one row at a time, programs read only that row's keys.
All pointer offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import FreeSoloConfig
from ..torch.fsb import NodeTable, SearchTables, build_row_forests, segment_leaf_order, tree_nodes
from ._common import launch, next_pow2

__all__ = ["LEAF_BLOCK", "STATS_CELLS", "UPPER_NODES", "cells_node_table", "forest_tables", "row_cell_stats", "row_forests"]

LEAF_BLOCK = 64  # leaves one `_levels_kernel` program holds (levels 0 .. 6 of every tree from one load)
UPPER_NODES = 16  # nodes one `_upper_mu_kernel` program makes
STATS_CELLS = 2  # cells one `_row_stats_kernel` program reduces (a [2, 32, 64] float64 tile at the paper sizes)


@triton.jit
def _row_stats_kernel(
    K,  # [Hkv, T, D] contiguous keys (storage dtype), one batch row
    KBAR,  # fp32 [Hkv, C, D]
    A,  # fp32 [Hkv, C]
    KBAR64,  # fp64 [Hkv, C, D]
    A64,  # fp64 [Hkv, C]
    T,
    C,
    D,
    CELL: tl.constexpr,
    CELL_P: tl.constexpr,
    CB: tl.constexpr,  # cells per program
    BLOCK_D: tl.constexpr,
):
    g = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0).to(tl.int64) * CB + tl.arange(0, CB).to(tl.int64)  # [CB] cells
    t = tl.arange(0, CELL_P).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    c_ok = c < C
    d_ok = d < D
    pos = c[:, None, None] * CELL + t[None, :, None]  # [CB, CELL_P, 1] token positions
    mask = c_ok[:, None, None] & (t < CELL)[None, :, None] & d_ok[None, None, :]
    x = tl.load(K + (g * T + pos) * D + d[None, None, :], mask=mask, other=0.0).to(tl.float64)  # [CB, CELL_P, BLOCK_D]
    mean = tl.sum(x, axis=1) / CELL  # [CB, BLOCK_D]
    # sqrt is monotone and (float64) correctly rounded: the max of the token norms = the torch backend's
    # amax of sqrt; padded tokens have norm 0 <= every real norm
    a64 = tl.max(tl.sqrt(tl.sum(x * x, axis=2)), axis=1)  # [CB]
    rows = g * C + c
    row_mask = c_ok[:, None] & d_ok[None, :]
    tl.store(KBAR64 + rows[:, None] * D + d[None, :], mean, mask=row_mask)
    tl.store(KBAR + rows[:, None] * D + d[None, :], mean.to(tl.float32), mask=row_mask)
    tl.store(A64 + rows, a64, mask=c_ok)
    tl.store(A + rows, a64.to(tl.float32), mask=c_ok)


@triton.jit
def _store_nodes(MU, RAD, AN, E, CELLID, g, N_TAB, node, ok, mu, rad, a_node, e_node, cell_node, d, d_ok, D):
    """Rows node [M] of (b = 0, kv head g)'s node table: mu [M, BLOCK_D], rad / A fp32, e / cell int64 [M]."""
    rows = g * N_TAB + node
    tl.store(MU + rows[:, None] * D + d[None, :], mu, mask=ok[:, None] & d_ok[None, :])
    tl.store(RAD + rows, rad, mask=ok)
    tl.store(AN + rows, a_node, mask=ok)
    tl.store(E + rows, e_node, mask=ok)
    tl.store(CELLID + rows, cell_node, mask=ok)


@triton.jit
def _node_ids(base, first, h, lvl):
    """Flat ids of the level-lvl nodes of the height-h trees (tree t at base + t * nodes(h), levels
    0 .. h inside it, `torch.fsb.level_offset`) whose first leaves are `first` (leaf positions, trees one
    after another). Levels above h (masked nodes of `_levels_kernel`) get some id, never a negative shift
    (h and lvl may both be constexprs: Triton makes an int argument equal to 1 one)."""
    level_offset = (2 << h) - (2 << tl.maximum(h - lvl, 0))
    return base + (first >> h) * ((2 << h) - 1) + level_offset + ((first & ((1 << h) - 1)) >> lvl)


@triton.jit
def _load_leaves(KBAR, LEAF, g, n, C, D, R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The leaves [pid * R, pid * R + R) of the height-h trees of kv head g (past n: masked):
    (p int64 [R] leaf positions, ok [R], d int64 [BLOCK_D], d_ok, cell int64 [R], x fp32 [R, BLOCK_D] their kbar)."""
    p = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    ok = p < n
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    cell = tl.load(LEAF + g * n + p, mask=ok, other=0)
    x = tl.load(KBAR + (g * C + cell)[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    return p, ok, d, d_ok, cell, x


@triton.jit
def _levels_kernel(
    KBAR,  # fp32 [Hkv, C, D] cell means
    A,  # fp32 [Hkv, C] cell max key norms
    LEAF,  # int64 [Hkv, n]: the cell at each leaf of the height-h trees (leaf order, trees one after another)
    MU, RAD, AN, E, CELLID,  # the node table: kv head g's node x at row g * N_TAB + x (of D values in MU)
    SUMS,  # fp64 [Hkv, n / R, D]: the float64 sums of the level-LOG_R nodes (written when STORE_SUMS)
    C,
    N_TAB,
    n,  # leaves of the height-h trees (a multiple of 2^h)
    base,  # flat id of the first height-h tree
    h,
    D,
    cell_size,
    R: tl.constexpr,  # leaves per program (LEAF_BLOCK)
    LOG_R: tl.constexpr,
    STORE_SUMS: tl.constexpr,  # h > LOG_R: the levels above are made from these sums
    BLOCK_D: tl.constexpr,
):
    """mu, A, e and cell of levels 0 .. min(h, LOG_R) of the trees of height h over the leaves
    [pid * R, pid * R + R), each level's float64 sums from its children's (levels above h, groups
    across trees, are computed and not stored). The radii are `_radius_kernel`'s."""
    g = tl.program_id(1).to(tl.int64)
    p0 = tl.program_id(0).to(tl.int64) * R
    p, ok, d, d_ok, cell, x = _load_leaves(KBAR, LEAF, g, n, C, D, R, BLOCK_D)
    sums = x.to(tl.float64)
    a_node = tl.load(A + g * C + cell, mask=ok, other=0.0)
    cell_min = cell
    for lvl in tl.static_range(LOG_R + 1):
        # (sizes written out, R >> lvl nodes of 1 << lvl leaves: a constexpr cannot be reassigned in an unrolled loop)
        if lvl > 0:  # a level's float64 sums (exact for 16-bit keys' means), A and e from its children's
            sums = tl.sum(tl.reshape(sums, [R >> lvl, 2, BLOCK_D]), axis=1)
            a_node = tl.max(tl.reshape(a_node, [R >> lvl, 2]), axis=1)
            cell_min = tl.min(tl.reshape(cell_min, [R >> lvl, 2]), axis=1)
        mu = (sums / (1 << lvl)).to(tl.float32)  # [R >> lvl, BLOCK_D]
        cell_node = cell_min if lvl == 0 else tl.full([R >> lvl], -1, tl.int64)
        first = p0 + tl.arange(0, R >> lvl).to(tl.int64) * (1 << lvl)  # first leaf of each node
        _store_nodes(MU, RAD, AN, E, CELLID, g, N_TAB, _node_ids(base, first, h, lvl), (first < n) & (lvl <= h),
                     mu, tl.zeros([R >> lvl], tl.float32), a_node, cell_min * cell_size, cell_node, d, d_ok, D)  # fmt: skip
    if STORE_SUMS:
        row = g * (n // R) + tl.program_id(0).to(tl.int64)
        tl.store(SUMS + row * D + d, tl.reshape(sums, [BLOCK_D]), mask=d_ok)


@triton.jit
def _upper_mu_kernel(
    SUMS_IN,  # fp64 [Hkv, n >> (lvl - 1), D]: the sums of level lvl - 1's nodes
    SUMS_OUT,  # fp64 [Hkv, n >> lvl, D]: written
    MU, RAD, AN, E, CELLID, N_TAB, n, base, h, lvl, D,
    NB: tl.constexpr,  # nodes per program
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """mu, A, e and cell of the level-lvl nodes (lvl > log2(LEAF_BLOCK)) from their two children: the
    float64 sums add (exact for 16-bit keys' means), A is their max, e their min. The radius is
    `_radius_kernel`'s (rad is left 0 here)."""
    g = tl.program_id(1).to(tl.int64)
    u = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB).to(tl.int64)  # [NB] nodes of the level
    ok = u < (n >> lvl)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    m = ok[:, None] & d_ok[None, :]
    rows_in = g * (n >> (lvl - 1)) + 2 * u
    s = tl.load(SUMS_IN + rows_in[:, None] * D + d[None, :], mask=m, other=0.0)
    s += tl.load(SUMS_IN + (rows_in + 1)[:, None] * D + d[None, :], mask=m, other=0.0)
    tl.store(SUMS_OUT + (g * (n >> lvl) + u)[:, None] * D + d[None, :], s, mask=m)
    first = u << lvl
    left = g * N_TAB + _node_ids(base, first, h, lvl - 1)
    right = g * N_TAB + _node_ids(base, first + (1 << (lvl - 1)), h, lvl - 1)
    a_node = tl.maximum(tl.load(AN + left, mask=ok, other=0.0), tl.load(AN + right, mask=ok, other=0.0))
    e_node = tl.minimum(tl.load(E + left, mask=ok, other=0), tl.load(E + right, mask=ok, other=0))
    mu = (s / (tl.full([], 1, tl.int64) << lvl).to(tl.float64)).to(tl.float32)
    _store_nodes(MU, RAD, AN, E, CELLID, g, N_TAB, _node_ids(base, first, h, lvl), ok, mu, tl.zeros([NB], tl.float32),
                 a_node, e_node, tl.full([NB], -1, tl.int64), d, d_ok, D)  # fmt: skip


@triton.jit
def _leaf_distances(x, MU, row_base, node, valid, d, d_ok, D):
    """|x - mu| per leaf: x fp32 [R, BLOCK_D] leaves, node int64 [R] their ancestors' flat ids (mu rows
    gathered per leaf; not read where `valid` is False), float32 differences, correctly rounded sqrt: fp32 [R]."""
    mu = tl.load(MU + (row_base + node)[:, None] * D + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    diff = x - mu
    return tl.sqrt_rn(tl.sum(diff * diff, axis=1))


@triton.jit
def _radius_kernel(
    KBAR, LEAF, MU, RAD, C, N_TAB, n, base, h, D, outward,
    R: tl.constexpr,
    LOG_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The covering radii of levels 1 .. h (every mu made beforehand) over the leaves [pid * R, pid * R + R):
    rad = outward * max over a node's leaves of |leaf - mu|. Levels <= LOG_R (nodes inside the block):
    the max of each group of leaves, stored; levels above (the block inside one node): the block's max,
    merged into RAD (zeroed beforehand) by an atomic max, the same bits in any order."""
    g = tl.program_id(1).to(tl.int64)
    p0 = tl.program_id(0).to(tl.int64) * R
    p, ok, d, d_ok, cell, x = _load_leaves(KBAR, LEAF, g, n, C, D, R, BLOCK_D)
    row_base = g * N_TAB
    for lvl in tl.static_range(1, LOG_R + 1):
        far = _leaf_distances(x, MU, row_base, _node_ids(base, p, h, lvl), ok & (lvl <= h), d, d_ok, D)
        # x * outward is monotone in x: the max of the scaled distances is the scaled max
        far = tl.max(tl.reshape(far, [R >> lvl, 1 << lvl]), axis=1) * outward
        first = p0 + tl.arange(0, R >> lvl).to(tl.int64) * (1 << lvl)
        tl.store(RAD + row_base + _node_ids(base, first, h, lvl), far, mask=(first < n) & (lvl <= h))
    for lvl in range(LOG_R + 1, h + 1):  # (here 2^h >= 2^lvl > R: the block is whole, inside one node)
        ancestor = _node_ids(base, p0, h, lvl)
        block_far = tl.max(_leaf_distances(x, MU, row_base, ancestor + p * 0, ok, d, d_ok, D), axis=0) * outward
        tl.atomic_max(RAD + row_base + ancestor, block_far, sem="relaxed")


def _check_row(k: torch.Tensor) -> None:
    if k.dim() != 4 or k.shape[0] != 1:
        raise ValueError(f"k must be one row [1, Hkv, T, D], got {tuple(k.shape)}")
    if k.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"k must be float16 / bfloat16 / float32, got {k.dtype}")


def row_cell_stats(k: torch.Tensor, cell: int) -> tuple:
    """`torch.fsb.row_cell_stats` in one Triton pass over k [1, Hkv, T, D] (storage dtype):
    (kbar fp32 [1, Hkv, C, D], a fp32 [1, Hkv, C], kbar64 fp64, a64 fp64), C = T // cell."""
    _check_row(k)
    _, Hkv, T, D = k.shape
    C = T // cell
    k = k.contiguous()
    kbar = torch.empty(1, Hkv, C, D, dtype=torch.float32, device=k.device)
    kbar64 = torch.empty(1, Hkv, C, D, dtype=torch.float64, device=k.device)
    a = torch.empty(1, Hkv, C, dtype=torch.float32, device=k.device)
    a64 = torch.empty(1, Hkv, C, dtype=torch.float64, device=k.device)
    if C * Hkv == 0:
        return kbar, a, kbar64, a64
    launch(_row_stats_kernel, (triton.cdiv(C, STATS_CELLS), Hkv),
        k, kbar, a, kbar64, a64, T, C, D,
        CELL=cell, CELL_P=next_pow2(cell), CB=STATS_CELLS, BLOCK_D=next_pow2(D), num_warps=4,
    )  # fmt: skip
    return kbar, a, kbar64, a64


def _bases(M: int) -> list:
    """Flat id of the first tree of each height 0 .. H of a forest over M elements, then its node count."""
    base = [0]
    for h in range((M.bit_length() - 1) + 1 if M > 0 else 0):
        base.append(base[-1] + (M >> h) * tree_nodes(h))
    return base


def _empty_fields(Hkv: int, N: int, D: int, device) -> dict:
    """Node-table fields (`torch.fsb.TREE_FIELDS`) of N nodes per kv head; rad zeroed (the radius kernel's
    atomic maxima start from 0)."""
    return {
        "mu": torch.empty(1, Hkv, N, D, dtype=torch.float32, device=device),
        "rad": torch.zeros(1, Hkv, N, dtype=torch.float32, device=device),
        "A": torch.empty(1, Hkv, N, dtype=torch.float32, device=device),
        "e": torch.empty(1, Hkv, N, dtype=torch.int64, device=device),
        "cell": torch.empty(1, Hkv, N, dtype=torch.int64, device=device),
    }


def cells_node_table(kbar, a, cells, codes, M: int, cfg: FreeSoloConfig, outward: bool, out: dict | None = None) -> NodeTable:
    """`torch.fsb.cells_node_table` with the node statistics made by Triton kernels: the trees over
    the elements cells (int64 [1, Hkv, M], None: every cell in order) of kbar fp32 [1, Hkv, C, D],
    a fp32 [1, Hkv, C]; codes int64 [1, Hkv, M] the elements' content codes. out: the fields to
    write (as `_empty_fields` makes them, of exactly this table's nodes), e.g. views of a joined table."""
    if not outward:
        raise ValueError("the Triton node tables round radii outward (float32 statistics): pass outward=True")
    if kbar.dtype != torch.float32 or a.dtype != torch.float32:
        raise ValueError(f"kbar and a must be float32, got {kbar.dtype} and {a.dtype}")
    _, Hkv, C, D = kbar.shape
    dev = kbar.device
    base = _bases(M)
    H, N = len(base) - 2, base[-1]
    out = _empty_fields(Hkv, N, D, dev) if out is None else out
    mu, rad, A, e, cell_id = (out[name] for name in ("mu", "rad", "A", "e", "cell"))
    # the kernels address node rows as kv head * stride + node: the stride of a kv head's rows, N for a table
    # of its own, the joined table's node count for a slice of it
    stride = rad.stride(1)
    if any(x.shape[2] != N or x.stride(1) != stride * (D if x.dim() == 4 else 1) for x in (mu, rad, A, e, cell_id)):
        raise ValueError(f"out must hold {N} nodes a kv head, its fields laid out alike")
    kbar, a = kbar.contiguous(), a.contiguous()
    R = LEAF_BLOCK
    log_r = R.bit_length() - 1
    factor = 1.0 + 8 * torch.finfo(torch.float32).eps
    block_d = next_pow2(D)
    for h in range(H + 1):
        n = (M >> h) << h  # elements covered by the complete segments of height h
        ranks = segment_leaf_order(codes[:, :, :n], h, cfg)  # the element at each leaf
        leaf = (ranks if cells is None else torch.gather(cells[:, :, :n], 2, ranks)).contiguous()
        upper = h > log_r  # levels above log_r: from the level-log_r sums, then the radii
        sums = torch.empty(Hkv, n >> log_r if upper else 1, D, dtype=torch.float64, device=dev)
        launch(_levels_kernel, (triton.cdiv(n, R), Hkv),
            kbar, a, leaf, mu, rad, A, e, cell_id, sums, C, stride, n, base[h], h, D, cfg.cell,
            R=R, LOG_R=log_r, STORE_SUMS=upper, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
        for lvl in range(log_r + 1, h + 1):
            sums_up = torch.empty(Hkv, n >> lvl, D, dtype=torch.float64, device=dev)
            launch(_upper_mu_kernel, (triton.cdiv(n >> lvl, UPPER_NODES), Hkv),
                sums, sums_up, mu, rad, A, e, cell_id, stride, n, base[h], h, lvl, D,
                NB=UPPER_NODES, BLOCK_D=block_d, num_warps=4,
            )  # fmt: skip
            sums = sums_up
        if h > 0:
            launch(_radius_kernel, (triton.cdiv(n, R), Hkv),
                kbar, leaf, mu, rad, C, stride, n, base[h], h, D, factor, R=R, LOG_R=log_r, BLOCK_D=block_d, num_warps=4,
            )  # fmt: skip
    return NodeTable(mu, rad, A, e, cell_id, torch.tensor(base, device=dev), H)


def forest_tables(kbar, a, forests: list, cfg: FreeSoloConfig, outward: bool) -> SearchTables:
    """`torch.fsb.search_tables` with Triton node tables: the forests [(cells, codes, M), ...] built
    into one joined table, each forest a slice of it (no concatenation: at 1M, H 16, D 64 the copy
    took 4 ms and 6.9 GB)."""
    _, Hkv, _, D = kbar.shape
    sizes = [_bases(M)[-1] for _, _, M in forests]
    joined = _empty_fields(Hkv, sum(sizes), D, kbar.device)
    tables, start = [], 0
    for (cells, codes, M), size in zip(forests, sizes):
        part = {name: x[:, :, start : start + size] for name, x in joined.items()}
        tables.append(cells_node_table(kbar, a, cells, codes, M, cfg, outward, out=part))
        start += size
    return SearchTables(tables, joined=joined)


def row_forests(k: torch.Tensor, cfg: FreeSoloConfig) -> tuple:
    """Both FS-B forests of one row from k [1, Hkv, T, D] unrotated keys in their storage dtype:
    `torch.fsb.build_row_forests` (outward radii) with `row_cell_stats` and `forest_tables` in Triton.
    Returns (SearchTables, high_prefix int64 [1, Hkv, C + 1])."""
    _check_row(k)
    return build_row_forests(k, cfg, outward=True, stats=row_cell_stats, tables=forest_tables)
