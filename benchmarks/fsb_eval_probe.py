"""Where FS-B evaluation time goes (issue 14): one trained checkpoint with FS-B selection, the time of
one forward per length, and a CUDA profile of one forward at the longest length (top ops by GPU time,
launch count). Usage: python benchmarks/fsb_eval_probe.py --ckpt CKPT --lengths 4096 32768."""

from __future__ import annotations

import argparse
import time

__all__ = ["main"]


def main() -> int:
    import numpy as np
    import torch

    from freesolo.retrieval.evaluate import _selection_chunk, prepare
    from freesolo.retrieval.modelio import backend_scope, pick_backend
    from freesolo.retrieval.tasks import lm_sequence

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt", default="benchmarks/results/checkpoints/ckpt_fs")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke run of this script)")
    p.add_argument("--selection-chunk", type=int, default=None, help="as `freesolo eval --selection-chunk`")
    p.add_argument("--profile-length", type=int, default=4096, help="length of the profiled forward")
    args = p.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    backend = pick_backend(args.backend, device)
    with backend_scope(backend), torch.no_grad():
        model, _, kind = prepare(args.ckpt, "fsb", device)

        def sequence(length):
            return torch.as_tensor(lm_sequence(length, np.random.default_rng(0)), device=device)[None]

        for length in args.lengths:
            x = sequence(length)
            with _selection_chunk(args.selection_chunk, length):
                model(x)
                sync()
                t0 = time.perf_counter()
                model(x)
                sync()
            print(f"{kind} backend={backend} L={length} selection chunk={args.selection_chunk}: one forward {time.perf_counter() - t0:.3f} s", flush=True)
        x = sequence(args.profile_length)
        with _selection_chunk(args.selection_chunk, args.profile_length), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
            model(x)
            sync()
        events = prof.key_averages()
        print(f"L={args.profile_length}: {sum(e.count for e in events)} profiled op calls")
        print("most called:", ", ".join(f"{e.key} {e.count}" for e in sorted(events, key=lambda e: -e.count)[:12]))
        print(events.table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
