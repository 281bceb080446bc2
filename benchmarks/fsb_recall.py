"""FS-B recall study (issue 3): recall@4 of FS-B's selection against the exhaustive top-4 by rho.

For each sequence length T, synthetic keys that look like real ones are generated (below), tau is
calibrated once on an independent sequence of the same generator (a per-checkpoint constant),
and a random sample of query positions in the last blocks is evaluated with the numba FS-B path
(forests built once per leaf order, then reused for every beam / radius_weight). The reference is
the exhaustive top-4 by rho_h(i, c) = logsumexp_{t in c}(scale q_i . k_t) among ALL available
cells c < n_j. Because FS-B reranks its candidates by the same rho, its recall@4 equals the
fraction of the exhaustive top-4 that the beam search puts among its candidates.

Synthetic keys [T, D] (one kv head per sequence, D = 64):
- a shared bias with two outlier channels (real keys carry a large common component); bias and
  topic directions are fixed "model" constants shared by every sequence, the text varies;
- topics: 32 directions; the text is a chain of segments (mean 1.5k tokens) each mixing a main
  and a secondary topic whose weight drifts across the segment, one topic per 16-token phrase;
  a slow positional drift field (anchors every 4k tokens) is added to every key;
- keypoint cells: ~1.5% of the cells get one or two high-norm "needle" tokens, each needle a
  unique direction (the cell's a_c is far above tau).
Queries (Hq = 4 heads sharing the kv head, GQA), per sampled position and head, one of:
- "needle" (40%): aimed at a random available needle; - "topic" (40%): aimed at a topic seen
  earlier in the sequence (long-range retrieval); - "local" (20%): aimed at the current topic.

Run: python benchmarks/fsb_recall.py            (T = 16k and 64k, 512 query positions x 4 heads each)
Writes benchmarks/results/fsb_recall.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba

from freesolo import FreeSoloConfig
from freesolo.backends._numba_fsb import build_head_forests_numba, query_head_numba
from freesolo.reference.forest import hyperplanes
from freesolo.reference.oracle import calibrate_tau
from freesolo.reference.primitives import cell_stats

BEAMS = (4, 8, 16, 32)
RADIUS_WEIGHTS = (0.0, 0.5, 1.0)
LEAF_ORDERS = ("content", "position")
QUERY_TYPES = ("needle", "topic", "local")
D, HQ, N_TOPICS, PHRASE = 64, 4, 32, 16
KEY_NOISE, QUERY_NOISE = 0.5, 0.5  # per-dimension std of token noise in keys / queries
TOPIC_NORM, NEEDLE_NORM = 4.0, 8.0
MODEL_SEED = 1234  # bias and topic directions: fixed, like a checkpoint's key space  # norm of a topic centre / of a needle token's direction part


class Sequence:
    """One synthetic sequence: keys k [T, D], its topic schedule and its needles."""

    def __init__(self, T: int, cell: int, seed: int):
        model = np.random.default_rng(MODEL_SEED)  # the "checkpoint": shared by every sequence
        self.bias = model.normal(0, 0.3, D)
        self.bias[[3, 17]] += 4.0  # outlier channels
        centers = model.standard_normal((N_TOPICS, D))
        rng = np.random.default_rng(seed)  # the "text"
        self.rng = rng
        self.centers = TOPIC_NORM * centers / np.linalg.norm(centers, axis=1, keepdims=True)  # [N_TOPICS, D]
        # topic per 16-token phrase: segments with a main / secondary topic and a drifting mixture
        n_phrases = T // PHRASE + 1
        phrase_topic = np.zeros(n_phrases, np.int64)
        main = np.zeros(n_phrases, np.int64)
        p = 0
        while p < n_phrases:
            length = max(8, int(rng.exponential(1500 / PHRASE)))
            a, b = rng.choice(N_TOPICS, 2, replace=False)
            w = np.linspace(0.85, 0.25, length)  # weight of the main topic drifts over the segment
            pick = np.where(rng.random(length) < w, a, b)
            phrase_topic[p : p + length] = pick[: n_phrases - p]
            main[p : p + length] = a
            p += length
        self.topic = np.repeat(phrase_topic, PHRASE)[:T]  # [T]
        self.main_topic = np.repeat(main, PHRASE)[:T]
        anchors = rng.standard_normal((T // 4096 + 2, D)) * 0.8  # slow positional drift
        x = np.arange(T) / 4096
        lo = np.floor(x).astype(int)
        frac = (x - lo)[:, None]
        drift = anchors[lo] * (1 - frac) + anchors[lo + 1] * frac
        k = self.bias + self.centers[self.topic] + drift + KEY_NOISE * rng.standard_normal((T, D))
        # keypoint cells carrying needles
        C = T // cell
        n_needles = max(8, int(0.015 * C))
        self.needle_cells = np.sort(rng.choice(C, n_needles, replace=False))
        dirs = rng.standard_normal((n_needles, D))
        self.needle_dirs = dirs / np.linalg.norm(dirs, axis=1, keepdims=True)
        for c, u in zip(self.needle_cells, self.needle_dirs):
            for t in c * cell + rng.choice(cell, rng.integers(1, 3), replace=False):
                k[t] = self.bias + NEEDLE_NORM * u + 0.3 * rng.standard_normal(D)
        self.k = k

    def query(self, i: int, n_avail: int, cell: int) -> tuple[np.ndarray, str]:
        """One query vector [D] at position i and its type."""
        rng = self.rng
        kind = rng.choice(QUERY_TYPES, p=[0.4, 0.4, 0.2])
        avail_needles = np.flatnonzero(self.needle_cells < n_avail)
        unit = self.centers / TOPIC_NORM  # unit topic directions
        if kind == "needle" and len(avail_needles):  # "the passcode in the part about <topic>"
            x = rng.choice(avail_needles)
            target = 12.0 * self.needle_dirs[x] + 6.0 * unit[self.topic[self.needle_cells[x] * cell]]
        elif kind in ("needle", "topic"):
            kind = "topic"
            seen = np.unique(self.topic[: n_avail * cell])
            old = np.setdiff1d(seen, self.main_topic[max(0, i - 2048) : i + 1])  # not the current ones
            target = 16.0 * unit[rng.choice(old if len(old) else seen)]
        else:
            target = 16.0 * unit[self.main_topic[i]]
        return target + QUERY_NOISE * rng.standard_normal(D), str(kind)


def exhaustive_top4_rho(qs: np.ndarray, k: np.ndarray, n: int, cell: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-4 by rho among cells [0, n) for queries qs [P, D] -> top [P, 4] (ties: larger c first), rho [P, n]."""
    logits = (qs @ k[: n * cell].T / math.sqrt(D)).reshape(len(qs), n, cell)  # [P, n, cell]
    top = logits.max(axis=2, keepdims=True)
    rho = top[..., 0] + np.log(np.exp(logits - top).sum(axis=2))  # [P, n]
    cells = np.arange(n)
    return np.array([np.lexsort((-cells, -r))[:4] for r in rho]), rho


def exhaustive_top4_score(qs, positions, kbar, a, n, cfg) -> np.ndarray:
    """FS: top-4 by score_h(i, c) (with the position prior) among cells [0, n) -> [P, 4]."""
    out = []
    cells = np.arange(n)
    for q_i, i in zip(qs, positions):
        g = np.array([math.erf(cfg.sigma * (i - c * cfg.cell) / (2.0 * cfg.cell)) for c in cells])
        score = kbar[:n] @ q_i / math.sqrt(D) + cfg.lam * a[:n] * g
        out.append(np.lexsort((-cells, -score))[:4])
    return np.array(out)


def run_length(T: int, n_queries: int, seeds: list[int], base: FreeSoloConfig) -> list[dict]:
    """All configurations at one length -> rows of the results table."""
    tau_seq = Sequence(max(T // 4, 4096), base.cell, seed=10_000 + T)  # independent calibration text
    tau = calibrate_tau(tau_seq.k[None, :, None, :], base)  # [1]
    rows: dict[tuple, dict] = {}
    for seed in seeds:
        seq = Sequence(T, base.cell, seed=seed * 7919 + T)
        last_blocks = 8 * base.block
        positions = np.sort(seq.rng.choice(np.arange(T - last_blocks, T), n_queries // len(seeds), replace=False))
        P = len(positions)
        q = np.zeros((P, HQ, D))
        kinds = np.empty((P, HQ), dtype=object)
        for p, i in enumerate(positions):
            n_avail = (i // base.block) * base.block // base.cell
            for h in range(HQ):
                q[p, h], kinds[p, h] = seq.query(i, n_avail, base.cell)
        # references
        n_of = (positions // base.block) * base.block // base.cell
        ref = np.zeros((P, HQ, 4), np.int64)
        rho = np.empty((P, HQ), dtype=object)  # rho [n] of every available cell, per query
        fs = np.zeros((P, HQ, 4), np.int64)
        kbar, a = cell_stats(seq.k, base.cell)
        for n in np.unique(n_of):
            rows_n = np.flatnonzero(n_of == n)
            for h in range(HQ):
                ref[rows_n, h], rho_n = exhaustive_top4_rho(q[rows_n, h], seq.k, int(n), base.cell)
                for x, p in enumerate(rows_n):
                    rho[p, h] = rho_n[x]
                fs[rows_n, h] = exhaustive_top4_score(q[rows_n, h], positions[rows_n], kbar, a, int(n), base)
        _accumulate(
            rows,
            ("FS (exhaustive score)", "-", "-", "-"),
            fs,
            ref,
            rho,
            kinds,
            node_keys=np.repeat(n_of[:, None], HQ, 1),
            reranked=np.zeros((P, HQ)),
        )
        planes = hyperplanes(base.hash_seed, 1, base.hash_bits, D)[0]
        for leaf_order in LEAF_ORDERS:
            t0 = time.perf_counter()
            cfg0 = base.replace(leaf_order=leaf_order, tau=tuple(tau))
            forests = build_head_forests_numba(seq.k, cfg0, float(tau[0]), planes)
            build_s = time.perf_counter() - t0
            for rw in RADIUS_WEIGHTS:
                for beam in BEAMS:
                    cfg = cfg0.replace(beam=beam, radius_weight=rw)
                    t0 = time.perf_counter()
                    idx, node_keys, reranked = query_head_numba(
                        forests, q, positions, seq.k, cfg.per_head("sigma", HQ), cfg.per_head("lam", HQ), cfg
                    )
                    query_s = time.perf_counter() - t0
                    row = _accumulate(rows, ("FS-B", leaf_order, rw, beam), idx, ref, rho, kinds, node_keys, reranked)
                    row["build_s"] = row.get("build_s", 0.0) + build_s
                    row["query_s"] = row.get("query_s", 0.0) + query_s
        print(
            f"T={T} seed={seed}: {P} positions x {HQ} heads, tau={tau[0]:.3f}, "
            f"{len(seq.needle_cells)} needle cells, {int((a > tau[0]).sum())}/{len(a)} high-norm cells",
            flush=True,
        )
    out = []
    for (method, leaf_order, rw, beam), row in rows.items():
        hits, count = row.pop("hits"), row.pop("count")
        out.append(
            {
                "T": T,
                "method": method,
                "leaf_order": leaf_order,
                "radius_weight": rw,
                "beam": beam,
                "recall@4": hits["all"] / (4 * count["all"]),
                **{f"recall@4 {kind}": hits[kind] / max(1, 4 * count[kind]) for kind in QUERY_TYPES},
                "top-1 hit": row["top1"] / count["all"],
                "rho-mass ratio": row["mass"] / count["all"],
                "queries": count["all"],
                **{f"n {kind}": count[kind] for kind in QUERY_TYPES},
                "node_keys/query": row["node_keys"] / count["all"],
                "cells_reranked/query": row["reranked"] / count["all"],
                **({"build_s": row["build_s"], "query_s": row["query_s"]} if "build_s" in row else {}),
            }
        )
    return out


def _accumulate(rows, key, idx, ref, rho, kinds, node_keys, reranked) -> dict:
    """Add one batch of selections idx [P, H, 4] against the exhaustive ref [P, H, 4] to a row."""
    row = rows.setdefault(
        key,
        {
            "hits": {t: 0 for t in ("all",) + QUERY_TYPES},
            "count": {t: 0 for t in ("all",) + QUERY_TYPES},
            "node_keys": 0,
            "reranked": 0,
            "top1": 0,
            "mass": 0.0,
        },
    )
    P, H = kinds.shape
    for p in range(P):
        for h in range(H):
            sel = [c for c in idx[p, h].tolist() if c >= 0]
            hit = len(set(sel) & set(ref[p, h].tolist()))
            r = rho[p, h]
            top = r[ref[p, h]].max()
            row["mass"] += np.exp(r[sel] - top).sum() / np.exp(r[ref[p, h]] - top).sum()
            row["top1"] += int(ref[p, h, 0] in sel)
            for t in ("all", kinds[p, h]):
                row["hits"][t] += hit
                row["count"][t] += 1
    row["node_keys"] += float(np.sum(node_keys))
    row["reranked"] += float(np.sum(reranked))
    return row


NOTES = """## Reading (hand-written for the committed run; seeds are fixed, so a re-run reproduces it)

- **Spec default (content, radius_weight 1.0, beam 16)**: recall@4 0.656 at 16k and 0.259 at 64k, the
  worst of the six (leaf order, radius_weight) pairs at 64k. The provable ball bound is loose in
  D = 64: near the roots the term ||q|| * rad is large and nearly the same for every node, so the key
  stops discriminating and the beam drifts to nodes with a large radius or a large max-norm A_n.
- **radius_weight 0.5** is the best or within noise (about +-0.02 at 2048 query-heads) of the best at
  every (T, leaf order) and beam >= 8, except content order at 64k where 0.0 is 0.02-0.04 higher;
  1.0 is never the best. The numbers support lowering the default radius_weight to 0.5 (the
  pruning is then heuristic, not provable; L5 still holds for wide beams).
- **leaf order**: content order gives no real gain over position order on these keys (+0.01 at
  16k with radius_weight 0.5, within noise; -0.05 to -0.10 at 64k) (topics are
  contiguous in position, as in real text, so position order already groups similar keys); at 64k
  position + 0.5 is the best pair (0.633 at beam 16, 0.754 at beam 32). The numbers do not support
  the extra sorting of "content" as the default on this data.
- **beam**: recall rises steadily with the beam and falls with T at a fixed beam (the forest is
  deeper and each level keeps the same number of nodes). beam 16 evaluates 340 (16k) / 458 (64k)
  node keys per query and head (both forests; FS scores 494 / 2030 cells) and reranks ~21-29
  cells (x 32 tokens); beam 32 doubles the rerank for +0.12 recall at 64k. beam 16 is a fair
  cost/recall point at 16k; at 64k and beyond, beam 32 is needed for recall@4 >= 0.75.
- FS-B with beam >= 8-16 beats exhaustive FS scoring (mean key + norm prior) against the rho
  top-4, because FS-B reranks its candidates at token level: its misses are cells the beam never
  reached, not rerank errors (recall@4 = candidate recall).
- Caveat: synthetic keys. The magnitudes were set so that the content term and the norm prior
  compete (with key noise dominating, or with needles far above the typical norm, every method's
  recall collapses to the norm prior's choices). Re-run on keys dumped from a real checkpoint
  before changing the spec's defaults.
"""


def to_markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# FS-B recall study",
        "",
        (
            f"Generated by `python benchmarks/fsb_recall.py` ({meta['date']}, {meta['machine']}, numpy "
            f"{meta['numpy']}, numba {meta['numba']}, {meta['seconds']:.0f} s)."
        ),
        "",
        "recall@4 = |FS-B's 4 cells ∩ exhaustive top-4 by rho among ALL available cells| / 4, averaged over",
        f"queries: {meta['queries_per_T']} random query positions in the last 8 blocks of each sequence",
        f"({meta['seeds']} sequences per length) x {HQ} query heads on one kv head, D = {D}; defaults otherwise",
        "(cell 32, block 128, K = 4, sigma 4, lambda 1, 16-bit codes). tau = median a_c of an independent",
        "sequence of the same generator. Numba path. node keys = keys evaluated per query and head, both forests",
        "(data independent); the FS row scores every available cell (its 'node keys' = cells scored).",
        "needle / topic / local: recall@4 per query type. top-1 hit: the exhaustive best cell is selected.",
        "rho-mass: sum exp(rho) over the selected cells / the same over the exhaustive top-4 (attention mass kept).",
        "",
    ]
    for T in sorted({r["T"] for r in results}):
        lines += [
            f"## T = {T}",
            "",
            "| method | leaf order | radius_weight | beam | recall@4 | needle | topic | local | top-1 hit | rho-mass | node keys/query | cells reranked/query |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            if r["T"] != T:
                continue
            lines.append(
                f"| {r['method']} | {r['leaf_order']} | {r['radius_weight']} | {r['beam']} | {r['recall@4']:.3f} | "
                f"{r['recall@4 needle']:.3f} | {r['recall@4 topic']:.3f} | {r['recall@4 local']:.3f} | "
                f"{r['top-1 hit']:.3f} | {r['rho-mass ratio']:.3f} | "
                f"{r['node_keys/query']:.0f} | {r['cells_reranked/query']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n" + NOTES


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--queries", type=int, default=512, help="query positions per length (split over seeds)")
    parser.add_argument("--seeds", type=int, default=4, help="independent sequences per length")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fsb_recall")
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    base = FreeSoloConfig(variant="fsb")
    results = []
    for T in args.lengths:
        results += run_length(T, args.queries, list(range(args.seeds)), base)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "seconds": time.perf_counter() - start,
        "queries_per_T": args.queries,
        "seeds": args.seeds,
        "heads": HQ,
        "head_dim": D,
        "config": {k: v for k, v in base.__dict__.items() if k != "tau"},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(results, meta))
    print(to_markdown(results, meta))


if __name__ == "__main__":
    main()
