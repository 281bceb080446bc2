"""FS-B streaming cache memory vs context (issue 12): `FreeSoloCache.memory_bytes()` after a
state-only `prefill` of T tokens, and the share of the two forests' node tables.

The cache's layout does not depend on the device, so this runs on the CPU by default (B 1, H 16
MHA, D 64, bf16, default config, tau = per-head median of the max key norms of the first 64k
random keys). Writes a JSON and a PNG:
    python benchmarks/fsb_cache_memory.py --out benchmarks/results/fsb_cache_memory.json   # ~2 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _tau, _versions, plot_lines, series_by_T, write_results  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloCache, FreeSoloConfig  # noqa: E402

__all__ = ["main"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    ap.add_argument("--chunk", type=int, default=65536, help="prefill chunk (tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, dtype, H, D = torch.device(args.device), torch.bfloat16, 16, 64
    gen = torch.Generator(device=device).manual_seed(0)
    base = FreeSoloConfig(variant="fsb")
    cfg = base.replace(tau=_tau(torch.randn(1, 65536, H, D, generator=gen, device=device).to(dtype), base))
    results = []
    for T in args.contexts:
        t0 = time.perf_counter()
        cache = FreeSoloCache(cfg, 1, H, H, D, backend="torch", dtype=dtype, device=device, check_finite=False)
        for c0 in range(0, T, args.chunk):
            n = min(args.chunk, T - c0)
            k, v = (torch.randn(1, n, H, D, generator=gen, device=device).to(dtype) for _ in range(2))
            cache.prefill(k, v)
        state = cache.state
        forests = {**state.forest_all.tensors("all"), **state.forest_high.tensors("high")}
        row = {
            "T": T,
            "cache_gib": cache.memory_bytes() / 2**30,
            "forests_gib": sum(t.numel() * t.element_size() for t in forests.values()) / 2**30,
            "full_kv_gib": 2 * T * H * D * 2 / 2**30,
        }
        results.append(row)
        print(
            f"T={T:>8}: FS-B cache {row['cache_gib']:.3f} GiB (forests {row['forests_gib']:.3f}); "
            f"full KV {row['full_kv_gib']:.3f} GiB  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        del cache, state, forests
    payload = {
        "env": _versions(device),
        "dtype": "bfloat16",
        "shape": {"B": 1, "H": H, "D": D},
        "what": "FreeSoloCache.memory_bytes() after prefill (state only); forests = both ForestTable node tables",
        "results": results,
    }
    if args.out:
        write_results(args.out, payload, _plot)
    return 0


def _plot(payload, path):
    rows = payload["results"]
    labels = {"cache_gib": "FS-B cache (all)", "forests_gib": "FS-B forests", "full_kv_gib": "full KV cache (bf16)"}
    plot_lines(series_by_T(rows, labels), path, "context T", "GiB per layer (B 1)", f"FS-B cache memory, H 16, D 64 ({payload['env'].get('gpu')})")


if __name__ == "__main__":
    raise SystemExit(main())
