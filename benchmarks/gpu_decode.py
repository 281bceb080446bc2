"""Per-token decode latency and cache memory: FS-L `FreeSoloCache` vs SDPA over a full KV cache.

Contexts 4k, 64k, 256k, 1M; batch 1 and 32; H = 16 heads (MHA), D = 64, bf16, on one GPU.
For each (B, T) in the same run:

- FS-L: a cache is brought to context T with `prefill` (state only, chunked: the real state, the
  one `extend` would leave: tested in proofs_tests/test_cache.py), then `--steps` one-token decode
  steps are timed back to back (CUDA events), eagerly (`extend(check_finite=False)`) and through
  a CUDA graph (`decode_graph()`; block boundaries run eagerly inside). Memory: `memory_bytes()`.
  The eager step also runs `block + 1` times under `torch.cuda.set_sync_debug_mode("error")`
  (`fsl_sync_free` in the JSON: True, or the error a host sync raised).
- SDPA: `scaled_dot_product_attention(q [B, H, 1, D], K [B, H, T, D], V)` (1 query vs T cached
  keys, flash kernel), timed the same way. Memory: K and V. Skipped (with the reason) when the
  full KV cache does not fit in free GPU memory (B = 32 at 1M needs 128 GiB).

Writes benchmarks/results/gpu_decode.json and gpu_decode.png. Takes ~2-4 minutes on an H200.
    python benchmarks/gpu_decode.py            # full run (GPU)
    python benchmarks/gpu_decode.py --quick    # small CPU / GPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

import freesolo
from freesolo import FreeSoloCache, FreeSoloConfig

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info(device: str) -> dict:
    info = {"torch": torch.__version__, "freesolo": freesolo.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


class Timer:
    """Mean seconds per call of `fn` over `n` back-to-back calls (CUDA events, or perf_counter on CPU)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self, fn, n: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(n):
                fn(i)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - t0) / n


def fsl_run(cfg, B, H, D, T, dtype, device, steps, chunk, timer) -> dict:
    """Prefill an FS-L cache to T tokens, then time eager and CUDA-graph decode steps."""
    cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device)
    t0 = time.perf_counter()
    for start in range(0, T, chunk):
        n = min(chunk, T - start)
        k = torch.randn(B, n, H, D, device=device, dtype=dtype)  # (B, n, H, D)
        v = torch.randn(B, n, H, D, device=device, dtype=dtype)
        cache.prefill(k, v, check_finite=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    memory = cache.memory_bytes()
    q = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)  # decode inputs, made before timing
    k = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)
    v = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)
    out = {}

    def eager(i):
        return cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], check_finite=False)

    for i in range(2):  # warm-up, also leaves a step that is not a block boundary
        o = eager(i)
    assert torch.isfinite(o).all(), "non-finite FS-L decode output"
    out["fsl_eager_us"] = timer(lambda i: eager(2 + i), steps) * 1e6
    if device.startswith("cuda"):  # the eager FS-L step must not synchronise (block boundaries included)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(cfg.block + 1):
                eager(i)
            out["fsl_sync_free"] = True
        except RuntimeError as error:
            out["fsl_sync_free"] = f"host sync detected: {error}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if cache.length % cfg.block == 0:
        eager(0)
    if device.startswith("cuda"):
        try:
            graph = cache.decode_graph()
            base = 2 + steps

            def replay(i):
                return graph(
                    q[:, base + i : base + i + 1], k[:, base + i : base + i + 1], v[:, base + i : base + i + 1]
                )

            replay(0)
            out["fsl_graph_us"] = timer(lambda i: replay(1 + i), steps - 1) * 1e6
        except Exception as error:  # noqa: BLE001 - record why, keep the eager numbers
            out["fsl_graph_us"] = None
            out["fsl_graph_error"] = f"{type(error).__name__}: {error}"
            print(f"  CUDA graph capture failed: {out['fsl_graph_error']}")
    out.update(
        fsl_memory_bytes=memory,
        fsl_memory_after_decode=cache.memory_bytes(),
        prefill_s=prefill_s,
        fsl_T_end=cache.length,
    )
    return out


def sdpa_run(B, H, D, T, dtype, device, steps, timer) -> dict:
    """1 query vs a full KV cache of T tokens: latency and the cache's bytes (or why skipped)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = 2 * B * H * T * D * itemsize
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        if need > 0.9 * free:
            return {
                "sdpa_us": None,
                "sdpa_memory_bytes": need,
                "sdpa_skipped": f"full KV cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
            }
    Kc = torch.randn(B, H, T, D, device=device, dtype=dtype)  # (B, H, T, D)
    Vc = torch.randn(B, H, T, D, device=device, dtype=dtype)
    q = torch.randn(B, H, 1, D, device=device, dtype=dtype)

    def step(_):
        return F.scaled_dot_product_attention(q, Kc, Vc)

    step(0)
    n = max(10, min(steps, int(2e10 // max(need, 1))))  # fewer calls when each reads many GB
    us = timer(step, n) * 1e6
    return {"sdpa_us": us, "sdpa_memory_bytes": need, "sdpa_steps": n}


def plot(rows, path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for B, style in zip(sorted({r["B"] for r in rows}), ("-", "--")):
        sub = [r for r in rows if r["B"] == B]
        Ts = [r["T"] for r in sub]
        for key, label, color in (
            ("fsl_graph_us", "FS-L (CUDA graph)", "C0"),
            ("fsl_eager_us", "FS-L (eager)", "C2"),
            ("sdpa_us", "SDPA full KV", "C3"),
        ):
            pts = [(r["T"], r[key]) for r in sub if r.get(key)]
            if pts:
                ax_t.plot(*zip(*pts), style, marker="o", color=color, label=f"{label}, B={B}")
        ax_m.plot(
            Ts, [r["fsl_memory_bytes"] / 2**20 for r in sub], style, marker="o", color="C0", label=f"FS-L cache, B={B}"
        )
        ax_m.plot(
            Ts, [r["sdpa_memory_bytes"] / 2**20 for r in sub], style, marker="o", color="C3", label=f"full KV, B={B}"
        )
    for ax, ylabel in ((ax_t, "decode latency per token (us)"), (ax_m, "cache memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax_t.set_title(f"per-token decode latency (1 layer, {title})")
    ax_m.set_title("cache memory per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=256, help="decode steps timed (256 = 2 block boundaries)")
    p.add_argument("--chunk", type=int, default=16384, help="prefill chunk (tokens)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test, CPU friendly)")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.heads, args.steps, args.chunk = [1024, 4096], [1, 2], 4, 16, 2048
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32
    cfg = FreeSoloConfig(variant="fsl")
    info = env_info(args.device)
    print(f"gpu_decode: {info}")
    print(f"config: {cfg}")
    timer = Timer(args.device)
    rows = []
    header = f"{'B':>3} {'T':>8} | {'FS-L graph us':>13} {'FS-L eager us':>13} {'SDPA us':>9} | {'FS-L MiB':>9} {'full KV MiB':>12} | prefill s"
    print(header)
    t_start = time.perf_counter()
    for B in args.batches:
        for T in args.contexts:
            row = {"B": B, "T": T, "H": args.heads, "D": args.dim, "dtype": str(dtype)}
            row.update(fsl_run(cfg, B, args.heads, args.dim, T, dtype, args.device, args.steps, args.chunk, timer))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            row.update(sdpa_run(B, args.heads, args.dim, T, dtype, args.device, args.steps, timer))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            rows.append(row)

            def fmt(x, spec):
                return "-" if x is None else format(x, spec)

            print(
                f"{B:>3} {T:>8} | {fmt(row.get('fsl_graph_us'), '13.1f')} {row['fsl_eager_us']:>13.1f} "
                f"{fmt(row['sdpa_us'], '9.1f')} | {row['fsl_memory_bytes'] / 2**20:>9.2f} "
                f"{row['sdpa_memory_bytes'] / 2**20:>12.1f} | {row['prefill_s']:.2f}"
                + f"  sync-free: {row.get('fsl_sync_free', 'n/a')}"
                + (f"  (SDPA skipped: {row['sdpa_skipped']})" if row.get("sdpa_skipped") else ""),
                flush=True,
            )
    for B in args.batches:
        mems = {r["fsl_memory_bytes"] for r in rows if r["B"] == B}
        print(
            f"FS-L memory at B={B} over contexts {args.contexts}: {sorted(mems)} bytes "
            f"({'constant' if len(mems) == 1 else 'NOT constant'})"
        )
    os.makedirs(args.out, exist_ok=True)
    name = "gpu_decode_quick" if args.quick else "gpu_decode"
    result = {
        "env": info,
        "config": {k: v for k, v in vars(cfg).items()},
        "device": args.device,
        "steps": args.steps,
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
        "notes": "latency = mean per token over back-to-back steps (CUDA events); FS-L state reached by "
        "chunked prefill of random bf16 keys/values; SDPA = 1 query vs T cached keys",
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    plot(
        rows,
        os.path.join(args.out, f"{name}.png"),
        f"H={args.heads}, D={args.dim}, {str(dtype).replace('torch.', '')}, {info.get('gpu', args.device)}",
    )
    print(f"wrote {os.path.join(args.out, name)}.json/.png in {result['wall_s']:.0f} s")
    return 0 if all(math.isfinite(r["fsl_eager_us"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
