"""How many distinct cells a 64-query tile selects (the Triton long kernel's union: its work per
query is 32 x union tokens) on a trained model's keys, against iid Gaussian keys of the same shape.

The FS-L checkpoint of the extrapolation study (`results/checkpoints/ckpt_fsl`, trained at 1k
tokens, cell 16, pool 32 + 4 recent) reads an S-NIAH-1 sample; every layer's unrotated q / k are
captured at the attention call and selected again (torch backend) with the model's config and with
the library default (cell 32, pool 64 + 8 recent, block 64). Also the unions of tiles whose queries
are sorted by selection (`attention.long_query_order`, the Triton forward's `sorted_long` tiles).
Means over every tile of the sequence. CPU only, a few minutes at 64k:

    python benchmarks/union_real_keys.py --length 65536 --out benchmarks/results/union_real_keys_64k.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import freesolo  # noqa: E402
import freesolo.nn as fnn  # noqa: E402
from freesolo.backends.triton.attention import long_query_order  # noqa: E402
from freesolo.retrieval import tasks  # noqa: E402
from freesolo.retrieval.modelio import backend_scope, load_model  # noqa: E402

__all__ = ["capture_qk", "checkpoint_layers", "key_kinds", "main", "save_payload", "tile_union_sizes"]


def tile_union_sizes(idx: torch.Tensor, rows: int, order: torch.Tensor | None = None) -> np.ndarray:
    """idx int [B, T, H, K] (-1 padded) -> the number of distinct cells of every tile of `rows`
    consecutive queries of one (b, h): int [B * H * ceil(T / rows)]. order int [B * H, T]
    (`attention.long_query_order`): the tiles hold the positions in that order instead."""
    B, T, H, K = idx.shape
    sizes = []
    for b in range(B):
        for h in range(H):
            rows_bh = idx[b, :, h] if order is None else idx[b, order[b * H + h].long(), h]
            for t0 in range(0, T, rows):
                cells = rows_bh[t0 : t0 + rows].reshape(-1)
                sizes.append(int(torch.unique(cells[cells >= 0]).numel()))
    return np.asarray(sizes)


def capture_qk(model, tokens: torch.Tensor, with_v: bool = False) -> list:
    """Run the model on tokens [1, T]; return every attention call's (q, k) (unrotated, float32),
    or (q, k, v) with with_v."""
    seen = []
    original = fnn.freesolo_attention

    def recording(q, k, v, cfg, **kw):
        seen.append(tuple(x.detach().float().clone() for x in ((q, k, v) if with_v else (q, k))))
        return original(q, k, v, cfg, **kw)

    fnn.freesolo_attention = recording
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        fnn.freesolo_attention = original
    return seen


def key_kinds(layer: int, q: torch.Tensor, k: torch.Tensor) -> tuple:
    """(("model", (q, k)), ("iid", (q', k'))): the captured q / k and iid Gaussian ones of the same
    shapes (torch.randn, seeded by the layer index)."""
    g = torch.Generator().manual_seed(layer)
    return ("model", (q, k)), ("iid", (torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)))


def checkpoint_layers(ckpt: str, task: str, length: int, with_v: bool = False) -> tuple:
    """(model, every attention call's (q, k[, v])) of the checkpoint reading one sample of `task`
    (depth 0.5, seed 0) of `length` tokens on the torch backend (torch seed 0)."""
    torch.manual_seed(0)
    model = load_model(ckpt).eval()
    sample = tasks.generate(task, length, 0.5, tasks.sample_seed(0, task, length, 0))
    tokens = torch.as_tensor(np.asarray(sample.tokens)[None, :], dtype=torch.int64)
    with backend_scope("torch"):
        return model, capture_qk(model, tokens, with_v=with_v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=os.path.join(os.path.dirname(__file__), "results", "checkpoints", "ckpt_fsl"))
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--rows", type=int, default=64, help="queries per tile (the long kernel's union rows)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, layers = checkpoint_layers(args.ckpt, args.task, args.length)
    model_cfg = model.config.freesolo
    configs = {"model config (cell 16, pool 32 + 4)": model_cfg, "library default (cell 32, pool 64 + 8)": freesolo.FreeSoloConfig(variant="fsl")}
    records = []
    for cfg_name, cfg in configs.items():
        for layer, (q, k) in enumerate(layers):
            for keys_name, (qq, kk) in key_kinds(layer, q, k):
                idx = torch.as_tensor(freesolo.select_cells(qq, kk, cfg, backend="torch")).contiguous()
                order = long_query_order(idx, cfg.cell, use_kernel=False)
                rec = {"config": cfg_name, "layer": layer, "keys": keys_name, "T": int(q.shape[1]), "K": cfg.top_k, "rows": args.rows}
                for tag, sizes in (("", tile_union_sizes(idx, args.rows)), ("_sorted", tile_union_sizes(idx, args.rows, order))):
                    # every tile of the sequence (a sorted tile holds positions of its 4096-position chunk)
                    full = sizes
                    rec.update({f"union{tag}_mean": float(full.mean()), f"union{tag}_p90": float(np.percentile(full, 90)),
                                f"union{tag}_max": int(full.max())})  # fmt: skip
                records.append(rec)
                r = records[-1]
                print(f"{cfg_name:42s} layer {layer} {keys_name:5s}: union mean {r['union_mean']:.1f} p90 {r['union_p90']:.0f} "
                      f"max {r['union_max']}; sorted tiles mean {r['union_sorted_mean']:.1f} p90 {r['union_sorted_p90']:.0f}", flush=True)  # fmt: skip
    payload = {"ckpt": os.path.relpath(args.ckpt), "task": args.task, "length": args.length, "torch": torch.__version__,
               "records": records}
    save_payload(args.out, payload)


def save_payload(path: str, payload: dict) -> None:
    """Write a results payload as JSON to `path` (its folder created) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
