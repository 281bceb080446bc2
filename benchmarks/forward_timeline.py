"""Timeline of the Triton forward's kernels inside one CUDA-graph replay (issue 10's 4k bar).

The forward runs the window kernel on the current stream and the selection chain on a side stream
(`attention.forward_with_selection`), then the long kernel. A per-kernel table (profile_triton.py)
sums kernel times; it cannot show which kernels overlap, or what the critical path is. This probe
captures the API call (FS-L / FS, B 1, H 16, D 64, bf16, no_grad) in one CUDA graph, profiles single
replays with torch.profiler (CUPTI traces the kernels of a graph one by one), and reports every
kernel's stream, start and duration relative to the replay's first kernel, the replay's span (first
start to last end), the sum of the kernels' times and each stream's busy time. It keeps the replay
of median span out of --replays; with several side-stream priorities (FREESOLO_TRITON_SIDE_PRIORITY)
each is captured and profiled in turn. A Gantt chart (PNG) beside the JSON.

    python benchmarks/forward_timeline.py --lengths 4096 65536 --out $OUT/forward_timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import write_results  # noqa: E402
from triton_attention_bench import _inputs, capture_graph, gpu_payload  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton import graphs  # noqa: E402

__all__ = ["kernel_events", "main", "summarize"]

H, D = 16, 64


def kernel_events(trace_path: str) -> list[dict]:
    """The GPU kernels of a chrome trace written by torch.profiler: [{name, stream, start_us, dur_us}] by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            out.append({"name": e["name"], "stream": int(e.get("args", {}).get("stream", e.get("tid", -1))),
                        "start_us": float(e["ts"]), "dur_us": float(e["dur"])})  # fmt: skip
    return sorted(out, key=lambda r: r["start_us"])


def summarize(kernels: list[dict]) -> dict:
    """Span, kernel-time sum and per-stream busy time of one replay's kernels; starts made relative to the first."""
    if not kernels:
        return {"span_us": 0.0, "kernel_sum_us": 0.0, "stream_busy_us": {}, "kernels": []}
    t0 = kernels[0]["start_us"]
    rows = [dict(k, start_us=round(k["start_us"] - t0, 2), dur_us=round(k["dur_us"], 2)) for k in kernels]
    busy: dict = {}
    for r in rows:
        busy[str(r["stream"])] = round(busy.get(str(r["stream"]), 0.0) + r["dur_us"], 2)
    span = max(r["start_us"] + r["dur_us"] for r in rows)
    return {"span_us": round(span, 2), "kernel_sum_us": round(sum(r["dur_us"] for r in rows), 2),
            "stream_busy_us": busy, "kernels": rows}  # fmt: skip


def profile_replay(graph) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return summarize(kernel_events(f.name))


def case(variant: str, T: int, priority: str, replays: int) -> dict:
    os.environ[att.ENV_SIDE_PRIORITY] = priority
    graphs.clear()
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, v = _inputs(T, H, H, D, torch.bfloat16, "iid")

    def fn():
        with torch.no_grad():
            return freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)

    graph = capture_graph(fn)
    for _ in range(3):
        graph.replay()
    runs = sorted((profile_replay(graph) for _ in range(replays)), key=lambda r: r["span_us"])
    best = runs[len(runs) // 2]
    row = {"variant": variant, "T": T, "side_priority": priority, "spans_us": [r["span_us"] for r in runs], **best}
    print(f"{variant} T={T} side priority {priority}: span {best['span_us']:.1f} us, kernels {best['kernel_sum_us']:.1f} us,"
          f" busy per stream {best['stream_busy_us']}", flush=True)  # fmt: skip
    for r in best["kernels"]:
        print(f"   stream {r['stream']:3d}  {r['start_us']:8.1f} +{r['dur_us']:7.1f} us  {r['name'][:70]}", flush=True)
    return row


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.6 + 0.9 * len(rows) * 2), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        streams = sorted({k["stream"] for k in row["kernels"]})
        for y, stream in enumerate(streams):
            ks = [k for k in row["kernels"] if k["stream"] == stream]
            ax.broken_barh([(k["start_us"], k["dur_us"]) for k in ks], (y - 0.4, 0.8), edgecolor="k", linewidth=0.3)
            for k in ks:
                if k["dur_us"] > 0.04 * row["span_us"]:
                    label = k["name"].lstrip("_").replace("_kernel", "")[:14]
                    ax.text(k["start_us"] + k["dur_us"] / 2, y, label, ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams], fontsize=7)
        ax.set_title(f"{row['variant']} T={row['T']} side priority {row['side_priority']}: span {row['span_us']:.0f} us, "
                     f"kernels {row['kernel_sum_us']:.0f} us ({payload['env']['gpu']})", fontsize=8)  # fmt: skip
        ax.set_xlabel("us from the replay's first kernel", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 65536])
    ap.add_argument("--variants", nargs="+", default=["fsl"], choices=["fsl", "fs"])
    ap.add_argument("--priorities", nargs="+", default=["0", "-100"], help="FREESOLO_TRITON_SIDE_PRIORITY values")
    ap.add_argument("--replays", type=int, default=5, help="profiled replays per case (the median span is kept)")
    ap.add_argument("--out", default=None, help="JSON output path (and a .png beside it)")
    args = ap.parse_args(argv)
    payload = gpu_payload(shape="H16-D64", dtype="bfloat16", B=1, keys="iid", results=[])
    for variant in args.variants:
        for T in args.lengths:
            for priority in args.priorities:
                payload["results"].append(case(variant, T, priority, args.replays))
    os.environ.pop(att.ENV_SIDE_PRIORITY, None)
    if args.out:
        write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
