"""A/B of the torch backend's readout modes (FREESOLO_TORCH_READOUT) on one GPU.

The torch readout reads a block's long-range tokens in one of two row-independent layouts (spec
L12; see freesolo/backends/torch/attention.py): "union" (one matmul over a buffer of cells fixed
by the block's available cells: FS-L's candidate set C_j, or the slice of every available cell)
and "gather" (each query's own K cells). The mode picks the layout per chunk and sizes the chunks:

  auto    the default: FS-L with its candidate sets "union"; FS / FS-B "union" while every
          available cell is at most P + W cells, then "gather" (chunks for the gather: twice as
          long as "wide")
  wide    the rule of commit 9d31a86: "union" while its per-query tensors are no larger than the
          gather's (up to 211 cells at D 64), then "gather"
  gather  "gather" for every chunk and variant (FS-L's candidate sets unused)
  union   "union" everywhere (FS / FS-B: every available cell, however many: a test layout whose
          memory grows with T; not timed unless asked with --modes)

Cases (B 1, Hq = Hkv = 16, D 64, bf16, default config, FS-B tau = per-head median of a_c):
  full        freesolo_attention(backend="torch"): selection + readout; "fwd" for fs / fsl / fsb,
              "fwd+bwd" for fsl / fsb (loss = <out, fixed random gradient>)
  readout     the readout alone with the selection precomputed (backend `attention(idx=...)`),
              fs / fsb: the selection dominates FS-B's full call (~2.5 s at 64k), so a readout
              change shows here first. FS-L's readout needs its candidate sets from the
              selection: it is timed by "full" only.
Timing: modes are interleaved per case (A B C A B C ...) after one warm-up call per case;
triton.testing.do_bench median for calls under 50 ms, else the median of --slow-reps calls (2
above 1 s a call).
peak_gib = torch.cuda.max_memory_allocated during one call minus the memory before it.
The JSON also carries the figures this A/B is judged against (the issue's bar: row independence
costing at most 10 % of the pre-L12 speed; H200, torch 2.11): `reference_ms`.

Usage (repository root):
    python benchmarks/torch_readout_ab.py --out benchmarks/results/torch_readout_ab.json   # ~3 min on an H200
    python benchmarks/torch_readout_ab.py --dry-run --out /tmp/ab.json   # CPU smoke test, tiny T
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _once_ms, _sync, _versions, smoke_or_gpu  # noqa: E402 (benchmarks/ is this script's folder)

import freesolo
from freesolo.backends.torch._ops import cell_stats
from freesolo.backends.torch.attention import READOUT_ENV, READOUT_MODES
from freesolo.backends.torch.backend import attention as torch_attention

__all__ = ["main", "plot"]

LENGTHS = [4096, 16384, 65536]
MODES = ["auto", "wide", "gather"]
SHAPE = {"B": 1, "Hq": 16, "Hkv": 16, "D": 64}
# (variant, case, what): what is timed at every length
CASES = [
    ("fsl", "full", "fwd"),
    ("fsl", "full", "fwd+bwd"),
    ("fs", "full", "fwd"),
    ("fs", "readout", "fwd"),
    ("fsb", "readout", "fwd"),
    ("fsb", "readout", "fwd+bwd"),
    ("fsb", "full", "fwd"),
    ("fsb", "full", "fwd+bwd"),
]
# H200, torch 2.11, bf16, B1 H16 D64, benchmarks/gpu_attention.py (freesolo_* providers):
# before L12 (commit 0bbfde8, results/gpu_attention_torch.json) and after 9d31a86 + 52253ab (d7e8376,
# results/gpu_attention_torch_l12.json). Keys: "variant what T".
REFERENCE_MS = {
    "before_l12_0bbfde8": {
        "fsl fwd 4096": 6.56, "fsl fwd 16384": 26.65, "fsl fwd 65536": 104.63,
        "fsl fwd+bwd 4096": 16.03, "fsl fwd+bwd 16384": 73.84, "fsl fwd+bwd 65536": 296.84,
        "fsb fwd 4096": 145.43, "fsb fwd 16384": 611.9, "fsb fwd 65536": 2656.6,
        "fsb fwd+bwd 4096": 161.21, "fsb fwd+bwd 16384": 694.47, "fsb fwd+bwd 65536": 2990.06,
    },
    "after_9d31a86_d7e8376": {
        "fsl fwd 4096": 8.46, "fsl fwd 16384": 25.25, "fsl fwd 65536": 100.38,
        "fsl fwd+bwd 4096": 21.08, "fsl fwd+bwd 16384": 72.01, "fsl fwd+bwd 65536": 297.12,
        "fsb fwd 4096": 141.70, "fsb fwd 16384": 633.05, "fsb fwd 65536": 2812.22,
        "fsb fwd+bwd 4096": 168.14, "fsb fwd+bwd 16384": 796.17, "fsb fwd+bwd 65536": 3403.14,
        "fs fwd 4096": 15.72, "fs fwd 16384": 73.27, "fs fwd 65536": 365.29,
    },
}  # fmt: skip


def _peak_gib(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _with_mode(mode, fn):
    def call():
        os.environ[READOUT_ENV] = mode
        return fn()

    return call


def _make(variant, case, what, q, k, v, cfg, idx):
    """-> a function running one call (forward under no_grad, or forward + backward)."""
    if case == "full":
        op = lambda: freesolo.freesolo_attention(q, k, v, cfg, backend="torch")  # noqa: E731
    else:
        op = lambda: torch_attention(q, k, v, cfg, idx=idx)  # noqa: E731
    if what == "fwd":

        def fn():
            with torch.no_grad():
                op()

        return fn
    grad = {}

    def fn_bwd():
        for x in (q, k, v):
            x.grad = None
        out = op()
        if "g" not in grad:
            grad["g"] = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device)
        out.backward(grad["g"].to(out.dtype))

    return fn_bwd


def time_modes(fns, device, rep_ms, slow_reps):
    """fns {mode: fn} -> {mode: median ms}, modes interleaved."""
    first = {m: _once_ms(f, device) for m, f in fns.items()}  # warm-up (allocator, first launches)
    if device.type == "cuda" and max(first.values()) < 50:
        import triton.testing

        return {
            m: float(triton.testing.do_bench(f, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))
            for m, f in fns.items()
        }
    samples = {m: [] for m in fns}
    reps = min(slow_reps, 2) if max(first.values()) > 1000 else slow_reps  # FS-B at 64k: ~3 s a call
    for _ in range(reps):
        for m, f in fns.items():
            samples[m].append(_once_ms(f, device))
    return {m: statistics.median(x) for m, x in samples.items()}


def _env(device, commit):
    """gpu_attention's environment record; `commit` (--commit) overrides git when the copy has no .git."""
    env = _versions(device)
    env["git_commit"] = commit or env["git_commit"]
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON to write")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, float32, tiny T (smoke test, no timings worth reading)"
    )
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--modes", nargs="*", default=None, choices=READOUT_MODES)
    ap.add_argument("--cases", nargs="*", default=None, help="'variant case what' entries, e.g. 'fsl full fwd'")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench rep (ms)")
    ap.add_argument("--slow-reps", type=int, default=3, help="calls per mode when a call takes 50 ms or more")
    ap.add_argument("--commit", default=None, help="git commit to record (the device copy may have no .git)")
    ap.add_argument("--plot-only", action="store_true", help="only draw the PNG of the --out JSON (next to it)")
    args = ap.parse_args(argv)
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        return

    device, dtype = smoke_or_gpu(args.dry_run)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run for the CPU smoke test")
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "D": 16} if args.dry_run else SHAPE
    lengths = args.lengths or ([256, 640] if args.dry_run else LENGTHS)
    modes = args.modes or MODES
    cases = [tuple(c.split()) for c in args.cases] if args.cases else CASES
    env = _env(device, args.commit)
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | commit {env['git_commit']}", flush=True)

    saved_env = os.environ.get(READOUT_ENV)
    start = time.time()
    results = []
    try:
        for T in lengths:
            gen = torch.Generator(device=device).manual_seed(0)
            B, Hq, Hkv, D = shape["B"], shape["Hq"], shape["Hkv"], shape["D"]
            q = torch.randn(B, T, Hq, D, device=device, dtype=dtype, generator=gen)
            k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=gen)
            v = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=gen)
            idx_cache = {}
            for variant, case, what in cases:
                cfg = freesolo.FreeSoloConfig(variant=variant)
                if variant == "fsb":
                    _, a = cell_stats(k.detach().float().permute(0, 2, 1, 3), cfg.cell)  # (B, Hkv, C)
                    tau = a.permute(1, 0, 2).reshape(Hkv, -1).median(dim=-1).values
                    cfg = cfg.replace(tau=tuple(float(x) for x in tau))
                idx = None
                if case == "readout":
                    if variant not in idx_cache:
                        t0 = time.perf_counter()
                        idx_cache[variant] = freesolo.select_cells(q, k, cfg, backend="torch")
                        _sync(device)
                        print(f"  (selection {variant} T={T}: {time.perf_counter() - t0:.2f} s, untimed)", flush=True)
                    idx = idx_cache[variant]
                for x in (q, k, v):
                    x.requires_grad_(what == "fwd+bwd")
                fns = {m: _with_mode(m, _make(variant, case, what, q, k, v, cfg, idx)) for m in modes}
                rec = {"variant": variant, "case": case, "what": what, "T": T}
                try:
                    rec["ms"] = time_modes(fns, device, args.rep_ms, args.slow_reps)
                    rec["peak_gib"] = {m: _peak_gib(f, device) for m, f in fns.items()}
                    rec["status"] = "ok"
                except torch.cuda.OutOfMemoryError:
                    rec.update(ms=None, peak_gib=None, status="oom")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                results.append(rec)
                times = "  ".join(f"{m} {rec['ms'][m]:9.2f}" for m in modes) if rec["ms"] else rec["status"]
                print(
                    f"T={T:>6} {variant:>3} {case:>7} {what:>7}: {times} ms  ({time.time() - start:.0f} s)", flush=True
                )
    finally:
        if saved_env is None:
            os.environ.pop(READOUT_ENV, None)
        else:
            os.environ[READOUT_ENV] = saved_env

    payload = {
        "env": env,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "lengths": lengths,
        "modes": modes,
        "freesolo_config": {
            f: getattr(freesolo.FreeSoloConfig(), f)
            for f in ("window", "cell", "top_k", "block", "pool", "recent", "beam")
        },
        "timing": "median ms per mode, modes interleaved: triton.testing.do_bench under 50 ms per call, else the "
        "median of --slow-reps calls (at most 2 above 1 s a call); peak_gib: torch.cuda.max_memory_allocated during one call minus the memory "
        "allocated before it",
        "results": results,
        "reference_ms": REFERENCE_MS,
        "elapsed_s": round(time.time() - start, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {args.out} ({payload['elapsed_s']:.0f} s)")
    plot(payload, os.path.splitext(args.out)[0] + ".png")


def plot(payload: dict, path: str) -> None:
    """One panel per (variant, case, what): ms vs T per readout mode (log-log), to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["variant"], r["case"], r["what"]) for r in payload["results"] if r["status"] == "ok"))
    cols = 4
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        recs = sorted((r for r in payload["results"] if (r["variant"], r["case"], r["what"]) == key and r["status"] == "ok"), key=lambda r: r["T"])
        for n, mode in enumerate(payload["modes"]):
            pts = [(r["T"], r["ms"][mode]) for r in recs if r["ms"].get(mode)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode, color=f"C{n}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(" ".join(key), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.suptitle(f"torch readout modes: {payload['env'].get('gpu')}, ms (median)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
