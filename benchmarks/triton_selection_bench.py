"""Timing of the Triton selection kernels (`freesolo.backends.triton.selection`) on one GPU.

Per T in (4k, 16k, 64k), B = 1, Hq = 16, Hkv in (16, 4), D = 64, bf16, default config (cell 32,
block 128, pool 64, recent 8, top_k 4), median ms of `triton.testing.do_bench`:
  cell_stats      one pass over K (kbar, amax)
  fsl_pool        FS-L candidate pools (the sequential running top-P, one program per (b, kv head))
  fsl_select      the whole FS-L selection (cell_stats + pools + scoring / top-K)
  fs_select       the whole FS selection (cell_stats + scoring / top-K over every available cell)
  torch_fsl       the torch backend's FS-L selection, for reference
then a sweep of the scoring tiles (BLOCK_M, BLOCK_N, num_warps) and of the pool scan's chunk at
64k, Hkv = 16, and a check that the Triton FS-L / FS selections equal the torch backend's on all
but near-tie rows at 4k.

Usage (GPU machine, repository root; < 1 minute on an H200):
    python benchmarks/triton_selection_bench.py [--json benchmarks/results/triton_selection.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch.backend import select_cells as torch_select  # noqa: E402
from freesolo.backends.triton.selection import (  # noqa: E402
    ScoreTiles,
    cell_stats,
    fsl_candidates,
    score_tiles,
    select_cells,
)

LENGTHS = [4096, 16384, 65536]
HQ, D = 16, 64
SWEEP = [(64, 32, 4), (64, 64, 4), (64, 64, 8), (32, 32, 4), (128, 32, 8)]


def ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the records to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    fsl, fs = FreeSoloConfig(variant="fsl"), FreeSoloConfig(variant="fs")
    records = []
    names = ("cell_stats", "fsl_pool", "fsl_select", "fs_select", "torch_fsl")
    print(f"{'T':>6} {'Hkv':>4} " + " ".join(f"{n:>11}" for n in names) + "   (ms)")
    for Hkv in (16, 4):
        for T in LENGTHS:
            torch.manual_seed(0)
            q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
            _, amax = cell_stats(k, fsl.cell)
            row = {
                "T": T,
                "Hq": HQ,
                "Hkv": Hkv,
                "D": D,
                "dtype": "bf16",
                "cell_stats": ms(lambda: cell_stats(k, fsl.cell)),
                "fsl_pool": ms(lambda: fsl_candidates(amax, T, fsl)),
                "fsl_select": ms(lambda: select_cells(q, k, fsl)),
                "fs_select": ms(lambda: select_cells(q, k, fs)),
                "torch_fsl": ms(lambda: torch_select(q, k, fsl)),
            }
            records.append(row)
            print(f"{T:>6} {Hkv:>4} " + " ".join(f"{row[n]:>11.3f}" for n in names))
    T, Hkv = 65536, 16
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    defaults = f"default FS-L {score_tiles(fsl, D, q.dtype)}, FS {score_tiles(fs, D, q.dtype)}"
    print(f"tile sweep at T={T}, Hkv={Hkv} ({defaults})")
    for bm, bn, nw in SWEEP:
        tiles = ScoreTiles(bm, bn, nw)
        t_fsl = ms(lambda: select_cells(q, k, fsl, tiles))
        t_fs = ms(lambda: select_cells(q, k, fs, tiles))
        records.append({"sweep": [bm, bn, nw], "T": T, "Hkv": Hkv, "fsl_select": t_fsl, "fs_select": t_fs})
        print(f"  BLOCK_M={bm:>3} BLOCK_N={bn:>3} warps={nw}: fsl_select {t_fsl:8.3f} ms   fs_select {t_fs:8.3f} ms")
    _, amax = cell_stats(k, fsl.cell)
    for chunk in (32, 64, 128):
        t_pool = ms(lambda: fsl_candidates(amax, T, fsl, chunk=chunk))
        records.append({"pool_chunk": chunk, "T": T, "Hkv": Hkv, "fsl_pool": t_pool})
        print(f"  FS-L pools with scan chunk {chunk:>3}: {t_pool:8.3f} ms")
    # agreement with the torch backend (fp32 scores both; rows may differ only at near-ties)
    T = 4096
    q = torch.randn(1, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, 4, D, device="cuda", dtype=torch.bfloat16)
    for cfg in (fsl, fs):
        a, b = select_cells(q, k, cfg), torch_select(q, k, cfg)
        same = (a == b).all(-1).float().mean().item()
        print(f"{cfg.variant}: triton == torch backend on {same:.4%} of rows at T={T} (the rest: near-ties)")
        records.append({"agree_with_torch": cfg.variant, "T": T, "fraction": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
