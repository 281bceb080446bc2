"""`freesolo decode`: prefill a context of random tokens into a FreeSoloCache, then decode.

Prints the per-token decode latency (mean, median, p90) and the cache memory. Example:

    freesolo decode --context 65536 --batch 1 --heads 16 --kv-heads 16 --dim 64 --backend torch --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

__all__ = ["add_decode_parser", "run_decode"]


def add_decode_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `decode` sub-command (func=run_decode) on an argparse subparsers object."""
    p = subparsers.add_parser("decode", help="streaming cache: prefill a context, time per-token decode, memory")
    p.add_argument("--context", type=int, default=4096, help="tokens prefilled before decoding (T)")
    p.add_argument("--steps", type=int, default=256, help="decode steps timed (one token each)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads Hq")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads Hkv (default: Hq)")
    p.add_argument("--dim", type=int, default=64, help="head dim D")
    p.add_argument("--backend", default="torch", choices=["numpy", "numba", "torch"])
    p.add_argument("--variant", default="fsl", choices=["fs", "fsl", "fsb"])
    p.add_argument("--dtype", default="bfloat16", help="torch backend: storage dtype (float32, bfloat16, ...)")
    p.add_argument("--device", default=None, help="torch backend: device (default cuda if available)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk length (tokens)")
    p.add_argument("--outputs", action="store_true", help="prefill with extend (computes outputs) instead of prefill")
    p.add_argument("--graph", action="store_true", help="torch on CUDA: decode through a CUDA graph (FS-L; FS and FS-B with the fused Triton step)")
    p.add_argument(
        "--decode-kernel",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="one-token steps: auto = the fused Triton step on CUDA (fp32 / fp16 / bf16, triton installed), "
        "else torch ops; torch = torch ops; triton = the fused step (an error naming why where it cannot run)",
    )
    for name, default in (("window", 512), ("cell", 32), ("top-k", 4), ("block", 128), ("pool", 64), ("recent", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_decode)
    return p


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def run_decode(args) -> int:
    """Prefill `--context` random tokens, decode `--steps` tokens, print latency and memory."""
    from tqdm import tqdm

    import freesolo
    from freesolo import FreeSoloCache, FreeSoloConfig

    B, Hq, D = args.batch, args.heads, args.dim
    Hkv = args.kv_heads or Hq
    sizes = {
        "window": args.window,
        "cell": args.cell,
        "top_k": args.top_k,
        "block": args.block,
        "pool": args.pool,
        "recent": args.recent,
    }
    rng = np.random.default_rng(args.seed)
    tau = None
    if args.variant == "fsb":
        tau = freesolo.calibrate_tau(rng.standard_normal((1, 64 * args.cell, Hkv, D)), FreeSoloConfig(**sizes))
    cfg = FreeSoloConfig(variant=args.variant, tau=tau, **sizes)
    host = args.backend in ("numpy", "numba")
    if host:
        cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend=args.backend)
        device = "cpu"

        def make(n, h):
            return rng.standard_normal((B, n, h, D))

        def sync():
            return None
    else:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, args.dtype)
        cache = FreeSoloCache(
            cfg, B, Hq, Hkv, D, backend="torch", dtype=dtype, device=device, decode_kernel=args.decode_kernel
        )
        gen = torch.Generator(device=device).manual_seed(args.seed)

        def make(n, h):
            return torch.randn(B, n, h, D, generator=gen, device=device, dtype=torch.float32).to(dtype)

        def sync():
            if device.startswith("cuda"):
                torch.cuda.synchronize()

    print(
        f"freesolo decode: variant={cfg.variant} backend={args.backend} device={device} B={B} Hq={Hq} Hkv={Hkv} "
        f"D={D} context={args.context} (window={cfg.window} cell={cfg.cell} block={cfg.block} pool={cfg.pool} "
        f"recent={cfg.recent} top_k={cfg.top_k})"
        + ("" if host else f" decode step: {'fused triton' if getattr(cache.state, '_fused', False) else 'torch ops'}")
    )
    start = time.perf_counter()
    chunks = range(0, args.context, args.chunk)
    for s in tqdm(chunks, desc="prefill", unit="chunk", disable=args.quiet):
        n = min(args.chunk, args.context - s)
        k, v = make(n, Hkv), make(n, Hkv)
        if args.outputs:
            cache.extend(make(n, Hq), k, v, check_finite=False)
        else:
            cache.prefill(k, v, check_finite=False)
    sync()
    prefill_s = time.perf_counter() - start
    print(
        f"  prefill           {prefill_s:.3f} s ({args.context / max(prefill_s, 1e-9):,.0f} tok/s, "
        f"{'extend' if args.outputs else 'state only'})"
    )

    step = None
    if args.graph:
        for _ in range(cfg.block):  # reach a step that is not a boundary, past the window
            if cache.length >= cfg.window and cache.length % cfg.block:
                break
            cache.extend(make(1, Hq), make(1, Hkv), make(1, Hkv), check_finite=False)
        step = cache.decode_graph()
    inputs = [(make(1, Hq), make(1, Hkv), make(1, Hkv)) for _ in range(min(args.steps, 64))]
    for q, k, v in inputs[:3]:  # warm-up
        step(q, k, v) if step is not None else cache.extend(q, k, v, check_finite=False)
    sync()
    latencies = []
    for n in tqdm(range(args.steps), desc="decode", unit="tok", disable=args.quiet):
        q, k, v = inputs[n % len(inputs)]
        t0 = time.perf_counter()
        step(q, k, v) if step is not None else cache.extend(q, k, v, check_finite=False)
        sync()
        latencies.append(time.perf_counter() - t0)
    lat_us = sorted(x * 1e6 for x in latencies)
    print(
        f"  decode latency    mean {statistics.fmean(lat_us):,.1f} us  median {statistics.median(lat_us):,.1f} us  "
        f"p90 {lat_us[int(0.9 * (len(lat_us) - 1))]:,.1f} us per token ({args.steps} steps, "
        f"{'CUDA graph' if step is not None else 'eager'}, synchronised per step)"
    )
    print(f"  cache memory      {_mib(cache.memory_bytes())} at T={cache.length}")
    if not host:
        itemsize = cache.state.ring_k.element_size() if hasattr(cache.state, "ring_k") else 8
        full = 2 * B * cache.length * Hkv * D * itemsize
        print(f"  full KV cache     {_mib(full)} (dense attention at the same T, for comparison)")
    return 0
