"""GPU benchmark of the fused Triton forward (issue 10): `attention_forward` on precomputed selections
against FlexAttention SWA-512 (compiled) and SDPA causal, plus a sweep of tile sizes.

Per length T (B = 1, bf16, Hq = Hkv = 16, D = 64 unless told; medians of `triton.testing.do_bench`):
- `triton_fwd`: the whole forward (tile unions + RoPE of k + fused kernel) on indices of the torch
  backend's selection (selection precomputed, not timed); `kernel`: the fused kernel alone;
  `unions`: the union sort alone; for FS-L and FS, on iid keys and on keys with a lognormal norm
  spread (`skewed`: selections concentrate), with the mean / max distinct cells of a tile's union;
- `flex_swa512`: torch.nn.attention.flex_attention compiled, causal sliding window 512, fwd;
- `sdpa_causal`: scaled_dot_product_attention(is_causal=True), fwd.
Ratios triton_fwd / flex and triton_fwd / sdpa are printed and saved. `--sweep` times the kernel
for several AttentionTiles at the longest length (tile choice for `default_tiles`).
A correctness line compares the bf16 output with the torch backend (float32, same idx).

Usage (GPU machine, repository root; about 1-2 minutes on an H200):
    python benchmarks/triton_attention_bench.py --out benchmarks/results/triton_attention.json --sweep
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import backend as torch_backend  # noqa: E402
from freesolo.backends.torch._ops import rope_tables  # noqa: E402
from freesolo.backends.triton._common import rope_rotate  # noqa: E402
from freesolo.backends.triton.attention import (  # noqa: E402
    AttentionTiles,
    attention_forward,
    default_tiles,
    forward_unions,
    launch_forward,
)

WINDOW = 512
SWEEP = [  # (block_m, block_n, num_warps, num_stages, prefetch of the long loop, window phases)
    AttentionTiles(64, 64, 8, 2),
    AttentionTiles(64, 64, 8, 2, True, False),
    AttentionTiles(64, 64, 4, 2, True, False),
    AttentionTiles(64, 64, 4, 3, True, False),
    AttentionTiles(64, 64, 8, 2, False),
    AttentionTiles(64, 64, 4, 2),
    AttentionTiles(64, 64, 4, 2, False),
    AttentionTiles(32, 64, 4, 2, False),
    AttentionTiles(64, 64, 8, 3),
    AttentionTiles(64, 64, 4, 3),
    AttentionTiles(64, 128, 8, 2),
    AttentionTiles(64, 32, 4, 2),
    AttentionTiles(128, 64, 8, 2),
    AttentionTiles(128, 32, 8, 2),
    AttentionTiles(32, 64, 4, 2),
    AttentionTiles(32, 32, 2, 2),
    AttentionTiles(16, 64, 4, 2),
]


def _versions() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def gpu_payload(**fields) -> dict:
    """The start of a GPU A/B script's run: exits without CUDA, raises dynamo's recompile limits
    (FlexAttention compiles once per shape), prints the GPU / versions / commit line, and returns
    {"env": gpu_attention._versions(...), **fields} for the JSON."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    from gpu_attention import _versions as gpu_versions

    payload = {"env": gpu_versions(torch.device("cuda")), **fields}
    env = payload["env"]
    print(f"GPU: {env['gpu']} | torch {env['torch']} | triton {env['triton']} | commit {env['git_commit']}", flush=True)
    return payload


def _bench(fn, rep: int) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median"))


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn captured once in a CUDA graph (two warm-up calls on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn, rep: int) -> float:
    """GPU time of fn without its host work: fn captured in one CUDA graph, the replay timed (do_bench median)."""
    return _bench(capture_graph(fn).replay, rep)


def _inputs(T, Hq, Hkv, D, dtype, keys: str, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, Hq, D, device="cuda", generator=g)
    k = torch.randn(1, T, Hkv, D, device="cuda", generator=g)
    v = torch.randn(1, T, Hkv, D, device="cuda", generator=g)
    if keys == "skewed":  # per-token norm spread: a few high-norm cells attract most selections
        k = k * torch.exp(0.5 * torch.randn(1, T, Hkv, 1, device="cuda", generator=g))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def triton_case(T, Hq, Hkv, D, dtype, rep, variant, keys, check=False) -> dict:
    cfg = FreeSoloConfig(variant=variant, window=WINDOW)
    q, k, v = _inputs(T, Hq, Hkv, D, dtype, keys)
    t0 = time.perf_counter()
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    torch.cuda.synchronize()
    res = {"selection_s_torch": time.perf_counter() - t0}
    beta = torch.ones(Hq, device="cuda", dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    tiles = default_tiles(D, dtype, q.device)
    unions = forward_unions(idx, cfg, tiles)
    full = unions.count[:, (T // 2) // tiles.union_rows :].float()  # tiles of the second half
    res["tiles"] = list(tiles.__dict__.values())
    res["union_mean"], res["union_max"] = float(full.mean()), int(full.max())
    res["fwd_ms"] = _bench(lambda: attention_forward(q, k, v, idx, beta, cos, sin, cfg), rep)
    res["unions_ms"] = _bench(lambda: forward_unions(idx, cfg, tiles), rep)
    res["rope_k_ms"] = _bench(lambda: rope_rotate(k, cos, sin), rep)
    res["kernel+rope_ms"] = _bench(lambda: launch_forward(q, k, v, idx, unions, beta, cos, sin, cfg, tiles), rep)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attention_forward(q, k, v, idx, beta, cos, sin, cfg)
    torch.cuda.synchronize()
    res["peak_gib_beyond_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    if check:
        o = attention_forward(q, k, v, idx, beta, cos, sin, cfg)[0].double()
        ref = torch_backend.attention(q.float(), k.float(), v.float(), cfg, beta, idx=idx).double()
        res["rms_rel_vs_torch_fp32"] = float((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    return res


def sweep(T, Hq, Hkv, D, dtype, rep, variant="fsl", keys="iid") -> list:
    cfg = FreeSoloConfig(variant=variant, window=WINDOW)
    q, k, v = _inputs(T, Hq, Hkv, D, dtype, keys)
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    beta = torch.ones(Hq, device="cuda", dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    out = []
    ref = None
    for tiles in SWEEP:
        try:
            unions = forward_unions(idx, cfg, tiles)
            fn = lambda: launch_forward(q, k, v, idx, unions, beta, cos, sin, cfg, tiles)  # noqa: E731
            o = fn()[0].float()
            ref = o if ref is None else ref
            err = float((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
            row = {"tiles": list(tiles.__dict__.values()), "kernel+rope_ms": _bench(fn, rep), "rms_vs_first": err}
        except Exception as e:  # noqa: BLE001 (a tile that does not compile / fit is reported, not fatal)
            row = {"tiles": list(tiles.__dict__.values()), "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print("   sweep", json.dumps(row), flush=True)
        out.append(row)
    return out


def sdpa_causal(T, Hq, Hkv, D, dtype, rep) -> float:
    q, k, v = (x.transpose(1, 2).contiguous() for x in _inputs(T, Hq, Hkv, D, dtype, "iid"))

    def fwd():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)

    return _bench(fwd, rep)


def flex_swa512(T, Hq, Hkv, D, dtype, rep) -> float:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:  # block-index construction of benchmarks/gpu_attention.py (no dense T x T mask evaluation)
        from gpu_attention import swa_block_mask

        mask = swa_block_mask(T, "cuda")
    except Exception:  # noqa: BLE001

        def swa(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

        mask = create_block_mask(swa, None, None, T, T, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    q, k, v = (x.transpose(1, 2).contiguous() for x in _inputs(T, Hq, Hkv, D, dtype, "iid"))

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, block_mask=mask, enable_gqa=Hq != Hkv)

    return _bench(fwd, rep)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--variants", nargs="+", default=["fsl", "fs"])
    ap.add_argument("--keys", nargs="+", default=["iid", "skewed"])
    ap.add_argument("--sweep", action="store_true", help="time several AttentionTiles at the longest length")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    payload = {"versions": _versions(), "shape": dict(B=1, Hq=H, Hkv=Hkv, D=D, dtype=args.dtype), "results": {}}
    print(json.dumps(payload["versions"]), flush=True)
    t_start = time.perf_counter()
    for T in args.lengths:
        row = {}
        if not args.no_baselines:
            row["sdpa_causal_ms"] = sdpa_causal(T, H, Hkv, D, dtype, args.rep)
            row["flex_swa512_ms"] = flex_swa512(T, H, Hkv, D, dtype, args.rep)
        for variant in args.variants:
            for keys in args.keys:
                if variant == "fs" and keys == "skewed" and T > 16384:
                    continue  # FS selection by the torch backend is quadratic: keep the run short
                name = f"triton_{variant}_{keys}"
                r = triton_case(T, H, Hkv, D, dtype, args.rep, variant, keys, check=(T == args.lengths[0]))
                if not args.no_baselines:
                    r["ratio_vs_flex"] = r["fwd_ms"] / row["flex_swa512_ms"]
                    r["ratio_vs_sdpa"] = r["fwd_ms"] / row["sdpa_causal_ms"]
                row[name] = r
                line = (
                    f"T={T:6d} {name:20s} fwd {r['fwd_ms']:.3f} ms (kernel+rope {r['kernel+rope_ms']:.3f}, "
                    f"rope_k {r['rope_k_ms']:.3f}, unions {r['unions_ms']:.3f}) union cells/tile "
                    f"{r['union_mean']:.1f} (max {r['union_max']}) peak {r['peak_gib_beyond_inputs']:.3f} GiB"
                )
                if not args.no_baselines:
                    line += f" | /flex {r['ratio_vs_flex']:.2f}  /sdpa {r['ratio_vs_sdpa']:.3f}"
                if "rms_rel_vs_torch_fp32" in r:
                    line += f" | rms-rel vs torch fp32 {r['rms_rel_vs_torch_fp32']:.2e}"
                print(line, flush=True)
        if not args.no_baselines:
            print(f"T={T:6d} sdpa_causal {row['sdpa_causal_ms']:.3f} ms  flex_swa512 {row['flex_swa512_ms']:.3f} ms")
        payload["results"][str(T)] = row
    if args.sweep:
        T = max(args.lengths)
        print(f"tile sweep at T={T} (fsl, iid keys): [block_m, block_n, num_warps, num_stages]", flush=True)
        payload["sweep"] = {"T": T, "rows": sweep(T, H, Hkv, D, dtype, args.rep)}
    payload["wall_s"] = time.perf_counter() - t_start
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
        print("saved", args.out)
    print(f"wall {payload['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
