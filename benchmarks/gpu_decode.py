"""Per-token decode latency and cache memory: FreeSoloCache (FS-L, FS) vs SDPA over a full KV cache.

Contexts 4k, 64k, 256k, 1M; batch 1 and 32; H = 16 heads (MHA), D = 64, bf16, on one GPU.
For each (B, T) in the same run:

- FS-L, torch step: a cache is brought to context T with `prefill` (state only, chunked: the
  real state, the one `extend` would leave: tested in proofs_tests/test_cache.py), then `--steps`
  one-token decode steps are timed back to back (CUDA events), eagerly
  (`extend(check_finite=False)`) and through a CUDA graph (`decode_graph()`). Memory: `memory_bytes()`.
  The eager step also runs `block + 1` times under `torch.cuda.set_sync_debug_mode("error")`
  (`fsl_sync_free` in the JSON: True, or the error a host sync raised).
- FS-L, fused Triton step (`decode_kernel="triton"`, freesolo/backends/triton/decode.py): the
  same state loaded into a triton cache; `block + 1` steps checked against the torch step on the
  same state (`fsl_triton_vs_torch_rms`, RMS-relative) under sync debug "error"
  (`fsl_triton_sync_free`), then eager and CUDA-graph steps timed (`fsl_triton_eager_us`,
  `fsl_triton_graph_us`).
- FS, fused Triton step: an FS cache (the whole archive) prefilled to T, checked against the
  torch step like FS-L (`fs_triton_vs_torch_rms`, `fs_triton_sync_free`), then eager and graph
  steps timed (`fs_triton_eager_us`, `fs_triton_graph_us`); the archive is grown to its final
  capacity first so that the timed steps do not re-capture. Skipped (with the reason) when the
  archive does not fit in free GPU memory (B = 32 at 1M needs 128 GiB).
- SDPA: `scaled_dot_product_attention(q [B, H, 1, D], K [B, H, T, D], V)` (1 query vs T cached
  keys, flash kernel), timed the same way. Memory: K and V. Skipped (with the reason) when the
  full KV cache does not fit in free GPU memory (B = 32 at 1M needs 128 GiB).

Writes benchmarks/results/gpu_decode.json and gpu_decode.png. Takes ~1-3 minutes on an H200.
    python benchmarks/gpu_decode.py            # full run (GPU)
    python benchmarks/gpu_decode.py --quick    # small CPU / GPU smoke run (triton parts: GPU only)
    python benchmarks/gpu_decode.py --no-triton  # torch step and SDPA only
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
    return out, cache


def _decode_inputs(B, H, D, n, dtype, device):
    """q [B, n, H, D], k / v [B, n, H, D]: decode inputs, made before timing."""
    return tuple(torch.randn(B, n, H, D, device=device, dtype=dtype) for _ in range(3))


def check_against_torch_step(cache, q, k, v, n: int, prefix: str) -> dict:
    """n fused steps, each compared with the torch step on the same state (the small buffers the
    step writes are restored between the two; block boundaries are applied once, before both,
    with the torch ops both paths use). The fused steps run under sync debug "error"."""
    state = cache.state
    names = ("ring_k", "ring_v", "block_k", "block_v", "pos")
    errs, sync = [], True
    for i in range(n):
        t = cache.length
        if t > 0 and t % state.cfg.block == 0:
            state._advance(state.block_k, state.block_v, t // state.cfg.cell)
        small = {name: getattr(state, name).clone() for name in names}
        step = (q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        state._fused = False
        ref = state._piece(*step, state.ones_beta).float()  # torch step
        for name, x in small.items():
            getattr(state, name).copy_(x)
        state._fused = True
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = state._piece(*step, state.ones_beta).float()  # fused step
        except RuntimeError as error:
            sync, got = f"host sync detected: {error}", None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        state.length = t + 1
        if got is None:
            break
        errs.append(float(((got - ref).pow(2).mean() / ref.pow(2).mean().clamp_min(1e-30)).sqrt()))
    return {f"{prefix}_triton_vs_torch_rms": max(errs) if errs else None, f"{prefix}_triton_sync_free": sync}


def time_fused(cache, prefix: str, steps: int, timer, dtype, device) -> dict:
    """Eager and CUDA-graph timing of the fused step of `cache` (decode_kernel="triton")."""
    B, H, D = cache.batch, cache.num_heads, cache.head_dim
    q, k, v = _decode_inputs(B, H, D, 2 * steps + 8, dtype, device)
    out = {}

    def eager(i):
        return cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], check_finite=False)

    for i in range(2):
        o = eager(i)
    assert torch.isfinite(o).all(), f"non-finite {prefix} fused decode output"
    out[f"{prefix}_triton_eager_us"] = timer(lambda i: eager(2 + i), steps) * 1e6
    try:
        graph = cache.decode_graph()
        base = 2 + steps

        def replay(i):
            return graph(q[:, base + i : base + i + 1], k[:, base + i : base + i + 1], v[:, base + i : base + i + 1])

        replay(0)
        out[f"{prefix}_triton_graph_us"] = timer(lambda i: replay(1 + i), steps - 1) * 1e6
    except Exception as error:  # noqa: BLE001 - record why, keep the eager numbers
        out[f"{prefix}_triton_graph_us"] = None
        out[f"{prefix}_triton_graph_error"] = f"{type(error).__name__}: {error}"
        print(f"  {prefix} fused CUDA graph failed: {out[f'{prefix}_triton_graph_error']}")
    return out


def fsl_triton_run(torch_cache, cfg, steps, timer, dtype, device) -> dict:
    """The FS-L state of `torch_cache` in a fused-step cache: check vs the torch step, time it."""
    B, H, D = torch_cache.batch, torch_cache.num_heads, torch_cache.head_dim
    cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device, decode_kernel="triton")
    cache.load_state_dict(torch_cache.state_dict())
    q, k, v = _decode_inputs(B, H, D, cfg.block + 1, dtype, device)
    out = check_against_torch_step(cache, q, k, v, cfg.block + 1, "fsl")
    out.update(time_fused(cache, "fsl", steps, timer, dtype, device))
    return out


def fs_triton_run(cfg, B, H, D, T, dtype, device, steps, chunk, timer) -> dict:
    """An FS cache (archive) prefilled to T - margin (the checked and timed steps then end at
    about T, inside the archive's capacity: no growth, no re-capture while timing): check the
    fused step vs the torch step, time it."""
    cfg = cfg.replace(variant="fs")
    itemsize = torch.empty((), dtype=dtype).element_size()
    margin = 3 * steps + 2 * cfg.block + 16  # check + warm-up + eager + graph steps
    T_pre = T - margin if T > 2 * margin else T
    end_cells = (T_pre + margin) // cfg.cell
    cap = 1 << max(0, end_cells - 1).bit_length()
    need = B * H * cap * (2 * cfg.cell * D * itemsize + 4 * D + 12)  # cell k / v, kbar, a, ids
    free, _ = torch.cuda.mem_get_info()
    if 1.6 * need > 0.9 * free:  # growth copies during prefill: old + new stores
        return {"fs_triton_skipped": f"FS archive needs {need / 2**30:.1f} GiB (+ growth), {free / 2**30:.1f} GiB free"}
    cache = None
    try:
        cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device, decode_kernel="triton")
        t0 = time.perf_counter()
        for start in range(0, T_pre, chunk):
            n = min(chunk, T_pre - start)
            cache.prefill(
                torch.randn(B, n, H, D, device=device, dtype=dtype),
                torch.randn(B, n, H, D, device=device, dtype=dtype),
                check_finite=False,
            )
        cache.state._grow_store(end_cells)  # no-op unless the margin crosses a doubling
        torch.cuda.synchronize()
        out = {"fs_prefill_s": time.perf_counter() - t0, "fs_memory_bytes": cache.memory_bytes(), "fs_T_start": T_pre}
        q, k, v = _decode_inputs(B, H, D, 8, dtype, device)
        out.update(check_against_torch_step(cache, q, k, v, 8, "fs"))
        out.update(time_fused(cache, "fs", steps, timer, dtype, device))
        out["fs_capacity_cells"] = int(cache.state.cell_ids.shape[2])
        out["fs_T_end"] = cache.length
    except torch.cuda.OutOfMemoryError as error:
        out = {"fs_triton_skipped": f"out of memory: {str(error).splitlines()[0]}"}
    del cache
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
            ("fsl_graph_us", "FS-L torch step (CUDA graph)", "C0"),
            ("fsl_triton_graph_us", "FS-L fused Triton (CUDA graph)", "C1"),
            ("fs_triton_graph_us", "FS fused Triton (CUDA graph)", "C4"),
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
        fs_pts = [(r["T"], r["fs_memory_bytes"] / 2**20) for r in sub if r.get("fs_memory_bytes")]
        if fs_pts:
            ax_m.plot(*zip(*fs_pts), style, marker="o", color="C4", label=f"FS archive, B={B}")
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
    p.add_argument("--no-triton", action="store_true", help="skip the fused Triton decode (FS-L, FS)")
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
    triton_on = args.device.startswith("cuda") and not args.no_triton
    if triton_on:
        try:
            import triton  # noqa: F401
        except ImportError as error:
            print(f"fused Triton decode skipped: {error}")
            triton_on = False
    rows = []
    header = (
        f"{'B':>3} {'T':>8} | {'FS-L graph':>10} {'eager':>7} | {'FS-L tri graph':>14} {'eager':>7} | "
        f"{'FS tri graph':>12} {'eager':>7} | {'SDPA us':>9} | {'FS-L MiB':>9} {'FS MiB':>8} {'full KV MiB':>12}"
    )
    print(header)
    t_start = time.perf_counter()
    for B in args.batches:
        for T in args.contexts:
            row = {"B": B, "T": T, "H": args.heads, "D": args.dim, "dtype": str(dtype)}
            fsl, cache = fsl_run(cfg, B, args.heads, args.dim, T, dtype, args.device, args.steps, args.chunk, timer)
            row.update(fsl)
            if triton_on:
                row.update(fsl_triton_run(cache, cfg, args.steps, timer, dtype, args.device))
                torch.cuda.empty_cache()
                fs = fs_triton_run(cfg, B, args.heads, args.dim, T, dtype, args.device, args.steps, args.chunk, timer)
                row.update(fs)
            del cache
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            row.update(sdpa_run(B, args.heads, args.dim, T, dtype, args.device, args.steps, timer))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            rows.append(row)

            def fmt(x, spec):
                return "-" if x is None else format(x, spec)

            print(
                f"{B:>3} {T:>8} | {fmt(row.get('fsl_graph_us'), '10.1f')} {row['fsl_eager_us']:>7.0f} | "
                f"{fmt(row.get('fsl_triton_graph_us'), '14.1f')} {fmt(row.get('fsl_triton_eager_us'), '7.0f')} | "
                f"{fmt(row.get('fs_triton_graph_us'), '12.1f')} {fmt(row.get('fs_triton_eager_us'), '7.0f')} | "
                f"{fmt(row['sdpa_us'], '9.1f')} | {row['fsl_memory_bytes'] / 2**20:>9.2f} "
                f"{fmt(row['fs_memory_bytes'] / 2**20 if row.get('fs_memory_bytes') else None, '8.0f')} "
                f"{row['sdpa_memory_bytes'] / 2**20:>12.1f}"
                + f"  sync-free: torch {row.get('fsl_sync_free', 'n/a')}, "
                + f"fused FS-L {row.get('fsl_triton_sync_free', 'n/a')}"
                + f" FS {row.get('fs_triton_sync_free', 'n/a')}; fused vs torch rms FS-L "
                + f"{fmt(row.get('fsl_triton_vs_torch_rms'), '.1e')} FS {fmt(row.get('fs_triton_vs_torch_rms'), '.1e')}"
                + (f"  (SDPA skipped: {row['sdpa_skipped']})" if row.get("sdpa_skipped") else "")
                + (f"  (FS skipped: {row['fs_triton_skipped']})" if row.get("fs_triton_skipped") else ""),
                flush=True,
            )
    summary = []
    for r in rows:
        if r.get("sdpa_us") and r.get("fs_triton_graph_us"):
            r["fs_speedup_vs_sdpa"] = r["sdpa_us"] / r["fs_triton_graph_us"]
        if r.get("sdpa_us") and r.get("fsl_triton_graph_us"):
            r["fsl_speedup_vs_sdpa"] = r["sdpa_us"] / r["fsl_triton_graph_us"]
    for B in args.batches:
        fused = [r["fsl_triton_graph_us"] for r in rows if r["B"] == B and r.get("fsl_triton_graph_us")]
        if fused:
            mean = sum(fused) / len(fused)
            line = (
                f"FS-L fused graph at B={B}: {min(fused):.1f} .. {max(fused):.1f} us over contexts "
                f"(spread {100 * (max(fused) - min(fused)) / mean:.0f} % of the mean)"
            )
            summary.append(line)
            print(line)
        for r in rows:
            if r["B"] == B and r.get("fs_speedup_vs_sdpa"):
                line = f"FS fused graph at B={B}, T={r['T']}: {r['fs_speedup_vs_sdpa']:.1f}x faster than SDPA"
                summary.append(line)
                print(line)
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
        "summary": summary,
        "wall_s": time.perf_counter() - t_start,
        "notes": "latency = mean per token over back-to-back steps (CUDA events); FS-L / FS state reached by "
        "chunked prefill of random bf16 keys/values; SDPA = 1 query vs T cached keys; *_triton_* = fused "
        "Triton step (decode_kernel='triton'), *_graph_us = CUDA graph replay incl. the input copies",
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
