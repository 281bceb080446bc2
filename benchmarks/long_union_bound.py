"""How fast could the Triton forward's long readout be if no query read a cell it did not select?
(issue 10: the 4k and 64k bars; s50)

The long kernel (`attention._long_fwd_kernel`) gives each tile of 64 queries the union of the
cells they selected. Every query reads every cell of that union, and the cells it did not select
are masked. On iid keys that union holds 14-18 cells at 4k, so a query reads about 500 key pairs
where it needs 4 x 32 = 128 (`long_tile_steps.py`).

This script times the long kernel alone on two selections of the same q, k, v:
- **real:** the triton backend's FS-L selection (`select_cells`);
- **shared:** every query of a 64-query tile takes the selection of the tile's first query. Each
  union then holds at most 4 cells, so a query reads only the pairs it needs. That is the work an
  inverted readout (cells outside, their readers inside) would do, before the partial results it
  must merge.

It also times the window kernel alone (with its RoPE of k) on the same inputs, and reports the
mean union size of each selection. B 1, H 16, D 64, bf16. Median of `triton.testing.do_bench`.

    python benchmarks/long_union_bound.py --out $OUT/long_union_bound.json      # GPU, ~30 s
    python benchmarks/long_union_bound.py --dry-run --out /tmp/long_union_bound.json
"""

from __future__ import annotations

import argparse
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_attention import _versions, bench_ms, plot_bars, smoke_or_gpu, write_results  # noqa: E402 (benchmarks/ is this script's folder)

import freesolo  # noqa: E402
from freesolo.backends.torch._ops import rope_tables  # noqa: E402
from freesolo.backends.triton import attention  # noqa: E402

__all__ = ["shared_selection", "main"]


def shared_selection(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """idx [B, T, H, K] -> the same shape, where each query of a tile of `rows` consecutive positions
    holds the selection of the tile's first query. That query lies in the same query block as the
    rest of its tile (rows divides the block), so its cells are available to all of them. The last
    partial tile takes its own first query's selection too."""
    B, T, H, K = idx.shape
    first = torch.arange(T, device=idx.device) // rows * rows  # [T]: the first position of each tile
    return idx[:, first].contiguous()


def time_case(T: int, device, dtype, rep_ms: int, H: int, D: int, cfg) -> list:
    """-> records {T, selection, kernel, ms, mean_union} of the long kernel on the real and the shared
    selection and of the window kernel."""
    gen = torch.Generator(device=device).manual_seed(T)
    q, k, v = (torch.randn(1, T, H, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    beta = torch.full((H,), 0.5, dtype=torch.float32, device=device)
    cos, sin = rope_tables(T, D, cfg.rope_theta, device, torch.float32)
    tiles = attention.default_tiles(D, dtype, device)
    if tiles.long_block == 0:
        raise SystemExit(
            f"the default tiles on {device} run the long branch inside the window kernel: nothing to time apart"
        )
    idx = (
        torch.as_tensor(freesolo.select_cells(q, k, cfg, backend="triton", check_finite=False)).to(device).contiguous()
    )
    records = []
    for name, sel in (("real", idx), ("shared", shared_selection(idx, tiles.union_rows))):
        unions = attention.forward_unions(sel, cfg, tiles)
        outputs = attention._outputs(q, tiles, save_stats=False)
        outputs[0].zero_()  # the long kernel adds its term to o (window_first)

        def long_only(sel=sel, unions=unions, outputs=outputs):
            attention._launch_long(q, k, v, sel, unions, beta, cfg, tiles, outputs)

        long_only()
        ms = bench_ms(long_only, device, rep_ms)
        mean_union = float(unions.count.float().mean())
        records.append(dict(T=T, selection=name, kernel="long", ms=ms, mean_union=mean_union))
        print(f"T={T:>7} {name:<6} long kernel {ms * 1000:9.1f} us  mean union {mean_union:5.2f} cells", flush=True)
        if name == "real":

            def window_only(sel=sel, unions=unions, outputs=outputs):
                attention._launch_window(q, k, v, sel, unions.union, unions.count, beta, cos, sin, cfg, tiles, outputs)

            window_only()
            ms = bench_ms(window_only, device, rep_ms)
            records.append(dict(T=T, selection=name, kernel="window+rope", ms=ms, mean_union=None))
            print(f"T={T:>7} {name:<6} window + RoPE {ms * 1000:7.1f} us", flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny CPU smoke test (interpreter)")
    args = ap.parse_args()
    device, dtype = smoke_or_gpu(args.dry_run)
    H, D = (2, 16) if args.dry_run else (16, 64)
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    if args.dry_run:
        cfg = cfg.replace(window=32, cell=4, block=16, pool=8, recent=2)
        os.environ.setdefault(attention.ENV_LONG_BLOCK, "16")  # the CPU tiles keep the long branch fused
    lengths = [300] if args.dry_run else args.lengths
    records = [r for T in lengths for r in time_case(T, device, dtype, args.rep_ms, H, D, cfg)]
    payload = dict(env=_versions(device), dtype=str(dtype), B=1, H=H, D=D, keys="iid", config=repr(cfg),
                   rep_ms=args.rep_ms, results=records)  # fmt: skip

    def plot(data, png):
        values = {f"{r['T']} {r['kernel']} ({r['selection']})": r["ms"] * 1000 for r in data["results"]}
        plot_bars(values, png, "kernel time (us, median)", "FS-L long readout: real unions vs shared selections")

    write_results(args.out, payload, plot)


if __name__ == "__main__":
    main()
