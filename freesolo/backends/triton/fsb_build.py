"""One-launch rebuild of an FS-B streaming tree slot (spec §6.2-§6.3) with Triton.

`build_tree_slot` builds the perfect tree of height h over the 2^h elements starting at
`first[b, g]`, for every (b, kv head) row whose `changed[b, g]` is set, and writes it straight
into the node table slot [lo, lo + nodes(h)) (the `NodeTable` layout of one segment: levels
0..h in order, level l holding 2^(h-l) nodes, node i of level l covering sorted leaves
[i * 2^l, (i + 1) * 2^l)). It is `build_segments(part, h, cfg, outward)` of the torch backend
(`freesolo.backends.torch.fsb`) with part = those 2^h elements, without its ~12 torch ops per
level: at most a gather of the codes and a stable `torch.sort` (leaf order "content"), then ONE
kernel launch for all levels of all rows. No host synchronisation: the kernel reads `changed`
on the device, and a row whose flag is False returns at once (its slot is left bit-for-bit).

Grid: (2^(h-c+1) - 1, B * Hkv), with CH = 2^c leaves per chunk (c = min(h, log2 of a register
budget / padded D), e.g. 64 leaves at float32 D 64). Per row, the programs form a perfect tree of
height h - c:

- 2^(h-c) "bottom" programs, one per chunk of CH consecutive sorted leaves: each loads its CH
  leaves ([CH, D_P] in registers) once and writes levels 0..c of its chunk (CH >> l nodes at
  level l, a whole number of nodes), the sums pairwise from level to level, the radius from the
  leaves held in registers;
- 2^(h-l) "top" programs per level l in c+1..h, one per node: two passes over the node's 2^l
  leaves in blocks of TB (<= 128) leaves, masked past the node (the sum, compensated across
  blocks, with max a and min cell; then the covering radius about the node's own mean).

Work per row: O(2^h * (h + 1) * D) (each level visits every leaf once or twice); the programs of
the top levels come first in launch order (the longest ones start first). The critical path is
the root's program: 2 * 2^h leaf visits in one program (H200, float32, D 64, 16 rows: about
2 ms at h = 15, 74 ms at h = 20); shortening it needs the top nodes split across programs, i.e.
a second launch or a grid-wide dependency (mean before radius). All pointer offsets
are int64. Accumulation in the table's dtype (float32 or float64).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import MAX_HEAD_DIM, launch, next_pow2, same_device  # (importing _common also patches the interpreter for NumPy >= 2.4)

__all__ = ["build_tree_slot", "warm_up_builds"]

MAX_TREE_HEIGHT = 25
LEAF_ORDERS = ("content", "position")
_REGISTER_BUDGET = {torch.float32: 4096, torch.float64: 2048}  # elements of a [CH, D_P] leaf tile
_MAX_LOG_CHUNK = 8  # at most 256 leaves per chunk (levels 0..8 unrolled in a bottom program)
# Top blocks: at most 128 leaves and 16384 elements ([TB, D_P]), 4 warps. On an H200 (h = 15,
# 16 rows, content order), 128 leaves with 4 warps was within 20% of the best of the tiles tried
# (64-512 leaves, 4 or 8 warps) for float32 D 64 / D 128 and float64 D 64: 2.3 / 4.5 / 4.2 ms.
_TOP_REGISTER_BUDGET = {torch.float32: 16384, torch.float64: 16384}
_MAX_LOG_TOP_BLOCK = 7
_NUM_WARPS = 4
_MAX_GRID_ROWS = 65535  # grid axis 1
# _NO_FP_FUSION: the build kernel is compiled with enable_fp_fusion=False. With fusion, the
# radius's `tl.sum(diff * diff)` over D contracts the squares into FMAs along the reduction's
# butterfly, so lanes that hold the same reduced element can round it differently (by an ulp),
# and on small trees (few leaves: the reduced tensor is replicated across lanes) those lanes
# store their different values to the same shared-memory slot: s32 call3's racecheck of the
# decode reported these write-write hazards (1-ulp different values, threads of different
# warps), so the radius's last bit could depend on the order the warps' stores land in
# (triton-lang/triton#7264). Plain adds are commutative: every lane then holds the same bits.


def _tree_nodes(h: int) -> int:
    return (2 << h) - 1


@triton.jit
def _level_offset(h, level):
    """Index of the first node of `level` in a tree of height h (int64)."""
    return (2 << h) - (2 << (h - level))


@triton.jit
def _load_leaves(KBAR, AV, CELLS, PERM, row, first, S, elem_row, j, lmask, d, dmask, D: tl.constexpr, CONTENT: tl.constexpr):
    """Sorted leaves j [C] (int64) of a row where lmask [C]: kbar [C, D_P] (zeros past D and where
    masked), a [C] (-inf where masked), cell ids [C] (2^62 where masked)."""
    if CONTENT:
        pos = tl.load(PERM + row * S + j, mask=lmask, other=0)  # position of the leaf in the segment
    else:
        pos = j
    eidx = elem_row + first + pos
    x = tl.load(KBAR + eidx[:, None] * D + d[None, :], mask=lmask[:, None] & dmask[None, :], other=0.0)
    av = tl.load(AV + eidx, mask=lmask, other=float("-inf"))
    return x, av, tl.load(CELLS + eidx, mask=lmask, other=2**62)


@triton.jit
def _bottom_chunk(
    MU, RAD, A_T, E_T, CELL_T, KBAR, AV, CELLS, PERM, row, first, S, elem_row, node_row, h, chunk, cell,
    D: tl.constexpr, D_P: tl.constexpr, LOG_CH: tl.constexpr, CONTENT: tl.constexpr, OUTWARD: tl.constexpr,
    OUT_SCALE: tl.constexpr,
):
    """Chunk `chunk` of CH = 2^LOG_CH sorted leaves: its nodes of levels 0..LOG_CH (CH >> l at
    level l), the leaves loaded once, the sums pairwise from level to level."""
    CH: tl.constexpr = 1 << LOG_CH
    d = tl.arange(0, D_P)
    dmask = d < D
    j = chunk * CH + tl.arange(0, CH).to(tl.int64)  # sorted leaf ids
    x, av, cid = _load_leaves(KBAR, AV, CELLS, PERM, row, first, S, elem_row, j, j >= 0, d, dmask, D, CONTENT)
    node = node_row + j  # level 0 starts at offset 0
    tl.store(MU + node[:, None] * D + d[None, :], x, mask=dmask[None, :])
    tl.store(RAD + node, tl.zeros([CH], dtype=x.dtype))
    tl.store(A_T + node, av)
    tl.store(E_T + node, cid * cell)
    tl.store(CELL_T + node, cid)
    sums = x
    amax = av
    cmin = cid
    for level in tl.static_range(1, LOG_CH + 1):
        # shapes inline (a constexpr name cannot be rebound per unrolled level, and the
        # interpreter turns plain assignments into tensors): CH >> level nodes of 2^level leaves
        sums = tl.sum(tl.reshape(sums, [CH >> level, 2, D_P]), axis=1)  # pairwise sums of the children
        amax = tl.max(tl.reshape(amax, [CH >> level, 2]), axis=1)
        cmin = tl.min(tl.reshape(cmin, [CH >> level, 2]), axis=1)
        mu = sums * (1.0 / (1 << level))  # exact: a power-of-two scaling
        diff = tl.reshape(x, [CH >> level, 1 << level, D_P]) - mu[:, None, :]
        rad = tl.max(tl.sqrt(tl.sum(diff * diff, axis=2)), axis=1)  # [CH >> level]
        if OUTWARD:
            rad = rad + rad * OUT_SCALE
        node = node_row + _level_offset(h, level) + chunk * (CH >> level) + tl.arange(0, CH >> level).to(tl.int64)
        tl.store(MU + node[:, None] * D + d[None, :], mu, mask=dmask[None, :])
        tl.store(RAD + node, rad)
        tl.store(A_T + node, amax)
        tl.store(E_T + node, cmin * cell)
        tl.store(CELL_T + node, tl.full([CH >> level], -1, tl.int64))


@triton.jit
def _top_node(
    MU, RAD, A_T, E_T, CELL_T, KBAR, AV, CELLS, PERM, row, first, S, elem_row, node_row, h, level, index, cell,
    D: tl.constexpr, D_P: tl.constexpr, LOG_TB: tl.constexpr, CONTENT: tl.constexpr, OUTWARD: tl.constexpr,
    OUT_SCALE: tl.constexpr,
):
    """Node `index` of level `level`: two passes over its 2^level leaves in blocks of
    TB = 2^LOG_TB (masked past the node): the sum compensated across blocks, max a, min cell id;
    then the radius about the mean."""
    TB: tl.constexpr = 1 << LOG_TB
    DT = KBAR.dtype.element_ty
    d = tl.arange(0, D_P)
    dmask = d < D
    width = 1 << level  # leaves of the node
    nblk = (width + TB - 1) >> LOG_TB
    leaf0 = index << level
    lane = tl.arange(0, TB).to(tl.int64)
    acc = tl.zeros([D_P], dtype=DT)
    comp = tl.zeros([D_P], dtype=DT)
    amax = tl.full([], float("-inf"), DT)
    cmin = tl.full([], 2**62, tl.int64)
    for blk in range(nblk):
        k = blk * TB + lane
        x, av, cid = _load_leaves(KBAR, AV, CELLS, PERM, row, first, S, elem_row, leaf0 + k, k < width, d, dmask, D, CONTENT)
        y = tl.sum(x, axis=0) - comp  # Kahan: the blocks' sums, compensated
        t = acc + y
        comp = (t - acc) - y
        acc = t
        amax = tl.maximum(amax, tl.max(av, axis=0))
        cmin = tl.minimum(cmin, tl.min(cid, axis=0))
    mu = acc * (1.0 / width.to(DT))  # exact: a power-of-two scaling
    rad = tl.zeros([], dtype=DT)
    for blk in range(nblk):
        k = blk * TB + lane
        x, av, cid = _load_leaves(KBAR, AV, CELLS, PERM, row, first, S, elem_row, leaf0 + k, k < width, d, dmask, D, CONTENT)
        diff = x - mu[None, :]
        dist = tl.where(k < width, tl.sqrt(tl.sum(diff * diff, axis=1)), 0.0)
        rad = tl.maximum(rad, tl.max(dist, axis=0))
    if OUTWARD:
        rad = rad + rad * OUT_SCALE
    node = node_row + _level_offset(h, level) + index
    tl.store(MU + node * D + d, mu, mask=dmask)
    tl.store(RAD + node, rad)
    tl.store(A_T + node, amax)
    tl.store(E_T + node, cmin * cell)
    tl.store(CELL_T + node, tl.full([], -1, tl.int64))


@triton.jit(do_not_specialize=["N", "M", "lo", "h", "cell"])  # one compile per tile shape, not per size
def _build_tree_kernel(
    MU,  # [R, N, D] table means (DT)
    RAD,  # [R, N] (DT)
    A_T,  # [R, N] (DT)
    E_T,  # [R, N] int64
    CELL_T,  # [R, N] int64
    KBAR,  # [R, M, D] (DT), position order
    AV,  # [R, M] (DT)
    CELLS,  # [R, M] int64
    PERM,  # [R, 2^h] int64 sorted leaf -> position in the segment (CONTENT only)
    FIRST,  # [R] int64 first element of the segment
    CHANGED,  # [R] uint8 (a bool tensor's bytes)
    N,  # nodes per row of the table
    M,  # elements per row
    lo,  # flat node id of the slot
    h,  # tree height
    cell,  # tokens per cell
    D: tl.constexpr,
    D_P: tl.constexpr,
    LOG_CH: tl.constexpr,
    LOG_TB: tl.constexpr,
    CONTENT: tl.constexpr,
    OUTWARD: tl.constexpr,
    OUT_SCALE: tl.constexpr,  # 8 * eps(DT), a power of two: rad + rad * OUT_SCALE == rad * (1 + 8 eps)
):
    """Grid (2^(h - LOG_CH + 1) - 1, R): per row, a perfect tree of programs of height
    hp = h - LOG_CH, its top first: program ids [0, 2^hp - 1) are the nodes of levels > LOG_CH
    (top level first), the last 2^hp the bottom chunks."""
    row = tl.program_id(1).to(tl.int64)
    if tl.load(CHANGED + row) == 0:
        return
    h64 = h.to(tl.int64)
    hp = h64 - LOG_CH  # height of the tree of programs
    pid = (2 << hp) - 2 - tl.program_id(0).to(tl.int64)  # reversed: the longest programs launch first
    first = tl.load(FIRST + row)
    S = 1 << h64  # leaves
    elem_row = row * M
    node_row = row * N + lo
    if pid < (1 << hp):
        _bottom_chunk(
            MU, RAD, A_T, E_T, CELL_T, KBAR, AV, CELLS, PERM, row, first, S, elem_row, node_row, h64, pid, cell,
            D, D_P, LOG_CH, CONTENT, OUTWARD, OUT_SCALE,
        )
    else:
        # level LOG_CH + L (L >= 1) holds program ids [2^(hp+1) - 2^(hp-L+1), 2^(hp+1) - 2^(hp-L))
        L = hp * 0 + 1  # int64
        for k in range(2, hp + 1):
            L += (pid >= (2 << hp) - (2 << (hp - k))).to(tl.int64)
        index = pid - ((2 << hp) - (2 << (hp - L)))
        _top_node(
            MU, RAD, A_T, E_T, CELL_T, KBAR, AV, CELLS, PERM, row, first, S, elem_row, node_row, h64, L + LOG_CH,
            index, cell, D, D_P, LOG_TB, CONTENT, OUTWARD, OUT_SCALE,
        )


def _log_chunk(h: int, D_P: int, dtype: torch.dtype) -> int:
    """log2 of the leaves per chunk: the largest power of two with CH * D_P within the register
    budget, at most 2^_MAX_LOG_CHUNK and 2^h."""
    ch = max(1, min(1 << _MAX_LOG_CHUNK, _REGISTER_BUDGET[dtype] // D_P))
    return min(h, ch.bit_length() - 1)


def _log_top_block(h: int, D_P: int, dtype: torch.dtype) -> int:
    """log2 of the leaves per block of a top program: a larger tile than a chunk (a top program
    holds one block and a [D_P] sum; more loads in flight on its long, latency-bound loops)."""
    tb = max(1, min(1 << _MAX_LOG_TOP_BLOCK, _TOP_REGISTER_BUDGET[dtype] // D_P))
    return min(h, tb.bit_length() - 1)


def _check(fields, lo, elems, first, changed, h, cell, leaf_order):
    """ValueError on any bad input; returns (B, Hkv, N, M, D, dtype)."""
    if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h <= MAX_TREE_HEIGHT:
        raise ValueError(f"h={h!r} must be an int in [0, {MAX_TREE_HEIGHT}]")
    if leaf_order not in LEAF_ORDERS:
        raise ValueError(f"leaf_order={leaf_order!r} must be one of {LEAF_ORDERS}")
    if not isinstance(cell, int) or isinstance(cell, bool) or cell <= 0:
        raise ValueError(f"cell={cell!r} must be a positive int")
    if not isinstance(lo, int) or isinstance(lo, bool) or lo < 0:
        raise ValueError(f"lo={lo!r} must be a non-negative int")
    for name in ("mu", "rad", "A", "e", "cell"):
        if name not in fields or not isinstance(fields[name], torch.Tensor):
            raise ValueError(f"fields[{name!r}] is missing or not a tensor")
    need = ("kbar", "a", "cells", "codes") if leaf_order == "content" else ("kbar", "a", "cells")
    for name in need:
        if name not in elems or not isinstance(elems[name], torch.Tensor):
            raise ValueError(f"elems[{name!r}] is missing or not a tensor")
    mu = fields["mu"]
    if mu.dim() != 4:
        raise ValueError(f"fields['mu'] must be [B, Hkv, N, D], got shape {tuple(mu.shape)}")
    B, Hkv, N, D = mu.shape
    dtype = mu.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the table dtype must be float32 or float64, got {dtype}")
    if D % 2 != 0 or not 2 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} must be even and in [2, {MAX_HEAD_DIM}]")
    kbar = elems["kbar"]
    if kbar.dim() != 4 or tuple(kbar.shape[:2]) != (B, Hkv) or kbar.shape[3] != D:
        raise ValueError(f"elems['kbar'] must be [B={B}, Hkv={Hkv}, M, D={D}], got shape {tuple(kbar.shape)}")
    M = kbar.shape[2]
    if M < (1 << h):
        raise ValueError(f"elems hold M={M} elements per row, fewer than the 2^h={1 << h} leaves of a tree")
    if lo + _tree_nodes(h) > N:
        raise ValueError(f"the slot [lo={lo}, {lo + _tree_nodes(h)}) of a height-{h} tree exceeds the table's N={N} nodes")
    expect = {
        ("fields", "mu"): ((B, Hkv, N, D), dtype),
        ("fields", "rad"): ((B, Hkv, N), dtype),
        ("fields", "A"): ((B, Hkv, N), dtype),
        ("fields", "e"): ((B, Hkv, N), torch.int64),
        ("fields", "cell"): ((B, Hkv, N), torch.int64),
        ("elems", "kbar"): ((B, Hkv, M, D), dtype),
        ("elems", "a"): ((B, Hkv, M), dtype),
        ("elems", "cells"): ((B, Hkv, M), torch.int64),
    }
    if leaf_order == "content":
        expect[("elems", "codes")] = ((B, Hkv, M), torch.int64)
    dev = mu.device
    for (group, name), (shape, dt) in expect.items():
        t = (fields if group == "fields" else elems)[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{group}[{name!r}] must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != dt:
            raise ValueError(f"{group}[{name!r}] must be {dt}, got {t.dtype}")
        if not same_device(t.device, dev):
            raise ValueError(f"{group}[{name!r}] is on {t.device}, the table on {dev}")
        if not t.is_contiguous():
            raise ValueError(f"{group}[{name!r}] must be contiguous")
    for name, t, dt in (("first", first, torch.int64), ("changed", changed, torch.bool)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor")
        if tuple(t.shape) != (B, Hkv):
            raise ValueError(f"{name} must have shape {(B, Hkv)}, got {tuple(t.shape)}")
        if t.dtype != dt:
            raise ValueError(f"{name} must be {dt}, got {t.dtype}")
        if not same_device(t.device, dev):
            raise ValueError(f"{name} is on {t.device}, the table on {dev}")
    if B * Hkv > _MAX_GRID_ROWS:
        raise ValueError(f"B * Hkv = {B * Hkv} rows exceed the grid's {_MAX_GRID_ROWS}")
    return B, Hkv, N, M, D, dtype


def _build_tree_slot(
    fields, lo, elems, first, changed, h, cell, leaf_order, outward, log_chunk=None, log_top_block=None, num_warps=None,
    first_host=None, check=True,
) -> None:  # fmt: skip
    """`build_tree_slot` with optional tile sizes: chunks of 2^log_chunk leaves, top blocks of
    2^log_top_block leaves (tests: small tiles exercise the top programs' block loops and masks
    on small trees), and num_warps."""
    if check:
        B, Hkv, N, M, D, dtype = _check(fields, lo, elems, first, changed, h, cell, leaf_order)
    else:
        B, Hkv, N, D = fields["mu"].shape
        M, dtype = elems["kbar"].shape[2], fields["mu"].dtype
    R = B * Hkv
    if R == 0:
        return
    D_P = next_pow2(D)
    c = _log_chunk(h, D_P, dtype) if log_chunk is None else min(int(log_chunk), h)
    tb = _log_top_block(h, D_P, dtype) if log_top_block is None else min(int(log_top_block), h)
    S = 1 << h
    first = first.contiguous()
    changed_u8 = changed.contiguous().view(torch.uint8)
    content = leaf_order == "content"
    if content and first_host is not None:  # one start for every row: the codes' slice is a view
        if not 0 <= first_host <= M - S:
            raise ValueError(f"first_host={first_host} must be in [0, M - 2^h = {M - S}]")
        perm = torch.sort(elems["codes"][:, :, first_host : first_host + S], dim=-1, stable=True).indices
    elif content:
        # rows without a new tree (changed False) gather clamped indices: their perm is never read
        idx = (first.clamp(min=0)[..., None] + torch.arange(S, device=first.device)).clamp_(max=M - 1)
        perm = torch.sort(torch.gather(elems["codes"], 2, idx), dim=-1, stable=True).indices  # (B, Hkv, 2^h)
    else:
        perm = first  # never read
    out_scale = 8 * torch.finfo(dtype).eps  # 2^-20 / 2^-49: exact in float32
    grid = ((2 << (h - c)) - 1, R)
    launch(_build_tree_kernel, grid,
        fields["mu"],
        fields["rad"],
        fields["A"],
        fields["e"],
        fields["cell"],
        elems["kbar"],
        elems["a"],
        elems["cells"],
        perm,
        first,
        changed_u8,
        N,
        M,
        lo,
        h,
        cell,
        D=D,
        D_P=D_P,
        LOG_CH=c,
        LOG_TB=tb,
        CONTENT=content,
        OUTWARD=bool(outward),
        OUT_SCALE=out_scale,
        num_warps=_NUM_WARPS if num_warps is None else num_warps,
        enable_fp_fusion=False,  # see _NO_FP_FUSION
    )


_WARMED: set = set()


def warm_up_builds(D: int, dtype: torch.dtype, device, leaf_order: str, outward: bool) -> None:
    """Compile every variant of the build kernel that trees of any height use for these (D,
    dtype, device, leaf order, outward), once per process: the chunk and top-block sizes are
    compile-time constants equal to min(h, their cap), so heights 0 .. max cap + 1 cover every
    tree (integer sizes are not specialized). A cache calls it at allocation, so that no block
    boundary of a decode loop waits seconds for a compile (Triton's disk cache makes later
    processes fast). Each launch builds nothing (`changed` all False)."""
    device = torch.device(device)
    key = (D, dtype, str(device), leaf_order, bool(outward))
    if key in _WARMED:
        return
    D_P = next_pow2(D)
    heights, seen = [], set()
    for h in range(MAX_TREE_HEIGHT + 1):
        shape = (_log_chunk(h, D_P, dtype), _log_top_block(h, D_P, dtype), h > 0)
        if shape not in seen:
            seen.add(shape)
            heights.append(h)
    H = max(heights) + 1
    if H not in heights:
        heights.append(H)  # the first height with both caps reached and top programs present
    for h in heights:
        n = 1 << h
        nodes = (2 << h) - 1
        fields = {
            "mu": torch.zeros(1, 1, nodes, D, dtype=dtype, device=device),
            "rad": torch.zeros(1, 1, nodes, dtype=dtype, device=device),
            "A": torch.zeros(1, 1, nodes, dtype=dtype, device=device),
            "e": torch.zeros(1, 1, nodes, dtype=torch.int64, device=device),
            "cell": torch.zeros(1, 1, nodes, dtype=torch.int64, device=device),
        }
        elems = {
            "kbar": torch.zeros(1, 1, n, D, dtype=dtype, device=device),
            "a": torch.zeros(1, 1, n, dtype=dtype, device=device),
            "cells": torch.zeros(1, 1, n, dtype=torch.int64, device=device),
            "codes": torch.zeros(1, 1, n, dtype=torch.int64, device=device),
        }
        first = torch.zeros(1, 1, dtype=torch.int64, device=device)
        changed = torch.zeros(1, 1, dtype=torch.bool, device=device)
        build_tree_slot(fields, 0, elems, first, changed, h, 1, leaf_order, outward)
    _WARMED.add(key)


def build_tree_slot(
    fields: dict,
    lo: int,
    elems: dict,
    first: torch.Tensor,
    changed: torch.Tensor,
    h: int,
    cell: int,
    leaf_order: str,
    outward: bool,
    first_host: Optional[int] = None,
    check: bool = True,
) -> None:
    """Rebuild the tree slot [lo, lo + 2^(h+1) - 1) of every changed (b, kv head) row, in place.

    fields: the node table, contiguous, on one device: "mu" [B, Hkv, N, D], "rad" / "A"
        [B, Hkv, N] in the accumulation dtype (float32 or float64), "e" / "cell" [B, Hkv, N] int64.
    lo: flat node id of the slot; the tree's levels 0..h follow in order, level l holding
        2^(h-l) nodes (the `NodeTable` layout of one segment).
    elems: contiguous, position order: "kbar" [B, Hkv, M, D] and "a" [B, Hkv, M] in the
        accumulation dtype, "cells" [B, Hkv, M] int64, "codes" [B, Hkv, M] int64 (read for
        leaf_order "content" only). M >= 2^h.
    first: int64 [B, Hkv] (device): the tree of row (b, g) is over elements
        first[b, g] .. first[b, g] + 2^h - 1 (< M where changed).
    changed: bool [B, Hkv] (device): rows to rebuild; the others are not written (bit-for-bit).
    h: tree height in [0, 25]; cell: tokens per cell (e = min cell id * cell);
    leaf_order: "content" (stable sort by code) or "position"; outward: scale the radius of
        levels >= 1 by (1 + 8 eps(dtype)).
    first_host: optional host int equal to every entry of `first` (the all-cells forest: one
        count for every row): the codes are sorted from a slice, without the index gather.
    check: validate the inputs (False: a caller that built them, e.g. `ForestTable`, skips the
        ~50 us of host checks per launch).

    Equals `build_segments(part, h, cfg, outward)` (torch backend) on the 2^h elements at
    `first`, up to the rounding of mu and rad (pairwise / compensated sums; e, cell, A exact);
    rad covers the node's leaves about the stored mu. One kernel launch (plus, for "content",
    a gather of the codes and a stable sort); no host synchronisation.
    """
    from .backend import on_device_of

    with on_device_of(first):  # first's CUDA device current while the kernels launch
        _build_tree_slot(fields, lo, elems, first, changed, h, cell, leaf_order, outward, first_host=first_host, check=check)
