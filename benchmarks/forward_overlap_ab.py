"""A/B of the Triton forward's launch order (issue 10), through the public API.

Configurations (`CONFIGS`; 16-bit default tiles of `attention.default_tiles` changed as named):
- split:   s24 .. s25's default: long kernel (writes beta * rmsnorm(o_long) into o), then the
           window kernel adds o_loc; selection, unions, kernels in one stream.
- wfirst:  AttentionTiles.window_first (s26's default): the window kernel writes
           o = o_loc while the selection and the unions run on a side stream, then the long
           kernel adds its term.
- sorted:  wfirst + AttentionTiles.sorted_long (the default since s27): the long tiles hold
           queries sorted by their selected cells (`attention.long_query_order`), within chunks
           of attention.ORDER_CHUNK positions; sorted2k / sorted8k: chunks of 2048 / 8192 (torch.sort
           leaves its in-block path past 4096); sorted_lb32 / sorted_lb32w2 / sorted_lb16w1: long
           tiles of 32 / 32 / 16 queries on 4 / 2 / 1 warps (sorted tiles of fewer queries share
           fewer cells).
- overlap: sorted with the side stream at every length (FREESOLO_TRITON_OVERLAP_MIN_T=0: the default
           until s31); sorted overlaps from attention.OVERLAP_MIN_T positions only (s31).
- s30:     overlap + the keys always rotated in chunks of the budget (ROTATION_ONE_CHUNK_FACTOR 0):
           s30's forward; sorted rotates a sequence that fits two budgets in one chunk (s31).
results/session_2026-12-02_s26/call2 ran an earlier version of this script (commit 570ce1a) that
also had the side stream at priority -1 vs 0 (no difference) and the long kernel over aligned
pairs of cells (`AttentionTiles.long_group`, 27 % slower at 64k; removed).
For FS-L (and FS at 64k), B 1, H 16, D 64, bf16, iid keys, at 4k / 16k / 64k / 128k: the API time
(eager, `check_finite=False`, do_bench median), the API call captured in a CUDA graph (GPU time
without the host), the host time of one eager call (perf_counter over calls that queue on the GPU
without syncs; at small T the eager time is this), the rms-rel difference of the output from
the first configuration's, the mean union size (cells, or pairs) of the long tiles, and two
kernels alone: the long kernel (`_launch_long`) and the unions (`forward_unions`, the order
included). SDPA causal and FlexAttention SWA-512 (compiled) in the same run.

    python benchmarks/forward_overlap_ab.py --out $OUT/forward_overlap_ab.json   # ~2 min on an H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton_attention_bench import _bench, _inputs, flex_swa512, gpu_payload, graph_replay_ms, sdpa_causal  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton.selection import select_cells  # noqa: E402

__all__ = ["CONFIGS", "host_ms", "main"]

CONFIGS = {
    "split": dict(window_first=False, sorted_long=False),
    "wfirst": dict(window_first=True, sorted_long=False),
    "sorted": dict(window_first=True, sorted_long=True),
    "sorted2k": dict(window_first=True, sorted_long=True),
    "sorted8k": dict(window_first=True, sorted_long=True),
    "sorted_lb32": dict(window_first=True, sorted_long=True, long_block=32),
    "sorted_lb32w2": dict(window_first=True, sorted_long=True, long_block=32, long_warps=2),
    "sorted_lb16w1": dict(window_first=True, sorted_long=True, long_block=16, long_warps=1),
    "overlap": dict(window_first=True, sorted_long=True),
    "s30": dict(window_first=True, sorted_long=True),
}
CONFIG_ENV = {"overlap": {att.ENV_OVERLAP_MIN_T: "0"}, "s30": {att.ENV_OVERLAP_MIN_T: "0"}}  # environment variables a configuration sets
CONFIG_ATTRS = {"s30": {"ROTATION_ONE_CHUNK_FACTOR": 0}}  # attention module constants a configuration sets
ORDER_CHUNKS = {"sorted2k": 2048, "sorted8k": 8192}  # attention.ORDER_CHUNK of these configurations
H, D = 16, 64


def _use(config: str):
    """Make the API's `default_tiles` return the configuration's tiles."""
    change = CONFIGS[config]
    base = _ORIGINAL_DEFAULT_TILES

    def tiles(D_, dtype, device):
        t = base(D_, dtype, device)
        return dataclasses.replace(t, **change) if t.long_block else t

    att.default_tiles = tiles
    att.ORDER_CHUNK = ORDER_CHUNKS.get(config, _ORIGINAL_ORDER_CHUNK)
    for env in CONFIG_ENV.values():
        for name in env:
            os.environ.pop(name, None)
    os.environ.update(CONFIG_ENV.get(config, {}))
    for name, value in _ORIGINAL_ATTRS.items():
        setattr(att, name, CONFIG_ATTRS.get(config, {}).get(name, value))


_ORIGINAL_DEFAULT_TILES = att.default_tiles
_ORIGINAL_ORDER_CHUNK = att.ORDER_CHUNK
_ORIGINAL_ATTRS = {name: getattr(att, name) for attrs in CONFIG_ATTRS.values() for name in attrs}


def host_ms(fn, calls: int = 20) -> float:
    """Host time per call (no syncs between calls: the GPU queue absorbs them while not full)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _rms_rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def case(variant: str, T: int, rep: int, configs) -> dict:
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, v = _inputs(T, H, H, D, torch.bfloat16, "iid")

    def api():
        with torch.no_grad():
            return freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)

    row = {"variant": variant, "T": T}
    ref = None
    idx = select_cells(q, k, cfg)
    for config in configs:
        _use(config)
        out = api()
        ref = out if ref is None else ref
        tiles = att.default_tiles(D, q.dtype, q.device)
        unions = att.forward_unions(idx, cfg, tiles)
        count = unions.count
        beta = torch.ones(H, device=q.device, dtype=torch.float32)
        outputs = att._outputs(q, tiles)
        row[config] = {
            "long_kernel_ms": _bench(lambda: att._launch_long(q, k, v, idx, unions, beta, cfg, tiles, outputs), rep),
            "unions_ms": _bench(lambda: att.forward_unions(idx, cfg, tiles), rep),
            "api_ms": _bench(api, rep),
            "graph_ms": graph_replay_ms(api, rep),
            "host_ms": host_ms(api),
            "rms_rel_vs_first": _rms_rel(out, ref),
            "union_mean": float(count.float().mean()),
        }
        r = row[config]
        print(f"{variant:3s} T={T:6d} {config:13s} api {r['api_ms']:7.3f}  graph {r['graph_ms']:7.3f}  "
              f"host {r['host_ms']:6.3f} ms  union {r['union_mean']:5.1f}  rms-rel {r['rms_rel_vs_first']:.1e}  "
              f"long kernel {r['long_kernel_ms']:.3f}  unions {r['unions_ms']:.3f} ms", flush=True)  # fmt: skip
    _use(configs[0])
    att.default_tiles = _ORIGINAL_DEFAULT_TILES
    for name, value in _ORIGINAL_ATTRS.items():
        setattr(att, name, value)
    for env in CONFIG_ENV.values():
        for name in env:
            os.environ.pop(name, None)
    if variant == "fsl":
        row["sdpa_causal_ms"] = sdpa_causal(T, H, H, D, torch.bfloat16, rep)
        row["flex_swa512_ms"] = flex_swa512(T, H, H, D, torch.bfloat16, rep)
        print(f"    T={T:6d} sdpa_causal {row['sdpa_causal_ms']:.3f}  flex_swa512 {row['flex_swa512_ms']:.3f} ms", flush=True)
    return row


def kernel_usage() -> list:
    """Registers and spills of every compiled long / window kernel of this process (the launches'
    real specializations, unlike benchmarks/triton_selection_sm90_check.py's upper bounds)."""
    rows = []
    for name in ("_long_fwd_kernel", "_attention_fwd_kernel"):
        for caches in getattr(att, name).device_caches.values():
            for kernel in caches[0].values():
                try:
                    consts = {k[0] if isinstance(k, tuple) else k: v for k, v in kernel.src.constants.items()}
                    keep = {k: consts[k] for k in ("ADD_TO_OUT", "READ_LONG", "HAS_LONG", "BLOCK_M") if k in consts}
                    rows.append({"kernel": name, **{k: str(v) for k, v in keep.items()},
                                 "n_regs": int(kernel.n_regs), "n_spills": int(kernel.n_spills)})  # fmt: skip
                except Exception as e:  # noqa: BLE001 (a Triton version without these fields: report, go on)
                    rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:200]})
    for r in rows:
        print("  ", r, flush=True)
    return rows


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if r["variant"] == "fsl"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    Ts = [r["T"] for r in rows]
    for config in payload["configs"]:
        ax.plot(Ts, [r[config]["api_ms"] for r in rows], marker="o", label=f"FS-L {config}")
    ax.plot(Ts, [r["flex_swa512_ms"] for r in rows], "k--", marker="s", label="Flex SWA-512")
    ax.plot(Ts, [3 * r["flex_swa512_ms"] for r in rows], "k:", label="3x Flex (issue 10 bar)")
    ax.plot(Ts, [r["sdpa_causal_ms"] for r in rows], "r--", marker="^", label="SDPA causal")
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="forward ms (median)",
           title=f"FS-L forward, launch order / long steps ({payload['env']['gpu']})")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384, 65536, 131072])
    ap.add_argument("--configs", nargs="+", default=["wfirst", "sorted"], choices=list(CONFIGS))
    ap.add_argument("--fs-lengths", nargs="*", type=int, default=[65536], help="FS at these lengths too")
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep (ms)")
    ap.add_argument("--out", default=None, help="JSON output path (and a .png beside it)")
    args = ap.parse_args(argv)
    payload = gpu_payload(dtype="bfloat16", B=1, H=H, D=D, keys="iid", rep_ms=args.rep, configs=args.configs, results=[])
    t0 = time.perf_counter()
    for T in args.lengths:
        payload["results"].append(case("fsl", T, args.rep, args.configs))
    for T in args.fs_lengths:
        payload["results"].append(case("fs", T, args.rep, args.configs))
    payload["kernels"] = kernel_usage()
    payload["seconds"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        plot(payload, os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {args.out} and the .png ({payload['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
