"""The triton FS-L forward on a trained model's own q / k / v against iid inputs of the same shape,
with SDPA causal and FlexAttention SWA-512 on the same tensors, same run (issue 10: the long
kernel's work is 32 x (cells in a 64-query tile's union) tokens per query, and on trained keys the
unions are smaller than on iid keys: `union_real_keys.py`, 13.7 vs 19.8 cells at 16k).

The FS-L checkpoint of the extrapolation study (`results/checkpoints/ckpt_fsl`: 6 layers, 4 query
heads on 2 kv heads, D 64, trained at 1k tokens) reads an S-NIAH-1 sample of `--length` tokens;
every layer's q / k / v (unrotated, at the attention call) are captured in bf16, then each layer is
timed with the library default FS-L config (cell 32, pool 64 + 8, as in `gpu_attention.py`), and
its mean union size is recorded (`tile_unions` over the default selection, 64-query tiles).

    python benchmarks/real_keys_bench.py --length 65536 --out $OUT/real_keys.json   # H200, ~1 min
    python benchmarks/real_keys_bench.py --dry-run --out /tmp/real_keys.json        # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _versions, bench_ms, make_call, plot_bars, smoke_or_gpu, write_results  # noqa: E402
from union_real_keys import capture_qk  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton.attention import long_query_order, tile_unions  # noqa: E402
from freesolo.retrieval import tasks  # noqa: E402
from freesolo.retrieval.modelio import backend_scope, load_model  # noqa: E402

__all__ = ["main", "mean_union"]

UNION_ROWS = 64  # the split long kernel's tile rows (AttentionTiles.long_block of the 16-bit defaults)


def mean_union(q: torch.Tensor, k: torch.Tensor, cfg, backend: str, sort: bool = False) -> float:
    """Mean number of distinct cells in a tile of UNION_ROWS queries' selections (all tiles, all
    heads): consecutive queries, or (sort) queries sorted by selection (`long_query_order`)."""
    idx = torch.as_tensor(freesolo.select_cells(q, k, cfg, backend=backend, check_finite=False)).contiguous()
    order = long_query_order(idx, cfg.cell) if sort else None
    return float(tile_unions(idx, UNION_ROWS, use_kernel=q.is_cuda, order=order).count.float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoints", "ckpt_fsl"))
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU smoke test (interpreter; no timings worth reading)")
    args = ap.parse_args()
    device, dtype = smoke_or_gpu(args.dry_run)
    T = 512 if args.dry_run else args.length
    backend = "torch" if args.dry_run else "triton"
    providers = ["triton_fsl", "sdpa_causal"] + ([] if args.dry_run else ["flex_swa512"])
    model = load_model(args.ckpt).to(device).eval()
    sample = tasks.generate(args.task, T, 0.5, tasks.sample_seed(0, args.task, T, 0))
    tokens = torch.as_tensor(np.asarray(sample.tokens)[None, :], dtype=torch.int64, device=device)
    with backend_scope(backend):
        layers = capture_qk(model, tokens, with_v=True)
    del model
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    records = []
    for layer, (q, k, v) in enumerate(layers):
        real = [x.to(dtype).contiguous() for x in (q, k, v)]
        gen = torch.Generator(device=device).manual_seed(layer)
        iid = [torch.randn(x.shape, device=device, dtype=dtype, generator=gen) for x in real]
        for name, (qq, kk, vv) in (("model", real), ("iid", iid)):
            row = {"layer": layer, "inputs": name, "T": T, "Hq": qq.shape[2], "Hkv": kk.shape[2], "D": qq.shape[3],
                   "union_mean": mean_union(qq, kk, cfg, "torch" if args.dry_run else "triton"),
                   "union_mean_sorted": mean_union(qq, kk, cfg, "torch" if args.dry_run else "triton", sort=True)}
            for provider in providers:
                if name == "iid" and provider != "triton_fsl":
                    continue  # the peers do not depend on the values
                call = make_call(provider, qq, kk, vv, compiled=not args.dry_run)
                with torch.no_grad():
                    call()
                    row[f"{provider}_ms"] = bench_ms(lambda: call(), device, args.rep_ms)
            records.append(row)
            print("  ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}" for key, val in row.items()), flush=True)
    payload = {"meta": {**_versions(device), "ckpt": os.path.relpath(args.ckpt), "task": args.task, "T": T,
                        "config": "FreeSoloConfig(variant='fsl') (library default)", "union_rows": UNION_ROWS},
               "records": records}  # fmt: skip

    def plot(data, png):
        bars = {}
        for r in data["records"]:
            bars[f"L{r['layer']} {r['inputs']} triton_fsl (union {r['union_mean']:.1f})"] = r["triton_fsl_ms"]
            for p in providers[1:]:
                if f"{p}_ms" in r:
                    bars[f"L{r['layer']} {p}"] = r[f"{p}_ms"]
        plot_bars(bars, png, "ms per call (forward)", f"FS-L on a trained model's q / k / v vs iid, T = {T}")

    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
