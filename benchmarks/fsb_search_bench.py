"""FS-B selection on the GPU: the torch backend's search against the Triton search (issue 12),
same run, same inputs, and how often their selections differ (near-ties only).

Providers per length (B 1, H 16 MHA, D 64, bf16, the default config, tau = median a_c per head):
  torch         `freesolo.backends.torch.select_cells` (budget chunks, 4096 tokens on CUDA)
  torch_chunk   the same in one selection chunk per row (`selection_chunk_scope(T)`)
  triton        `freesolo.backends.triton.fsb_search.fsb_select_cells` (the triton backend's default
                FS-B search on CUDA)
Where triton and torch differ, the float64 margins of the search (`fsb_audit.near_tie_audit`) at up
to --audit differing (query, head) entries and as many random agreeing ones: a difference is a
near-tie when its margin is within float32 rounding of the keys (~1e-5), a defect when it is wide.
Writes a JSON (env, shapes, medians, differing fraction, margins) and prints one line per length:
    python benchmarks/fsb_search_bench.py --lengths 4096 16384 65536 --out results/fsb_search.json
`--dry-run`: CPU, Triton interpreter, T = 64: plumbing only.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import BENCH_TIMING, _tau, _versions, bench_ms, plot_lines, smoke_or_gpu, write_results  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import select_cells as torch_select  # noqa: E402
from freesolo.backends.torch import selection_chunk_scope  # noqa: E402
from freesolo.backends.triton.fsb_audit import near_tie_audit  # noqa: E402
from freesolo.backends.triton.fsb_search import fsb_select_cells  # noqa: E402

__all__ = ["main"]

SHAPE = {"B": 1, "Hq": 16, "Hkv": 16, "D": 64}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--providers", nargs="+", default=["torch", "torch_chunk", "triton"])
    ap.add_argument(
        "--warps",
        type=int,
        nargs="*",
        default=[],
        help="also time the Triton search at these num_warps (providers triton_w<n>)",
    )
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) for calls under 50 ms")
    ap.add_argument("--audit", type=int, default=16, help="differing entries audited per length (0: none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device, dtype = smoke_or_gpu(args.dry_run)
    lengths = [64] if args.dry_run else args.lengths
    shape = {"B": 1, "Hq": 2, "Hkv": 1, "D": 16} if args.dry_run else SHAPE
    base = (
        FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=4)
        if args.dry_run
        else FreeSoloConfig(variant="fsb")
    )
    calls = {
        "torch": lambda q, k, cfg: torch_select(q, k, cfg),
        "torch_chunk": lambda q, k, cfg: _in_one_chunk(q, k, cfg),
        "triton": lambda q, k, cfg: fsb_select_cells(q, k, cfg),
    }
    for w in args.warps:
        calls[f"triton_w{w}"] = functools.partial(lambda q, k, cfg, w: fsb_select_cells(q, k, cfg, num_warps=w), w=w)
    providers = args.providers + [f"triton_w{w}" for w in args.warps]
    results = []
    t_start = time.perf_counter()
    for T in lengths:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, T, shape["Hq"], shape["D"], device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, T, shape["Hkv"], shape["D"], device=device, dtype=dtype, generator=gen)
        cfg = base.replace(tau=_tau(k, base))
        sel, line = {}, []
        for name in providers:
            call = functools.partial(calls[name], q, k, cfg)
            sel[name] = call()  # warm-up (compiles the kernel)
            ms = bench_ms(call, device, args.rep)
            results.append({"T": T, "provider": name, "ms": ms})
            line.append(f"{name} {ms:9.2f} ms")
        ref = sel.get("torch")
        for name, idx in sel.items():
            if ref is not None and name != "torch":
                frac = float((idx != ref).any(-1).float().mean())
                results.append({"T": T, "provider": name, "differs_from_torch": frac})
                line.append(f"{name} differs {frac:.4%}")
        print(f"T={T:>8}: " + " | ".join(line) + f"  ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if args.audit and ref is not None and "triton" in sel:
            record = _audit(q, k, cfg, sel["triton"], ref, args.audit)
            results.append({"T": T, "provider": "triton", "audit": record})
            print(
                f"    audit: {record['differing']} differing entries ({record['differing_sets']} as sets), largest margin among {len(record['differ'])} audited "
                f"{record['max_margin_differ']:.3g}; smallest margin among {len(record['agree'])} random agreeing ones "
                f"{record['min_margin_agree']:.3g}",
                flush=True,
            )
    payload = {
        "env": _versions(device),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "freesolo_config": {
            k: getattr(base, k) for k in ("window", "cell", "block", "beam", "top_k", "leaf_order", "radius_weight")
        },
        "timing": BENCH_TIMING,
        "results": results,
    }
    if args.out:
        write_results(args.out, payload, _plot)
    return 0


def _plot(payload, path):
    """Selection time vs T per provider (log-log), written to `path`."""
    rows = [r for r in payload["results"] if "ms" in r]
    series = {name: [(r["T"], r["ms"]) for r in rows if r["provider"] == name] for name in dict.fromkeys(r["provider"] for r in rows)}
    shape = payload["shape"]
    title = f"{payload['env'].get('gpu')}: B {shape['B']}, H {shape['Hq']}, D {shape['D']}, {payload['dtype']}"
    plot_lines(series, path, "T", "FS-B selection, ms (median)", title)


def _audit(q, k, cfg, idx, ref, limit):
    """near_tie_audit at up to `limit` (row, query, head) entries where idx and ref differ and at as
    many random entries (past the first block) where they agree."""
    differ = (idx != ref).any(-1)  # (B, T, Hq)
    gen = torch.Generator().manual_seed(1)
    agree_all = (~differ).nonzero()
    agree_all = agree_all[agree_all[:, 1] >= cfg.block].cpu()
    pick = torch.randperm(agree_all.shape[0], generator=gen)[:limit]
    records = {}
    for name, entries in (("differ", differ.nonzero()[:limit].cpu()), ("agree", agree_all[pick])):
        records[name] = near_tie_audit(q, k, cfg, [tuple(int(x) for x in e) for e in entries.tolist()])
    for r in records["differ"]:  # the two selections at the entry: the same cells in another order, or not
        a, b = (x[r["row"], r["i"], r["hq"]].tolist() for x in (idx, ref))
        r.update(triton=a, torch=b, same_set=sorted(a) == sorted(b))
    margins = {name: [r["margin"] for r in rec] for name, rec in records.items()}
    return {
        "differing": int(differ.sum()),
        "differing_sets": int((torch.sort(idx, -1).values != torch.sort(ref, -1).values).any(-1).sum()),
        "max_margin_differ": max(margins["differ"], default=0.0),
        "min_margin_agree": min(margins["agree"], default=float("inf")),
        **records,
    }


def _in_one_chunk(q, k, cfg):
    with selection_chunk_scope(q.shape[1]):
        return torch_select(q, k, cfg)


if __name__ == "__main__":
    raise SystemExit(main())
