"""A/B of the selection side stream's priority (`attention.SIDE_PRIORITY`, issue 10's 4k bar).

The Triton forward (window_first tiles) runs the window kernel on the current stream and the
selection chain (cell statistics, FS-L pool scan and candidates, scoring, unions) on a side stream;
the long kernel waits for both. At short T the chain is a string of small kernels and the window
kernel fills the GPU beside it, so the chain's start-up waits for SM slots. This script times the
same calls with the side stream at priority 0 (torch's default) and at the device's highest
(FREESOLO_TRITON_SIDE_PRIORITY=-100, clamped by torch), in one process, rounds interleaved (A B A B):

- `api_ms`: `freesolo_attention(..., backend="triton")` through the public API (do_bench median;
  short calls replay the backend's CUDA graphs, `graphs.py`), forward under no_grad, or forward +
  backward of o.sum();
- `graph_ms`: the same call captured in one user CUDA graph (the GPU time without host work);
- `same_bits`: the outputs (and gradients) of the two priorities are bitwise equal.

SDPA causal (forward, forward + backward) in the same run. B 1, H 16, D 64, bf16, iid keys.

    python benchmarks/side_priority_ab.py --out $OUT/side_priority_ab.json   # ~2 min on an H100
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import write_results  # noqa: E402
from triton_attention_bench import _bench, _inputs, gpu_payload, graph_replay_ms  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton import graphs  # noqa: E402

__all__ = ["PRIORITIES", "main"]

PRIORITIES = {"p0": "0", "high": "-100"}  # FREESOLO_TRITON_SIDE_PRIORITY of each arm
H, D = 16, 64


def _set_priority(arm: str) -> int:
    """Set the arm's FREESOLO_TRITON_SIDE_PRIORITY (every length), drop the cached graphs; the stream's real priority."""
    os.environ[att.ENV_SIDE_PRIORITY] = PRIORITIES[arm]
    graphs.clear()  # (the key holds the switch too; clearing keeps the memory of one arm at a time)
    return int(att._side_stream(torch.device("cuda"), att.side_priority()).priority)


def _call(variant: str, T: int, mode: str):
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, v = _inputs(T, H, H, D, torch.bfloat16, "iid")
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                return (freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False),)

        return fn
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))

    def fn():
        for x in (q, k, v):
            x.grad = None
        o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        o.float().sum().backward()
        return o, q.grad, k.grad, v.grad

    return fn


def _sdpa(T: int, mode: str, rep: int) -> float:
    q, k, v = (x.transpose(1, 2).contiguous() for x in _inputs(T, H, H, D, torch.bfloat16, "iid"))
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    else:
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))

        def fn():
            for x in (q, k, v):
                x.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()

    return _bench(fn, rep)


def case(variant: str, T: int, mode: str, rep: int, rounds: int) -> dict:
    fn = _call(variant, T, mode)
    row = {"variant": variant, "T": T, "mode": mode, "rounds": {arm: [] for arm in PRIORITIES}, "stream_priority": {}}
    outs = {}
    for _ in range(rounds):
        for arm in PRIORITIES:
            row["stream_priority"][arm] = _set_priority(arm)
            outs[arm] = [x.detach().clone() for x in fn()]
            api = _bench(fn, rep)
            # (a backward in a user graph needs static gradients: the forward only)
            graph = graph_replay_ms(fn, rep) if mode == "fwd" else None
            row["rounds"][arm].append({"api_ms": api, "graph_ms": graph})
    row["same_bits"] = all(torch.equal(a, b) for a, b in zip(outs["p0"], outs["high"]))
    for arm in PRIORITIES:
        rs = row["rounds"][arm]
        row[arm] = {
            "api_ms": sorted(r["api_ms"] for r in rs)[len(rs) // 2],
            "graph_ms": None if mode != "fwd" else sorted(r["graph_ms"] for r in rs)[len(rs) // 2],
        }
    if variant == "fsl":
        row["sdpa_causal_ms"] = _sdpa(T, mode, rep)
    a, b = row["p0"], row["high"]
    print(f"{variant:3s} {mode:7s} T={T:6d} api p0 {a['api_ms']:.4f} high {b['api_ms']:.4f} ms"
          + (f" | graph p0 {a['graph_ms']:.4f} high {b['graph_ms']:.4f}" if mode == "fwd" else "")
          + (f" | sdpa {row['sdpa_causal_ms']:.4f}" if "sdpa_causal_ms" in row else "")
          + f" | same bits {row['same_bits']} | priorities {row['stream_priority']}", flush=True)  # fmt: skip
    return row


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        rows = [r for r in payload["results"] if r["variant"] == "fsl" and r["mode"] == mode]
        if not rows:
            ax.set_visible(False)
            continue
        Ts = [r["T"] for r in rows]
        for arm, style in (("p0", "o-"), ("high", "s-")):
            ax.plot(Ts, [r[arm]["api_ms"] for r in rows], style, label=f"triton_fsl API, side stream {arm}")
        ax.plot(Ts, [r["sdpa_causal_ms"] for r in rows], "k--", label="sdpa_causal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"FS-L {mode}, bf16 H16 D64 B1 ({payload['env']['gpu']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 65536])
    ap.add_argument("--bwd-lengths", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved A / B rounds (median over them)")
    ap.add_argument("--out", default=None, help="JSON output path (and a .png beside it)")
    args = ap.parse_args(argv)
    payload = gpu_payload(shape="H16-D64", dtype="bfloat16", B=1, keys="iid", priorities=PRIORITIES, results=[])
    for T in args.lengths:
        payload["results"].append(case("fsl", T, "fwd", args.rep, args.rounds))
    payload["results"].append(case("fs", 4096, "fwd", args.rep, args.rounds))
    for T in args.bwd_lengths:
        payload["results"].append(case("fsl", T, "fwd+bwd", args.rep, args.rounds))
    os.environ.pop(att.ENV_SIDE_PRIORITY, None)
    if args.out:
        write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
