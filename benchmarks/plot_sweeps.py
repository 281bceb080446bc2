"""PNG of a committed tile sweep: one bar per configuration (milliseconds), next to its JSON.

Reads the sweeps written on the GPU by `benchmarks/triton_forward_ab.py --sweep-only` (key
"sweep": {name: {"kernels_ms": ...}}) and `benchmarks/triton_backward_bench.py --sweep-only`
(key "sweep": [{"tiles": {...}, "bwd_ms_det": ...}]); runs anywhere (no GPU).

    python benchmarks/plot_sweeps.py benchmarks/results/session_2026-12-01_s21/call2/triton_forward_sweep.json \\
        benchmarks/results/session_2026-12-01_s21/call3/triton_backward_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import plot_bars  # noqa: E402 (benchmarks/ is this script's folder)

__all__ = ["main", "sweep_values"]

# BwdTiles fields a backward sweep varies (the rest are the defaults of the run)
_BWD_FIELDS = ("kv_block_n", "kv_block_m", "q_block_m", "q_block_n", "num_warps", "num_stages",
               "block_r", "seg", "num_warps_long", "block_rows", "long_chunk")  # fmt: skip


def sweep_values(payload: dict) -> tuple[dict, str, str]:
    """({label: ms}, label of the run's default, x-axis label) of a forward or backward sweep."""
    sweep = payload["sweep"]
    if isinstance(sweep, dict):  # forward: {name: {"kernels_ms": ...}}
        values = {name: row["kernels_ms"] for name, row in sweep.items() if "kernels_ms" in row}
        return values, "long64w4+maxnreg128", "FS-L forward kernels at 64k (unions precomputed), ms"
    values, first = {}, None
    for row in sweep:  # backward: the first row is the defaults of the run
        if not isinstance(row["bwd_ms_det"], (int, float)):
            continue
        tiles = row["tiles"]
        first = first or tiles
        changed = [f"{k}={tiles[k]}" for k in _BWD_FIELDS if tiles[k] != first[k]]
        values[", ".join(changed) or "defaults of the run"] = row["bwd_ms_det"]
    return values, "defaults of the run", "FS-L backward at 64k (deterministic), ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="sweep JSON files; each PNG is written next to its JSON")
    args = ap.parse_args(argv)
    for path in args.paths:
        with open(path) as f:
            payload = json.load(f)
        values, mark, xlabel = sweep_values(payload)
        plot_bars(values, os.path.splitext(path)[0] + ".png", xlabel, os.path.basename(path), mark=mark)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
