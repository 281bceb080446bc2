"""FS-B decode on the GPU (issue 12): the step with the torch search vs the Triton search
(`FreeSoloCache(..., decode_kernel="triton")`: `fsb_search.decode_select_cells`), against SDPA
decode over the full KV cache, same run.

Per context T (B 1, H 16 MHA, D 64, bf16, default config, tau = per-head median of the max key
norms of the first 64k tokens): one cache per search kind brought to T by `prefill` (state only),
then `--steps` one-token `extend` calls timed back to back with CUDA events (eager: FS-B's block
boundaries sync the host, so there is no CUDA-graph path yet); the steps cross `steps // 128`
block boundaries, whose forest updates are included in the mean. The two kinds' outputs of those
steps are compared (fraction of (step, head) rows that differ: near-ties of the float32 searches).
SDPA: `scaled_dot_product_attention(q [1, H, 1, D], K [1, H, T, D], V)`, `triton.testing.do_bench`.

    python benchmarks/fsb_decode_bench.py --out benchmarks/results/fsb_decode.json   # H200, ~2 min
    python benchmarks/fsb_decode_bench.py --dry-run --out /tmp/fsb_decode.json      # CPU plumbing
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _tau, _versions, bench_ms, plot_lines, write_results  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloCache, FreeSoloConfig  # noqa: E402

__all__ = ["main"]


def _steps_us(cache, q, k, v, device) -> tuple[float, torch.Tensor]:
    """Mean microseconds per one-token extend over q.shape[1] steps, and the outputs [1, n, H, D]."""
    outs = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for i in range(q.shape[1]):
        outs.append(cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], check_finite=False))
    if device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
    else:
        ms = (time.perf_counter() - t0) * 1e3
    return 1e3 * ms / q.shape[1], torch.cat(outs, dim=1)


def _split_us(cache, q, k, v, block: int) -> dict:
    """Per-step CUDA-event times of q.shape[1] one-token extends (CUDA only): the median of the
    steps inside a block and the mean of the block-boundary steps (their forest updates), us."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(q.shape[1])]
    at_boundary = []
    torch.cuda.synchronize()
    for i, (start, end) in enumerate(events):
        at_boundary.append(cache.length % block == 0)
        start.record()
        cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], check_finite=False)
        end.record()
    torch.cuda.synchronize()
    us = [1e3 * s.elapsed_time(e) for s, e in events]
    inside = sorted(u for u, b in zip(us, at_boundary) if not b)
    edge = [u for u, b in zip(us, at_boundary) if b]
    return {"inblock_median_us": inside[len(inside) // 2] if inside else None,
            "boundary_mean_us": sum(edge) / len(edge) if edge else None, "boundary_steps": len(edge)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    ap.add_argument("--steps", type=int, default=256, help="timed one-token steps per context and kind")
    ap.add_argument("--chunk", type=int, default=65536, help="prefill chunk (tokens)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    H, D = (2, 16) if args.dry_run else (16, 64)
    base = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=4) if args.dry_run else FreeSoloConfig(variant="fsb")
    contexts = [64] if args.dry_run else args.contexts
    steps = 12 if args.dry_run else args.steps
    results = []
    t_start = time.perf_counter()
    for T in contexts:
        gen = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(1, T + steps, H, D, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, T + steps, H, D, device=device, dtype=dtype, generator=gen)
        q = torch.randn(1, steps, H, D, device=device, dtype=dtype, generator=gen)
        cfg = base.replace(tau=_tau(k[:, : min(T, 65536)], base))
        row = {"T": T, "steps": steps}
        outs = {}
        for kernel in ("torch", "triton"):
            cache = FreeSoloCache(cfg, 1, H, H, D, backend="torch", dtype=dtype, device=device, check_finite=False,
                                  decode_kernel=kernel)  # fmt: skip
            for c0 in range(0, T, args.chunk):
                cache.prefill(k[:, c0 : min(T, c0 + args.chunk)], v[:, c0 : min(T, c0 + args.chunk)], check_finite=False)
            _steps_us(cache, q[:, :2], k[:, T : T + 2], v[:, T : T + 2], device)  # warm-up (compiles the kernel)
            row[f"{kernel}_us"], outs[kernel] = _steps_us(cache, q[:, 2:], k[:, T + 2 : T + steps], v[:, T + 2 : T + steps], device)
            if device.type == "cuda":  # the same steps again (state past T + steps), timed one by one
                split = _split_us(cache, q[:, 2:], k[:, T + 2 : T + steps], v[:, T + 2 : T + steps], cfg.block)
                row.update({f"{kernel}_{name}": value for name, value in split.items()})
            row["cache_mib"] = cache.memory_bytes() / 2**20
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
        differ = (outs["torch"] != outs["triton"]).any(-1)  # (1, steps - 2, H)
        row["rows_differing"] = float(differ.float().mean())
        row["max_abs_diff"] = float((outs["torch"].float() - outs["triton"].float()).abs().max())
        full_k, full_v = (x[:, :T].transpose(1, 2).contiguous() for x in (k, v))  # [1, H, T, D]
        sdpa = functools.partial(F.scaled_dot_product_attention, q[:, :1].transpose(1, 2).contiguous(), full_k, full_v)
        row["sdpa_us"] = 1e3 * bench_ms(sdpa, device, 50)
        del full_k, full_v, sdpa
        results.append(row)
        print(
            f"T={T:>8}: FS-B step torch search {row['torch_us']:9.1f} us | triton search {row['triton_us']:8.1f} us | "
            f"SDPA {row['sdpa_us']:7.1f} us | outputs differ in {row['rows_differing']:.4%} of (step, head) rows | "
            f"cache {row['cache_mib']:.0f} MiB  ({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
        if "triton_inblock_median_us" in row:
            print(f"          triton search: in-block step median {row['triton_inblock_median_us']:.1f} us, boundary step "
                  f"mean {row['triton_boundary_mean_us'] or float('nan'):.1f} us ({row['triton_boundary_steps']} boundaries)")  # fmt: skip
    payload = {
        "env": _versions(device),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"B": 1, "H": H, "D": D},
        "timing": "FS-B: mean per one-token extend over the timed steps (CUDA events, eager, block boundaries "
        "included); SDPA: triton.testing.do_bench median",
        "results": results,
    }
    if args.out:
        write_results(args.out, payload, _plot)
    return 0


def _plot(payload, path):
    """us per step vs context T: FS-B with either search, SDPA (log-log), written to `path`."""
    rows = payload["results"]
    labels = {"torch_us": "FS-B step, torch search", "triton_us": "FS-B step, Triton search", "sdpa_us": "SDPA decode, full cache"}
    series = {label: [(r["T"], r[key]) for r in rows] for key, label in labels.items()}
    title = f"FS-B decode: {payload['env'].get('gpu')}, H {payload['shape']['H']}, D {payload['shape']['D']}"
    plot_lines(series, path, "context T", "us per layer step (B 1)", title)


if __name__ == "__main__":
    raise SystemExit(main())
