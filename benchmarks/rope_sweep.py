"""Tile sweep of the Triton RoPE kernel (`_common._rope_rows_kernel`, the forward's rotated keys
and the backward's rotated q / k): rows per program x warps, each variant's output checked bit for
bit against the default's (the rotation is elementwise: tiles change no bit), timed with
triton.testing.do_bench (median) at T = 16k / 64k (B 1, H 16, D 64, bf16).

    python benchmarks/rope_sweep.py --out $OUT/rope_sweep.json     # H200, ~20 s
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import _versions, write_json  # noqa: E402

from freesolo.backends.torch._ops import rope_tables  # noqa: E402
from freesolo.backends.triton import _common  # noqa: E402


def launch_variant(x, cos, sin, out, block_r: int, num_warps: int) -> None:
    """The kernel launch of `_common.rope_rotate` with explicit rows per program and warps."""
    B, T, H, D = x.shape
    R = B * T * H
    half_p = _common.padded_dims(D)[1]
    _common._rope_rows_kernel[(triton.cdiv(R, block_r),)](
        x, out, cos, sin, R, T, H, x.stride(0) if B > 1 else T * H * D, HALF=D // 2, HALF_P=half_p, BLOCK_R=block_r,
        num_warps=num_warps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dev = torch.device("cuda")
    H, D = 16, 64
    rows = []
    for T in args.T:
        x = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
        cos, sin = rope_tables(T, D, 10000.0, dev, torch.float32)
        want = _common.rope_rotate(x, cos, sin)
        default_ms = triton.testing.do_bench(lambda: _common.rope_rotate(x, cos, sin, out=want), return_mode="median")
        rows.append(dict(T=T, variant="default", ms=default_ms, equal=True))
        print(f"T={T} default {default_ms * 1e3:.1f} us", flush=True)
        for block_r in (32, 64, 128, 256, 512):
            for warps in (2, 4, 8):
                out = torch.empty_like(x)
                try:
                    launch_variant(x, cos, sin, out, block_r, warps)
                    equal = bool(torch.equal(out, want))
                    ms = triton.testing.do_bench(lambda: launch_variant(x, cos, sin, out, block_r, warps), return_mode="median")
                except Exception as error:  # a probe: record and go on
                    rows.append(dict(T=T, block_r=block_r, num_warps=warps, error=repr(error)[:200]))
                    continue
                rows.append(dict(T=T, block_r=block_r, num_warps=warps, ms=ms, equal=equal))
                print(f"T={T} block_r {block_r:4d} warps {warps}: {ms * 1e3:7.1f} us  equal {equal}", flush=True)
    write_json(args.out, dict(meta=_versions(dev), H=H, D=D, dtype="bfloat16", rows=rows))


if __name__ == "__main__":
    main()
