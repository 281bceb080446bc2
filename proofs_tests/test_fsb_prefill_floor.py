"""benchmarks/fsb_prefill_floor.py: its per-(query, head) counts are the spec's (lemma L9), checked
against the float64 oracle's own counted node keys and rerank sizes."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from freesolo import FreeSoloConfig
from freesolo.reference.fsb import fsb_costs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("fsb_prefill_floor", ROOT / "benchmarks" / "fsb_prefill_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("T, beam", [(200, 2), (256, 4), (97, 64)])
def test_counts_equal_the_oracle_counts(T, beam):
    """With tau below every cell's norm both forests cover every available cell (high_share 1), so
    the script's node keys are exactly the oracle's; its rerank tokens bound the oracle's reranked
    cells times the cell (the union of two forests' candidates holds at most 2 * beam cells)."""
    bench = _load_benchmark()
    H, D = 2, 8
    cfg = FreeSoloConfig(variant="fsb", window=32, cell=4, block=16, top_k=2, beam=beam, tau=(-1.0,))
    rng = np.random.default_rng(T)
    q, k = (rng.standard_normal((1, T, H, D)) for _ in range(2))
    costs = fsb_costs(q, k[:, :, :1], cfg.replace(tau=(-1.0,)))  # one kv head, GQA group H
    counted = bench.count(T, H, D, cfg, high_share=1.0)
    assert counted["node_keys"] == int(costs["node_keys"].sum()) > 0
    assert int(costs["cells_reranked"].sum()) * cfg.cell <= counted["rerank_tokens"]
    assert counted["bytes_nodes"] == counted["node_keys"] * (4 * D + bench.NODE_ROW_EXTRA_BYTES)
    assert counted["flops"] == 2 * D * (counted["node_keys"] + counted["rerank_tokens"])


def test_rerank_sharing_counts():
    """One query per tile shares nothing (ratio 1); a tile's union never exceeds its candidates nor
    the cells that exist, and larger tiles share at least as much."""
    bench = _load_benchmark()
    T, H, D = 2048, 1, 16
    single = bench.rerank_sharing(T, H, D, rows=1)
    assert single["sharing"] == 1.0 and single["distinct"] == single["candidates"] > 0
    wide = bench.rerank_sharing(T, H, D, rows=64)
    assert wide["candidates"] == single["candidates"], "the same search, cut into other tiles"
    assert wide["union_per_tile"] <= T // 32 and wide["distinct"] <= wide["candidates"]
    assert wide["sharing"] >= bench.rerank_sharing(T, H, D, rows=16)["sharing"] >= 1.0


def test_node_sharing_counts():
    """The traced node keys of one-query tiles are the spec's count per query (both forests; tau the
    median), distinct per query since a level never evaluates a node twice; tiles of 64 share."""
    bench = _load_benchmark()
    T, H, D = 2048, 1, 16
    single = bench.rerank_sharing(T, H, D, rows=1)
    assert single["node_keys"] == single["node_distinct"] > 0, "no node twice in one query's level"
    wide = bench.rerank_sharing(T, H, D, rows=64)
    assert wide["node_keys"] == single["node_keys"]
    assert wide["node_distinct"] < wide["node_keys"], "the top levels are the same for every query of a block"


def test_tile_sharing_takes_gqa_heads_apart():
    """GQA [1, Hkv, G, T, D]: every query head is its own set of tiles, so a group of two identical
    query heads counts exactly twice what one of them counts."""
    import torch

    bench = _load_benchmark()
    g = torch.Generator().manual_seed(3)
    q1 = torch.randn(1, 1, 1, 1024, 16, generator=g)
    k = torch.randn(1, 1, 1024, 16, generator=g)
    cfg = bench.median_tau(k, FreeSoloConfig(variant="fsb"))
    one = bench.tile_sharing(q1, k, cfg, rows=64)
    two = bench.tile_sharing(torch.cat([q1, q1], dim=2), k, cfg, rows=64)
    for field in ("candidates", "distinct", "tiles", "node_keys", "node_distinct"):
        assert two[field] == 2 * one[field] > 0, field


def test_level_union_stats_describe_the_tile_levels():
    """The per-level union sizes add up to the tile's distinct nodes, a wider tile's level holds at
    least what one query's level holds and at most that many times its rows, and the summary of a
    known list is exact."""
    bench = _load_benchmark()
    T, H, D = 2048, 1, 16
    single = bench.rerank_sharing(T, H, D, rows=1)
    wide = bench.rerank_sharing(T, H, D, rows=64)
    for rec in (single, wide):
        stats = rec["level_union"]
        assert stats["levels"] > 0
        assert abs(stats["mean"] * stats["levels"] - rec["node_distinct"]) < 1e-6 * rec["node_distinct"]
        assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert single["level_union"]["max"] <= wide["level_union"]["max"] <= 64 * single["level_union"]["max"]
    assert bench.level_union_stats([]) == {"levels": 0}
    known = bench.level_union_stats([10, 40, 70, 300])
    assert known["levels"] == 4 and known["mean"] == 105.0 and known["max"] == 300 and known["p50"] == 55.0
    assert (known["over_32"], known["over_64"], known["over_128"], known["over_256"]) == (0.75, 0.5, 0.25, 0.25)
