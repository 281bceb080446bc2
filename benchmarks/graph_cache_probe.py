"""The triton backend's CUDA-graph cache of short calls, on and off (`freesolo.backends.triton.graphs`).

For FS-L (B 1, H 16, D 64, bf16, through the API, `check_finite=False`) at each length and in
each mode (fwd without grad; fwd+bwd into the inputs' .grad), with FREESOLO_TRITON_GRAPHS=0 (every
call launches its kernels) and with the default (calls of at most 8192 tokens at H 16, D 64 replay a graph):

- ms per call (median of `triton.testing.do_bench`) and host us per call (calls queued back to
  back, one sync at the end: the host's time when the host is the bottleneck);
- the capturing call's wall time (the second call of a key) and the GPU memory the cache holds
  (allocated bytes freed by `graphs.clear()`), the graphs on the caller's inputs included (s49: with
  FREESOLO_TRITON_GRAPH_DIRECT_MAX=N set, forwards without gradients past 8192 tokens and up to N query
  elements replay only those);
- whether the replayed outputs (and gradients) equal the eager ones bit for bit;
- host us per call with the GPU idle at each call's start, and (--profile) the kernels' GPU time.

    python benchmarks/graph_cache_probe.py --out $OUT/graph_cache.json    # H200, ~30 s
Writes the JSON and a PNG beside it (ms per call, both settings).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import _versions, plot_bars, write_results  # noqa: E402
from host_overhead_probe import host_us  # noqa: E402 (calls queued back to back)
from launch_host_probe import idle_host_us  # noqa: E402 (GPU idle at each call's start)

import freesolo  # noqa: E402
from freesolo.backends.triton import graphs  # noqa: E402

SETTINGS = {"eager": "0", "graphs": ""}


def _call(mode: str, q, k, v, do, cfg):
    def fwd():
        with torch.no_grad():
            return [freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)]

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        o.backward(do)
        return [o.detach(), q.grad, k.grad, v.grad]

    return fwd if mode == "fwd" else fwd_bwd


def _kernel_us(fn, calls: int) -> dict:
    """torch.profiler: CUDA time per call of each kernel / copy name (summed over `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    sums = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            sums[event.key[:90]] = us / calls
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def _print_cprofile(fn, title: str, calls: int = 50) -> None:
    """cProfile of `calls` calls with the GPU idle at each call's start: the 30 functions with the
    most own time, printed."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    torch.cuda.synchronize()
    print(f"=== cProfile {title}: {calls} calls, GPU idle at each start", flush=True)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)


def measure(T: int, mode: str, setting: str, rep_ms: int, profile_kernels: bool) -> dict:
    import triton.testing

    os.environ[graphs.GRAPHS_ENV] = SETTINGS[setting]
    graphs.clear()
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, T, 16, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    do = torch.randn(1, T, 16, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    for x in (q, k, v):
        x.requires_grad_(mode == "fwd+bwd")
    fn = _call(mode, q, k, v, do, cfg)
    first = [x.clone() for x in fn()]  # eager in both settings (the first call of a key)
    torch.cuda.synchronize()
    held_before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    second = [x.clone() for x in fn()]  # the graphs setting captures here
    torch.cuda.synchronize()
    second_ms = 1e3 * (time.perf_counter() - start)
    later = [x.clone() for x in fn()]
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, later))
    ms = float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
    host = [host_us(fn, 100) for _ in range(3)]
    idle_host = [idle_host_us(fn, 50) for _ in range(3)]
    kernels = _kernel_us(fn, 20) if profile_kernels else {}
    if profile_kernels and setting == "graphs":
        _print_cprofile(fn, f"T={T} {mode} {setting}")
    stats = dict(graphs.CACHE.stats)
    direct_stats = dict(graphs.CACHE.direct_stats)
    held = torch.cuda.memory_allocated()
    graphs.clear()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    return {
        "T": T, "mode": mode, "setting": setting, "graphs_env": SETTINGS[setting], "ms": ms, "host_us": host,
        "idle_host_us": idle_host, "kernel_us_per_call": kernels, "kernel_sum_us": sum(kernels.values()),
        "second_call_ms": second_ms,
        "cache_gib": freed / 2**30, "allocated_by_second_call_gib": (held - held_before) / 2**30,
        "bitwise_equal_to_first_call": equal, "cache_stats": stats,
        "direct_stats": direct_stats,
    }


def plot(payload: dict, path: str) -> None:
    values = {f"{r['mode']} T={r['T']} {r['setting']} ({r['graphs_env']!r})": r["ms"] for r in payload["results"]}
    plot_bars(values, path, "ms per call (median)", "triton FS-L, CUDA-graph cache of short calls on / off (H16 D64 bf16)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--graphs-env", default="", help="FREESOLO_TRITON_GRAPHS of the graphs setting (default: the backend's)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler kernel times per call (kernel_us_per_call)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    SETTINGS["graphs"] = args.graphs_env
    results = []
    for T in args.lengths:
        for mode in ("fwd", "fwd+bwd"):
            for setting in SETTINGS:
                row = measure(T, mode, setting, args.rep_ms, args.profile)
                print(row, flush=True)
                results.append(row)
    meta = _versions(torch.device("cuda"))
    meta.update(shape="B 1, Hq = Hkv = 16, D 64, bf16, FS-L, check_finite=False", timing="triton.testing.do_bench median")
    write_results(args.out, {"meta": meta, "results": results}, plot)


if __name__ == "__main__":
    main()
