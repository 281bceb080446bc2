"""Per-kernel GPU time of the triton backend's forward and forward+backward (torch.profiler).

Usage (GPU): python benchmarks/profile_triton.py [--T 16384 65536] [--variant fsl]
Prints, per T and mode, the CUDA kernels sorted by total time (the table names each kernel).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import freesolo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--T", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--variant", default="fsl")
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--D", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = freesolo.FreeSoloConfig(variant=args.variant)
    for T in args.T:
        q, k, v = (torch.randn(1, T, args.H, args.D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        for mode in ("fwd", "fwd+bwd"):

            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
                else:
                    o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
                    o.backward(torch.ones_like(o))

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(f"\n=== {args.variant} T={T} {mode} (5 calls) ===")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
