"""What an FS-B prefill must move and compute, counted from the spec (CPU, no GPU needed).

Issue 12 asks the FS-B prefill forward at T = 1M (H 16, D 64) to be 5x faster than `triton_fs`
(447 ms on the H200 in s30, results/session_2026-12-04_s30/call5/, so at most ~89 ms). This script counts, per (query, query head), the
work that the spec's search (§6.4) and rerank fix, whatever the kernel:

- node keys: exactly `fsb_node_keys_count(n, beam)` per forest (lemma L9's count, data
  independent), for the all-cells forest over the block's n_j available cells and the high-norm
  forest over `high_share * n_j` of them (gpu_attention.py's tau is the median of a_c: 0.5);
- per node key one D-dim dot with mu (float32 tables), the radius, A and e (4 + 4 + 8 bytes) and
  one erf;
- the rerank: logsumexp over the tokens of every candidate cell, at most 2 * beam cells (fewer
  where the forests hold fewer), `cell` tokens of D bf16 key values each;

then the totals over T queries and H heads and the rates a kernel needs to finish within a time
budget if no loaded row serves two (query, head) pairs: `bytes_gathered / t` is the bandwidth
that the per-query loads need (L2 or shared memory), `flops / t` the FMA throughput. Rows shared
between queries (tensor-core scoring of the nodes that a tile's beams have in common) are what a
faster design must exploit.

`--sharing T ...` measures how much a tile could share: the torch backend's beam search
(`row_candidates`, CPU) on iid Gaussian bf16-rounded q / k (tau the median of a_c per head, as
gpu_attention.py sets it), then per tile of `--rows` consecutive queries of one head the number of
distinct candidate cells against the sum of the queries' candidates (the rerank's token rows a
tile-shared rerank would load once), and the same for the node keys the tile's beams evaluate at
each level (node rows a tile-shared search would load once). `--ckpt FOLDER` measures the same on a
trained checkpoint's keys (one retrieval sample of `--ckpt-T` tokens, every layer, its own config).

    python benchmarks/fsb_prefill_floor.py --T 65536 262144 1048576 --budget-ms 89.4 439.6 1779 \
        --sharing 16384 65536 262144 --rows 32 64 128 --ckpt benchmarks/results/checkpoints/ckpt_fs --ckpt-T 16384 \
        --out benchmarks/results/fsb_prefill_floor.json

(s43: 6.5 min on this CPU; 439.6 ms is `triton_fs` at 1M on the H100, s43 call2; 1779 ms `triton_fsb` at 1M
in s30.) Each sharing record also gives `level_union`: the distribution of a tile's distinct nodes per level
(`level_union_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch._ops import cell_stats  # noqa: E402
from freesolo.backends.torch.fsb import row_candidates  # noqa: E402
from freesolo.reference.fsb import fsb_node_keys_count  # noqa: E402

__all__ = [
    "count", "tile_sharing", "level_union_stats", "median_tau", "rerank_sharing", "checkpoint_sharing", "describe_sharing",
    "main",
]  # fmt: skip

NODE_ROW_EXTRA_BYTES = 4 + 4 + 8  # rad, A (float32), e (int64)


def count(T: int, H: int, D: int, cfg: FreeSoloConfig, high_share: float) -> dict:
    """Totals over T queries and H query heads of one sequence (B 1).

    Returns node_keys, rerank_tokens (token dots of the rerank), readout_tokens (K cells read per
    query), bytes_nodes (float32 mu rows + rad / A / e), bytes_rerank (bf16 key rows), flops
    (2 per multiply-add of the dots), erfs."""
    node_keys = rerank_tokens = readout_tokens = 0
    for j in range(-(-T // cfg.block)):
        rows = min(cfg.block, T - j * cfg.block)
        n_all = j * cfg.block // cfg.cell
        n_high = int(n_all * high_share)
        keys = fsb_node_keys_count(n_all, cfg.beam) + fsb_node_keys_count(n_high, cfg.beam)
        candidates = min(2 * cfg.beam, n_all)
        node_keys += rows * keys
        rerank_tokens += rows * candidates * cfg.cell
        readout_tokens += rows * min(cfg.top_k, candidates) * cfg.cell
    node_keys, rerank_tokens, readout_tokens = (x * H for x in (node_keys, rerank_tokens, readout_tokens))
    bytes_nodes = node_keys * (4 * D + NODE_ROW_EXTRA_BYTES)
    bytes_rerank = rerank_tokens * 2 * D
    flops = 2 * D * (node_keys + rerank_tokens)
    return dict(node_keys=node_keys, rerank_tokens=rerank_tokens, readout_tokens=readout_tokens,
                bytes_nodes=bytes_nodes, bytes_rerank=bytes_rerank, flops=flops, erfs=node_keys)  # fmt: skip


def tile_sharing(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, rows: int) -> dict:
    """How much the queries of a tile share in the FS-B search + rerank (torch backend's search).

    q [1, Hkv, G, T, D], k [1, Hkv, T, D] unrotated (float32), cfg an FS-B config with tau. Per
    tile of `rows` consecutive queries of one query head: candidates = the sum over its queries of
    their candidate cells (what per-query reranks load), distinct = the size of the tile's union
    (what a tile-shared rerank loads once); node_keys / node_distinct: the node keys the tile's
    queries evaluate, summed over levels, against the distinct nodes among them per level (forests
    apart). Returns the totals over heads, their ratios and the mean union per tile."""
    _, Hkv, G, T, _ = q.shape
    H = Hkv * G
    sigma = torch.full((Hkv, G), float(cfg.sigma))
    lam = torch.full((Hkv, G), float(cfg.lam))
    candidates = distinct = tiles = node_keys = node_distinct = 0
    level_unions: list = []  # distinct nodes of one tile at one level (the columns a tile-shared level must score)
    levels: list = []  # (nodes, ok) of the chunk being searched, level by level

    def trace(level, nodes, ok):
        levels.append((nodes[0].reshape(H, -1, nodes.shape[-2] * nodes.shape[-1]).numpy(),
                       ok[0].reshape(H, -1, ok.shape[-2] * ok.shape[-1]).numpy()))  # fmt: skip

    for i0, i1, _, cells in row_candidates(q, k, cfg, sigma, lam, nblocks_per_chunk=8, trace=trace):
        per_query = cells[0].reshape(H, -1, cells.shape[-1])[:, : i1 - i0].numpy()  # (H, i1 - i0, 2*beam)
        for h in range(H):
            for t0 in range(0, i1 - i0, rows):
                t1 = min(t0 + rows, i1 - i0)
                tile = per_query[h, t0:t1]
                tile = tile[tile >= 0]
                if tile.size:
                    candidates += tile.size
                    distinct += len(np.unique(tile))
                    tiles += 1
                for nodes, ok in levels:  # node keys evaluated by the tile's queries at each level
                    used = nodes[h, t0:t1][ok[h, t0:t1]]
                    if used.size:
                        node_keys += used.size
                        level_unions.append(len(np.unique(used)))
                        node_distinct += level_unions[-1]
        levels.clear()
    return dict(T=T, H=H, rows=rows, candidates=int(candidates), distinct=int(distinct), tiles=tiles,
                sharing=candidates / max(distinct, 1), union_per_tile=distinct / max(tiles, 1),
                node_keys=int(node_keys), node_distinct=int(node_distinct),
                node_sharing=node_keys / max(node_distinct, 1),
                level_union=level_union_stats(level_unions))  # fmt: skip


def level_union_stats(sizes: list) -> dict:
    """Distribution of a tile's distinct nodes per search level (`tile_sharing`): what a search that
    scores a tile's queries against the union of their nodes, level by level, must hold per level.
    Keys: levels (tile-level pairs with a node), mean, p50 / p90 / p99 / max, and the share of levels
    whose union exceeds 32 / 64 / 128 / 256 nodes."""
    if not sizes:
        return dict(levels=0)
    x = np.asarray(sizes)
    out = dict(levels=int(x.size), mean=float(x.mean()), max=int(x.max()))
    out.update({f"p{p}": float(np.percentile(x, p)) for p in (50, 90, 99)})
    out.update({f"over_{n}": float((x > n).mean()) for n in (32, 64, 128, 256)})
    return out


def median_tau(k: torch.Tensor, cfg: FreeSoloConfig) -> FreeSoloConfig:
    """cfg with tau the median of a_c per kv head (as gpu_attention.py sets it); k [1, Hkv, T, D]."""
    _, a = cell_stats(k, cfg.cell)
    return cfg.replace(variant="fsb", tau=tuple(float(x) for x in a[0].median(dim=-1).values))


def rerank_sharing(T: int, H: int, D: int, rows: int, seed: int = 0) -> dict:
    """`tile_sharing` on iid Gaussian bf16-rounded q / k of H heads (one query head per kv head)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, H, 1, T, D, generator=g).bfloat16().float() for _ in range(2))
    k = k[:, :, 0]  # [1, Hkv = H, T, D]
    return tile_sharing(q, k, median_tau(k, FreeSoloConfig(variant="fsb")), rows)


def checkpoint_sharing(folder: str, T: int, rows_list, task: str = "s-niah-2", seed: int = 0) -> list[dict]:
    """`tile_sharing` on a trained checkpoint's keys: one retrieval sample of `task` at length T,
    one CPU forward (numba backend), every layer's unrotated q / k (benchmarks/fsb_recall.py's
    `capture_qk`), the layer's config as FS-B with tau the median of a_c per kv head."""
    import importlib.util

    from freesolo.retrieval.modelio import load_model
    from freesolo.retrieval.tasks import generate, sample_seed

    spec = importlib.util.spec_from_file_location("fsb_recall", os.path.join(os.path.dirname(__file__), "fsb_recall.py"))
    fsb_recall = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsb_recall)
    model = load_model(folder).eval()
    sample = generate(task, T, 0.5, sample_seed(seed, task, T, 0))
    qs, ks, _ = fsb_recall.capture_qk(model, sample.tokens, np.arange(T), torch.device("cpu"), "numba")
    out = []
    for layer, (q_l, k_l) in enumerate(zip(qs, ks)):
        cfg = model.layers[layer].self_attn.cfg
        Hq, Hkv = q_l.shape[1], k_l.shape[1]
        q = torch.from_numpy(q_l).float().permute(1, 0, 2).reshape(Hkv, Hq // Hkv, T, -1)[None]  # [1, Hkv, G, T, D]
        k = torch.from_numpy(k_l).permute(1, 0, 2)[None].contiguous()  # [1, Hkv, T, D]
        for rows in rows_list:
            out.append(dict(layer=layer, **tile_sharing(q.contiguous(), k, median_tau(k, cfg), rows)))
    return out


def describe_sharing(rec: dict) -> str:
    """One line of a `tile_sharing` record."""
    return (f"T={rec['T']} rows={rec['rows']}: {rec['union_per_tile']:.1f} distinct candidate cells per tile, "
            f"{rec['sharing']:.2f} candidates per distinct cell; node keys: {rec['node_sharing']:.2f} evaluations "
            "per distinct node of a tile's level; distinct nodes per tile and level: "
            + ", ".join(f"{k} {v:.3g}" for k, v in rec.get("level_union", {}).items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[65536, 262144, 1048576])
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--high-share", type=float, default=0.5, help="share of cells in the high-norm forest")
    ap.add_argument("--budget-ms", type=float, nargs="+", default=[89.4, 1779.0])
    ap.add_argument("--sharing", type=int, nargs="*", default=[], help="lengths for the measured tile sharing (CPU search)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64], help="queries per tile for --sharing")
    ap.add_argument("--sharing-heads", type=int, default=2, help="heads searched for --sharing")
    ap.add_argument("--ckpt", default=None, help="also measure the sharing on this checkpoint's keys (folder of `freesolo train`)")
    ap.add_argument("--ckpt-T", type=int, default=16384, help="sequence length of the checkpoint sample")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = FreeSoloConfig(variant="fsb")
    records = []
    for T in args.T:
        rec = dict(T=T, H=args.H, D=args.D, **count(T, args.H, args.D, cfg, args.high_share))
        pairs = T * args.H
        rec["per_query_head"] = {
            "node_keys": rec["node_keys"] / pairs,
            "rerank_tokens": rec["rerank_tokens"] / pairs,
            "bytes": (rec["bytes_nodes"] + rec["bytes_rerank"]) / pairs,
        }
        gathered = rec["bytes_nodes"] + rec["bytes_rerank"]
        rec["rates"] = {
            f"{ms:g} ms": {"gathered_TB_per_s": gathered / (ms * 1e-3) / 1e12, "TFLOP_per_s": rec["flops"] / (ms * 1e-3) / 1e12}
            for ms in args.budget_ms
        }  # fmt: skip
        records.append(rec)
        pq = rec["per_query_head"]
        print(f"T={T}: {pq['node_keys']:.0f} node keys + {pq['rerank_tokens']:.0f} rerank tokens per (query, head), "
              f"{pq['bytes'] / 1024:.0f} KiB gathered; total {gathered / 1e12:.2f} TB, {rec['flops'] / 1e12:.2f} TFLOP; "
              + "; ".join(f"in {k}: {v['gathered_TB_per_s']:.1f} TB/s, {v['TFLOP_per_s']:.1f} TFLOP/s" for k, v in rec["rates"].items()))  # fmt: skip
    sharing = []
    for T in args.sharing:
        for rows in args.rows:
            rec = rerank_sharing(T, args.sharing_heads, args.D, rows)
            sharing.append(rec)
            print("iid keys " + describe_sharing(rec), flush=True)
    ckpt = []
    if args.ckpt:
        ckpt = checkpoint_sharing(args.ckpt, args.ckpt_T, args.rows)
        for rec in ckpt:
            print(f"checkpoint layer {rec['layer']} " + describe_sharing(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            record = {
                "config": repr(cfg),
                "high_share": args.high_share,
                "records": records,
                "sharing": sharing,
                "sharing_keys": "iid Gaussian bf16-rounded, tau the median of a_c per head",
                "checkpoint": args.ckpt,
                "checkpoint_sharing": ckpt,
            }
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
