"""Why the host-bound FS-L API time at 4k / 16k is bimodal across processes (issue 10, s26).

s26 call3 / call4: in some processes `gpu_attention.py` timed the triton FS-L forward at ~0.55 ms
(4k and 16k, B 1, H 16, D 64, bf16), in others ~1.0-1.15 ms, with either launch order, while SDPA
and fla NSA in the same processes kept their usual figures. This probe runs in one process and
prints, for T = 4096 and 16384: do_bench's median of the API call; the host time per call (calls
queued without a sync); the synchronized wall time per call; the caching allocator's device
malloc / free counts and its `num_sync_all_streams` over the timed calls (a cudaFree or an
allocator sync inside the loop would serialize host and GPU); Python garbage collections during
the timed calls; the CPU the process runs on. Run it in several processes:

    for i in 1 2 3 4; do python benchmarks/host_bimodal_probe.py --out $OUT/bimodal_$i.json; done
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from forward_overlap_ab import host_ms  # noqa: E402
from gpu_attention import _versions  # noqa: E402
from triton_attention_bench import _bench, _inputs  # noqa: E402

import freesolo  # noqa: E402

__all__ = ["main"]

_STATS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")


def _alloc_stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: int(s.get(k, -1)) for k in _STATS}


def probe(T: int, rep: int) -> dict:
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    q, k, v = _inputs(T, 16, 16, 64, torch.bfloat16, "iid")

    def api():
        with torch.no_grad():
            return freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)

    api()
    torch.cuda.synchronize()
    gc_before = sum(s["collections"] for s in gc.get_stats())
    stats_before = _alloc_stats()
    bench_ms = _bench(api, rep)
    stats_after = _alloc_stats()
    gc_after = sum(s["collections"] for s in gc.get_stats())
    n = 100
    host = host_ms(api, n)
    t = time.perf_counter()
    for _ in range(n):
        api()
        torch.cuda.synchronize()
    synced_ms = (time.perf_counter() - t) / n * 1e3
    gc.disable()
    bench_nogc_ms = _bench(api, rep)
    gc.enable()
    row = {
        "T": T,
        "do_bench_ms": bench_ms,
        "do_bench_gc_off_ms": bench_nogc_ms,
        "host_ms_per_call": host,
        "synced_ms_per_call": synced_ms,
        "gc_collections_during_do_bench": gc_after - gc_before,
        "allocator_during_do_bench": {k: stats_after[k] - stats_before[k] for k in _STATS},
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    payload = {"env": _versions(torch.device("cuda")), "pid": os.getpid(),
               "cpu_affinity": sorted(os.sched_getaffinity(0)), "results": []}  # fmt: skip
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            payload["cpu_at_start"] = int(f.read().split()[38])
    except (OSError, IndexError, ValueError):
        payload["cpu_at_start"] = None
    print(f"pid {payload['pid']} cpu {payload['cpu_at_start']} affinity {len(payload['cpu_affinity'])} cpus", flush=True)
    for T in args.lengths:
        payload["results"].append(probe(T, args.rep))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
