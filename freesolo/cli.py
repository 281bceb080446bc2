"""The `freesolo` command: `info`, `run`, `scaling` (complexity) and `decode` (streaming cache)."""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time

import numpy as np

__all__ = ["main"]


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
        return getattr(module, "__version__", "?")
    except Exception as error:  # noqa: BLE001 - report any import failure
        return f"not available ({type(error).__name__}: {error})"


def cmd_info(args) -> int:
    """Print versions and which backends can run here (and why not)."""
    import freesolo
    from freesolo.backends.registry import _report

    print(f"freesolo {freesolo.__version__}  python {platform.python_version()}  {platform.machine()}")
    for name in ("numpy", "numba", "torch", "triton", "matplotlib"):
        print(f"  {name:<10} {_version(name)}")
    try:
        import torch

        if torch.cuda.is_available():
            print(f"  cuda       {torch.version.cuda}  {torch.cuda.get_device_name()}")
        else:
            print("  cuda       no GPU visible")
    except ImportError:
        pass
    print(f"current backend: {freesolo.get_backend()}")
    print(_report(None, None))
    return 0


def _peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cmd_run(args) -> int:
    """Random inputs through one backend: time, tokens/s, counted cost per query, memory."""
    from tqdm import tqdm

    import freesolo
    from freesolo.complexity.counted import cell_max_norms, count_per_query, high_norm_prefix_counts

    tau = None
    rng = np.random.default_rng(args.seed)
    B, T, Hq, Hkv, D = args.batch, args.T, args.heads, args.kv_heads, args.dim
    q = rng.standard_normal((B, T, Hq, D))  # (B, T, Hq, D)
    k = rng.standard_normal((B, T, Hkv, D))  # (B, T, Hkv, D)
    v = rng.standard_normal((B, T, Hkv, D))
    if args.variant == "fsb":
        tau = freesolo.calibrate_tau(k, freesolo.FreeSoloConfig())
    cfg = freesolo.FreeSoloConfig(variant=args.variant, tau=tau)
    group = Hq // Hkv
    print(f"freesolo run: variant={cfg.variant} backend={args.backend} B={B} T={T} Hq={Hq} Hkv={Hkv} D={D}")
    out = np.empty_like(q)
    # Warm-up on a short prefix so that JIT compilation (or loading numba's cache) is not timed.
    warm_T = min(T, 2 * cfg.block)
    start = time.perf_counter()
    freesolo.freesolo_attention(
        q[:1, :warm_T, :group],
        k[:1, :warm_T, :1],
        v[:1, :warm_T, :1],
        cfg if tau is None else cfg.replace(tau=(float(tau[0]),)),
        backend=args.backend,
    )
    print(
        f"  warm-up           {time.perf_counter() - start:.3f} s (compile / cache load, T={warm_T}; not timed below)"
    )
    # One call per kv head (its query heads together): heads are independent, and the bar moves.
    bar = tqdm(range(Hkv), desc="kv heads", unit="head", disable=args.quiet or Hkv == 1)
    start = time.perf_counter()
    for g in bar:
        heads = slice(g * group, (g + 1) * group)
        sub_cfg = cfg if tau is None else cfg.replace(tau=(float(tau[g]),))
        out[:, :, heads] = freesolo.freesolo_attention(
            q[:, :, heads], k[:, :, g : g + 1], v[:, :, g : g + 1], sub_cfg, backend=args.backend
        )
    elapsed = time.perf_counter() - start
    assert np.isfinite(out).all(), "non-finite output"
    high_prefix = None
    if cfg.variant == "fsb":
        high_prefix = high_norm_prefix_counts(cell_max_norms(k, cfg.cell), tau)  # [B, Hkv, C+1]
    cost = count_per_query(T, cfg, Hq, Hkv, high_prefix, batch=B)  # each [B, T, Hq]
    queries = B * T * Hq
    print(f"  time              {elapsed:.3f} s")
    print(f"  tokens/s          {B * T / elapsed:,.0f}   (query-heads/s {queries / elapsed:,.0f})")
    for name, label in (("cells_scored", "cells scored"), ("node_keys", "node keys"), ("tokens_read", "tokens read")):
        if name == "node_keys" and cfg.variant != "fsb":
            continue
        values = cost[name]
        print(f"  {label:<17} {values.mean():.2f} per query (mean), max {values.max()}")
    print(f"  inputs+output     {(q.nbytes + k.nbytes + v.nbytes + out.nbytes) / 2**20:.1f} MiB")
    print(f"  peak RSS          {_peak_rss_mib():.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freesolo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions and available backends")
    info.set_defaults(func=cmd_info)

    run = sub.add_parser("run", help="time one forward pass on random inputs")
    run.add_argument("--variant", choices=["fs", "fsl", "fsb"], default="fsl")
    run.add_argument("--T", type=int, default=65536, help="sequence length (tokens)")
    run.add_argument("--backend", default="numba")
    run.add_argument("--batch", type=int, default=1)
    run.add_argument("--heads", type=int, default=4, help="query heads Hq")
    run.add_argument("--kv-heads", type=int, default=2, help="kv heads Hkv (Hq % Hkv == 0)")
    run.add_argument("--dim", type=int, default=64, help="head dim D")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=cmd_run)

    from freesolo.complexity.scaling import add_scaling_parser
    from freesolo.streaming.cli import add_decode_parser

    add_scaling_parser(sub)
    add_decode_parser(sub)
    from freesolo.retrieval.cli import add_eval_parser, add_train_parser

    add_train_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
