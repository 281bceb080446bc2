"""The FS-B prefill forests built by Triton kernels (spec §6.2-§6.3), issue 12.

`row_forests(k_row, cfg)` is the torch backend's `build_row_forests` (its content codes, tau test,
high-norm cells and stable sorts per dyadic segment stay torch ops) with two pieces in Triton:

1. `_row_stats_kernel`: one pass over the keys in their storage dtype (no float32 or float64 copy
   of k): per cell the float64 mean key and max key norm (the content codes and the tau test, as
   the torch backend computes them from a float64 copy of k) and their float32 roundings, the
   tables' kbar and a. For 16-bit keys the float64 sums of a cell are exact, so kbar64 and a64 are
   the torch backend's bits and kbar is the correctly rounded mean.
2. `_levels_kernel` and `_upper_level_kernel`: the node statistics of every tree of height h,
   written straight into the flat node table (`torch.fsb.NodeTable` layout; no per-level torch ops
   and no concatenation). A `_levels_kernel` program holds LEAF_BLOCK consecutive leaves (several
   whole trees when 2^h < LEAF_BLOCK) and makes levels 0 .. log2(LEAF_BLOCK) from that one load;
   each level above is one `_upper_level_kernel` launch, one program per node, two passes over
   its leaves (mean, then covering radius).

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
from ..torch.fsb import NodeTable, build_row_forests, segment_leaf_order, tree_nodes
from ._common import launch, next_pow2

__all__ = ["LEAF_BLOCK", "STATS_CELLS", "row_cell_stats", "cells_node_table", "row_forests"]

LEAF_BLOCK = 64  # leaves one `_levels_kernel` program holds (levels 0 .. 6 of every tree from one load)
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
def _levels_kernel(
    KBAR,  # fp32 [Hkv, C, D] cell means
    A,  # fp32 [Hkv, C] cell max key norms
    LEAF,  # int64 [Hkv, n]: the cell at each leaf of the height-h trees (leaf order, trees one after another)
    MU, RAD, AN, E, CELLID,  # the node table [Hkv, N_TAB(, D)]
    C,
    N_TAB,
    n,  # leaves of the height-h trees (a multiple of 2^h)
    base,  # flat id of the first height-h tree
    h,
    D,
    cell_size,
    outward,  # fp32 factor of the radii (1 + 8 eps)
    R: tl.constexpr,  # leaves per program (LEAF_BLOCK)
    LOG_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Levels 0 .. min(h, LOG_R) of the trees of height h over the leaves [pid * R, pid * R + R)."""
    g = tl.program_id(1).to(tl.int64)
    p0 = tl.program_id(0).to(tl.int64) * R
    p = p0 + tl.arange(0, R).to(tl.int64)
    ok = p < n
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    cell = tl.load(LEAF + g * n + p, mask=ok, other=0)
    x = tl.load(KBAR + (g * C + cell)[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    a = tl.load(A + g * C + cell, mask=ok, other=0.0)
    nodes_h = (2 << h) - 1
    for lvl in tl.static_range(LOG_R + 1):
        if lvl <= h:
            # (the group size 2^lvl and the node count R / 2^lvl written out: a constexpr cannot be
            # reassigned in an unrolled loop)
            xs = tl.reshape(x, [R >> lvl, 1 << lvl, BLOCK_D])
            mu = (tl.sum(xs.to(tl.float64), axis=1) / (1 << lvl)).to(tl.float32)  # [R >> lvl, BLOCK_D]
            diff = xs - tl.expand_dims(mu, 1)
            rad = tl.max(tl.sqrt_rn(tl.sum(diff * diff, axis=2)), axis=1)  # [R >> lvl]
            if lvl == 0:
                rad = rad * 0.0
            else:
                rad = rad * outward
            a_node = tl.max(tl.reshape(a, [R >> lvl, 1 << lvl]), axis=1)
            cell_min = tl.min(tl.reshape(cell, [R >> lvl, 1 << lvl]), axis=1)
            first = p0 + tl.arange(0, R >> lvl).to(tl.int64) * (1 << lvl)  # first leaf of each node
            tree = first >> h
            in_level = (first & ((1 << h) - 1)) >> lvl
            node = base + tree * nodes_h + ((2 << h) - (2 << (h - lvl))) + in_level
            cell_node = cell_min if lvl == 0 else cell_min * 0 - 1
            _store_nodes(MU, RAD, AN, E, CELLID, g, N_TAB, node, first < n, mu, rad, a_node, cell_min * cell_size,
                         cell_node, d, d_ok, D)  # fmt: skip


@triton.jit
def _upper_level_kernel(
    KBAR, A, LEAF, MU, RAD, AN, E, CELLID, C, N_TAB, n, base, h, lvl, D, cell_size, outward,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Level lvl > log2(R) of the trees of height h: one program per node u of the level (trees one
    after another), its 2^lvl leaves read R at a time, twice (the mean, then the covering radius)."""
    g = tl.program_id(1).to(tl.int64)
    u = tl.program_id(0).to(tl.int64)
    group = tl.full([], 1, tl.int64) << lvl
    p0 = u * group
    j = tl.arange(0, R).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    acc = tl.zeros([BLOCK_D], tl.float64)
    a_max = tl.zeros([R], tl.float32)
    cell_min = tl.full([R], 2**62, tl.int64)
    for s in range(0, group, R):
        cell = tl.load(LEAF + g * n + p0 + s + j)
        x = tl.load(KBAR + (g * C + cell)[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float64), axis=0)
        a_max = tl.maximum(a_max, tl.load(A + g * C + cell))
        cell_min = tl.minimum(cell_min, cell)
    mu = (acc / group.to(tl.float64)).to(tl.float32)  # [BLOCK_D]
    rad_sq = tl.zeros([R], tl.float32)
    for s in range(0, group, R):
        cell = tl.load(LEAF + g * n + p0 + s + j)
        x = tl.load(KBAR + (g * C + cell)[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
        diff = x - mu[None, :]
        rad_sq = tl.maximum(rad_sq, tl.sum(diff * diff, axis=1))
    # sqrt_rn is monotone: the max of the leaves' norms is the sqrt of the max of their squares
    rad = tl.sqrt_rn(tl.max(rad_sq, axis=0)) * outward
    tree = p0 >> h
    in_level = (p0 & ((1 << h) - 1)) >> lvl
    node = base + tree * ((2 << h) - 1) + ((2 << h) - (2 << (h - lvl))) + in_level
    one = tl.arange(0, 1).to(tl.int64)
    _store_nodes(MU, RAD, AN, E, CELLID, g, N_TAB, node + one, one == 0, mu[None, :], rad + one * 0.0,
                 tl.max(a_max, axis=0) + one * 0.0, tl.min(cell_min, axis=0) * cell_size + one * 0,
                 one - 1, d, d_ok, D)  # fmt: skip


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


def cells_node_table(kbar, a, cells, codes, M: int, cfg: FreeSoloConfig, outward: bool) -> NodeTable:
    """`torch.fsb.cells_node_table` with the node statistics made by Triton kernels: the trees over
    the elements cells (int64 [1, Hkv, M], None: every cell in order) of kbar fp32 [1, Hkv, C, D],
    a fp32 [1, Hkv, C]; codes int64 [1, Hkv, M] the elements' content codes."""
    if not outward:
        raise ValueError("the Triton node tables round radii outward (float32 statistics): pass outward=True")
    if kbar.dtype != torch.float32 or a.dtype != torch.float32:
        raise ValueError(f"kbar and a must be float32, got {kbar.dtype} and {a.dtype}")
    _, Hkv, C, D = kbar.shape
    dev = kbar.device
    H = M.bit_length() - 1 if M > 0 else -1
    base = [0]
    for h in range(H + 1):
        base.append(base[-1] + (M >> h) * tree_nodes(h))
    N = base[-1]
    mu = torch.empty(1, Hkv, N, D, dtype=torch.float32, device=dev)
    rad = torch.empty(1, Hkv, N, dtype=torch.float32, device=dev)
    A = torch.empty(1, Hkv, N, dtype=torch.float32, device=dev)
    e = torch.empty(1, Hkv, N, dtype=torch.int64, device=dev)
    cell_id = torch.empty(1, Hkv, N, dtype=torch.int64, device=dev)
    kbar, a = kbar.contiguous(), a.contiguous()
    log_r = LEAF_BLOCK.bit_length() - 1
    factor = 1.0 + 8 * torch.finfo(torch.float32).eps
    common = dict(BLOCK_D=next_pow2(D))
    for h in range(H + 1):
        n = (M >> h) << h  # elements covered by the complete segments of height h
        ranks = segment_leaf_order(codes[:, :, :n], h, cfg)  # the element at each leaf
        leaf = (ranks if cells is None else torch.gather(cells[:, :, :n], 2, ranks)).contiguous()
        args = (kbar, a, leaf, mu, rad, A, e, cell_id, C, N, n, base[h], h)
        launch(_levels_kernel, (triton.cdiv(n, LEAF_BLOCK), Hkv), *args, D, cfg.cell, factor,
               R=LEAF_BLOCK, LOG_R=log_r, num_warps=4, **common)  # fmt: skip
        for lvl in range(log_r + 1, h + 1):
            launch(_upper_level_kernel, (n >> lvl, Hkv), *args, lvl, D, cfg.cell, factor,
                   R=LEAF_BLOCK, num_warps=4, **common)  # fmt: skip
    return NodeTable(mu, rad, A, e, cell_id, torch.tensor(base, device=dev), H)


def row_forests(k: torch.Tensor, cfg: FreeSoloConfig) -> tuple:
    """Both FS-B forests of one row from k [1, Hkv, T, D] unrotated keys in their storage dtype:
    `torch.fsb.build_row_forests` (outward radii) with `row_cell_stats` and `cells_node_table` in Triton.
    Returns (SearchTables, high_prefix int64 [1, Hkv, C + 1])."""
    _check_row(k)
    return build_row_forests(k, cfg, outward=True, stats=row_cell_stats, node_table=cells_node_table)
