"""Counted cost of FreeSolo selection (spec §10): exact counts from the algorithm's structure.

Every per-query count below depends only on the position `i`, the config and (FS-B) the number of
high-norm cells `n_high` among the available ones, so it is computed per query block with NumPy,
vectorised: a sweep to T = 1M tokens takes well under a second. `proofs_tests/test_complexity.py`
cross-checks these closed forms against the instrumented counters of the numba path
(`freesolo.backends.numba.backend.count_costs`) and of the FS-B oracle (`reference.fsb.fsb_costs`).

Per query `i` (block `j = i // Bq`, available cells `n_j = j*Bq/s`) and query head:

| count | FS | FS-L | FS-B |
|---|---|---|---|
| cells scored (`score_h(i, c)` evaluated) | `n_j` | `min(n_j, P+W)` | 0 |
| node keys (`key_h(i, n)` evaluated) | 0 | 0 | `keys(n_j) + keys(n_high_j)` |
| cells reranked (`rho` evaluated, `s` dots each) | 0 | 0 | `<= min(n_j, min(beam, n_j) + min(beam, n_high_j))` |
| cells selected | `min(K, n_j)` | `min(K, n_j, P+W)` | `min(K, n_j)` when `K <= beam` (else a bound) |
| tokens read (readout) | `min(i+1, w) + s * selected` | same | same |

`keys(n)` is the height-aligned beam search of §6.4 over a forest of `n` cells: the root of the
tallest tree (height `H = floor(log2 n)`) starts the frontier without a key (as in
`reference.fsb`); at each level `l = H-1..0` the children of the `min(beam, floor(n / 2^(l+1)))`
kept nodes and the root of the height-`l` tree when bit `l` of `n` is set get a key. In closed
form `keys(n) = popcount(n) - 1 + 2 * sum_{l=1..H} min(beam, floor(n / 2^l))` (`keys(0) = 0`),
which is `<= 2*beam*(H+1) + popcount(n)` (lemma L9). FS-B's rerank de-duplicates cells found by
both forests, which depends on the data: the structural count is the upper bound (no overlap).

Construction (per kv head, once per sequence): cell statistics read every key once (`T` tokens);
FS-B builds every aligned dyadic segment `[m 2^l, (m+1) 2^l)`, `l >= 1`, inside each forest
once: `sum_l floor(n/2^l) * 2^l` elements merged (content order; 0 for position order, which
sorts nothing) and `sum_l floor(n/2^l) * l * 2^l` leaf visits for the exact covering radii (every
node of height `l' >= 1` visits its `2^l'` leaves) — the `O(n log^2 n)` term of the paper.

"Work" is counted in D-length dot products per query head: one per cell scored, node key,
token of a reranked cell and token read (readout), plus the construction terms.
State bytes are the streaming state of §9 after `T` tokens (per batch row, all kv heads).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import FreeSoloConfig

__all__ = [
    "COUNT_NAMES",
    "available_per_block",
    "available_per_query",
    "beam_node_keys",
    "beam_leaves",
    "l9_node_key_bound",
    "popcount",
    "forest_build_cost",
    "cell_max_norms",
    "tau_from_norms",
    "high_norm_prefix_counts",
    "random_cell_max_norms",
    "count_per_block",
    "count_per_query",
    "count_totals",
    "fs_total_cells_scored_closed_form",
    "state_bytes",
    "counted_sweep",
]

# per-query counts returned by `count_per_query` (all int64 [B, T, Hq])
COUNT_NAMES = ("cells_scored", "node_keys", "cells_reranked", "cells_selected", "tokens_read")


# ---- small closed forms ---------------------------------------------------------------------
def popcount(n: np.ndarray) -> np.ndarray:
    """Number of set bits of each element of a non-negative int64 array (same shape)."""
    n = np.asarray(n, dtype=np.int64)
    if n.size and n.min() < 0:
        raise ValueError(f"popcount needs non-negative integers, got min {n.min()}")
    out = np.zeros(n.shape, dtype=np.int64)
    x = n.copy()
    while np.any(x):
        out += x & 1
        x >>= 1
    return out


def _floor_log2(n: np.ndarray) -> np.ndarray:
    """floor(log2 n) for n >= 1 (exact on int64), -1 for n = 0."""
    n = np.asarray(n, dtype=np.int64)
    out = np.full(n.shape, -1, dtype=np.int64)
    x = n.copy()
    while np.any(x):
        out += x > 0
        x >>= 1
    return out


def available_per_block(T: int, cfg: FreeSoloConfig) -> np.ndarray:
    """n_j = j*Bq/s for every query block j < ceil(T/Bq): int64 [nb]."""
    nb = -(-T // cfg.block)
    return np.arange(nb, dtype=np.int64) * cfg.block // cfg.cell


def available_per_query(T: int, cfg: FreeSoloConfig) -> np.ndarray:
    """n_j of each query's block: int64 [T]."""
    return (np.arange(T, dtype=np.int64) // cfg.block) * cfg.block // cfg.cell


def _block_sizes(T: int, cfg: FreeSoloConfig) -> np.ndarray:
    """Queries per block: int64 [nb] (Bq, the last one possibly shorter)."""
    starts = np.arange(0, T, cfg.block, dtype=np.int64)
    return np.minimum(starts + cfg.block, T) - starts


def beam_node_keys(n, beam: int) -> np.ndarray:
    """Node keys evaluated by the beam search of §6.4 over a forest of n cells (any int array shape).

    keys(n) = popcount(n) - 1 + 2 * sum_{l=1..floor(log2 n)} min(beam, floor(n / 2^l)); keys(0) = 0
    (the root of the tallest tree starts the frontier without a key).
    """
    n = np.asarray(n, dtype=np.int64)
    keys = np.maximum(popcount(n) - 1, 0)
    shifted = n >> 1
    while np.any(shifted):
        keys += 2 * np.minimum(beam, shifted)
        shifted >>= 1
    return keys


def beam_leaves(n, beam: int) -> np.ndarray:
    """Cells a forest of n cells returns after level 0: min(beam, n)."""
    return np.minimum(beam, np.asarray(n, dtype=np.int64))


def l9_node_key_bound(n, beam: int) -> np.ndarray:
    """Lemma L9's bound on node keys per forest and query: 2*beam*(floor(log2 n)+1) + popcount(n); 0 if n = 0."""
    n = np.asarray(n, dtype=np.int64)
    return np.where(n > 0, 2 * beam * (_floor_log2(n) + 1) + popcount(n), 0)


def forest_build_cost(n, leaf_order: str = "content") -> dict[str, np.ndarray]:
    """Cost of building every aligned dyadic segment of size >= 2 inside [0, n) once (§6.1, §10).

    Returns int64 arrays shaped like n: "segments", "sorted_elements" (merge moves; 0 for the
    position order), "radius_visits" (leaf visits of the exact covering radii), "nodes" (internal nodes).
    """
    n = np.asarray(n, dtype=np.int64)
    segments = np.zeros(n.shape, dtype=np.int64)
    sorted_elements = np.zeros(n.shape, dtype=np.int64)
    radius_visits = np.zeros(n.shape, dtype=np.int64)
    nodes = np.zeros(n.shape, dtype=np.int64)
    level = 1
    while np.any(n >> level):
        count = n >> level  # segments of size 2^level
        size = np.int64(1) << level
        segments += count
        sorted_elements += count * size
        radius_visits += count * level * size
        nodes += count * (size - 1)
        level += 1
    if leaf_order == "position":
        sorted_elements[...] = 0
    elif leaf_order != "content":
        raise ValueError(f"leaf_order={leaf_order!r} must be 'content' or 'position'")
    return {"segments": segments, "sorted_elements": sorted_elements, "radius_visits": radius_visits, "nodes": nodes}


# ---- high-norm cells (FS-B's second forest) -------------------------------------------------
def cell_max_norms(k: np.ndarray, cell: int) -> np.ndarray:
    """a_c = max_{t in c} ||k_t||: k [B, T, Hkv, D] -> [B, Hkv, C], C = T // cell (vectorised)."""
    k = np.asarray(k)
    B, T, Hkv, D = k.shape
    C = T // cell
    norms = np.sqrt(np.sum(np.asarray(k[:, : C * cell], dtype=np.float64) ** 2, axis=-1))  # [B, C*s, Hkv]
    return norms.reshape(B, C, cell, Hkv).max(axis=2).transpose(0, 2, 1).copy()  # [B, Hkv, C]


def tau_from_norms(a: np.ndarray) -> np.ndarray:
    """calibrate_tau from cell max norms a [B, Hkv, C]: per kv head, the median over all cells and rows -> [Hkv]."""
    a = np.asarray(a, dtype=np.float64)
    if a.shape[-1] == 0:
        raise ValueError("tau needs at least one complete cell (T >= cell)")
    return np.median(a.transpose(1, 0, 2).reshape(a.shape[1], -1), axis=1)


def high_norm_prefix_counts(a: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Prefix counts of high-norm cells: a [B, Hkv, C], tau [Hkv] -> int64 [B, Hkv, C+1].

    out[..., n] = #{c < n: a_c > tau} (the size of the high-norm forest over [0, n)).
    """
    a = np.asarray(a, dtype=np.float64)
    flags = a > np.asarray(tau, dtype=np.float64)[None, :, None]  # [B, Hkv, C]
    out = np.zeros(a.shape[:2] + (a.shape[2] + 1,), dtype=np.int64)
    np.cumsum(flags, axis=-1, out=out[..., 1:])
    return out


def random_cell_max_norms(
    T: int, cell: int, batch: int, num_kv_heads: int, dim: int, seed: int, chunk: int = 1 << 16
) -> np.ndarray:
    """a_c of standard-normal keys k [B, T, Hkv, D] drawn in chunks (1M tokens in ~1 s, O(chunk) memory).

    Deterministic in (seed, chunk); prefixes are causal: the norms of the first T' tokens do not depend on T.
    """
    rng = np.random.default_rng(seed)
    C = T // cell
    chunk = max(cell, chunk - chunk % cell)
    out = np.empty((batch, num_kv_heads, C), dtype=np.float64)
    for start in range(0, C * cell, chunk):
        stop = min(start + chunk, C * cell)
        k = rng.standard_normal((batch, stop - start, num_kv_heads, dim), dtype=np.float32)  # [B, t, Hkv, D]
        out[:, :, start // cell : stop // cell] = cell_max_norms(k, cell)
    return out


# ---- per-block and per-query counts ---------------------------------------------------------
def _n_high_per_block(high_prefix: np.ndarray | None, n_blocks: np.ndarray, B: int, Hkv: int) -> np.ndarray:
    """n_high per block: high_prefix [B, Hkv, >= max n + 1] -> int64 [B, nb, Hkv]."""
    if high_prefix is None:
        raise ValueError("FS-B counts need the high-norm prefix counts (high_prefix [B, Hkv, C+1])")
    high_prefix = np.asarray(high_prefix, dtype=np.int64)
    if high_prefix.ndim != 3 or high_prefix.shape[:2] != (B, Hkv):
        raise ValueError(f"high_prefix shape {high_prefix.shape} must be [B={B}, Hkv={Hkv}, C+1]")
    if high_prefix.shape[2] <= n_blocks.max(initial=0):
        raise ValueError(f"high_prefix covers {high_prefix.shape[2] - 1} cells, the blocks need {n_blocks.max()}")
    return high_prefix[:, :, n_blocks].transpose(0, 2, 1)  # [B, nb, Hkv]


def count_per_block(
    T: int, cfg: FreeSoloConfig, num_kv_heads: int = 1, high_prefix: np.ndarray | None = None, batch: int = 1
) -> dict[str, np.ndarray]:
    """Selection counts per query block and kv head (the same for every query of a block and every
    query head of a kv group): int64 [B, nb, Hkv] for cells_scored, node_keys, cells_reranked,
    cells_selected; plus "available" [nb] and "block_sizes" [nb]. FS-B needs `high_prefix`
    ([B, Hkv, C+1] from `high_norm_prefix_counts`); its `batch` must match."""
    n = available_per_block(T, cfg)  # [nb]
    if high_prefix is not None:
        batch = np.asarray(high_prefix).shape[0]
    shape = (batch, n.size, num_kv_heads)
    n_b = np.broadcast_to(n[None, :, None], shape)  # [B, nb, Hkv]
    zeros = np.zeros(shape, dtype=np.int64)
    if cfg.variant == "fs":
        scored, keys, reranked = n_b.copy(), zeros, zeros.copy()
        selected = np.minimum(cfg.top_k, n_b)
    elif cfg.variant == "fsl":
        scored, keys, reranked = np.minimum(n_b, cfg.pool + cfg.recent), zeros, zeros.copy()
        selected = np.minimum(cfg.top_k, scored)
    elif cfg.variant == "fsb":
        nh = _n_high_per_block(high_prefix, n, batch, num_kv_heads)  # [B, nb, Hkv]
        scored = zeros
        keys = beam_node_keys(n_b, cfg.beam) + beam_node_keys(nh, cfg.beam)
        # the union of both forests' leaves, upper bound (no overlap), and never more than the n_j cells
        reranked = np.minimum(n_b, beam_leaves(n_b, cfg.beam) + beam_leaves(nh, cfg.beam))
        # exact when top_k <= beam (the all-cells forest alone returns min(beam, n) >= min(K, n) cells);
        # an upper bound otherwise
        selected = np.minimum(cfg.top_k, reranked)
    else:
        raise ValueError(f"variant={cfg.variant!r} must be 'fs', 'fsl' or 'fsb'")
    return {
        "cells_scored": np.ascontiguousarray(scored, dtype=np.int64),
        "node_keys": np.ascontiguousarray(keys, dtype=np.int64),
        "cells_reranked": np.ascontiguousarray(reranked, dtype=np.int64),
        "cells_selected": np.ascontiguousarray(selected, dtype=np.int64),
        "available": n,
        "block_sizes": _block_sizes(T, cfg),
    }


def _local_tokens(T: int, window: int) -> np.ndarray:
    """min(i+1, w) for i < T: int64 [T]."""
    return np.minimum(np.arange(1, T + 1, dtype=np.int64), window)


def count_per_query(
    T: int,
    cfg: FreeSoloConfig,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    high_prefix: np.ndarray | None = None,
    batch: int = 1,
) -> dict[str, np.ndarray]:
    """Per-query counts of COUNT_NAMES, each int64 [B, T, Hq] (same layout as the numba counters).

    Query head h reads kv head h // (Hq // Hkv). FS-B needs `high_prefix` [B, Hkv, C+1].
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    blocks = count_per_block(T, cfg, num_kv_heads, high_prefix, batch)
    group = num_heads // num_kv_heads
    out = {}
    for name in ("cells_scored", "node_keys", "cells_reranked", "cells_selected"):
        per_block = blocks[name]  # [B, nb, Hkv]
        per_query = np.repeat(per_block, blocks["block_sizes"], axis=1)  # [B, T, Hkv]
        out[name] = np.ascontiguousarray(np.repeat(per_query, group, axis=2))  # [B, T, Hq]
    out["tokens_read"] = _local_tokens(T, cfg.window)[None, :, None] + cfg.cell * out["cells_selected"]
    return out


def fs_total_cells_scored_closed_form(T: int, cfg: FreeSoloConfig) -> int:
    """FS: sum_i n_{i // Bq} over one sequence and head = (Bq/s) * (Bq * J(J-1)/2 + J * r), where
    T = J*Bq + r (0 <= r < Bq): full blocks j < J score j*Bq/s cells each for Bq queries, the partial
    block J scores J*Bq/s for its r queries."""
    J, r = divmod(T, cfg.block)
    per_block = cfg.block // cfg.cell
    return per_block * (cfg.block * J * (J - 1) // 2 + J * r)


def state_bytes(
    T: int,
    cfg: FreeSoloConfig,
    num_kv_heads: int,
    dim: int,
    dtype_bytes: int = 2,
    n_high: np.ndarray | None = None,
) -> int:
    """Streaming state after T tokens (spec §9), per batch row, all kv heads, in bytes (model, not measured).

    FS-L: last min(T, w) keys+values, the pooled cells' tokens (<= P+W cells of s tokens) and their
    statistics (kbar: D, a: 1), the T mod Bq tokens of the current block. FS: every key and value
    plus every complete cell's statistics. FS-B: FS plus both forests' internal nodes
    (mu: D, rad, A, e: 3 values each) and leaf order (1 per leaf); `n_high` [Hkv] is the number of
    high-norm cells among the available ones (default: none).
    """
    n = (T // cfg.block) * cfg.block // cfg.cell  # cells available to the next query
    D = dim
    if cfg.variant == "fsl":
        pooled = min(n, cfg.pool + cfg.recent)
        values = (min(T, cfg.window) + pooled * cfg.cell + T % cfg.block) * 2 * D + pooled * (D + 1)
        return int(values * num_kv_heads * dtype_bytes)
    archive = T * 2 * D + (T // cfg.cell) * (D + 1)
    if cfg.variant == "fs":
        return int(archive * num_kv_heads * dtype_bytes)
    if cfg.variant != "fsb":
        raise ValueError(f"variant={cfg.variant!r} must be 'fs', 'fsl' or 'fsb'")
    nh = np.zeros(num_kv_heads, dtype=np.int64) if n_high is None else np.asarray(n_high, dtype=np.int64)
    total = 0
    for forest_n in [np.full(num_kv_heads, n, dtype=np.int64), nh]:
        internal = forest_build_cost(forest_n)["nodes"]  # [Hkv]
        total += int(np.sum(internal * (D + 3) + forest_n))
    return int((archive * num_kv_heads + total) * dtype_bytes)


def count_totals(
    T: int,
    cfg: FreeSoloConfig,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    high_prefix: np.ndarray | None = None,
    batch: int = 1,
    dim: int = 64,
    dtype_bytes: int = 2,
) -> dict[str, int]:
    """Totals over the whole batch, sequence and heads (Python ints).

    Keys: the COUNT_NAMES summed over (b, i, h); "build_tokens" (cell statistics: T per kv head),
    "build_sorted" and "build_radius" (FS-B forests, per kv head); "selection_work" = cells scored
    + node keys + s * cells reranked + build terms; "readout_work" = tokens read; "work" = both;
    "state_bytes" (per batch row, spec §9 model).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    blocks = count_per_block(T, cfg, num_kv_heads, high_prefix, batch)
    B = blocks["cells_scored"].shape[0]
    group = num_heads // num_kv_heads
    sizes = blocks["block_sizes"][None, :, None]  # [1, nb, 1]
    totals = {
        name: int(np.sum(blocks[name] * sizes)) * group
        for name in ("cells_scored", "node_keys", "cells_reranked", "cells_selected")
    }
    totals["tokens_read"] = (
        int(np.sum(_local_tokens(T, cfg.window))) * B * num_heads + cfg.cell * totals["cells_selected"]
    )
    totals["build_tokens"] = (T // cfg.cell) * cfg.cell * B * num_kv_heads
    totals["build_sorted"] = totals["build_radius"] = 0
    n_high_last = None
    if cfg.variant == "fsb":
        n_last = blocks["available"][-1]
        n_high_last = np.asarray(high_prefix, dtype=np.int64)[:, :, n_last]  # [B, Hkv]
        for forest_n in (np.full(n_high_last.shape, n_last, dtype=np.int64), n_high_last):
            build = forest_build_cost(forest_n, cfg.leaf_order)
            totals["build_sorted"] += int(build["sorted_elements"].sum())
            totals["build_radius"] += int(build["radius_visits"].sum())
    totals["selection_work"] = (
        totals["cells_scored"]
        + totals["node_keys"]
        + cfg.cell * totals["cells_reranked"]
        + totals["build_tokens"]
        + totals["build_sorted"]
        + totals["build_radius"]
    )
    totals["readout_work"] = totals["tokens_read"]
    totals["work"] = totals["selection_work"] + totals["readout_work"]
    nh_state = None
    if cfg.variant == "fsb":
        n_next = (T // cfg.block) * cfg.block // cfg.cell
        hp = np.asarray(high_prefix, dtype=np.int64)
        nh_state = hp[0, :, min(n_next, hp.shape[2] - 1)]
    totals["state_bytes"] = state_bytes(T, cfg, num_kv_heads, dim, dtype_bytes, nh_state)
    return totals


def counted_sweep(
    T_list: Sequence[int],
    variants: Sequence[str],
    cfg: FreeSoloConfig,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    dim: int = 64,
    seed: int = 0,
    batch: int = 1,
    dtype_bytes: int = 2,
) -> list[dict]:
    """Counted totals for every (variant, T): a list of rows (dicts) with per-query means too.

    FS-B's high-norm forest uses standard-normal keys (seed) and tau = calibrate_tau on the first T
    tokens (the median of a_c), so n_high ~ n/2; one key sequence of max(T_list) tokens is drawn
    and its prefixes are used (causal).
    """
    T_list = sorted(int(T) for T in T_list)
    a_all = None
    if "fsb" in variants:
        a_all = random_cell_max_norms(T_list[-1], cfg.cell, batch, num_kv_heads, dim, seed)  # [B, Hkv, C]
    rows = []
    for variant in variants:
        vcfg = cfg.replace(variant=variant)
        for T in T_list:
            high_prefix = None
            if variant == "fsb":
                a = a_all[:, :, : T // cfg.cell]
                high_prefix = high_norm_prefix_counts(a, tau_from_norms(a))
            totals = count_totals(T, vcfg, num_heads, num_kv_heads, high_prefix, batch, dim, dtype_bytes)
            queries = batch * T * num_heads
            row = {"variant": variant, "T": T, **totals}
            for name in ("cells_scored", "node_keys", "cells_reranked", "tokens_read"):
                row[f"{name}_per_query"] = totals[name] / queries
            rows.append(row)
    return rows
