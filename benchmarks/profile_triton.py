"""Per-kernel GPU time of the triton backend's forward and forward+backward (torch.profiler).

Usage (GPU): python benchmarks/profile_triton.py [--T 4096 16384 65536] [--variant fsl] [--H 16 --Hkv 16 --D 64]
[--modes fwd fwd+bwd] [--out F.json]
Prints, per T and mode, the CUDA kernels sorted by total time, in microseconds per call (5 calls
profiled after 3 warm-up calls; `check_finite=False`, as the benchmarks call the backend, so no
finite-check reductions appear), and their sum; --out also writes them as JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import freesolo  # noqa: E402

CALLS = 5


def kernel_table(prof, calls: int) -> list[dict]:
    """[{name, us_per_call, launches_per_call}] of the CUDA kernels, by total time descending."""
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = event.cuda_time_total
        if total <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append(dict(name=event.key[:90], us_per_call=round(total / calls, 2), launches_per_call=event.count / calls))
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--variant", default="fsl")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--Hkv", type=int, default=None, help="kv heads (default: H, MHA)")
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--modes", nargs="*", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--out", default=None, help="JSON of the tables (with the versions of gpu_attention.py)")
    args = ap.parse_args(argv)
    cfg = freesolo.FreeSoloConfig(variant=args.variant)
    hkv = args.Hkv or args.H
    if args.H % hkv:
        ap.error(f"--H {args.H} must be a multiple of --Hkv {hkv}")
    records = []
    for T in args.T:
        q, k, v = (
            torch.randn(1, T, heads, args.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for heads in (args.H, hkv, hkv)
        )
        do = torch.randn_like(q)
        for mode in args.modes:

            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
                else:
                    o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
                    for x in (q, k, v):  # as gpu_attention.py: no accumulation kernels into old .grad
                        x.grad = None
                    o.backward(do)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    step()
                torch.cuda.synchronize()
            table = kernel_table(prof, CALLS)
            total = sum(r["us_per_call"] for r in table)
            print(
                f"\n=== {args.variant} T={T} Hq={args.H} Hkv={hkv} D={args.D} {mode}: "
                f"{total:.1f} us of kernels per call ({CALLS} calls) ==="
            )
            for r in table:
                print(f"  {r['us_per_call']:10.2f} us  x{r['launches_per_call']:5.1f}  {r['name']}")
            records.append(dict(variant=args.variant, T=T, H=args.H, Hkv=hkv, D=args.D, dtype="bfloat16", mode=mode,
                                kernel_us_per_call=round(total, 2), kernels=table))
    if args.out:
        from gpu_attention import _versions, write_json

        write_json(args.out, dict(meta=_versions(torch.device("cuda")), calls=CALLS, records=records))


if __name__ == "__main__":
    main()
