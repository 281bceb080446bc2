"""A/B benchmark of the Triton forward (issue 10): the old configuration (long branch fused into
the window kernel over 64-query unions, no register cap) against the new switches of
`freesolo.backends.triton.attention.AttentionTiles` (`long_block`: the long branch in its own
kernel over smaller tiles with their own unions; `maxnreg`: register cap of the window kernel),
with SDPA causal and FlexAttention sliding-window 512 (compiled) timed in the same run.

1. Sweep (FS-L, iid keys, H16 D64 bf16, T = 65536): the fused + window kernels of every candidate
   configuration (`SWEEP`) on the same selection; the fastest is "new" for the rest of the run
   (or --new NAME).
2. Per shape and length (B1 H16 D64 at 4096, 16384, 65536; GQA Hq32 Hkv8 D128 at 16384, 65536),
   for FS-L and FS: the whole forward through the public API (`freesolo.freesolo_attention`,
   backend "triton", old / new set by the environment switches that `default_tiles` reads), and
   the breakdown: selection (`select_cells`, Triton), unions (`tile_unions`), kernels
   (`launch_forward`: RoPE of k + long + window kernels); the rms-rel difference new vs old.
3. sdpa_causal and flex_swa512 (helpers of benchmarks/triton_attention_bench.py).

Medians of triton.testing.do_bench (--rep ms). Writes JSON (--out: gpu, torch / triton versions,
date, git commit, shapes, medians) and prints a table with the issue's bars: FS-L 64k <= 3x Flex,
FS-L 4k <= SDPA, FS 64k <= 0.25x SDPA. About 1-2 minutes on an H200 (compiles included):
    python benchmarks/triton_forward_ab.py --out $OUT/triton_forward_ab.json
or in two shorter runs:
    python benchmarks/triton_forward_ab.py --sweep-only --out $OUT/ab_sweep.json
    python benchmarks/triton_forward_ab.py --skip-sweep --new long16w4+maxnreg128 --out $OUT/ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton_attention_bench import _bench, _inputs, flex_swa512, gpu_payload, sdpa_causal  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton.backend import rope_cos_sin  # noqa: E402
from freesolo.backends.triton.selection import select_cells  # noqa: E402

__all__ = ["LENGTHS", "SHAPES", "SWEEP", "case", "env_tiles", "kernels_call", "main", "old_tiles", "sweep"]

SHAPES = {"H16-D64": (16, 16, 64), "GQA-Hq32-Hkv8-D128": (32, 8, 128)}
LENGTHS = {"H16-D64": [4096, 16384, 65536], "GQA-Hq32-Hkv8-D128": [16384, 65536]}
# name -> AttentionTiles changes applied to the old (base) tiles of the shape
SWEEP = {
    "fused+maxnreg128": dict(maxnreg=128),
    "long16w4+maxnreg128": dict(long_block=16, long_warps=4, maxnreg=128),
    "long16w4-noprefetch+maxnreg128": dict(long_block=16, long_warps=4, prefetch=False, maxnreg=128),
    "long32w4+maxnreg128": dict(long_block=32, long_warps=4, maxnreg=128),
    "long64w4+maxnreg128": dict(long_block=64, long_warps=4, maxnreg=128),  # the 16-bit default since s17
    # s21: the window kernel's own tiles around the default (block_m, block_n, warps, stages)
    "long64w8+maxnreg128": dict(long_block=64, long_warps=8, maxnreg=128),
    "win128x64w8s2": dict(long_block=64, long_warps=4, maxnreg=128, block_m=128, block_n=64, num_warps=8, num_stages=2),
    "win128x32w8s3": dict(long_block=64, long_warps=4, maxnreg=128, block_m=128, block_n=32, num_warps=8, num_stages=3),
    "win128x64w8s2-nocap": dict(long_block=64, long_warps=4, block_m=128, block_n=64, num_warps=8, num_stages=2),
    "win64x64w4s2": dict(long_block=64, long_warps=4, maxnreg=128, block_m=64, block_n=64, num_warps=4, num_stages=2),
    "win64x64w4s3": dict(long_block=64, long_warps=4, maxnreg=128, block_m=64, block_n=64, num_warps=4, num_stages=3),
    "win64x64w8s3": dict(long_block=64, long_warps=4, maxnreg=128, block_m=64, block_n=64, num_warps=8, num_stages=3),
    "win64x128w8s2": dict(long_block=64, long_warps=4, maxnreg=128, block_m=64, block_n=128, num_warps=8, num_stages=2),
    "win128x128w8s2": dict(long_block=64, long_warps=4, maxnreg=128, block_m=128, block_n=128, num_warps=8, num_stages=2),
    # s24: the long kernel writing into o (the default since s24) by tile rows and warps
    "long64w4-into": dict(long_block=64, long_warps=4, maxnreg=128, long_into_out=True),  # the s24 default
    "long64w2-into": dict(long_block=64, long_warps=2, maxnreg=128, long_into_out=True),
    "long32w2-into": dict(long_block=32, long_warps=2, maxnreg=128, long_into_out=True),
    "long32w4-into": dict(long_block=32, long_warps=4, maxnreg=128, long_into_out=True),
    "long16w1-into": dict(long_block=16, long_warps=1, maxnreg=128, long_into_out=True),
    "long16w2-into": dict(long_block=16, long_warps=2, maxnreg=128, long_into_out=True),
    "long64w4-into-noprefetch": dict(long_block=64, long_warps=4, maxnreg=128, long_into_out=True, prefetch=False),
    # (s24's long-kernel sub-tiles, 2.5x slower at 64k in s25 call1, were removed)
}


def old_tiles(D: int, dtype) -> att.AttentionTiles:
    """The configuration before issue 10: fused long loop, no register cap."""
    base = att.default_tiles(D, dtype, torch.device("cuda"))
    return dataclasses.replace(base, long_block=0, maxnreg=None, long_warps=4, long_into_out=False)


@contextlib.contextmanager
def env_tiles(tiles: att.AttentionTiles):
    """Make `default_tiles` (hence the public API) return `tiles`' long_block / maxnreg."""
    saved = {k: os.environ.get(k) for k in (att.ENV_LONG_BLOCK, att.ENV_MAXNREG)}
    os.environ[att.ENV_LONG_BLOCK] = str(tiles.long_block)
    os.environ[att.ENV_MAXNREG] = str(tiles.maxnreg or 0)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rms_rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def kernels_call(q, k, v, idx, cfg, tiles):
    """() -> launch_forward on precomputed unions (RoPE of k + long + window kernels), and the unions."""
    beta = torch.ones(q.shape[2], device=q.device, dtype=torch.float32)
    cos, sin = rope_cos_sin(q.shape[1], q.shape[3], cfg.rope_theta, q.device)
    unions = att.forward_unions(idx, cfg, tiles)
    return lambda: att.launch_forward(q, k, v, idx, unions, beta, cos, sin, cfg, tiles)


def sweep(rep: int, names=None) -> dict:
    """Kernel time (unions precomputed) of old and every SWEEP configuration, FS-L, 64k, H16 D64."""
    T, (Hq, Hkv, D) = 65536, SHAPES["H16-D64"]
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    q, k, v = _inputs(T, Hq, Hkv, D, torch.bfloat16, "iid")
    idx = select_cells(q, k, cfg)
    old = old_tiles(D, q.dtype)
    ref = kernels_call(q, k, v, idx, cfg, old)()[0]
    rows = {"old": {"tiles": dataclasses.asdict(old), "kernels_ms": _bench(kernels_call(q, k, v, idx, cfg, old), rep)}}
    print(f"sweep T={T} FS-L H16-D64 kernels (unions precomputed): old {rows['old']['kernels_ms']:.3f} ms", flush=True)
    for name, change in SWEEP.items():
        if names and name not in names:
            continue
        tiles = dataclasses.replace(old, **change)
        try:
            fn = kernels_call(q, k, v, idx, cfg, tiles)
            err = _rms_rel(fn()[0], ref)
            row = {"tiles": dataclasses.asdict(tiles), "kernels_ms": _bench(fn, rep), "rms_rel_vs_old": err}
            print(f"  {name:34s} {row['kernels_ms']:.3f} ms  rms-rel vs old {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 (a configuration that fails is reported, not fatal)
            row = {"tiles": dataclasses.asdict(tiles), "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name:34s} ERROR {row['error']}", flush=True)
        rows[name] = row
    return rows


def case(variant, T, Hq, Hkv, D, rep, tiles_old, tiles_new) -> dict:
    cfg = freesolo.FreeSoloConfig(variant=variant)
    q, k, v = _inputs(T, Hq, Hkv, D, torch.bfloat16, "iid")
    res = {}
    outs = {}
    for tag, tiles in (("old", tiles_old), ("new", tiles_new)):
        with env_tiles(tiles):

            def api():
                with torch.no_grad():
                    return freesolo.freesolo_attention(q, k, v, cfg, backend="triton")

            outs[tag] = api()
            res[f"api_{tag}_ms"] = _bench(api, rep)
    res["rms_rel_new_vs_old"] = _rms_rel(outs["new"], outs["old"])
    idx = select_cells(q, k, cfg)
    res["selection_ms"] = _bench(lambda: select_cells(q, k, cfg), rep)
    for tag, tiles in (("old", tiles_old), ("new", tiles_new)):
        res[f"unions_{tag}_ms"] = _bench(lambda tiles=tiles: att.forward_unions(idx, cfg, tiles), rep)
        res[f"kernels_{tag}_ms"] = _bench(kernels_call(q, k, v, idx, cfg, tiles), rep)
        if tag == "old" or tiles.union_rows != tiles_old.union_rows:
            count = att.forward_unions(idx, cfg, tiles).count
            res[f"union_cells_{tag}"] = float(count[:, count.shape[1] // 2 :].float().mean())  # second half
        else:
            res[f"union_cells_{tag}"] = res["union_cells_old"]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep (ms)")
    ap.add_argument("--new", default=None, choices=list(SWEEP), help="new configuration (default: the sweep's fastest)")
    ap.add_argument("--skip-sweep", action="store_true", help="no sweep (needs --new)")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep at 64k")
    ap.add_argument("--sweep-names", nargs="+", default=None, choices=list(SWEEP), help="sweep these only (default: all)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["fsl", "fs"])
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    payload = gpu_payload(dtype="bfloat16", B=1, keys="iid", rep_ms=args.rep)
    if args.skip_sweep and not args.new:
        sys.exit("--skip-sweep needs --new NAME")
    payload["sweep"] = {} if args.skip_sweep else sweep(args.rep, args.sweep_names)
    ok = {n: r["kernels_ms"] for n, r in payload["sweep"].items() if n != "old" and "kernels_ms" in r}
    new_name = args.new or (min(ok, key=ok.get) if ok else None)
    if new_name is None:
        sys.exit("every new configuration failed: see the sweep above")
    payload["new"] = new_name
    print(f"new = {new_name}", flush=True)
    payload["results"] = []
    if args.sweep_only:
        args.shapes = []
    for shape in args.shapes:
        Hq, Hkv, D = SHAPES[shape]
        t_old = old_tiles(D, torch.bfloat16)
        t_new = dataclasses.replace(t_old, **SWEEP[new_name])
        for T in LENGTHS[shape]:
            row = {"shape": shape, "Hq": Hq, "Hkv": Hkv, "D": D, "T": T}
            row["sdpa_causal_ms"] = sdpa_causal(T, Hq, Hkv, D, torch.bfloat16, args.rep)
            row["flex_swa512_ms"] = flex_swa512(T, Hq, Hkv, D, torch.bfloat16, args.rep)
            for variant in args.variants:
                row[variant] = case(variant, T, Hq, Hkv, D, args.rep, t_old, t_new)
            payload["results"].append(row)
            r = row
            print(
                f"{shape} T={T}: sdpa {r['sdpa_causal_ms']:.3f} ms, flex_swa512 {r['flex_swa512_ms']:.3f} ms",
                flush=True,
            )
            for variant in args.variants:
                c = r[variant]
                print(
                    f"  {variant:3s} api old {c['api_old_ms']:.3f} new {c['api_new_ms']:.3f} ms | selection "
                    f"{c['selection_ms']:.3f} | unions {c['unions_old_ms']:.3f}/{c['unions_new_ms']:.3f} | kernels "
                    f"{c['kernels_old_ms']:.3f}/{c['kernels_new_ms']:.3f} | cells/union {c['union_cells_old']:.1f}/"
                    f"{c['union_cells_new']:.1f} | new/flex {c['api_new_ms'] / r['flex_swa512_ms']:.2f} "
                    f"new/sdpa {c['api_new_ms'] / r['sdpa_causal_ms']:.3f} | rms-rel new-old {c['rms_rel_new_vs_old']:.1e}",
                    flush=True,
                )
    bars = {}
    for r in payload["results"]:
        if r["shape"] != "H16-D64":
            continue
        if r["T"] == 65536 and "fsl" in r:
            bars["fsl_64k_over_flex (<= 3)"] = r["fsl"]["api_new_ms"] / r["flex_swa512_ms"]
        if r["T"] == 4096 and "fsl" in r:
            bars["fsl_4k_over_sdpa (<= 1)"] = r["fsl"]["api_new_ms"] / r["sdpa_causal_ms"]
        if r["T"] == 65536 and "fs" in r:
            bars["fs_64k_over_sdpa (<= 0.25)"] = r["fs"]["api_new_ms"] / r["sdpa_causal_ms"]
    payload["bars"] = bars
    payload["wall_s"] = time.perf_counter() - t0
    print("bars:", json.dumps({k: round(v, 3) for k, v in bars.items()}))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print("saved", args.out)
    print(f"wall {payload['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
