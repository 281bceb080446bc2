"""Where the host time of a short Triton FS-L forward goes (issues 10 / 11: the 4k bars).

At 4k (B 1, H 16, D 64, bf16) the triton FS-L forward took 0.83 ms per call through the API
(s22, `check_finite=False`) while its kernels took about 0.20 ms of GPU time (s21 profile): the
call is host bound. This probe times, per call and with the GPU left to run behind the host (no
sync inside the loop, so wall time per call is host time when the host is the bottleneck):

- each layer: the public API, `torch.ops.freesolo.triton_forward` (the custom op, as the API
  calls it), the op's body without the custom-op dispatch, and each stage of that body alone
  (cell statistics, FS-L candidates, scoring + top-K, tile unions, RoPE + the two attention
  kernels), plus an empty Triton kernel's launch;
- cProfile of the API call: the functions with the most own host time.

    python benchmarks/host_overhead_probe.py --T 4096 --out $OUT/host_overhead.json   # H200, ~20 s
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
import triton.language as tl

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _versions, write_json  # noqa: E402 (benchmarks/ is this script's folder)

import freesolo  # noqa: E402
from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton import attention, backend, selection  # noqa: E402

__all__ = ["main"]


@triton.jit
def _empty_kernel(X, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


def host_us(fn, calls: int) -> float:
    """Mean wall microseconds per call over `calls` calls issued back to back (one sync at the end)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls


def gpu_us(fn, calls: int) -> float:
    """Mean GPU microseconds per call (events around `calls` calls, after a sync)."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return 1e3 * a.elapsed_time(b) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[4096])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dev = torch.device("cuda")
    cfg = FreeSoloConfig(variant="fsl")
    cfg_json = backend.config_to_json(cfg)
    records = []
    for T in args.T:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, T, 16, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
        beta = torch.ones(16, device=dev)
        cos, sin = backend.rope_cos_sin(T, 64, cfg.rope_theta, dev)
        kbar, amax = selection.cell_stats(k, cfg.cell)
        idx = selection.select_cells(q, k, cfg)
        tiles = attention.default_tiles(64, q.dtype, dev)
        unions = attention.forward_unions(idx, cfg, tiles)
        x = torch.zeros(1024, device=dev)
        stages = {
            "api freesolo_attention": lambda: freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False),
            "api, finite check on": lambda: freesolo.freesolo_attention(q, k, v, cfg, backend="triton"),
            "custom op triton_forward": lambda: torch.ops.freesolo.triton_forward(q, k, v, beta, cfg_json),
            "op body (select + attention_forward)": lambda: backend._forward_impl(q, k, v, beta, cfg_json),
            "select_cells (fsl)": lambda: selection.select_cells(q, k, cfg),
            "  cell_stats": lambda: selection.cell_stats(k, cfg.cell),
            "  fsl_candidates": lambda: selection.fsl_candidates(amax, T, cfg),
            "attention_forward": lambda: attention.attention_forward(q, k, v, idx, beta, cos, sin, cfg),
            "  forward_unions": lambda: attention.forward_unions(idx, cfg, tiles),
            "  launch_forward": lambda: attention.launch_forward(q, k, v, idx, unions, beta, cos, sin, cfg, tiles),
            "empty triton launch": lambda: _empty_kernel[(1,)](x, 1024, BLOCK=1024),
            "torch.empty": lambda: torch.empty(1, T, 16, 64, device=dev),
        }
        for name, fn in stages.items():
            record = dict(T=T, stage=name, host_us=host_us(fn, args.calls), gpu_us=gpu_us(fn, args.calls))
            records.append(record)
            print(f"T={T:7d} {name:40s} host {record['host_us']:8.1f} us/call   gpu {record['gpu_us']:8.1f} us/call", flush=True)
        profile = cProfile.Profile()
        fn = stages["api freesolo_attention"]
        torch.cuda.synchronize()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    write_json(args.out, dict(meta=_versions(dev), calls=args.calls, records=records))


if __name__ == "__main__":
    main()
