"""Where does a dense (SDPA + KVCache) decode step of `freesolo.models` spend its time at 64k?

The 64k generation benchmark (`python -m freesolo.models.bench generate`) measured the dense
baseline at 65 ms per token (4 layers), far above what SDPA over a 64k cache costs (~65 us per layer,
`results/gpu_decode_ab.json`). This profiles a few decode steps of the same model to say why.

Usage (GPU): python benchmarks/profile_dense_decode.py [--T 65536] [--steps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from freesolo import FreeSoloConfig
from freesolo.models import FreeSoloLM, LMConfig

__all__ = ["main"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=65536)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cfg = LMConfig(vocab_size=1024, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, attention="dense",
                   freesolo=FreeSoloConfig(), backend="torch")  # fmt: skip
    model = FreeSoloLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, args.T), device=device)
    cache = model.new_cache(1, check_finite=False)
    with torch.no_grad():
        tok = model(ids, cache=cache)[:, -1].argmax(-1, keepdim=True)
        for _ in range(3):
            tok = model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        print(f"dense decode at T={args.T}: {1e3 * (time.perf_counter() - t0) / args.steps:.2f} ms per token")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                tok = model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
