"""Where an FS-B block boundary's time goes in a CUDA-graph decode loop (issue 12).

`fsb_decode_bench.py` measured (s21, s22) a boundary step through `cache.decode_graph()` at about
twice the eager boundary (GPU-event time of the step). This probe runs the fused FS-B step in a
CUDA graph (B 1, H 16, D 64, bf16, default config) at context T and, for each block boundary:

- "isolated": after a device sync, the boundary call's host time, its GPU-event time, and its
  wall time up to a sync, plus whether the graph was captured again (buffer layout changed) and
  the host time spent waiting on the pinned high-count copy's event (and, at a re-capture, the
  buffers whose address moved);
- "pipelined": no sync before (the host runs ahead of the GPU as in serving), GPU-event time;
- the first replay after the capture, alone (the bench's graph phase begins with a boundary step
  right after `decode_graph()`: its timing holds that first replay).

    python benchmarks/fsb_boundary_probe.py --T 65536 --out $OUT/fsb_boundary_probe.json   # H200, ~40 s
    python benchmarks/fsb_boundary_probe.py --dry-run --out /tmp/probe.json                # CPU plumbing
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _tau, _versions, write_json  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloCache, FreeSoloConfig  # noqa: E402
from freesolo.streaming import torch_fsb  # noqa: E402

__all__ = ["main"]


def _fake_graphs() -> None:
    """DecodeGraph without CUDA (dry run): a "capture" calls the step directly at each replay."""
    from freesolo.streaming import torch_state

    class Direct:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            self.out.copy_(self.fn())

    def capture(self, fn, share_with):
        snapshot = self.state.state_dict()
        out = fn().clone()
        self.state.load_state_dict(snapshot)
        return Direct(fn, out), out

    torch_state.DecodeGraph._check = staticmethod(lambda state: None)
    torch_state.DecodeGraph._warmup = lambda self, fns: None
    torch_state.DecodeGraph._capture = capture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--boundaries", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    cuda = not args.dry_run
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    H, D = (16, 64) if cuda else (2, 8)
    base = FreeSoloConfig(variant="fsb") if cuda else FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=2)
    T = args.T if cuda else 64
    nsteps = base.block * (2 * args.boundaries + 3)
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(1, T + nsteps, H, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, T + nsteps, H, D, device=device, dtype=dtype, generator=gen)
    q = torch.randn(1, nsteps, H, D, device=device, dtype=dtype, generator=gen)
    cfg = base.replace(tau=_tau(k[:, : min(T, 65536)], base))
    cache = FreeSoloCache(cfg, 1, H, H, D, backend="torch", dtype=dtype, device=device, check_finite=False, decode_kernel="triton")
    cache.prefill(k[:, :T], v[:, :T], check_finite=False)
    if not cuda:  # plumbing only: the graph's CUDA pieces replaced by direct calls
        _fake_graphs()
    waits = []
    before = torch_fsb.TorchFsbDeviceState._high_counts_before

    def timed_before(self):
        t0 = time.perf_counter()
        out = before(self)
        waits.append(1e3 * (time.perf_counter() - t0))
        return out

    torch_fsb.TorchFsbDeviceState._high_counts_before = timed_before
    from freesolo.streaming import torch_state

    moved = []  # (length, names of the buffers whose address changed) at each re-capture
    build = torch_state.DecodeGraph._build

    def logged_build(self):
        old = getattr(self, "layout", None)
        build(self)
        if old is not None:
            names = list(self.state.buffers())
            moved.append((self.state.length, [n for n, a, b in zip(names, old, self.layout) if a != b]))

    torch_state.DecodeGraph._build = logged_build
    i = 0

    def token():
        nonlocal i
        sl = slice(i, i + 1)
        kv = slice(T + i, T + i + 1)
        i += 1
        return q[:, sl], k[:, kv], v[:, kv]

    while cache.length % cfg.block != 1:  # eager steps up to just past a boundary (compiles everything)
        cache.extend(*token(), check_finite=False)
    graph = cache.decode_graph()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    sync()  # the first replay after a capture (fsb_decode_bench's graph phase starts on a boundary with it)
    t0 = time.perf_counter()
    graph(*token())
    sync()
    first_replay_ms = 1e3 * (time.perf_counter() - t0)
    print("first replay after the capture (in-block):", round(first_replay_ms, 3), "ms", flush=True)
    for mode in ("isolated", "pipelined"):
        for _ in range(args.boundaries):
            while cache.length % cfg.block != 0:
                graph(*token())
            layout = graph.layout
            if mode == "isolated":
                sync()
            waits.clear()
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            graph(*token())
            t1 = time.perf_counter()
            if cuda:
                e1.record()
            sync()
            t2 = time.perf_counter()
            rows.append(dict(mode=mode, length=cache.length, host_ms=1e3 * (t1 - t0), wall_ms=1e3 * (t2 - t0),
                             gpu_ms=e0.elapsed_time(e1) if cuda else None, recaptured=graph.layout != layout,
                             moved=list(moved[-1][1]) if graph.layout != layout and moved else [],
                             event_wait_ms=sum(waits)))  # fmt: skip
            print(rows[-1], flush=True)
    summary = {}
    for mode in ("isolated", "pipelined"):
        sel = [r for r in rows if r["mode"] == mode and not r["recaptured"]]
        if sel:
            summary[mode] = {key: statistics.median(r[key] for r in sel) for key in ("host_ms", "wall_ms", "event_wait_ms")}
            if cuda:
                summary[mode]["gpu_ms"] = statistics.median(r["gpu_ms"] for r in sel)
    print("median (no re-capture):", summary)
    print("re-captures (length, moved buffers):", moved)
    write_json(args.out, dict(env=_versions(device), T=T, H=H, D=D, dtype=str(dtype), rows=rows, median=summary, recaptures=moved,
                                    first_replay_ms=first_replay_ms))


if __name__ == "__main__":
    main()
