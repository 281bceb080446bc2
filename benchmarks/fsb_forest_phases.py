"""Where the FS-B prefill forests (`build_row_forests`) spend their time on the GPU (issue 12).

Per length (B 1, H 16 MHA, D 64, bf16 keys, the default FS-B config, tau = median a_c per head), each
phase called alone on the same inputs, CUDA events, median of --reps calls:
  to_f32        the search's widening of the keys to float32 (`fsb_search._run`)
  stats32       `cell_stats` of the float32 keys (the tables' kbar and a)
  stats64       the keys widened to float64 and their `cell_stats` (codes and the tau test, spec §6.2)
  codes         `content_codes` of the float64 means
  table_all     `build_node_table` of the all-cells forest
  table_high    the high-norm cells' gather and `build_node_table` of their forest
  forests       the torch `build_row_forests` (every phase above but to_f32): the search's builder until s41
  stats_triton  `fsb_forests.row_cell_stats`: one Triton pass over the bf16 keys (stats32 + stats64 + to_f32)
  tables_triton `fsb_forests.cells_node_table` of both forests (table_all + table_high)
  forests_triton `fsb_forests.row_forests` on the bf16 keys: the search's builder since s41
Then a torch.profiler table of the CUDA kernels of one call of each builder at the longest length (the
torch one with the keys' float32 copy that the search made for it), and the peak memory of one call.
    python benchmarks/fsb_forest_phases.py --lengths 262144 1048576 --out results/fsb_forest_phases.json
`--dry-run`: CPU, T = 256: plumbing only.
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

from gpu_attention import _tau, _versions, smoke_or_gpu, write_json  # noqa: E402 (benchmarks/ is this script's folder)

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch._ops import cell_stats  # noqa: E402
from freesolo.backends.torch.fsb import build_node_table, build_row_forests, content_codes  # noqa: E402
from freesolo.backends.triton import fsb_forests  # noqa: E402
from freesolo.reference.forest import hyperplanes  # noqa: E402

__all__ = ["main"]

SHAPE = {"B": 1, "H": 16, "D": 64}


def _time_ms(fn, device, reps: int) -> float:
    """Median milliseconds of fn over reps calls (one warm-up call first)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _phases(k_rows: torch.Tensor, k32: torch.Tensor, cfg: FreeSoloConfig) -> dict:
    """{phase: zero-argument callable} on k_rows [1, Hkv, T, D] (storage dtype) and k32 (its float32 copy),
    the inputs of later phases precomputed."""
    Hkv, D = k32.shape[1], k32.shape[3]
    dev = k32.device
    planes = torch.as_tensor(hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D), device=dev)
    tau = torch.as_tensor(cfg.tau_array(Hkv), dtype=torch.float64, device=dev)
    kbar, a = cell_stats(k32, cfg.cell)
    kbar64, a64 = cell_stats(k32.to(torch.float64), cfg.cell)
    codes = content_codes(kbar64, planes)
    C = a.shape[-1]
    cells = torch.arange(C, device=dev).expand(1, Hkv, C)
    high = a64 > tau.view(1, Hkv, 1)
    order = torch.sort((~high).to(torch.int8), dim=-1, stable=True).indices
    Mh = int(high.sum(dim=-1).max())
    hc = order[:, :, :Mh]

    def table_high():
        return build_node_table(
            torch.gather(kbar, 2, hc[..., None].expand(1, Hkv, Mh, D)), torch.gather(a, 2, hc), hc,
            torch.gather(codes, 2, hc), Mh, cfg, True,
        )  # fmt: skip

    def tables_triton():
        fsb_forests.cells_node_table(kbar, a, None, codes, C, cfg, True)
        fsb_forests.cells_node_table(kbar, a, hc, torch.gather(codes, 2, hc), Mh, cfg, True)

    return {
        "stats32": lambda: cell_stats(k32, cfg.cell),
        "stats64": lambda: cell_stats(k32.to(torch.float64), cfg.cell),
        "codes": lambda: content_codes(kbar64, planes),
        "table_all": lambda: build_node_table(kbar, a, cells, codes, C, cfg, True),
        "table_high": table_high,
        "forests": lambda: build_row_forests(k32, cfg, outward=True),
        "stats_triton": lambda: fsb_forests.row_cell_stats(k_rows, cfg.cell),
        "tables_triton": tables_triton,
        "forests_triton": lambda: fsb_forests.row_forests(k_rows, cfg),
    }


def _kernel_table(fn, top: int) -> list:
    """[(kernel name, ms per call, launches)] of one call of fn under torch.profiler, the top ones by time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ms, n = rows.get(ev.name, (0.0, 0))
            rows[ev.name] = (ms + ev.device_time / 1e3, n + 1)
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name[:100], "ms": round(ms, 3), "launches": n} for name, (ms, n) in ordered]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[262144, 1048576])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25, help="kernels listed in the profiler table")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device, dtype = smoke_or_gpu(args.dry_run)
    lengths = [256] if args.dry_run else args.lengths
    shape = {"B": 1, "H": 2, "D": 16} if args.dry_run else SHAPE
    base = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=4) if args.dry_run else FreeSoloConfig(variant="fsb")
    results = []
    for T in lengths:
        gen = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(1, T, shape["H"], shape["D"], device=device, dtype=dtype, generator=gen)
        cfg = base.replace(tau=_tau(k, base))
        k_rows = k.permute(0, 2, 1, 3).contiguous()
        k32 = k_rows.to(torch.float32)
        rec = {"T": T, **shape, "dtype": str(dtype).replace("torch.", ""), "ms": {}}
        rec["ms"]["to_f32"] = _time_ms(lambda: k_rows.to(torch.float32), device, args.reps)
        for name, fn in _phases(k_rows, k32, cfg).items():
            rec["ms"][name] = _time_ms(fn, device, args.reps)
        builders = {"torch": lambda: build_row_forests(k_rows.to(torch.float32), cfg, outward=True),
                    "triton": lambda: fsb_forests.row_forests(k_rows, cfg)}  # fmt: skip
        for name, build in builders.items() if device.type == "cuda" else ():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            build()
            torch.cuda.synchronize()
            rec[f"peak_extra_gib_{name}"] = (torch.cuda.max_memory_allocated() - before) / 2**30
            if T == max(lengths):
                rec[f"kernels_{name}"] = _kernel_table(build, args.top)
        peaks = " | ".join(f"{key} {v:.2f}" for key, v in rec.items() if key.startswith("peak_extra_gib"))
        print(f"T={T:>8}: " + " | ".join(f"{n} {v:8.2f} ms" for n, v in rec["ms"].items()) + (f" | {peaks}" if peaks else ""), flush=True)
        for name in builders:
            for row in rec.get(f"kernels_{name}", []):
                print(f"    [{name}] {row['ms']:9.3f} ms x {row['launches']:4d}  {row['name']}")
        results.append(rec)
        del k, k_rows, k32
    if args.out:
        write_json(args.out, {"env": _versions(device), "config": "FreeSoloConfig(variant='fsb'), tau = median a_c", "results": results})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
