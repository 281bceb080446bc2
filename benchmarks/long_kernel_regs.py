"""Registers, spills and shared memory of the split long kernel (`attention._long_fwd_kernel`) under
register caps (FREESOLO_TRITON_LONG_MAXNREG, s48), and how many of its programs one SM can hold.

The 4k long kernel is bound by the latency of its steps (s48 call2: sorted tiles with half the union
gained it 10 %), so more resident programs per SM might hide that latency. This probe compiles the
kernel as a 4k FS-L forward launches it (bf16, B 1, H 16, D 64) under each cap and prints what ptxas
gave; the timings are `switch_ab.py`'s arms.

    python benchmarks/long_kernel_regs.py --caps 0 128 96 80 72 --out $OUT/long_kernel_regs.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import write_json  # noqa: E402
from triton_attention_bench import gpu_payload  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402

__all__ = ["main"]


def _variants() -> dict:
    """{maxnreg: (n_regs, n_spills, shared bytes)} of every compiled long kernel of this process."""
    out = {}
    for caches in att._long_fwd_kernel.device_caches.values():
        for kernel in caches[0].values():
            meta = kernel.metadata
            out[getattr(meta, "maxnreg", None)] = (int(kernel.n_regs), int(kernel.n_spills), int(meta.shared))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="+", type=int, default=[0, 128, 96, 80, 72])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    payload = gpu_payload(T=args.T, B=1, H=16, D=64, dtype="bfloat16", variant="fsl")
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    q, k, v = (torch.randn(1, args.T, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    props = torch.cuda.get_device_properties(0)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    rows = []
    for cap in args.caps:
        os.environ[att.ENV_LONG_MAXNREG] = str(cap)
        with torch.no_grad():
            freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
        torch.cuda.synchronize()
        variants = _variants()
        if (cap or None) not in variants:  # a Triton whose metadata does not name the cap: report them all
            print("compiled long kernels (maxnreg: regs, spills, shared):", variants, flush=True)
            continue
        n_regs, n_spills, shared = variants[cap or None]
        tiles = att.default_tiles(64, torch.bfloat16, q.device)
        threads = 32 * tiles.long_warps
        per_sm = min(regs_per_sm // (n_regs * threads), smem_per_sm // max(shared, 1), 2048 // threads)
        row = dict(cap=cap, n_regs=n_regs, n_spills=n_spills, shared=shared, programs_per_sm=per_sm)
        rows.append(row)
        print(row, flush=True)
    os.environ.pop(att.ENV_LONG_MAXNREG, None)
    payload["rows"] = rows
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
