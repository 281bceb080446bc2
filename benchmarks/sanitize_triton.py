"""Small run of every Triton kernel of the forward and backward (FS-L, FS, FS-B readout) for
compute-sanitizer (memcheck / racecheck):

    compute-sanitizer --tool memcheck python benchmarks/sanitize_triton.py
"""

from __future__ import annotations

import torch

import freesolo


def main():
    torch.manual_seed(0)
    for variant in ("fsl", "fs", "fsb"):
        cfg = freesolo.FreeSoloConfig(variant=variant, window=64, cell=8, block=32, pool=4, recent=2, top_k=2)
        q = torch.randn(2, 301, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 301, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 301, 2, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if variant == "fsb":
            cfg = cfg.replace(tau=freesolo.calibrate_tau(k.detach().float(), cfg))
        o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        print(variant, "ok", bool(torch.isfinite(q.grad).all()))


if __name__ == "__main__":
    main()
