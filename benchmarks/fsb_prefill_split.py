"""Where the Triton FS-B prefill selection spends its time (issue 12): the forests, the search, the rerank.

Per length (B 1, H 16 MHA, D 64, bf16, the default FS-B config, tau = median a_c per head), same run:
  forests     the search's forests alone (`fsb_search.row_forests`: since s41 the Triton statistics of
              `fsb_forests` inside the torch build's codes and sorts)
  forests_torch / select_forests_torch   the forests / select with FREESOLO_TRITON_FSB_FORESTS=torch (the
              torch build on float32 keys: the search's builder until s40)
  search      the forests + `_fsb_search_kernel` without its rerank (`fsb_search._run(..., rerank=False)`)
  select      `fsb_select_cells`: forests + search + rerank, the rerank reading the bf16 keys
  select_k32  the same with float32 keys (the bytes of the rerank before s39: keys widened on the host)
  select_tile `fsb_select_cells` with FREESOLO_TRITON_FSB_RERANK=tile: the search, then the tile rerank
              (`_fsb_rerank_tile_kernel`: a tile of 32 queries scores its union of found cells once)
  search_dcN / select_dcN (--dim-chunks N ...) search / select with the one-query search loading node rows
              N dims at a time (`fsb_search.SEARCH_DIM_CHUNK`)
  search_mrN / select_mrN (--maxnregs N ...) search / select with the search launched at maxnreg N
              (`fsb_search.SEARCH_MAXNREG`)
  unions      the tile rerank's `tile_unions` alone (on the search's beams, computed beforehand)
  tile_only   the tile rerank's kernel alone (unions computed beforehand), at the default tile; with
              --tile-shapes ROWSxCELLS ..., also providers tile_ROWSxCELLS (queries per tile, union
              cells per step)
select_k32 and select_tile may differ from select at float32 near-ties only (the widened keys are
the same values, but the compiler lays a float32 tile out otherwise than a bf16 one, so the rerank's
sums run in another order): the script gives the fraction of (query, head) entries that differ from
select, and the float64 margins of up to --audit of them (`fsb_audit`) up to 256k.
    python benchmarks/fsb_prefill_split.py --lengths 65536 262144 1048576 --out results/fsb_prefill_split.json
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
from freesolo.backends.triton import fsb_search  # noqa: E402
from freesolo.backends.triton.fsb_audit import near_tie_audit  # noqa: E402

__all__ = ["main"]

SHAPE = {"B": 1, "Hq": 16, "Hkv": 16, "D": 64}
PROVIDERS = ("forests", "forests_torch", "search", "select", "select_forests_torch", "select_k32", "select_tile", "unions",
             "tile_only")  # fmt: skip


def _forests(q, k, cfg):
    return fsb_search.row_forests(k.permute(0, 2, 1, 3).contiguous(), cfg)


def _search(q, k, cfg):
    return fsb_search._run(q, k, cfg, False, 1, trace=None, rerank=False)


def _with_env(name, value, fn, *args):
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args)
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _with_search_setting(name, value, fn, *args):
    """fn(*args) with the module constant fsb_search.<name> set to value (restored after)."""
    previous = getattr(fsb_search, name)
    setattr(fsb_search, name, value)
    try:
        return fn(*args)
    finally:
        setattr(fsb_search, name, previous)


def _select_tile(q, k, cfg):
    return _with_env(fsb_search.RERANK_ENV, "tile", fsb_search.fsb_select_cells, q, k, cfg)


class _TileParts:
    """The tile rerank's inputs for one (q, k, cfg), computed once: `unions` / `tile_only` time its two steps."""

    def __init__(self, q, k, cfg):
        from freesolo.backends.triton.attention import tile_unions

        found = fsb_search._run(q, k, cfg, True, 1, trace=None, rerank=False)[1]  # int64 [1, T, Hq, 2 * beam]
        self.beams = found[0].to(torch.int32).contiguous()  # [T, Hq, 2 * beam]
        self.q_row = q[0].to(torch.float32).permute(1, 0, 2).contiguous()  # [Hq, T, D]
        self.k_row = k[0].permute(1, 0, 2).contiguous()  # [Hkv, T, D]
        self.out = torch.empty(q.shape[2], q.shape[1], cfg.top_k, dtype=torch.int64, device=q.device)
        self.cfg, self.G, self.dtype, self.tile_unions = cfg, q.shape[2] // k.shape[2], q.dtype, tile_unions
        self.unions = {}

    def union_step(self, rows=None):
        return self.tile_unions(self.beams[None], rows or fsb_search.RERANK_TILE_ROWS)

    def kernel_step(self, rows=None, cells=None):
        rows, cells = rows or fsb_search.RERANK_TILE_ROWS, cells or fsb_search.RERANK_TILE_CELLS
        if rows not in self.unions:
            self.unions[rows] = self.union_step(rows)
        unions = self.unions[rows]
        saved = fsb_search.RERANK_TILE_ROWS, fsb_search.RERANK_TILE_CELLS
        fsb_search.RERANK_TILE_ROWS, fsb_search.RERANK_TILE_CELLS = rows, cells
        try:
            fsb_search._rerank_tiles(self.q_row, self.k_row, self.beams, self.out, self.cfg, self.G, self.dtype,
                                     lambda *a: unions)  # fmt: skip
        finally:
            fsb_search.RERANK_TILE_ROWS, fsb_search.RERANK_TILE_CELLS = saved
        return self.out.permute(1, 0, 2)[None].clone()  # [1, T, Hq, K], the layout of fsb_select_cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[65536, 262144, 1048576])
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--dim-chunks", type=int, nargs="*", default=[], help="node-row chunks of the one-query search to time (search_dcN, select_dcN)")
    ap.add_argument("--maxnregs", type=int, nargs="*", default=[], help="maxnreg values of the search launch to time (search_mrN, select_mrN)")
    ap.add_argument("--tile-shapes", nargs="*", default=[], help="tile rerank shapes ROWSxCELLS to time alone (tile_only)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) for calls under 50 ms")
    ap.add_argument("--audit", type=int, default=8, help="differing select_tile entries audited per length (0: none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device, dtype = smoke_or_gpu(args.dry_run)
    lengths = [64] if args.dry_run else args.lengths
    shape = {"B": 1, "Hq": 2, "Hkv": 1, "D": 16} if args.dry_run else SHAPE
    base = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=4) if args.dry_run else FreeSoloConfig(variant="fsb")
    calls = {
        "forests": _forests,
        "search": _search,
        "select": lambda q, k, cfg: fsb_search.fsb_select_cells(q, k, cfg),
        "select_k32": lambda q, k, cfg: fsb_search.fsb_select_cells(q, k.to(torch.float32), cfg),
        "select_tile": _select_tile,
        "forests_torch": functools.partial(_with_env, fsb_search.FORESTS_ENV, "torch", _forests),
        "select_forests_torch": functools.partial(_with_env, fsb_search.FORESTS_ENV, "torch", fsb_search.fsb_select_cells),
    }
    results = []
    t_start = time.perf_counter()
    for T in lengths:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, T, shape["Hq"], shape["D"], device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, T, shape["Hkv"], shape["D"], device=device, dtype=dtype, generator=gen)
        cfg = base.replace(tau=_tau(k, base))
        out, line = {}, []
        shapes = [tuple(int(x) for x in text.split("x")) for text in args.tile_shapes]
        providers = list(args.providers) + [f"tile_{r}x{c}" for r, c in shapes]
        providers += [f"{kind}_dc{n}" for n in args.dim_chunks for kind in ("search", "select")]
        providers += [f"{kind}_mr{n}" for n in args.maxnregs for kind in ("search", "select")]
        parts = _TileParts(q, k, cfg) if {"unions", "tile_only"} & set(args.providers) or shapes else None
        for name in providers:
            if name == "unions":
                call = parts.union_step
            elif name == "tile_only":
                call = parts.kernel_step
            elif name.startswith(("search_dc", "select_dc")):
                kind, n = name.split("_dc")
                call = functools.partial(_with_search_setting, "SEARCH_DIM_CHUNK", int(n), calls[kind], q, k, cfg)
            elif name.startswith(("search_mr", "select_mr")):
                kind, n = name.split("_mr")
                call = functools.partial(_with_search_setting, "SEARCH_MAXNREG", int(n), calls[kind], q, k, cfg)
            elif name.startswith("tile_"):
                r, c = (int(x) for x in name[len("tile_") :].split("x"))
                call = functools.partial(parts.kernel_step, r, c)
            else:
                call = functools.partial(calls[name], q, k, cfg)
            out[name] = call()  # warm-up (compiles the kernel)
            ms = bench_ms(call, device, args.rep)
            results.append({"T": T, "provider": name, "ms": ms})
            line.append(f"{name} {ms:9.2f} ms")
        for name in ["select_k32", "select_tile", "select_forests_torch"] + [f"tile_{r}x{c}" for r, c in shapes] + [
            f"select_dc{n}" for n in args.dim_chunks
        ] + [f"select_mr{n}" for n in args.maxnregs]:
            if "select" not in out or name not in out:
                continue
            differ = (out["select"] != out[name]).any(-1)
            record = {"T": T, "provider": name, "differs_from_select": float(differ.float().mean())}
            if args.audit and bool(differ.any()) and T <= 262144:  # (the float64 audit of a 1M row takes long)
                entries = [tuple(int(x) for x in e) for e in differ.nonzero()[: args.audit].tolist()]
                record["audited_margins"] = [r["margin"] for r in near_tie_audit(q, k, cfg, entries)]
                line.append(f"{name} max margin {max(record['audited_margins']):.3g}")
            results.append(record)
            line.append(f"{name} differs {record['differs_from_select']:.4%}")
        print(f"T={T:>8}: " + " | ".join(line) + f"  ({time.perf_counter() - t_start:.0f} s)", flush=True)
        del q, k, out, parts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload = {
        "env": _versions(device),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "freesolo_config": {k: getattr(base, k) for k in ("window", "cell", "block", "beam", "top_k", "leaf_order")},
        "timing": BENCH_TIMING,
        "results": results,
    }
    if args.out:
        write_results(args.out, payload, _plot)
    return 0


def _plot(payload, path):
    rows = [r for r in payload["results"] if "ms" in r]
    series = {name: [(r["T"], r["ms"]) for r in rows if r["provider"] == name] for name in dict.fromkeys(r["provider"] for r in rows)}
    shape = payload["shape"]
    title = f"{payload['env'].get('gpu')}: FS-B prefill selection, B {shape['B']}, H {shape['Hq']}, D {shape['D']}, {payload['dtype']}"
    plot_lines(series, path, "T", "ms (median)", title)


if __name__ == "__main__":
    raise SystemExit(main())
