"""How much of a short Triton FS-L call's host time is Triton's launch path (issues 10 / 11: the 4k bars).

At 4k / 16k the triton FS-L forward and forward+backward are host bound on the H200's host (s28:
0.9 ms of host per 4k forward against ~0.15 ms of GPU time in a CUDA graph). This probe:

1. runs one call of each path (API forward without grad, API forward + backward) with
   `JITFunction.run` wrapped, and records every launch (kernel, grid, arguments);
2. times, per call, the whole path's host time, and the share spent inside `JITFunction.run`
   (perf_counter around each launch);
3. replays every recorded launch three ways, host time per launch:
   `jit`    - `kernel[grid](*args, **kwargs)` as the backend launches today;
   `bound`  - Triton's own binder (the specialization, C++) + the compiled kernel's cache lookup,
              then the compiled kernel's launcher directly (what a leaner launch path would do);
   `direct` - the compiled kernel's launcher with the bound arguments cached (the floor);
4. cProfile of each path sorted by cumulative time (freesolo's functions), then by own time
   (every function, torch's and Triton's builtins included);
5. `--ab`: each path's host time with `_common.launch`'s fast path off and on
   (FREESOLO_TRITON_FAST_LAUNCH=0 / 1), alternating, three rounds each, same process;
6. `--torch-profile`: torch.profiler (CPU + CUDA activity) of 20 calls of each path: the aten ops'
   and CUDA runtime / driver calls' host time (self CPU), to find the host work outside the launches.

    python benchmarks/launch_host_probe.py --T 4096 16384 --out $OUT/launch_host.json   # H200, ~30 s
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton
from triton.runtime import jit as triton_jit

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _versions, write_json  # noqa: E402 (benchmarks/ is this script's folder)
from host_overhead_probe import host_us  # noqa: E402

import freesolo  # noqa: E402
from freesolo import FreeSoloConfig  # noqa: E402

__all__ = ["main"]

_ORIGINAL_RUN = triton_jit.JITFunction.run


class LaunchRecorder:
    """Wraps JITFunction.run: records launches (when `recording`) and sums the host time spent inside."""

    def __init__(self):
        self.recording = False
        self.launches = []
        self.seconds = 0.0
        self.count = 0

    def install(self):
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            start = time.perf_counter()
            kernel = _ORIGINAL_RUN(self, *args, grid=grid, warmup=warmup, **kwargs)
            recorder.seconds += time.perf_counter() - start
            recorder.count += 1
            if recorder.recording and not warmup:
                recorder.launches.append((self, grid, args, dict(kwargs)))
            return kernel

        triton_jit.JITFunction.run = run

    def uninstall(self):
        triton_jit.JITFunction.run = _ORIGINAL_RUN


def replay_costs(launches, calls: int) -> list[dict]:
    """Host microseconds per launch of each recorded launch, three ways (module docstring)."""
    rows = []
    device = torch.cuda.current_device()
    for fn, grid, args, kwargs in launches:
        kw = dict(kwargs)
        kw.pop("debug", None)
        kw.pop("instrumentation_mode", None)
        grid_t = grid if not callable(grid) else None
        if grid_t is None:
            rows.append(dict(kernel=fn.__name__, note="callable grid: not replayed"))
            continue
        g = tuple(grid_t) + (1,) * (3 - len(grid_t))

        def jit_launch():
            fn[grid_t](*args, **kw)

        kernel_cache, kernel_key_cache, _target, _backend, binder = fn.device_caches[device]
        full_kw = dict(kw)
        full_kw["debug"] = fn.debug or triton.knobs.runtime.debug
        full_kw["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        bound_args, specialization, options = binder(*args, **full_kw)
        key = triton_jit.compute_cache_key(kernel_key_cache, specialization, options)
        compiled = kernel_cache[key]
        values = tuple(bound_args.values())

        def bound_launch():
            b_args, spec, opts = binder(*args, **full_kw)
            k = kernel_cache[triton_jit.compute_cache_key(kernel_key_cache, spec, opts)]
            stream = torch.cuda.current_stream(device).cuda_stream
            k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None, *b_args.values())

        def direct_launch():
            stream = torch.cuda.current_stream(device).cuda_stream
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

        row = dict(kernel=fn.__name__, grid=list(g), n_args=len(values))
        for name, launch in (("jit", jit_launch), ("bound", bound_launch), ("direct", direct_launch)):
            try:
                row[f"{name}_us"] = host_us(launch, calls)
            except Exception as error:  # a probe: say what failed and go on
                row[f"{name}_error"] = repr(error)
        rows.append(row)
    return rows


def profile_text(fn, calls: int) -> str:
    profile = cProfile.Profile()
    fn()
    torch.cuda.synchronize()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("freesolo", 45)
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)  # every function, builtins included
    return text.getvalue()


def ab_rounds(fn, calls: int) -> dict:
    """Host us per call with FREESOLO_TRITON_FAST_LAUNCH=0 and =1, alternating, three rounds each."""
    from freesolo.backends.triton import _common

    out = {"off": [], "on": []}
    previous = os.environ.get(_common.FAST_LAUNCH_ENV)
    try:
        for _ in range(3):
            for mode, value in (("off", "0"), ("on", "1")):
                os.environ[_common.FAST_LAUNCH_ENV] = value
                out[mode].append(round(host_us(fn, calls), 1))
    finally:
        if previous is None:
            os.environ.pop(_common.FAST_LAUNCH_ENV, None)
        else:
            os.environ[_common.FAST_LAUNCH_ENV] = previous
    return out


def idle_host_us(fn, calls: int) -> float:
    """Mean host microseconds per call with the GPU idle at each call's start (a sync before each,
    outside the timed span): the call's own host work, without back-pressure from a full launch queue."""
    for _ in range(5):
        fn()
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * total / calls


def without_launches(fn, calls: int) -> dict:
    """`idle_host_us` of fn with every Triton launch of the backend replaced by a no-op (outputs are
    garbage): the host time of everything but the launches (Python, allocations, streams, aten ops)."""
    from freesolo.backends.triton import _common, attention, attention_bwd, selection

    modules = (_common, attention, attention_bwd, selection)
    saved = [m.launch for m in modules]
    counter = {"n": 0}

    def no_launch(kernel, grid, *args, **kwargs):
        counter["n"] += 1

    try:
        for m in modules:
            m.launch = no_launch
        host = [round(idle_host_us(fn, calls), 1) for _ in range(3)]
    finally:
        for m, original in zip(modules, saved):
            m.launch = original
    return dict(host_us=host, launches_per_call=counter["n"] / (3 * (calls + 5)))


def torch_profile_table(fn, calls: int = 20) -> str:
    """torch.profiler key averages (self CPU time) over `calls` calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ab", action="store_true", help="fast launch off / on, alternating (module docstring)")
    parser.add_argument("--torch-profile", action="store_true", help="torch.profiler tables of each path")
    parser.add_argument("--no-replay", action="store_true", help="skip the launch recording, replay and cProfile")
    parser.add_argument("--idle", action="store_true", help="host time per call with the GPU idle at its start (`idle_host_us`)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    cfg = FreeSoloConfig(variant="fsl")
    recorder = LaunchRecorder()
    recorder.install()
    results = []
    for T in args.T:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, T, 16, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        do = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)

        def fwd_bwd():
            o = freesolo.freesolo_attention(qg, kg, vg, cfg, backend="triton", check_finite=False)
            o.backward(do)

        for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            if args.idle:
                idle = [round(idle_host_us(fn, args.calls), 1) for _ in range(3)]
                queued = [round(host_us(fn, args.calls), 1) for _ in range(3)]
                results.append(dict(T=T, path=name, idle_host_us=idle, queued_host_us=queued))
                print(f"T={T} {name}: host per call, GPU idle at the start {idle} / calls queued {queued} us", flush=True)
                if name == "fwd":  # (fwd+bwd: the backward's aten ops would index with garbage selections)
                    bare = without_launches(fn, args.calls)
                    results[-1]["without_launches"] = bare
                    print(f"T={T} {name}: host per call without the Triton launches {bare['host_us']} us "
                          f"({bare['launches_per_call']:.1f} launches per call skipped)", flush=True)
            if args.ab:
                ab = ab_rounds(fn, args.calls)
                results.append(dict(T=T, path=name, ab=ab))
                print(f"T={T} {name}: fast launch off {ab['off']} / on {ab['on']} us/call", flush=True)
            if args.torch_profile:
                recorder.uninstall()
                print(f"T={T} {name}: torch.profiler, 20 calls", flush=True)
                print(torch_profile_table(fn), flush=True)
                recorder.install()
            if args.no_replay:
                continue
            fn()
            torch.cuda.synchronize()
            recorder.launches, recorder.recording = [], True
            fn()
            recorder.recording = False
            torch.cuda.synchronize()
            launches = list(recorder.launches)
            recorder.seconds, recorder.count = 0.0, 0
            total = host_us(fn, args.calls)
            in_run = 1e6 * recorder.seconds / recorder.count * len(launches) if recorder.count else 0.0
            replay = replay_costs(launches, args.calls)
            sums = {w: sum(r.get(f"{w}_us", 0.0) for r in replay) for w in ("jit", "bound", "direct")}
            record = dict(T=T, path=name, host_us_per_call=total, launches=len(launches), in_run_us_per_call=in_run,
                          replay_sum_us=sums, replay=replay)
            results.append(record)
            print(f"T={T} {name}: host {total:.1f} us/call, {len(launches)} launches, {in_run:.1f} us inside "
                  f"JITFunction.run; replay sums jit {sums['jit']:.1f} bound {sums['bound']:.1f} direct {sums['direct']:.1f}",
                  flush=True)
            for r in replay:
                print("   ", r, flush=True)
            recorder.uninstall()
            print(profile_text(fn, args.calls), flush=True)
            recorder.install()
    recorder.uninstall()
    write_json(args.out, dict(meta=_versions(dev), calls=args.calls, results=results))


if __name__ == "__main__":
    main()
