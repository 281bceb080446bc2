"""Same-run A/B of the torch backend before and after the row-independence fix (issue 9, spec L12).

Issue 9 allows the L12 fix to cost at most 10 % of the torch backend's GPU speed. Earlier sessions
compared against figures of an earlier run (`results/gpu_attention_torch.json`, commit 0bbfde8); this
script times both trees in one run on one GPU:

  pre    the `freesolo` package of a commit before the fix (a folder holding it, `--pre`; make it
         with `git archive 0bbfde8 freesolo | tar -x -C .ab/pre_l12`)
  head   this repository's `freesolo`

Each (tree, round) runs in its own subprocess (`--worker`), rounds interleaved (pre, head, pre,
head, ...), so clocks and allocator state are shared fairly; the figure per case is the median over
rounds of the per-round `triton.testing.do_bench` medians (median of 3 calls above 50 ms).
Cases: freesolo_attention(backend="torch"), B 1, H 16 MHA, D 64, bf16, the default config:
FS-L fwd and fwd+bwd, FS fwd at every length, FS-B fwd / fwd+bwd up to --fsb-max. Each worker also
profiles one FS-L forward at the first length: CUDA kernel count and summed kernel time, against the
call's wall time (where the time goes at 4k: launches or work).

    python benchmarks/torch_l12_ab.py --pre .ab/pre_l12 --out benchmarks/results/torch_l12_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["main", "plot"]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worker(root: str, lengths: list[int], fsb_max: int, rep: int) -> dict:
    """Times the cases with the `freesolo` package under `root`; returns {case: ms} and a profile.
    It times with its own loop, not gpu_attention's `bench_ms`: that module imports this
    repository's `freesolo`, which the "pre" worker must not load."""
    sys.path.insert(0, root)
    import torch
    import triton

    import freesolo

    assert os.path.abspath(freesolo.__file__).startswith(os.path.abspath(root)), freesolo.__file__
    smoke = not torch.cuda.is_available()  # CPU smoke test of the plumbing: float32, one call per case
    dev, dt = torch.device("cpu" if smoke else "cuda"), torch.float32 if smoke else torch.bfloat16
    sync = (lambda: None) if smoke else torch.cuda.synchronize
    out, prof = {}, {}

    def bench(fn):
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if smoke or time.perf_counter() - t0 > 0.05:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        return triton.testing.do_bench(fn, rep=rep, return_mode="median")

    for T in lengths:
        g = torch.Generator(device=dev).manual_seed(T)
        q, k, v = (torch.randn(1, T, 16, 64, device=dev, dtype=dt, generator=g) for _ in range(3))
        dout = torch.randn(1, T, 16, 64, device=dev, dtype=dt, generator=g)
        variants = ["fsl", "fs"] + (["fsb"] if T <= fsb_max else [])
        for variant in variants:
            cfg = freesolo.FreeSoloConfig(variant=variant)
            if variant == "fsb":
                cfg = cfg.replace(tau=freesolo.calibrate_tau(k.float(), cfg))

            def fwd(cfg=cfg, q=q, k=k, v=v):
                with torch.no_grad():
                    return freesolo.freesolo_attention(q, k, v, cfg, backend="torch")

            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

            def fwd_bwd(cfg=cfg, qg=qg, kg=kg, vg=vg, dout=dout):
                o = freesolo.freesolo_attention(qg, kg, vg, cfg, backend="torch")
                torch.autograd.backward(o, dout)
                qg.grad = kg.grad = vg.grad = None

            out[f"{variant} fwd {T}"] = bench(fwd)
            if variant != "fs":
                out[f"{variant} fwd+bwd {T}"] = bench(fwd_bwd)
            if variant == "fsl" and T == lengths[0]:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as p:
                    t0 = time.perf_counter()
                    fwd()
                    sync()
                    wall = (time.perf_counter() - t0) * 1e3
                kern = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                cpu_ops = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")]
                prof = {
                    "T": T,
                    "wall_ms_profiled": wall,
                    "cuda_kernels": len(kern),
                    "cuda_kernel_ms": sum(e.device_time for e in kern) / 1e3,
                    "aten_ops": len(cpu_ops),
                    "syncs": sum(1 for e in p.events() if "synchronize" in e.name.lower() or e.name == "aten::item"),
                }
            if not smoke:
                torch.cuda.empty_cache()
    return {"ms": out, "profile_fsl_fwd": prof}


def plot(payload: dict, path: str) -> None:
    """Bars per case: head time / pre time (1 = unchanged; the issue's bar at 1.10), to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4.2))
    ratios = [r["head_ms"] / r["pre_ms"] for r in rows]
    ax.bar(range(len(rows)), ratios, color=["C2" if x <= 1.1 else "C3" for x in ratios])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.1, color="C3", ls="--", lw=0.8, label="bar: at most +10 %")
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("head / pre-L12 time (median over rounds)")
    env = payload["env"]
    ax.set_title(f"torch backend, L12 fix A/B: {env.get('gpu')}, pre {env.get('pre_commit')} vs {payload.get('ran_commit', str(env.get('git_commit'))[:8])}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pre", required=False, help="folder holding the pre-fix `freesolo` package")
    ap.add_argument("--pre-commit", default="0bbfde8", help="the commit the --pre folder was taken from")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--fsb-max", type=int, default=16384, help="FS-B cases up to this length (2.6 s a call at 64k)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG of a results JSON (next to it)")
    args = ap.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return 0
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.lengths, args.fsb_max, args.rep)), flush=True)
        return 0
    if not args.pre:
        ap.error("--pre is required")
    trees = {"pre": os.path.abspath(args.pre), "head": REPO}
    per_round = {name: [] for name in trees}
    profiles = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for name, root in trees.items():
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", root, "--lengths", *map(str, args.lengths),
                   "--fsb-max", str(args.fsb_max), "--rep", str(args.rep)]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
            line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode or not line:
                print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"worker {name} round {r} failed (rc {run.returncode})")
            res = json.loads(line[0][len("RESULT ") :])
            per_round[name].append(res["ms"])
            profiles.setdefault(name, []).append(res["profile_fsl_fwd"])
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res["ms"].items())
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    cases = list(per_round["head"][0])
    rows = []
    for case in cases:
        pre = statistics.median(rd[case] for rd in per_round["pre"])
        head = statistics.median(rd[case] for rd in per_round["head"])
        rows.append({"case": case, "pre_ms": pre, "head_ms": head, "change": head / pre - 1.0})
        print(f"{case:>20}: pre {pre:9.2f} ms  head {head:9.2f} ms  {100 * (head / pre - 1):+6.1f} %")
    for name, p in profiles.items():
        print(name, "profile", p[-1])
    import torch

    sys.path.insert(0, HERE)  # the parent times nothing: the shared env record and writer are safe to import
    from gpu_attention import _versions, write_results

    payload = {
        "env": {**_versions(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "pre_commit": args.pre_commit},
        "shape": {"B": 1, "Hq": 16, "Hkv": 16, "D": 64, "dtype": "bfloat16"},
        "timing": "per case: median over rounds (subprocesses, trees interleaved) of triton.testing.do_bench medians "
        "(median of 3 calls above 50 ms)",
        "bar": "issue 9: the L12 fix may cost at most 10 % of the torch backend's GPU speed",
        "rounds": {name: rds for name, rds in per_round.items()},
        "results": rows,
        "profile_fsl_fwd": profiles,
    }
    if args.out:
        write_results(args.out, payload, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
