"""Tile sweep of the Triton FS / FS-L scoring + top-K kernel (`selection._score_topk_kernel`,
issue 10): `ScoreTiles` variants (queries per program, candidates per step, warps, and the
top-K rounds' early exit, which costs one reduction across the tile's rows per round), timed
through `selection.select_cells` (cell statistics and FS-L candidates included: the same for
every variant, so differences are the kernel's), same run. Every variant's selection must equal
the default's bit for bit (same keys, same tie rule; only the schedule differs).

    python benchmarks/score_tiles_sweep.py --out $OUT/score_tiles.json   # H200, ~1 min
    python benchmarks/score_tiles_sweep.py --dry-run --out /tmp/score_tiles.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _versions, bench_ms, plot_bars, smoke_or_gpu, write_results  # noqa: E402 (benchmarks/ is this script's folder)

import freesolo  # noqa: E402
from freesolo.backends.triton.selection import ScoreTiles, cell_stats, fsl_candidates, score_tiles, select_cells  # noqa: E402

__all__ = ["VARIANTS", "main"]

VARIANTS = {  # name -> ScoreTiles (block_m, block_n, num_warps, early_exit, count_rounds, ...)
    # (s22 / s23 also swept block_n 64 / 128, block_m 32 / 128 and 8 warps: all slower at 64k and 1M,
    # results/session_2026-12-02_s23/call2/score_tiles_1m.json; s24 call3: block_m 32, 2 / 8 warps slower;
    # s24 call6: the top-K on int64 keys, removed after it, slower than the (score, cell) pairs)
    # s25 call2: block_n 64, 8 warps, block_m 32 slower; call3: a row-maximum gate (skip the count where
    # no row's chunk maximum reaches its K-th; removed) slower once full chunks lost their masks, one
    # stage faster than two or three; call4: FS-L 32 per step 0.596 vs 16 0.612 ms
    "m64n32w4-count-s1": ScoreTiles(64, 32, 4, False, count_rounds=True, num_stages=1),  # the FS default since s25
    "m64n16w4-noexit-s1": ScoreTiles(64, 16, 4, False, num_stages=1),
    "m64n32w4-count-s3": ScoreTiles(64, 32, 4, False, count_rounds=True, num_stages=3),
    "m64n16w4-noexit-s3": ScoreTiles(64, 16, 4, False, num_stages=3),
    "m64n16w4-count-s1": ScoreTiles(64, 16, 4, False, count_rounds=True, num_stages=1),
    "m64n32w4-noexit-s1": ScoreTiles(64, 32, 4, False, num_stages=1),  # the FS-L default since s25 call4
    # s28: FS-L's last partial chunk (the 8 recent cells past 64 pool slots) in one 16-wide chunk
    "m64n32w4-noexit-s1-tail": ScoreTiles(64, 32, 4, False, num_stages=1, fsl_tail=True),
    "m64n64w4-noexit-s1-tail": ScoreTiles(64, 64, 4, False, num_stages=1, fsl_tail=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["fsl:4096", "fsl:65536", "fs:16384"], help="variant:T")
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--chunks", type=int, nargs="*", default=[16, 32, 64, 128], help="FS-L scan steps (cells) timed alone")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU smoke test (interpreter)")
    args = ap.parse_args()
    device, dtype = smoke_or_gpu(args.dry_run)
    H, D = (2, 16) if args.dry_run else (16, 64)
    variants = VARIANTS if not args.dry_run else {n: dataclasses.replace(t, block_m=16, block_n=16) for n, t in list(VARIANTS.items())[:4]}
    results = []
    for case in args.cases:
        variant, T = case.split(":")
        T = int(T) if not args.dry_run else 300
        cfg = freesolo.FreeSoloConfig(variant=variant)
        if args.dry_run:
            cfg = cfg.replace(window=32, cell=4, block=16, pool=8, recent=2)
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=gen)
        default = score_tiles(cfg, D, dtype)
        reference = select_cells(q, k, cfg, tiles=default)
        if variant == "fsl":  # the stages before scoring, alone: cell statistics, then the candidates by scan step
            _, amax = cell_stats(k, cfg.cell)
            stages = {"cell_stats": lambda: cell_stats(k, cfg.cell)}
            first = fsl_candidates(amax, T, cfg)
            for chunk in args.chunks if not args.dry_run else [2, 4]:
                got = fsl_candidates(amax, T, cfg, chunk=chunk)
                same = bool(torch.equal(got.sort(dim=-1).values, first.sort(dim=-1).values))
                stages[f"fsl_candidates chunk {chunk}"] = (lambda c=chunk: fsl_candidates(amax, T, cfg, chunk=c), same)
            for name, item in stages.items():
                fn, same = item if isinstance(item, tuple) else (item, True)
                ms = bench_ms(fn, device, args.rep_ms)
                results.append(dict(variant=variant, T=T, tiles=name, stage=True, ms=ms, equal_to_default=same, is_default=False))
                print(f"{variant} T={T:>7} {name:<24} {ms:8.3f} ms  equal={same}", flush=True)
        for name, tiles in variants.items():
            got = select_cells(q, k, cfg, tiles=tiles)
            equal = bool(torch.equal(got, reference))
            ms = bench_ms(lambda: select_cells(q, k, cfg, tiles=tiles), device, args.rep_ms)
            row = dict(variant=variant, T=T, tiles=name, block_m=tiles.block_m, block_n=tiles.block_n,
                       num_warps=tiles.num_warps, early_exit=tiles.early_exit, count_rounds=tiles.count_rounds,
                       erf_skip=tiles.erf_skip, ms=ms, equal_to_default=equal,
                       is_default=tiles == default)  # fmt: skip
            results.append(row)
            print(f"{variant} T={T:>7} {name:<20} {ms:8.3f} ms  equal={equal}", flush=True)
    payload = dict(env=_versions(device), dtype=str(dtype), H=H, D=D, B=1, rep_ms=args.rep_ms, results=results)

    def plot(data, png):
        values = {f"{r['variant']} {r['T']} {r['tiles']}": r["ms"] for r in data["results"]}
        mark = next((k for k, r in zip(values, data["results"]) if r["is_default"]), "")
        plot_bars(values, png, "select_cells ms (median)", "FS / FS-L selection by ScoreTiles", mark=mark)

    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
