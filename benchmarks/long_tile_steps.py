"""How many cell steps the Triton forward's long kernel takes (CPU, no GPU needed): the sum over
64-query tiles of each tile's cell union, per head, for the tiles the kernel can use:

- consecutive: 64 consecutive positions per tile (the default below `SORTED_LONG_MIN_T`);
- sorted: positions sorted by selection within 4096-position chunks (`attention.long_query_order`,
  the default from 32k);
- variable (cap U): sorted positions cut into tiles of at most 64 queries whose union stays <= U
  (fewer masked rows per step, but a cell read by many queries recurs in more tiles);
- inverted (a bound): cells outside, their readers inside, 64 readers per step, as Flash Sparse
  Attention's loop does: sum over cells of ceil(readers / 64). It needs partial results per
  (query, slot) merged afterwards, which the union kernel does not.

Every step costs the same (a [64, cell] score tile and a [64, D] accumulator update), so the
kernel's time follows these counts. iid Gaussian q / k (bf16-rounded), FS-L library defaults,
torch backend selection:

    python benchmarks/long_tile_steps.py --T 65536 --H 4 --out benchmarks/results/long_tile_steps.json
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
from freesolo.backends.triton.attention import long_query_order  # noqa: E402

__all__ = ["main", "tile_steps"]

ROWS = 64


def tile_steps(sel: np.ndarray, caps=(8, 12)) -> dict:
    """sel int [T, K] (-1: none) of one head, rows in the order the tiles take them ->
    {"fixed": steps of 64-row tiles, f"cap{U}": (steps, tiles) of variable tiles}."""
    out = {"fixed": sum(len(np.unique(t[t >= 0])) for t in (sel[i : i + ROWS].reshape(-1) for i in range(0, len(sel), ROWS)))}
    for cap in caps:
        steps = tiles = rows = 0
        cur: set = set()
        for r in sel:
            cells = {int(c) for c in r if c >= 0}
            if rows == ROWS or (rows and len(cur | cells) > cap):
                steps, tiles, cur, rows = steps + len(cur), tiles + 1, set(), 0
            cur |= cells
            rows += 1
        out[f"cap{cap}"] = (steps + len(cur), tiles + 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    g = torch.Generator().manual_seed(args.seed)
    q, k = (torch.randn(1, args.T, args.H, 64, generator=g).bfloat16().float() for _ in range(2))
    idx = torch.as_tensor(freesolo.select_cells(q, k, cfg, backend="torch", check_finite=False)).contiguous()
    order = long_query_order(idx, cfg.cell, use_kernel=False)
    records = []
    for h in range(args.H):
        sel = idx[0, :, h].numpy()
        cells, readers = np.unique(sel[sel >= 0], return_counts=True)
        rec = {"head": h, "T": args.T, "tiles_fixed": -(-args.T // ROWS),
               "consecutive": tile_steps(sel, caps=())["fixed"],
               "inverted_bound": int(np.sum(-(-readers // ROWS))), "cells_read": int(len(cells))}  # fmt: skip
        sorted_steps = tile_steps(sel[order[h].long().numpy()])
        rec["sorted"] = sorted_steps.pop("fixed")
        rec.update({f"sorted_{name}": list(v) for name, v in sorted_steps.items()})
        records.append(rec)
        print(rec, flush=True)
    with open(args.out, "w") as f:
        json.dump({"config": "FreeSoloConfig(variant='fsl')", "keys": "iid bf16-rounded", "torch": torch.__version__,
                   "rows": ROWS, "records": records}, f, indent=1)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
