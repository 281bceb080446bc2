"""FS-B decode on the GPU (issue 12): the torch step against the fused Triton step
(`FreeSoloCache(..., decode_kernel="triton")`: `fsb_search.decode_select_cells`, then the fused
window + readout kernel), eager and in a CUDA graph, against SDPA decode over the full KV cache,
same run.

Per context T (B 1 or `--batch`, H 16 MHA, D 64, bf16, default config, tau = per-head median of the max key
norms of the first 64k tokens): one cache per kind brought to T by `prefill` (state only), then
`--steps` one-token `extend` calls timed back to back with CUDA events (eager; the steps cross
`steps // 128` block boundaries, whose forest updates are in the mean); their outputs are
compared (fraction of (step, head) rows off by more than ROW_TOL: other selections, i.e. float32
near-ties of the searches; below it the two steps differ only in bf16 rounding). Then the next
steps one by one (in-block median, boundary mean) and, fused kind only, `--steps` more through
`cache.decode_graph()` (the step in a CUDA graph; boundaries eager, without host sync since s22).
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

from gpu_attention import _tau, _versions, bench_ms, plot_lines, series_by_T, smoke_or_gpu, write_results  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloCache, FreeSoloConfig  # noqa: E402

__all__ = ["main"]

ROW_TOL = 0.05  # |fused - torch| above this in some element of a (step, head) row: another selection


def _steps_us(cache, q, k, v, device) -> tuple[float, torch.Tensor]:
    """Mean microseconds per one-token extend over q.shape[1] steps, and the outputs [B, n, H, D]."""
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


def _split_us(cache, q, k, v, block: int, step=None) -> dict:
    """Per-step CUDA-event times of q.shape[1] one-token steps (CUDA only; `step(q, k, v)`,
    default `cache.extend`): the mean over all steps, the median of the steps inside a block and
    the mean of the block-boundary steps (their forest updates), us; and the wall-clock mean per
    step (host clock from a sync before the first step to a sync after the last: what a serving
    loop sees, host-side boundary work included)."""
    step = step or (lambda q1, k1, v1: cache.extend(q1, k1, v1, check_finite=False))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(q.shape[1])]
    at_boundary = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (start, end) in enumerate(events):
        at_boundary.append(cache.length % block == 0)
        start.record()
        step(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        end.record()
    torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - t0) / len(events)
    us = [1e3 * s.elapsed_time(e) for s, e in events]
    inside = sorted(u for u, b in zip(us, at_boundary) if not b)
    edge = [u for u, b in zip(us, at_boundary) if b]
    return {"mean_us": sum(us) / len(us), "wall_mean_us": wall_us, "inblock_median_us": inside[len(inside) // 2] if inside else None,
            "boundary_mean_us": sum(edge) / len(edge) if edge else None, "boundary_steps": len(edge)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    ap.add_argument("--steps", type=int, default=256, help="timed one-token steps per context and kind")
    ap.add_argument("--chunk", type=int, default=65536, help="prefill chunk (tokens per batch row)")
    ap.add_argument("--batch", type=int, default=1, help="B: batch rows of the cache (each its own sequence)")
    ap.add_argument("--kernels", nargs="+", choices=["torch", "triton"], default=["torch", "triton"],
                    help="decode kernels to time (the output comparison needs both)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device, dtype = smoke_or_gpu(args.dry_run)
    H, D = (2, 16) if args.dry_run else (16, 64)
    base = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=4) if args.dry_run else FreeSoloConfig(variant="fsb")
    contexts = [64] if args.dry_run else args.contexts
    steps = 12 if args.dry_run else args.steps
    B = args.batch
    results = []
    t_start = time.perf_counter()
    for T in contexts:
        gen = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(B, T + 3 * steps, H, D, device=device, dtype=dtype, generator=gen)
        v = torch.randn(B, T + 3 * steps, H, D, device=device, dtype=dtype, generator=gen)
        q = torch.randn(B, 3 * steps, H, D, device=device, dtype=dtype, generator=gen)
        cfg = base.replace(tau=_tau(k[:1, : min(T, 65536)], base))
        row = {"T": T, "B": B, "steps": steps}
        outs = {}
        for kernel in args.kernels:
            cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device, check_finite=False,
                                  decode_kernel=kernel)  # fmt: skip
            for c0 in range(0, T, args.chunk):
                cache.prefill(k[:, c0 : min(T, c0 + args.chunk)], v[:, c0 : min(T, c0 + args.chunk)], check_finite=False)
            _steps_us(cache, q[:, :2], k[:, T : T + 2], v[:, T : T + 2], device)  # warm-up (compiles the kernel)
            row[f"{kernel}_us"], outs[kernel] = _steps_us(cache, q[:, 2:steps], k[:, T + 2 : T + steps], v[:, T + 2 : T + steps], device)
            if device.type == "cuda":  # the next steps timed one by one: eager, then the CUDA graph (fused step)
                ahead = (q[:, steps : 2 * steps], k[:, T + steps : T + 2 * steps], v[:, T + steps : T + 2 * steps])
                split = _split_us(cache, *ahead, cfg.block)
                row.update({f"{kernel}_{name}": value for name, value in split.items() if name != "mean_us"})
                if kernel == "triton":  # the search launch alone (reads the state only), by warps per program
                    from freesolo.backends.triton.fsb_search import decode_select_cells

                    qg = q[:, 0].reshape(B, H, 1, D)
                    for warps in (1, 2, 4):
                        search = functools.partial(decode_select_cells, cache.state, qg, num_warps=warps)
                        row[f"search_w{warps}_us"] = 1e3 * bench_ms(search, device, 30)
                    graph = cache.decode_graph()
                    # the first replay after the capture, timed alone (up to s22 it was the first timed
                    # step, and a block boundary, of the graph phase)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    graph(q[:, 2 * steps : 2 * steps + 1], k[:, T + 2 * steps : T + 2 * steps + 1], v[:, T + 2 * steps : T + 2 * steps + 1])
                    torch.cuda.synchronize()
                    row["graph_first_replay_us"] = 1e6 * (time.perf_counter() - t0)
                    later = (q[:, 2 * steps + 1 :], k[:, T + 2 * steps + 1 :], v[:, T + 2 * steps + 1 :])
                    split = _split_us(cache, *later, cfg.block, step=graph)
                    row.update({f"graph_{name}": value for name, value in split.items()})
                    del graph
            row["cache_mib"] = cache.memory_bytes() / 2**20
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # the fused step sums the window and the readout in another order than the torch ops: rows
        # differ in bf16 rounding; a row off by more than ROW_TOL (absolute) chose other cells
        if len(outs) == 2:
            differ = ((outs["torch"].float() - outs["triton"].float()).abs() > ROW_TOL).any(-1)  # (B, steps - 2, H)
            row["rows_differing"] = float(differ.float().mean())
            row["max_abs_diff"] = float((outs["torch"].float() - outs["triton"].float()).abs().max())
        full_k, full_v = (x[:, :T].transpose(1, 2).contiguous() for x in (k, v))  # [B, H, T, D]
        sdpa = functools.partial(F.scaled_dot_product_attention, q[:, :1].transpose(1, 2).contiguous(), full_k, full_v)
        row["sdpa_us"] = 1e3 * bench_ms(sdpa, device, 50)
        del full_k, full_v, sdpa
        results.append(row)
        timed = " | ".join(f"{name} {row[key]:9.1f} us" for name, key in (("FS-B step torch ops", "torch_us"), ("fused triton", "triton_us")) if key in row)
        differing = f"outputs differ in {row['rows_differing']:.4%} of (step, head) rows | " if "rows_differing" in row else ""
        print(f"T={T:>8} B={B}: {timed} | SDPA {row['sdpa_us']:7.1f} us | {differing}cache {row['cache_mib']:.0f} MiB  "
              f"({time.perf_counter() - t_start:.0f} s)", flush=True)  # fmt: skip
        if "graph_mean_us" in row:
            print(f"          fused eager: in-block median {row['triton_inblock_median_us']:.1f} us, boundary mean "
                  f"{row['triton_boundary_mean_us'] or float('nan'):.1f} us | CUDA graph: mean {row['graph_mean_us']:.1f} us "
                  f"per step (wall clock {row['graph_wall_mean_us']:.1f} us), in-block median {row['graph_inblock_median_us']:.1f} us, boundary mean "
                  f"{row['graph_boundary_mean_us'] or float('nan'):.1f} us ({row['graph_boundary_steps']} boundaries); first replay "
                  f"after the capture {row['graph_first_replay_us']:.1f} us (not in the means)")  # fmt: skip
        if "search_w1_us" in row:
            print("          search launch alone: " + ", ".join(f"{w} warps {row[f'search_w{w}_us']:.1f} us" for w in (1, 2, 4)))
    payload = {
        "env": _versions(device),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": {"B": B, "H": H, "D": D},
        "timing": "FS-B: torch_us / triton_us: mean per one-token extend over the timed steps (CUDA events, eager, "
        "block boundaries included); *_inblock_median_us / *_boundary_mean_us: the next steps timed one by one; "
        "graph_*: the steps after those through cache.decode_graph() (fused step in a CUDA graph, boundaries eager, "
        "graph_mean_us = mean over every step, graph_wall_mean_us = host wall clock per step from sync to sync); SDPA: triton.testing.do_bench median",
        "results": results,
    }
    if args.out:
        write_results(args.out, payload, _plot)
    return 0


def _plot(payload, path):
    """us per step vs context T: FS-B with either search, SDPA (log-log), written to `path`."""
    rows = payload["results"]
    labels = {"torch_us": "FS-B step, torch ops (eager)", "triton_us": "FS-B fused Triton step (eager)",
              "graph_mean_us": "FS-B fused step, CUDA graph (boundaries incl.)",
              "graph_wall_mean_us": "FS-B fused step, CUDA graph, wall clock per step",
              "graph_inblock_median_us": "FS-B fused step, CUDA graph, in-block", "sdpa_us": "SDPA decode, full cache"}  # fmt: skip
    series = series_by_T(rows, labels)
    title = f"FS-B decode: {payload['env'].get('gpu')}, H {payload['shape']['H']}, D {payload['shape']['D']}"
    plot_lines(series, path, "context T", f"us per layer step (B {payload['shape']['B']})", title)


if __name__ == "__main__":
    raise SystemExit(main())
