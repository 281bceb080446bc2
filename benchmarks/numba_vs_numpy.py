"""Speed of the `numba` backend against the float64 NumPy oracle (CPU), printed, not asserted.

Default: FS-L with the paper's sizes at T = 8192, B = 1, Hq = 2, Hkv = 1, D = 64; both backends
compute the whole forward (selection + local branch + readout + combine). The numba time is the
best of `--repeat` runs after a compile/warm-up call; the oracle runs once. `--long T` also
times numba alone at a long T (default run: 65536 with Hq = 4, Hkv = 1).

    python benchmarks/numba_vs_numpy.py                 # ratio at T=8192, then numba at T=65536
    python benchmarks/numba_vs_numpy.py --long 0        # ratio only

Writes benchmarks/results/numba_vs_numpy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numba
import numpy as np

import freesolo
from freesolo import FreeSoloConfig
from freesolo.backends.numba import backend as numba_backend
from freesolo.reference import oracle

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "numba_vs_numpy.json")


def _inputs(seed: int, B: int, T: int, Hq: int, Hkv: int, D: int):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, T, Hq, D)),
        rng.standard_normal((B, T, Hkv, D)),
        rng.standard_normal((B, T, Hkv, D)),
    )


def _best_of(fn, repeat: int) -> tuple[float, float]:
    """Best wall time and the CPU time (all threads) of that run, in seconds."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if wall < best:
            best, best_cpu = wall, cpu
    return best, best_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="fsl", choices=["fs", "fsl"])
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--Hq", type=int, default=2)
    parser.add_argument("--Hkv", type=int, default=1)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--long", type=int, default=65536, help="T of a numba-only timing (0: skip)")
    parser.add_argument("--long-Hq", type=int, default=4)
    args = parser.parse_args()

    print(
        f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}, "
        f"freesolo {getattr(freesolo, '__version__', '?')}, cpus {os.cpu_count()}, "
        f"numba threads {numba.get_num_threads()}, {platform.processor() or platform.machine()}"
    )
    cfg = FreeSoloConfig(variant=args.variant)
    q, k, v = _inputs(0, 1, args.T, args.Hq, args.Hkv, args.D)
    beta = np.ones(args.Hq)

    start = time.perf_counter()
    numba_backend.attention(q[:, :300], k[:, :300], v[:, :300], cfg, beta[: args.Hq])  # compile / load cache
    warmup = time.perf_counter() - start
    t_numba, cpu_numba = _best_of(lambda: numba_backend.attention(q, k, v, cfg, beta), args.repeat)
    out_numba = numba_backend.attention(q, k, v, cfg, beta)
    start, start_cpu = time.perf_counter(), time.process_time()
    out_numpy = oracle.attention(q, k, v, cfg, beta)
    t_numpy, cpu_numpy = time.perf_counter() - start, time.process_time() - start_cpu
    err = float(np.sqrt(np.mean((out_numba - out_numpy) ** 2) / np.mean(out_numpy**2)))
    ratio, cpu_ratio = t_numpy / t_numba, cpu_numpy / cpu_numba
    shape = f"B=1 T={args.T} Hq={args.Hq} Hkv={args.Hkv} D={args.D}"
    print(
        f"{args.variant} {shape}: numpy {t_numpy:.2f} s (cpu {cpu_numpy:.2f} s), numba {t_numba:.3f} s "
        f"(cpu {cpu_numba:.3f} s, warm-up {warmup:.1f} s): numba is {ratio:.0f}x faster in wall time, "
        f"{cpu_ratio:.0f}x in CPU time; rms-rel diff {err:.1e}"
    )
    result = {
        "variant": args.variant,
        "B": 1,
        "T": args.T,
        "Hq": args.Hq,
        "Hkv": args.Hkv,
        "D": args.D,
        "numpy_s": t_numpy,
        "numba_s": t_numba,
        "ratio": ratio,
        "rms_rel_diff": err,
        "numpy_cpu_s": cpu_numpy,
        "numba_cpu_s": cpu_numba,
        "cpu_ratio": cpu_ratio,
        "numba_threads": numba.get_num_threads(),
        "cpus": os.cpu_count(),
        "versions": {"numpy": np.__version__, "numba": numba.__version__, "python": platform.python_version()},
    }

    if args.long:
        q, k, v = _inputs(1, 1, args.long, args.long_Hq, args.Hkv, args.D)
        beta = np.ones(args.long_Hq)
        parts = {}
        start = time.perf_counter()
        idx = numba_backend.select_cells(q, k, cfg)
        parts["select"] = time.perf_counter() - start
        start = time.perf_counter()
        numba_backend.local_attention(q, k, v, cfg)
        parts["local"] = time.perf_counter() - start
        start = time.perf_counter()
        numba_backend.long_range_readout(q, k, v, idx, cfg)
        parts["readout"] = time.perf_counter() - start
        t_long, cpu_long = _best_of(lambda: numba_backend.attention(q, k, v, cfg, beta), 1)
        print(
            f"{args.variant} B=1 T={args.long} Hq={args.long_Hq} Hkv={args.Hkv} D={args.D}: numba {t_long:.2f} s "
            f"(cpu {cpu_long:.2f} s) "
            f"({args.long * args.long_Hq / t_long:,.0f} query-heads/s; "
            + ", ".join(f"{name} {sec:.2f} s" for name, sec in parts.items())
            + ")"
        )
        result["long"] = {
            "T": args.long,
            "Hq": args.long_Hq,
            "numba_s": t_long,
            "numba_cpu_s": cpu_long,
            "parts_s": parts,
        }

    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
