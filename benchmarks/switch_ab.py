"""A/B of the Triton backend's environment switches, one process, rounds interleaved (issue 10's 4k bar).

Each arm is a set of FREESOLO_TRITON_* values (`--arm NAME:VAR=VALUE,VAR=VALUE`; an arm with no
values runs the defaults). For every case and round the arms run in turn (A B A B ...), with the
backend's cached CUDA graphs dropped between arms (the switches are part of their keys anyway):

- `api_ms`: `freesolo_attention(..., backend="triton")` through the public API (do_bench median;
  short calls replay the backend's CUDA graphs, `graphs.py`), forward under no_grad, or forward +
  backward of o.sum();
- `graph_ms`: the same forward captured in one user CUDA graph (the GPU time without host work);
- `select_ms` (with --select): `selection.select_cells` alone, eager;
- `same_bits`: the outputs (and gradients) of every arm are bitwise equal to the first arm's.

SDPA causal (forward, forward + backward) in the same run. B 1, bf16, iid keys; H 16, D 64 unless
`--shape` names another (s50: `GQA-Hq32-Hkv8-D128`; `FREESOLO_TRITON_WINDOW_TILES` is a switch). The
default arms compare the selection side stream's priority (torch's 0 against the device's highest,
`FREESOLO_TRITON_SIDE_PRIORITY=-100`, clamped by torch); s46 adds the short-sequence FS-L candidate
kernel (`FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS`), s47 the cached graphs that read the caller's inputs
in place (`FREESOLO_TRITON_GRAPH_DIRECT`, not a kernel switch: it changes the API time only), s49 the
cache's size limits (`FREESOLO_TRITON_GRAPHS`, `FREESOLO_TRITON_GRAPH_DIRECT_MAX`, API time only):

    python benchmarks/switch_ab.py --out $OUT/side_priority_ab.json                   # ~2 min on an H100
    python benchmarks/switch_ab.py --arm scan: --arm direct:FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS=1024 \\
        --lengths 4096 8192 16384 32768 --select --out $OUT/fsl_direct_ab.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_GRAPHS_BEFORE = os.environ.get("FREESOLO_TRITON_GRAPHS")
from gpu_attention import SHAPES, write_results  # noqa: E402
from triton_attention_bench import _bench, _inputs, gpu_payload, graph_replay_ms  # noqa: E402

# triton_attention_bench turns the backend's graph cache off on import (its eager timings); the API
# column here is the call as users run it, the cache as the caller's environment has it (s47: s45-s47's
# api_ms were eager calls until this line)
if _GRAPHS_BEFORE is None:
    os.environ.pop("FREESOLO_TRITON_GRAPHS", None)
else:
    os.environ["FREESOLO_TRITON_GRAPHS"] = _GRAPHS_BEFORE

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton import graphs, selection  # noqa: E402

__all__ = ["DEFAULT_ARMS", "parse_arm", "parse_shape", "main"]

# the kernels' switches, whether the graph cache may read the caller's inputs in place (s47), and the
# cache's size limits (s49: FREESOLO_TRITON_GRAPHS, FREESOLO_TRITON_GRAPH_DIRECT_MAX)
SWITCHES = graphs.KNOB_ENVS + (graphs.DIRECT_ENV, graphs.GRAPHS_ENV, graphs.DIRECT_MAX_ENV)
DEFAULT_ARMS = ("p0:FREESOLO_TRITON_SIDE_PRIORITY=0", "high:FREESOLO_TRITON_SIDE_PRIORITY=-100")
H, HKV, D = 16, 16, 64  # the shape (--shape sets them)
SHAPE = "H16-D64"


def parse_shape(text: str) -> tuple[int, int, int]:
    """A shape name of `gpu_attention.SHAPES` ('H16-D64', 'GQA-Hq32-Hkv8-D128') -> (Hq, Hkv, D)."""
    if text not in SHAPES:
        raise SystemExit(f"--shape {text!r}: expected one of {sorted(SHAPES)}")
    shape = SHAPES[text]
    return shape["Hq"], shape["Hkv"], shape["D"]


def parse_arm(text: str) -> tuple[str, dict]:
    """'NAME:VAR=VALUE,VAR=VALUE' -> (NAME, {VAR: VALUE}); every VAR must be one of `SWITCHES`."""
    name, _, body = text.partition(":")
    if not name:
        raise SystemExit(f"--arm {text!r}: expected NAME:VAR=VALUE,...")
    values = {}
    for item in filter(None, body.split(",")):
        var, eq, value = item.partition("=")
        if not eq or var not in SWITCHES:
            raise SystemExit(f"--arm {text!r}: {item!r} is not VAR=VALUE with VAR one of {SWITCHES}")
        values[var] = value
    return name, values


def _set_arm(values: dict, every_var: set) -> dict:
    """Set the arm's switches (the other arms' variables unset), drop the cached graphs; what the arm ran."""
    for var in every_var:
        os.environ.pop(var, None)
    os.environ.update(values)
    graphs.clear()  # (the key holds the switches too; clearing keeps the memory of one arm at a time)
    return {"side_stream_priority": int(att._side_stream(torch.device("cuda"), att.side_priority()).priority),
            "fsl_direct_max_cells": selection.fsl_direct_max_cells(), "graph_direct": graphs.direct_inputs()}  # fmt: skip


def _call(variant: str, T: int, mode: str):
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, v = _inputs(T, H, HKV, D, torch.bfloat16, "iid")
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


def _select_call(variant: str, T: int):
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, _ = _inputs(T, H, HKV, D, torch.bfloat16, "iid")
    return lambda: selection.select_cells(q, k, cfg, out_dtype=torch.int32)


def _sdpa(T: int, mode: str, rep: int) -> float:
    q, k, v = (x.transpose(1, 2).contiguous() for x in _inputs(T, H, HKV, D, torch.bfloat16, "iid"))
    gqa = {"enable_gqa": True} if HKV != H else {}
    if mode == "fwd":

        def fn():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    else:
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))

        def fn():
            for x in (q, k, v):
                x.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).float().sum().backward()

    return _bench(fn, rep)


def _median(xs: list):
    return None if not xs or xs[0] is None else sorted(xs)[len(xs) // 2]


def case(variant: str, T: int, mode: str, arms: dict, rep: int, rounds: int, select: bool) -> dict:
    fn = _call(variant, T, mode)
    sel = _select_call(variant, T) if select and mode == "fwd" else None
    every_var = {var for values in arms.values() for var in values}
    row = {"variant": variant, "T": T, "mode": mode, "rounds": {arm: [] for arm in arms}, "ran": {}}
    outs = {}
    for _ in range(rounds):
        for arm, values in arms.items():
            row["ran"][arm] = _set_arm(values, every_var)
            outs[arm] = [x.detach().clone() for x in fn()]
            api = _bench(fn, rep)
            # (a backward in a user graph needs static gradients: the forward only)
            graph = graph_replay_ms(fn, rep) if mode == "fwd" else None
            select_ms = _bench(sel, rep) if sel is not None else None
            row["rounds"][arm].append(
                {
                    "api_ms": api,
                    "graph_ms": graph,
                    "select_ms": select_ms,
                    "graph_cache": graphs.CACHE.stats,
                    "direct_graphs": graphs.CACHE.direct_stats,
                }
            )
    first = next(iter(arms))
    row["same_bits"] = all(torch.equal(a, b) for arm in arms for a, b in zip(outs[first], outs[arm]))
    for arm in arms:
        rs = row["rounds"][arm]
        row[arm] = {key: _median([r[key] for r in rs]) for key in ("api_ms", "graph_ms", "select_ms")}
    if variant == "fsl":
        row["sdpa_causal_ms"] = _sdpa(T, mode, rep)
    text = f"{variant:3s} {mode:7s} T={T:6d}"
    for key in ("api_ms", "graph_ms", "select_ms"):
        if row[first][key] is not None:
            text += f" | {key[:-3]} " + " ".join(f"{arm} {row[arm][key]:.4f}" for arm in arms)
    if "sdpa_causal_ms" in row:
        text += f" | sdpa {row['sdpa_causal_ms']:.4f}"
    print(text + f" | same bits {row['same_bits']} | ran {row['ran']}", flush=True)
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
        for n, arm in enumerate(payload["arms"]):
            ax.plot(Ts, [r[arm]["api_ms"] for r in rows], "os^vD"[n % 5] + "-", label=f"triton_fsl API, {arm}")
            if mode == "fwd":
                ax.plot(Ts, [r[arm]["graph_ms"] for r in rows], "os^vD"[n % 5] + ":", label=f"triton_fsl graph, {arm}")
        ax.plot(Ts, [r["sdpa_causal_ms"] for r in rows], "k--", label="sdpa_causal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"FS-L {mode}, bf16 {payload['shape']} B1 ({payload['env']['gpu']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=None, help="NAME:VAR=VALUE,... (repeat; default: DEFAULT_ARMS)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 65536])
    ap.add_argument("--fs-lengths", nargs="*", type=int, default=[4096], help="FS forward lengths")
    ap.add_argument("--bwd-lengths", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--select", action="store_true", help="also time select_cells alone (forward cases)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median over them)")
    ap.add_argument("--out", default=None, help="JSON output path (and a .png beside it)")
    ap.add_argument("--shape", default="H16-D64", help="H16-D64 (default) or GQA-Hq32-Hkv8-D128 (B 1, bf16)")
    args = ap.parse_args(argv)
    global H, HKV, D, SHAPE
    H, HKV, D = parse_shape(args.shape)
    SHAPE = args.shape
    arms = dict(parse_arm(a) for a in (args.arm or DEFAULT_ARMS))
    payload = gpu_payload(shape=SHAPE, dtype="bfloat16", B=1, keys="iid", arms=arms, results=[])
    for T in args.lengths:
        payload["results"].append(case("fsl", T, "fwd", arms, args.rep, args.rounds, args.select))
    for T in args.fs_lengths:
        payload["results"].append(case("fs", T, "fwd", arms, args.rep, args.rounds, args.select))
    for T in args.bwd_lengths:
        payload["results"].append(case("fsl", T, "fwd+bwd", arms, args.rep, args.rounds, args.select))
    for var in {var for values in arms.values() for var in values}:
        os.environ.pop(var, None)
    if args.out:
        write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
