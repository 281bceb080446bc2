"""One GPU sweep of FreeSolo's forward time over T (torch backend; triton when it is available).

    python benchmarks/gpu_scaling.py                       # H200: T = 4k..1M, bf16, B=1, H=16, D=64
    python benchmarks/gpu_scaling.py --out "$OUT"          # write elsewhere (default benchmarks/results)
    python benchmarks/gpu_scaling.py --device cpu --dtype float32 --T 256,512,1k --heads 2   # CPU smoke run

Per (provider, variant, T): the forward `freesolo_attention` time and the `select_cells` time
(medians of `triton.testing.do_bench` on CUDA; a call slower than --single-shot-s is timed once
instead), and the peak extra CUDA memory of the forward (torch.cuda.max_memory_allocated minus
the inputs). Dense causal SDPA (FlashAttention inside) is timed alongside for the crossover.
A point predicted (from the last two points' slope) to exceed --max-seconds-per-point, or to
break the total --budget-s, is skipped and recorded; an out-of-memory error is recorded too.
Writes gpu_scaling.json (versions, config, rows, fitted exponents over T >= --fit-T-min) and
gpu_scaling.png, and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

import freesolo  # noqa: E402
from freesolo.complexity.fits import fit_cost_model, loglog_slope  # noqa: E402
from freesolo.complexity.measured import make_inputs, tau_for_keys  # noqa: E402
from freesolo.complexity.plots import format_tokens, plot_scaling  # noqa: E402
from freesolo.complexity.scaling import _table, parse_tokens  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _timer(fn, device: str, single_shot_s: float) -> tuple[float, str]:
    """Seconds per call of fn and how it was measured."""
    import torch

    def once() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = once()  # also the warm-up (allocator, lazy init)
    if first > single_shot_s:
        return once(), "single call"
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3, "do_bench median"
    times = [once() for _ in range(3)]
    return float(np.median(times)), "median of 3"


def _peak_bytes(fn, device: str):
    import torch

    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def _dump(folder: str, result: dict) -> None:
    """Write gpu_scaling.json (after every point, so a killed run keeps what it measured)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "gpu_scaling.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def _sdpa(q, k, v):
    """Dense causal attention, [B, T, H, D] layout in and out (GQA by repeating kv heads)."""
    import torch.nn.functional as F

    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    if group > 1:
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--T",
        type=lambda s: [parse_tokens(t) for t in s.split(",")],
        default=[1 << p for p in range(12, 21)],
        help="lengths (default 4k..1M, powers of 2)",
    )
    parser.add_argument("--variants", default="fs,fsl,fsb")
    parser.add_argument("--providers", default=None, help="backends (default: torch, and triton when available)")
    parser.add_argument("--no-sdpa", action="store_true", help="do not time dense causal SDPA")
    parser.add_argument("--no-selection", action="store_true", help="do not time select_cells alone")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds-per-point", type=float, default=15.0)
    parser.add_argument("--single-shot-s", type=float, default=0.5, help="calls slower than this are timed once")
    parser.add_argument("--budget-s", type=float, default=270.0, help="total wall-clock budget of the sweep")
    parser.add_argument("--fit-T-min", type=parse_tokens, default=16384)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)

    import torch

    start = time.perf_counter()
    kv_heads = args.kv_heads or args.heads
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False (use --device cpu for a smoke run)")
    providers = (
        args.providers.split(",")
        if args.providers
        else [p for p in ("torch", "triton") if p in freesolo.available_backends()]
    )
    variants = args.variants.split(",")
    base = freesolo.FreeSoloConfig()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "freesolo": freesolo.__version__,
        "device": args.device,
    }
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if args.device.startswith("cuda"):
        versions["gpu"] = torch.cuda.get_device_name()
    print(f"gpu_scaling: {versions}")
    print(
        f"providers {providers}, variants {variants}, B={args.batch} Hq={args.heads} Hkv={kv_heads} D={args.dim} "
        f"{args.dtype}, T = {', '.join(format_tokens(T) for T in args.T)}"
    )

    jobs = [(p, v) for p in providers for v in variants] + ([] if args.no_sdpa else [("torch", "sdpa")])
    rows = []
    for provider, variant in jobs:
        done = []
        stop = None
        for T in sorted(args.T):
            row = {
                "provider": provider,
                "variant": variant,
                "T": T,
                "status": "ok",
                "time_s": None,
                "select_time_s": None,
                "peak_bytes": None,
                "timing": None,
            }
            elapsed = time.perf_counter() - start
            if stop is None and done:
                last = done[-1]
                slope = 1.0
                if len(done) >= 2:
                    slope = max(
                        1.0, math.log(last["time_s"] / done[-2]["time_s"]) / math.log(last["T"] / done[-2]["T"])
                    )
                growth = (T / last["T"]) ** slope
                fwd, sel = last["time_s"] * growth, (last["select_time_s"] or 0.0) * growth
                # slow calls: 2 timed forwards + 1 for memory + 2 selections; fast: do_bench's ~0.15 s each
                slow = max(fwd, sel) > args.single_shot_s
                predicted = 3 * fwd + 2 * sel if slow else 0.5 + 10 * (fwd + sel)
                if predicted > args.max_seconds_per_point:
                    stop = f"skipped: predicted {predicted:.1f} s > {args.max_seconds_per_point:g} s per point"
                elif elapsed + predicted > args.budget_s:
                    stop = f"skipped: total budget {args.budget_s:g} s would be exceeded"
            if stop is not None:
                row["status"] = stop
                rows.append(row)
                print(f"  {provider:6s} {variant:4s} T={format_tokens(T):>5s}  {stop}")
                continue
            try:
                q, k, v = make_inputs(
                    args.batch, T, args.heads, kv_heads, args.dim, args.seed, "torch", args.device, args.dtype
                )
                if variant == "sdpa":
                    forward, select = functools.partial(_sdpa, q, k, v), None
                else:
                    cfg = base.replace(variant=variant)
                    if variant == "fsb":
                        cfg = cfg.replace(tau=tuple(tau_for_keys(k, cfg)))
                    forward = functools.partial(freesolo.freesolo_attention, q, k, v, cfg, backend=provider)
                    select = None
                    if not args.no_selection:
                        select = functools.partial(freesolo.select_cells, q, k, cfg, backend=provider)
                with torch.no_grad():
                    row["time_s"], row["timing"] = _timer(forward, args.device, args.single_shot_s)
                    row["peak_bytes"] = _peak_bytes(forward, args.device)
                    if select is not None:
                        row["select_time_s"], _ = _timer(select, args.device, args.single_shot_s)
                done.append(row)
            except torch.cuda.OutOfMemoryError as exc:
                stop = row["status"] = f"out of memory: {str(exc).splitlines()[0]}"
            except Exception as exc:  # noqa: BLE001 - recorded and printed, the sweep goes on
                stop = row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            finally:
                q = k = v = None
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            _dump(args.out, {"versions": versions, "args": vars(args), "rows": rows, "partial": True})
            sel = f", select {row['select_time_s'] * 1e3:.3f} ms" if row["select_time_s"] else ""
            mem = f", peak {row['peak_bytes'] / 2**20:.0f} MiB" if row["peak_bytes"] is not None else ""
            print(
                f"  {provider:6s} {variant:4s} T={format_tokens(T):>5s}  "
                + (
                    f"{row['time_s'] * 1e3:.3f} ms ({row['timing']}){sel}{mem}"
                    if row["status"] == "ok"
                    else row["status"]
                )
            )

    fits = {}
    for provider, variant in jobs:
        name = f"{provider}/{variant}"
        fits[name] = {}
        for key in ("time_s", "select_time_s", "peak_bytes"):
            pts = [
                (r["T"], r[key])
                for r in rows
                if r["provider"] == provider
                and r["variant"] == variant
                and r["status"] == "ok"
                and r[key]
                and r["T"] >= args.fit_T_min
            ]
            if len(pts) >= 2:
                T, y = np.array(pts, dtype=np.float64).T
                slope = loglog_slope(T, y)
                fits[name][key] = {
                    "slope": slope.as_dict(),
                    "slope_text": str(slope),
                    "model": fit_cost_model(T, y).as_dict(),
                    "T_range": [int(T.min()), int(T.max())],
                }

    os.makedirs(args.out, exist_ok=True)
    result = {
        "versions": versions,
        "args": vars(args),
        "config": {
            "window": base.window,
            "cell": base.cell,
            "top_k": base.top_k,
            "block": base.block,
            "pool": base.pool,
            "recent": base.recent,
            "beam": base.beam,
        },
        "rows": rows,
        "fits": fits,
        "elapsed_s": time.perf_counter() - start,
    }
    with open(os.path.join(args.out, "gpu_scaling.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)

    panels = []
    for key, ylabel, title, scale in (
        ("time_s", "forward time (ms)", "Forward time", 1e3),
        ("select_time_s", "select_cells time (ms)", "Selection time only", 1e3),
        ("peak_bytes", "peak extra memory (MiB)", "Peak CUDA memory of a forward (inputs not counted)", 1 / 2**20),
    ):
        for provider in providers:
            series, slopes, skipped = {}, {}, {}
            for p, variant in jobs:
                if p != provider and variant != "sdpa":
                    continue
                ok = sorted(
                    (r["T"], r[key] * scale)
                    for r in rows
                    if r["provider"] == p and r["variant"] == variant and r["status"] == "ok" and r[key]
                )
                if ok:
                    series[variant] = ([t for t, _ in ok], [y for _, y in ok])
                    fit = fits[f"{p}/{variant}"].get(key)
                    if fit:
                        slopes[variant] = fit["slope_text"]
                skipped[variant] = [
                    r["T"] for r in rows if r["provider"] == p and r["variant"] == variant and r["status"] != "ok"
                ]
            panels.append(
                dict(
                    series=series,
                    ylabel=ylabel,
                    slopes=slopes,
                    skipped=skipped,
                    title=f"{title}: {provider} backend",
                    fit_range=(args.fit_T_min, max(args.T)),
                )
            )
    where = versions.get("gpu", args.device)
    plot_scaling(
        panels,
        os.path.join(args.out, "gpu_scaling.png"),
        f"FreeSolo on {where}: {args.dtype}, B={args.batch} Hq={args.heads} Hkv={kv_heads} D={args.dim} "
        f"(legend: log-log slope [95% CI] over T >= {format_tokens(args.fit_T_min)}; dashed: reference slopes)",
        ncols=min(3, len(panels)),
    )

    table = []
    Ts = sorted(args.T)
    for provider, variant in jobs:
        vrows = {r["T"]: r for r in rows if r["provider"] == provider and r["variant"] == variant}
        fit = fits[f"{provider}/{variant}"]
        cells = [
            f"{vrows[T]['time_s'] * 1e3:.2f}"
            if vrows[T]["status"] == "ok"
            else "skip"
            if vrows[T]["status"].startswith("skipped")
            else "fail"
            for T in Ts
        ]
        table.append(
            [
                f"{provider}/{variant}",
                fit["time_s"]["slope_text"] if "time_s" in fit else "-",
                fit["select_time_s"]["slope_text"] if "select_time_s" in fit else "-",
                *cells,
            ]
        )
    print()
    print(
        _table(
            ["provider/variant", "forward exponent", "selection exponent", *[f"{format_tokens(T)} ms" for T in Ts]],
            table,
        )
    )
    print(f"\nwrote {args.out}/gpu_scaling.json and gpu_scaling.png in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
