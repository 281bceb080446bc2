"""FS-B selection of the torch backend (spec §6), under torch.no_grad.

Construction (vectorized over batch rows and kv heads, one pass per tree height h):
every aligned dyadic segment [m*2^h, (m+1)*2^h) of a forest's elements is a tree; its leaves
are the segment's elements stably sorted by content code (or kept in position order), and each
level's node statistics (mu, rad, A, e) are reductions over groups of 2^l consecutive leaves.
All trees of all heights live in one flat node table per (b, kv head); a node's flat id is
`base[h] + m * (2^(h+1) - 1) + level_offset(h, l) + index`. Work: O(M log^2 M * D) per forest.

Search (vectorized over the queries of a chunk, all query heads, batch rows, and both forests:
`beam_search_forests`, one op per level for the two, as the search is launch-bound on a GPU): a
Python loop over levels from the tallest height down to 0 keeps a frontier of `beam` nodes per
query and forest. At level l
the candidates are the children of the frontier plus the root of the tree of height l (when bit
l of the block's element count is set; at the tallest height that root alone forms the
frontier, as in the oracle). Exact tie-break: candidates are first sorted by their global index
in the level (start/2^l + index: the order of (segment start, index in level)), then a stable
descending sort on the key. Rerank by rho = logsumexp over the cell's tokens, ties larger c.

Row independence (spec L12): one batch row at a time, its queries padded to whole search chunks
(padded cells are available to padded blocks only), search and rerank chunks of fixed sizes, all
buffers of fixed widths (2*beam+1 candidates, 2*beam found cells, beam*s... tokens). A node's
statistics are reductions over its own leaves; levels above a query's tallest tree leave its
frontier empty, so the number of levels (which grows with T) does not reach its bits.
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig
from ...reference.forest import QUANT_SCALE, hyperplanes
from ._ops import cell_stats, pad_time, padded_length, take_rows
from .selection import topk_cells

__all__ = [
    "TREE_FIELDS",
    "NodeTable",
    "SearchTables",
    "beam_search",
    "beam_search_forests",
    "block_element_counts",
    "build_row_forests",
    "cells_node_table",
    "row_cell_stats",
    "build_node_table",
    "build_segments",
    "content_codes",
    "fsb_bytes_per_query",
    "fsb_select",
    "row_candidates",
    "search_tables",
    "segment_leaf_order",
    "level_offset",
    "tree_nodes",
]


def fsb_bytes_per_query(B: int, Hq: int, D: int, cfg: FreeSoloConfig, itemsize: int) -> tuple[int, int]:
    """Transient bytes per query position of (the beam search, the rerank) of FS-B selection, for
    B rows (the backend passes B = 1: it selects one row at a time)."""
    beam = 2 * 6 * (2 * cfg.beam + 1) * (D + 8)  # both forests: keys, node statistics, integer node ids
    rerank = 2 * cfg.beam * cfg.cell * (D + 2)  # gathered tokens of the <= 2*beam cells, logits
    return B * Hq * itemsize * beam, B * Hq * itemsize * rerank


def content_codes(kbar64: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """kbar64 [B, Hkv, M, D] float64, planes [Hkv, r, D] (+-1) -> int64 codes [B, Hkv, M] (spec §6.2).

    Q(x) = rint(x * 2^12) is integral and the projections are sums of D such integers: float64
    represents them exactly (well below 2^53), so the matmul is exact integer arithmetic.
    """
    r = planes.shape[1]
    qk = torch.round(kbar64 * QUANT_SCALE)  # (B, Hkv, M, D), integral float64 (rint: ties to even)
    proj = torch.einsum("bhmd,hrd->bhmr", qk, planes.to(torch.float64))  # (B, Hkv, M, r), exact
    # 2^(r-1-b), made on the device (a host list would be a host-to-device copy: a stream sync)
    weights = torch.bitwise_left_shift(torch.ones(r, dtype=torch.int64, device=kbar64.device),
                                       torch.arange(r - 1, -1, -1, device=kbar64.device))  # fmt: skip
    return ((proj > 0).to(torch.int64) * weights).sum(dim=-1)


class NodeTable:
    """All trees of one forest kind, for every (b, kv head): flat node arrays.

    mu [B, Hkv, N, D], rad / A [B, Hkv, N], e / cell [B, Hkv, N] int64 (cell: the leaf's cell
    index at level 0, -1 elsewhere); base[h] = flat id of tree 0 of height h (the tree of segment
    m at base[h] + m * nodes(h)). one_tree_per_height: the table holds only the trees a forest over
    the searched counts uses, one per height, each at base[h] whatever its segment (the streaming
    state's `ForestTable`).
    """

    def __init__(self, mu, rad, A, e, cell, base, max_height, one_tree_per_height: bool = False):
        self.mu, self.rad, self.A, self.e, self.cell = mu, rad, A, e, cell
        self.base = base  # int64 tensor [max_height + 2]
        self.max_height = max_height
        self.one_tree_per_height = one_tree_per_height


TREE_FIELDS = ("mu", "rad", "A", "e", "cell")


def tree_nodes(h: int) -> int:
    """Nodes of a perfect tree of height h."""
    return (2 << h) - 1


def segment_leaf_order(codes: torch.Tensor, h: int, cfg: FreeSoloConfig) -> torch.Tensor:
    """The leaves of the trees of height h over codes int64 [B, Hkv, n] (n a multiple of 2^h, position
    order): int64 [B, Hkv, n], the element at each leaf (aligned segments of 2^h elements, each stably
    sorted by code for cfg.leaf_order "content", in position order otherwise; spec §6.2)."""
    B, Hkv, n = codes.shape
    size = 1 << h
    nseg = n // size
    if cfg.leaf_order == "content":
        perm = torch.sort(codes.reshape(B, Hkv, nseg, size), dim=-1, stable=True).indices
    else:
        perm = torch.arange(size, device=codes.device).expand(B, Hkv, nseg, size)
    return (torch.arange(nseg, device=codes.device)[:, None] * size + perm).reshape(B, Hkv, n)


def build_segments(elems: dict, h: int, cfg: FreeSoloConfig, outward: bool) -> dict:
    """The trees of height h over consecutive aligned segments of 2^h elements (spec §6.2-§6.3).

    elems: kbar [B, Hkv, n, D], a [B, Hkv, n], cells / codes int64 [B, Hkv, n], n = nseg * 2^h,
    in position order. Leaves: stable sort by code (= the stable merge of the two children's
    sorted leaves, a carry) or position order. Returns mu [B, Hkv, nseg * nodes(h), D] and rad,
    A, e, cell [B, Hkv, nseg * nodes(h)], levels 0..h inside each tree (the NodeTable layout).
    """
    kbar, a, cells, codes = elems["kbar"], elems["a"], elems["cells"], elems["codes"]
    B, Hkv, n, D = kbar.shape
    size = 1 << h
    nseg = n // size
    dev = kbar.device
    ranks = segment_leaf_order(codes, h, cfg)
    kb = torch.gather(kbar, 2, ranks[..., None].expand(B, Hkv, n, D))  # (B, Hkv, n, D)
    aa = torch.gather(a, 2, ranks)
    cc = torch.gather(cells, 2, ranks)
    levels = {name: [] for name in TREE_FIELDS}
    for level in range(h + 1):
        g = 1 << level
        grp = kb.reshape(B, Hkv, nseg, size // g, g, D)  # (B, Hkv, nseg, nodes at level, 2^level, D)
        mu = grp.mean(dim=-2) if g > 1 else grp[..., 0, :]
        if g > 1:  # exact covering radius over the leaves, rounded outward below float64
            rad = torch.linalg.vector_norm(grp - mu[..., None, :], dim=-1).amax(dim=-1)
            if outward:
                rad = rad * (1.0 + 8 * torch.finfo(rad.dtype).eps)
        else:
            rad = torch.zeros(mu.shape[:-1], dtype=kb.dtype, device=dev)
        e = cc.reshape(B, Hkv, nseg, size // g, g).amin(dim=-1) * cfg.cell
        levels["mu"].append(mu)
        levels["rad"].append(rad)
        levels["A"].append(aa.reshape(B, Hkv, nseg, size // g, g).amax(dim=-1))
        levels["e"].append(e)
        levels["cell"].append(cc.reshape(B, Hkv, nseg, size) if level == 0 else torch.full_like(e, -1))
    out = {}
    for name, parts in levels.items():
        t = torch.cat(parts, dim=3)  # (B, Hkv, nseg, nodes(h)[, D])
        out[name] = t.reshape(B, Hkv, nseg * tree_nodes(h), *t.shape[4:])
    return out


def build_node_table(kbar, a, cells, codes, M: int, cfg: FreeSoloConfig, outward: bool) -> NodeTable:
    """Trees over the element sequences kbar [B, Hkv, M, D], a [B, Hkv, M], cells / codes int64
    [B, Hkv, M] (position order; elements past a row's own count are never read).
    `outward`: round the radius up (float32 computation)."""
    B, Hkv, _, D = kbar.shape
    dev = kbar.device
    parts = {name: [] for name in TREE_FIELDS}
    base = [0]
    H = M.bit_length() - 1 if M > 0 else -1
    for h in range(H + 1):
        n = (M >> h) << h  # elements covered by the complete segments of height h
        elems = {"kbar": kbar[:, :, :n], "a": a[:, :, :n], "cells": cells[:, :, :n], "codes": codes[:, :, :n]}
        trees = build_segments(elems, h, cfg, outward)
        for name in TREE_FIELDS:
            parts[name].append(trees[name])
        base.append(base[-1] + (M >> h) * tree_nodes(h))
    if H < 0:
        z = kbar.new_zeros(B, Hkv, 0)
        zi = torch.zeros(B, Hkv, 0, dtype=torch.int64, device=dev)
        return NodeTable(kbar.new_zeros(B, Hkv, 0, D), z, z, zi, zi, torch.tensor(base, device=dev), H)
    cat = {name: torch.cat(v, dim=2) for name, v in parts.items()}
    return NodeTable(cat["mu"], cat["rad"], cat["A"], cat["e"], cat["cell"], torch.tensor(base, device=dev), H)


def level_offset(h, l: int):
    """Index of the first node of level l in a tree of height h (a tensor or an int)."""
    return (1 << (h + 1)) - (1 << (h - l + 1))


class SearchTables:
    """The node tables of several forests, searched together (one beam per forest, one op per
    level for all of them: the search is launch-bound on a GPU, so two forests in one pass halve
    its launches). One forest: the table's own tensors (no copy); several: concatenated along the
    node axis once (forest f's ids shifted by the nodes of the forests before it).

    mu [B, Hkv, N, D], rad / A [B, Hkv, N], e / cell int64 [B, Hkv, N]; base int64
    [F, max_height + 2] (flat id of tree 0 of height h in forest f; unused heights 0);
    segment_scale int64 [F] (NodeTable.one_tree_per_height: 0, else 1).
    """

    def __init__(self, tables: list, joined: dict | None = None):
        """joined: {field: tensor} of all the tables one after another along the node axis, when the
        tables are already views of them (`triton.fsb_forests.forest_tables`: no concatenation)."""
        self.max_height = max(t.max_height for t in tables)
        width = self.max_height + 2
        offsets, offset = [], 0
        for t in tables:
            offsets.append(offset)
            offset += t.mu.shape[2]
        if joined is not None:
            if any(joined[name].shape[2] != offset for name in TREE_FIELDS):
                raise ValueError(f"joined fields must hold the tables' {offset} nodes")
            fields = joined
        elif len(tables) == 1:
            fields = {name: getattr(tables[0], name) for name in TREE_FIELDS}
        else:
            fields = {name: torch.cat([getattr(t, name) for t in tables], dim=2) for name in TREE_FIELDS}
        self.mu, self.rad, self.A, self.e, self.cell = (fields[name] for name in TREE_FIELDS)
        base = torch.zeros(len(tables), max(width, 1), dtype=torch.int64, device=self.mu.device)
        for f, (t, off) in enumerate(zip(tables, offsets)):
            h = min(width, t.base.shape[0])
            base[f, :h] = t.base[:h] + off
        self.base = base
        # per forest: 1 if the tree of segment m sits at base[h] + m * nodes(h), 0 if one per height
        scale = [0 if getattr(t, "one_tree_per_height", False) else 1 for t in tables]
        self.segment_scale = torch.tensor(scale, dtype=torch.int64, device=self.mu.device)


def beam_search_forests(tables: SearchTables, n, q, qnorm, pos, sigma, lam, cfg: FreeSoloConfig, trace=None):
    """Beam search of several forests for the queries of a chunk (spec §6.4), one beam per forest.

    tables: SearchTables of F forests; n: int64 [B, Hkv, nb, F] elements covered by each block's
    forest f. q [B, Hkv, G, nb, Bq, D], qnorm [B, Hkv, G, nb, Bq], pos [nb, Bq] query positions
    (float), sigma / lam [Hkv, G]. trace: None, or called at every level l as trace(l, nodes, ok)
    with the node ids whose keys the level evaluates, nodes int64 [B, Hkv, G, nb, Bq, F, 2*beam+1]
    (row-local ids into the tables, forests apart), and ok bool of that shape (the valid ones);
    for measurements (benchmarks/fsb_prefill_floor.py), it changes nothing.
    Returns element cells int64 [B, Hkv, G, nb, Bq, F * beam] (forest 0's beam first; -1 = none).
    """
    B, Hkv, G, nb, Bq, D = q.shape
    Fo = n.shape[-1]
    dev = q.device
    W = cfg.beam
    scale = D**-0.5
    if tables.max_height < 0:  # no element at all
        return torch.full((B, Hkv, G, nb, Bq, Fo * W), -1, dtype=torch.int64, device=dev)
    # frontier: (tree base, tree height, tree start, index in level) per node, and its validity
    state = torch.zeros(B, Hkv, G, nb, Bq, Fo, W, 4, dtype=torch.int64, device=dev)
    valid = torch.zeros(B, Hkv, G, nb, Bq, Fo, W, dtype=torch.bool, device=dev)
    sig = sigma.view(1, Hkv, G, 1, 1, 1, 1)
    lm = lam.view(1, Hkv, G, 1, 1, 1, 1)
    nq = n[:, :, None, :, None, :, None]  # (B, Hkv, 1, nb, 1, Fo, 1)
    child_scale = torch.tensor([1, 1, 1, 2], dtype=torch.int64, device=dev)
    right_child = torch.tensor([0, 0, 0, 1], dtype=torch.int64, device=dev)
    row_base = (torch.arange(B * Hkv, device=dev) * tables.mu.shape[2]).view(B, Hkv, 1, 1, 1, 1, 1)
    big = torch.iinfo(torch.int64).max
    for l in range(tables.max_height, -1, -1):
        # children of the frontier (if any), then the root of the tree of height l
        left = state * child_scale
        has_root = ((nq >> l) & 1) == 1  # (B, Hkv, 1, nb, 1, Fo, 1)
        r_ts = (nq >> (l + 1)) << (l + 1)
        r_tb = tables.base[:, l].view(Fo, 1) + (r_ts >> l) * ((2 << l) - 1) * tables.segment_scale.view(Fo, 1)
        root = torch.stack([r_tb, torch.full_like(r_ts, l), r_ts, torch.zeros_like(r_ts)], dim=-1)
        shape = (B, Hkv, G, nb, Bq, Fo, 1, 4)
        cand = torch.cat([left, left + right_child, root.expand(shape)], dim=-2)  # (..., Fo, 2W+1, 4)
        c_ok = torch.cat([valid, valid, has_root.expand(shape[:-1])], dim=-1)  # (..., Fo, 2W+1)
        c_tb, c_th, c_ts, c_ix = cand.unbind(-1)
        flat = torch.where(c_ok, c_tb + level_offset(c_th, l) + c_ix, 0)
        if trace is not None:
            trace(l, flat, c_ok)
        rows = (flat + row_base).reshape(-1)  # one flat row index for every field's gather
        mu = tables.mu.reshape(-1, D).index_select(0, rows).view(*flat.shape, D)
        rad, A, e = (getattr(tables, x).reshape(-1).index_select(0, rows).view(flat.shape) for x in ("rad", "A", "e"))
        dot = torch.einsum("bhgnqd,bhgnqfcd->bhgnqfc", q, mu)
        prior = lm * A * torch.erf(sig * (pos[..., None, None] - e.to(q.dtype)) / (2.0 * cfg.cell))
        key = scale * (dot + cfg.radius_weight * qnorm[..., None, None] * rad) + prior
        key = key.masked_fill(~c_ok, float("-inf"))
        gidx = torch.where(c_ok, (c_ts >> l) + c_ix, big)
        o1 = torch.sort(gidx, dim=-1).indices  # by (segment start, index in level)
        o2 = torch.sort(torch.gather(key, -1, o1), dim=-1, descending=True, stable=True).indices[..., :W]
        order = torch.gather(o1, -1, o2)  # (..., Fo, W)
        state = torch.gather(cand, -2, order[..., None].expand(*order.shape, 4))
        valid = torch.gather(c_ok, -1, order)
    tb, th, _, ix = state.unbind(-1)
    flat = torch.where(valid, tb + level_offset(th, 0) + ix, 0)
    cells = tables.cell.reshape(-1).index_select(0, (flat + row_base).reshape(-1)).view(flat.shape)
    return torch.where(valid, cells, -1).reshape(B, Hkv, G, nb, Bq, Fo * W)


def beam_search(table: NodeTable, n, q, qnorm, pos, sigma, lam, cfg: FreeSoloConfig):
    """Beam search of one forest kind: n int64 [B, Hkv, nb]; the rest as `beam_search_forests`.
    Returns element cells int64 [B, Hkv, G, nb, Bq, beam] (-1 = none)."""
    return beam_search_forests(SearchTables([table]), n[..., None], q, qnorm, pos, sigma, lam, cfg)


def row_cell_stats(k: torch.Tensor, cell: int) -> tuple:
    """The per-cell statistics `build_row_forests` needs, with torch ops: (kbar, a) of k in its own
    dtype (the tables' statistics) and (kbar64, a64) from float64 (the content codes and the tau
    test, spec §6.2). k [B, Hkv, T, D] unrotated keys; kbar [B, Hkv, C, D], a [B, Hkv, C]."""
    kbar, a = cell_stats(k, cell)
    kbar64, a64 = cell_stats(k.to(torch.float64), cell)
    return kbar, a, kbar64, a64


def cells_node_table(kbar, a, cells, codes, M: int, cfg: FreeSoloConfig, outward: bool) -> NodeTable:
    """`build_node_table` over the elements cells (int64 [B, Hkv, M], None: every cell in order) of
    the per-cell statistics kbar [B, Hkv, C, D], a [B, Hkv, C]; codes: the elements' codes [B, Hkv, M]."""
    if cells is None:
        C = a.shape[-1]
        return build_node_table(kbar, a, torch.arange(C, device=a.device).expand(a.shape), codes, C, cfg, outward)
    B, Hkv, _, D = kbar.shape
    return build_node_table(torch.gather(kbar, 2, cells[..., None].expand(B, Hkv, M, D)), torch.gather(a, 2, cells),
                            cells, codes, M, cfg, outward)  # fmt: skip


def search_tables(kbar, a, forests: list, cfg: FreeSoloConfig, outward: bool) -> SearchTables:
    """The SearchTables of the forests [(cells, codes, M), ...] (as `cells_node_table` takes them) of
    the per-cell statistics kbar, a: each built by `cells_node_table`, then concatenated."""
    return SearchTables([cells_node_table(kbar, a, cells, codes, M, cfg, outward) for cells, codes, M in forests])


def build_row_forests(k, cfg: FreeSoloConfig, outward: bool, stats=row_cell_stats, tables=search_tables) -> tuple:
    """Both FS-B forests of one row (spec §6.2-§6.3), built with torch ops on k's device.

    k: [1, Hkv, T, D] unrotated keys (statistics of the complete cells C = T // s).
    outward: round node radii up (any dtype below float64).
    stats: k, cell -> (kbar, a, kbar64, a64) as `row_cell_stats` (the default: torch ops on k in its
        own dtype, the compute dtype); tables: as `search_tables` (the default: torch ops). The Triton
        backend passes its kernels (`triton.fsb_forests`) and the keys in their storage dtype.
    Returns (SearchTables of [the all-cells forest, the high-norm forest], high_prefix int64
    [1, Hkv, C + 1]: the number of high-norm cells among the first c cells).
    """
    B, Hkv, _, D = k.shape
    dev = k.device
    tau = torch.as_tensor(cfg.tau_array(Hkv), dtype=torch.float64, device=dev)  # (Hkv,)
    planes = torch.as_tensor(hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D), device=dev)  # (Hkv, r, D)
    kbar, a, kbar64, a64 = stats(k, cfg.cell)  # (B, Hkv, C, D), (B, Hkv, C); codes and the tau test from float64
    C = a.shape[-1]
    codes = content_codes(kbar64, planes) if cfg.leaf_order == "content" else torch.zeros_like(a64, dtype=torch.int64)
    high = a64 > tau.view(1, Hkv, 1)  # (B, Hkv, C)
    order = torch.sort((~high).to(torch.int8), dim=-1, stable=True).indices  # high cells first, increasing
    n_high = high.sum(dim=-1)  # (B, Hkv)
    Mh = int(n_high.max()) if C else 0
    hc = order[:, :, :Mh]  # (B, Hkv, Mh) high cells (rows with fewer: padding never read)
    forests = [(None, codes, C), (hc, torch.gather(codes, 2, hc), Mh)]  # all cells, high-norm cells
    high_prefix = torch.cat([torch.zeros(B, Hkv, 1, dtype=torch.int64, device=dev), torch.cumsum(high, -1)], -1)
    return tables(kbar, a, forests, cfg, outward), high_prefix


def block_element_counts(high_prefix, j0: int, j1: int, cfg: FreeSoloConfig):
    """Elements of each query block's two forests, blocks j0..j1-1: int64 [B, Hkv, j1 - j0, 2]
    (all cells: n_j = j * Bq // s available cells; high-norm: those among them, from high_prefix)."""
    B, Hkv = high_prefix.shape[:2]
    n_all = (torch.arange(j0, j1, device=high_prefix.device) * cfg.block // cfg.cell).expand(B, Hkv, j1 - j0)
    return torch.stack([n_all, torch.gather(high_prefix, 2, n_all)], dim=-1)


@torch.no_grad()
def fsb_select(q, k, cfg: FreeSoloConfig, sigma, lam, nblocks_per_chunk: int, rerank_blocks: int) -> torch.Tensor:
    """FS-B selection.

    Args:
        q: [B, Hkv, G, T, D] unrotated queries (compute dtype); k: [B, Hkv, T, D] unrotated keys.
        sigma, lam: [Hkv, G]. nblocks_per_chunk: query blocks searched together;
        rerank_blocks: query blocks reranked together (the rerank gathers 2*beam*s tokens per query).
        Both are constants of the config, never of B, T or the data (row independence, L12).
    Returns:
        idx int64 [B, Hkv, G, T, top_k], by descending rho (ties larger c), -1 padded.
    """
    B, T = q.shape[0], q.shape[3]
    if B != 1:  # one row at a time: no shape depends on the other rows (L12)
        chunks = (nblocks_per_chunk, rerank_blocks)
        return torch.cat([fsb_select(q[b : b + 1], k[b : b + 1], cfg, sigma, lam, *chunks) for b in range(B)])
    T_pad = padded_length(T, cfg.block, nblocks_per_chunk)
    q, k = pad_time(q, T_pad, 3), pad_time(k, T_pad, 2)  # zeros after T
    idx = _fsb_select_row(q, k, cfg, sigma, lam, nblocks_per_chunk, rerank_blocks)
    return idx[:, :, :, :T].contiguous()


def row_candidates(q, k, cfg: FreeSoloConfig, sigma, lam, nblocks_per_chunk: int, trace=None):
    """The beam search of one row, search chunk by search chunk (spec §6.4, before the rerank).

    Args as `_fsb_select_row`; trace as `beam_search_forests` (called per level of each chunk, before
    the chunk is yielded). Yields (i0, i1, qc, cells) per chunk of query blocks that has an
    available cell: positions [i0, i1), qc [B, Hkv, G, nb, Bq, D] the chunk's queries (zero padded
    to whole blocks), cells int64 [B, Hkv, G, nb, Bq, 2*beam] the union of the two forests'
    candidates per query, descending, -1 padded (no duplicates).
    """
    B, Hkv, G, T, D = q.shape
    s, Bq = cfg.cell, cfg.block
    dev = q.device
    both, high_prefix = build_row_forests(k, cfg, outward=q.dtype != torch.float64)
    nblocks = -(-T // Bq)
    for j0 in range(0, nblocks, nblocks_per_chunk):
        j1 = min(nblocks, j0 + nblocks_per_chunk)
        nb = j1 - j0
        if (j1 - 1) * Bq // s == 0:
            continue  # no block of the chunk has an available cell
        n_both = block_element_counts(high_prefix, j0, j1, cfg)  # (B, Hkv, nb, 2)
        i0, i1 = j0 * Bq, min(T, j1 * Bq)
        qc = q[:, :, :, i0:i1]
        if i1 - i0 < nb * Bq:
            qc = torch.nn.functional.pad(qc, (0, 0, 0, nb * Bq - (i1 - i0)))
        qc = qc.reshape(B, Hkv, G, nb, Bq, D)
        qn = torch.linalg.vector_norm(qc, dim=-1)
        pos = torch.arange(i0, i0 + nb * Bq, device=dev, dtype=q.dtype).view(nb, Bq)
        found = beam_search_forests(both, n_both, qc, qn, pos, sigma, lam, cfg, trace)  # (B, Hkv, G, nb, Bq, 2*beam)
        found = torch.sort(found, dim=-1, descending=True).values  # larger c first, -1 last
        dup = torch.zeros_like(found, dtype=torch.bool)
        dup[..., 1:] = found[..., 1:] == found[..., :-1]
        ok = (found >= 0) & ~dup
        yield i0, i1, qc, torch.where(ok, found, torch.full_like(found, -1))


def _fsb_select_row(q, k, cfg: FreeSoloConfig, sigma, lam, nblocks_per_chunk: int, rerank_blocks: int) -> torch.Tensor:
    """fsb_select of one row whose length is a whole number of search chunks."""
    B, Hkv, G, T, D = q.shape
    s, Bq, K = cfg.cell, cfg.block, cfg.top_k
    dev = q.device
    scale = D**-0.5
    idx = torch.full((B, Hkv, G, T, K), -1, dtype=torch.int64, device=dev)
    for i0, i1, qc, cells in row_candidates(q, k, cfg, sigma, lam, nblocks_per_chunk):
        nb = qc.shape[3]
        sel = torch.empty(B, Hkv, G, nb, Bq, K, dtype=torch.int64, device=dev)
        for r0 in range(0, nb, rerank_blocks):  # rerank in sub-chunks: it gathers 2*beam*s tokens per query
            r1 = min(nb, r0 + rerank_blocks)
            cr = cells[:, :, :, r0:r1]  # (B, Hkv, G, nr, Bq, 2*beam)
            tok = (cr.clamp(min=0)[..., None] * s + torch.arange(s, device=dev)).clamp(max=T - 1)  # (..., 2*beam, s)
            kt = take_rows(k, tok)  # (B, Hkv, G, nr, Bq, 2*beam, s, D)
            logits = torch.einsum("bhgnqd,bhgnqcsd->bhgnqcs", qc[:, :, :, r0:r1], kt) * scale
            rho = torch.logsumexp(logits, dim=-1).masked_fill(cr < 0, float("-inf"))
            sel[:, :, :, r0:r1] = topk_cells(rho, cr, K)  # (B, Hkv, G, nr, Bq, K)
        idx[:, :, :, i0:i1] = sel.reshape(B, Hkv, G, nb * Bq, K)[:, :, :, : i1 - i0]
    return idx
