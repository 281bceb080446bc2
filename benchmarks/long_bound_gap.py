"""How far the Cauchy-Schwarz bound of the long branch's logits sits above their actual maximum, on
a trained model's q / k and on iid Gaussian q / k of the same shape.

The Triton long kernel takes, per query i and query head h, a softmax over the tokens of the
query's selected cells (NoPE, unrotated): s_t = scale * q_i . k_t, scale = 1 / sqrt(D). A fixed
per-row offset in place of the online softmax would be

    m_b = scale * ||q_i|| * max_{c selected by (i, h)} a_c,    a_c = max_{t in cell c} ||k_t||_2,

an upper bound of every logit of the row. It is numerically safe only while the gap
m_b - max_t s_t (nats) stays below about 69.3 nats (100 binades: exp(-gap) of the largest term
still representable; beyond that the fallback path runs). This script measures that gap for every
(position, head) that selects at least one cell.

The FS-L checkpoint of the extrapolation study (`results/checkpoints/ckpt_fsl`, trained at 1k
tokens, cell 16, pool 32 + 4 recent) reads an S-NIAH-1 sample; every layer's unrotated q / k are
captured at the attention call (`union_real_keys.capture_qk`) and selected again (torch backend)
with the model's config and with the library default (cell 32, pool 64 + 8 recent, block 64).
"iid" keys: torch.randn q and k of the same shapes (seeded by layer), selected the same way.
Reports per (config, layer, keys): mean, p50, p99, p99.9 and max gap, and the fractions of rows
with gap > 44 and > 69.3 nats. CPU only:

    python benchmarks/long_bound_gap.py --length 16384 --out benchmarks/results/long_bound_gap_16k.json
    python benchmarks/long_bound_gap.py --length 65536 --out benchmarks/results/long_bound_gap_64k.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import freesolo  # noqa: E402
from freesolo.retrieval import tasks  # noqa: E402
from freesolo.retrieval.modelio import backend_scope, load_model  # noqa: E402
from union_real_keys import capture_qk  # noqa: E402

__all__ = ["bound_gaps", "gap_stats", "main"]

SAFE_NATS = 100 * math.log(2.0)  # 69.3: 100 binades
WARN_NATS = 44.0


def bound_gaps(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, cell: int, chunk: int = 1024) -> torch.Tensor:
    """q [B, T, Hq, D], k [B, T, Hkv, D], idx int [B, T, Hq, K] (-1 padded) -> gap m_b - max_t s_t
    (float64, nats) of every (b, position, head) with at least one selected cell, flattened.

    s_t = q . k_t / sqrt(D) over the tokens of the selected cells; m_b = ||q|| / sqrt(D) * max a_c
    over the selected cells, a_c = max_{t in c} ||k_t||. Positions are processed `chunk` at a time."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    n_cells = -(-T // cell)
    pad = n_cells * cell - T
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)) if pad else k  # zero keys past T
    k_cells = k_pad.reshape(B, n_cells, cell, Hkv, D).permute(0, 3, 1, 2, 4).contiguous()  # [B, Hkv, C, cell, D]
    a = k_cells.norm(dim=-1).amax(dim=-1)  # [B, Hkv, C]
    kv_of = (torch.arange(Hq) // group)[None, :, None]  # [1, Hq, 1]
    gaps = []
    for b in range(B):
        for t0 in range(0, T, chunk):
            sel = idx[b, t0 : t0 + chunk].long()  # [P, Hq, K]
            valid = sel >= 0
            rows = valid.any(dim=-1)  # [P, Hq]
            if not bool(rows.any()):
                continue
            cc = sel.clamp(min=0)
            qc = q[b, t0 : t0 + chunk]  # [P, Hq, D]
            keys = k_cells[b][kv_of, cc]  # [P, Hq, K, cell, D]
            logits = torch.einsum("phd,phkcd->phkc", qc, keys) * scale
            logits = logits.masked_fill(~valid[..., None], float("-inf"))
            s_max = logits.amax(dim=(-2, -1))  # [P, Hq]
            a_sel = a[b][kv_of, cc].masked_fill(~valid, float("-inf")).amax(dim=-1)  # [P, Hq]
            m_b = scale * qc.norm(dim=-1) * a_sel
            gaps.append((m_b.double() - s_max.double())[rows])
    return torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)


def gap_stats(gaps: torch.Tensor) -> dict:
    """Summary of a 1-D tensor of gaps (nats)."""
    g = gaps.numpy()
    if g.size == 0:
        return {"rows": 0}
    p50, p99, p999 = np.percentile(g, [50, 99, 99.9])
    return {"rows": int(g.size), "gap_mean": float(g.mean()), "gap_p50": float(p50), "gap_p99": float(p99),
            "gap_p99_9": float(p999), "gap_max": float(g.max()), "gap_min": float(g.min()),
            "frac_gt_44": float((g > WARN_NATS).mean()), "frac_gt_69_3": float((g > SAFE_NATS).mean())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=os.path.join(os.path.dirname(__file__), "results", "checkpoints", "ckpt_fsl"))
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    start = time.perf_counter()
    torch.manual_seed(0)
    model = load_model(args.ckpt).eval()
    sample = tasks.generate(args.task, args.length, 0.5, tasks.sample_seed(0, args.task, args.length, 0))
    tokens = torch.as_tensor(np.asarray(sample.tokens)[None, :], dtype=torch.int64)
    with backend_scope("torch"):
        layers = capture_qk(model, tokens, with_v=False)
    model_cfg = model.config.freesolo
    configs = {f"model config (cell {model_cfg.cell}, pool {model_cfg.pool} + {model_cfg.recent})": model_cfg,
               "library default (cell 32, pool 64 + 8)": freesolo.FreeSoloConfig(variant="fsl")}  # fmt: skip
    records = []
    for cfg_name, cfg in configs.items():
        for layer, (q, k) in enumerate(layers):
            g = torch.Generator().manual_seed(layer)
            iid_q = torch.randn(q.shape, generator=g)
            iid_k = torch.randn(k.shape, generator=g)
            for keys_name, (qq, kk) in (("model", (q, k)), ("iid", (iid_q, iid_k))):
                idx = torch.as_tensor(freesolo.select_cells(qq, kk, cfg, backend="torch")).contiguous()
                with torch.no_grad():
                    gaps = bound_gaps(qq, kk, idx, cfg.cell)
                rec = {"config": cfg_name, "layer": layer, "keys": keys_name, "T": int(q.shape[1]), "cell": cfg.cell,
                       "K": cfg.top_k, **gap_stats(gaps)}  # fmt: skip
                records.append(rec)
                r = rec
                if r["rows"] == 0:
                    print(f"{cfg_name:42s} layer {layer} {keys_name:5s}: no row selects a cell", flush=True)
                    continue
                print(f"{cfg_name:42s} layer {layer} {keys_name:5s}: rows {r['rows']} gap mean {r['gap_mean']:.2f} "
                      f"p50 {r['gap_p50']:.2f} p99 {r['gap_p99']:.2f} p99.9 {r['gap_p99_9']:.2f} max {r['gap_max']:.2f} "
                      f"nats; >44 {r['frac_gt_44']:.2e} >69.3 {r['frac_gt_69_3']:.2e}", flush=True)  # fmt: skip
    elapsed = time.perf_counter() - start
    payload = {"ckpt": os.path.relpath(args.ckpt), "task": args.task, "length": args.length, "torch": torch.__version__,
               "safe_nats": SAFE_NATS, "warn_nats": WARN_NATS, "seconds": elapsed, "records": records}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {args.out} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
