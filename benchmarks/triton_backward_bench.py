"""GPU benchmark of the Triton FreeSolo backward (issue 11): readout fwd+bwd against SDPA causal and
FlexAttention SWA-512.

Providers (B = 1, bf16, Hq = Hkv = 16, D = 64 unless told otherwise; median of `do_bench`):
- `triton_fsl_det` / `triton_fsl_atomic`: `attention_forward` + `attention_backward` of
  freesolo/backends/triton on FS-L indices precomputed by the torch backend's selection (the selection
  is not timed here), deterministic (inverted selection) and atomic modes of the long branch's dk/dv;
  the backward alone is also timed (`bwd_ms`), and one call is profiled per kernel (`kernels_ms`);
- `triton_fsl_api`: the whole op through the backend's custom op (Triton selection included), autograd;
- `sdpa_causal`: torch.nn.functional.scaled_dot_product_attention(is_causal=True), fwd+bwd;
- `flex_swa512`: compiled FlexAttention with a causal sliding window of 512, fwd+bwd.
Same-run ratios (triton_fsl / sdpa, triton_fsl / flex) are printed and saved.

Usage (GPU machine, repository root; < 3 minutes on an H200):
    python benchmarks/triton_backward_bench.py --out benchmarks/results/triton_backward.json
    python benchmarks/triton_backward_bench.py --lengths 4096 --peak-T 1048576   # + peak memory of FS-L fwd+bwd at 1M
    python benchmarks/triton_backward_bench.py --lengths 16384 --sweep --no-baselines   # backward tile sweep
Without a GPU (any machine with triton): registers / spills of every backward kernel compiled for sm_90
    python benchmarks/triton_backward_bench.py --regs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import backend as torch_backend  # noqa: E402
from freesolo.backends.torch._ops import rope_tables  # noqa: E402

WINDOW = 512
DEV = "cuda"  # "cpu" in --dry-run (Triton interpreter, tiny sizes: checks the plumbing, not speed)


def _versions() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _bench(fn, rep: int) -> float:
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median"))


def _inputs(T, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, T, Hq, D, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(1, T, Hkv, D, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(1, T, Hkv, D, device=DEV, dtype=dtype, generator=g)
    do = torch.randn(1, T, Hq, D, device=DEV, dtype=dtype, generator=g)
    return q, k, v, do


def triton_fsl(T, Hq, Hkv, D, dtype, rep, cfg, profile=True) -> dict:
    from freesolo.backends.triton.attention import attention_forward
    from freesolo.backends.triton.attention_bwd import attention_backward

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    beta = torch.ones(Hq, device=DEV, dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    res = {}
    fwd = lambda: attention_forward(q, k, v, idx, beta, cos, sin, cfg)  # noqa: E731
    res["fwd_ms"] = _bench(fwd, rep)
    saved = fwd()
    for det in (True, False):
        name = "det" if det else "atomic"

        def bwd(det=det):
            return attention_backward(do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, deterministic=det)

        def both(det=det):
            o, ll, lg, rs = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
            return attention_backward(do, q, k, v, o, idx, beta, ll, lg, rs, cos, sin, cfg, deterministic=det)

        res[f"bwd_ms_{name}"] = _bench(bwd, rep)
        res[f"fwd+bwd_ms_{name}"] = _bench(both, rep)
        if DEV != "cuda":
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        both()
        torch.cuda.synchronize()
        res[f"peak_gib_{name}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if profile:
            res[f"kernels_ms_{name}"] = _kernel_breakdown(bwd)
    return res


def triton_fsl_api(T, Hq, Hkv, D, dtype, rep, cfg) -> dict:
    """The whole op through the backend's custom op (Triton selection included), fwd and fwd+bwd (autograd)."""
    from freesolo.backends.triton.backend import deterministic, triton_attention

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    for x in (q, k, v):
        x.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            triton_attention(q, k, v, cfg)

    res = {"fwd_ms": _bench(fwd, rep)}
    for det in (True, False):

        def both(det=det):
            with deterministic(det):
                triton_attention(q, k, v, cfg).backward(do)

        res["fwd+bwd_ms_" + ("det" if det else "atomic")] = _bench(both, rep)
    return res


def _kernel_breakdown(fn) -> dict:
    """CUDA time per kernel name (ms) of one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0:
            out[e.key[:80]] = round(t / 1e3, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def sdpa_causal(T, Hq, Hkv, D, dtype, rep) -> dict:
    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))  # (B, H, T, D)
    for x in (q, k, v):
        x.requires_grad_(True)
    gqa = Hq != Hkv

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def both():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        o.backward(do)

    return {"fwd_ms": _bench(fwd, rep), "fwd+bwd_ms": _bench(both, rep)}


def flex_swa512(T, Hq, Hkv, D, dtype, rep) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:  # the block-index construction of benchmarks/gpu_attention.py (no dense T x T evaluation)
        from gpu_attention import swa_block_mask

        mask = swa_block_mask(T, "cuda")
    except Exception:  # noqa: BLE001

        def swa(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

        mask = create_block_mask(swa, None, None, T, T, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    for x in (q, k, v):
        x.requires_grad_(True)
    gqa = Hq != Hkv

    def fwd():
        with torch.no_grad():
            fn(q, k, v, block_mask=mask, enable_gqa=gqa)

    def both():
        fn(q, k, v, block_mask=mask, enable_gqa=gqa).backward(do)

    return {"fwd_ms": _bench(fwd, rep), "fwd+bwd_ms": _bench(both, rep)}


def peak_memory(T, Hq, Hkv, D, dtype, cfg) -> dict:
    """Peak memory (GiB, beyond the inputs and the selection) of one FS-L fwd+bwd (deterministic) at T."""
    from freesolo.backends.triton.attention import attention_forward
    from freesolo.backends.triton.attention_bwd import attention_backward

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    t0 = time.perf_counter()
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    torch.cuda.synchronize()
    sel_s = time.perf_counter() - t0
    beta = torch.ones(Hq, device=DEV, dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    o, ll, lg, rs = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
    g = attention_backward(do, q, k, v, o, idx, beta, ll, lg, rs, cos, sin, cfg, deterministic=True)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(x).all()) for x in g)
    return {
        "T": T,
        "peak_gib_beyond_inputs": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "inputs_gib": base / 2**30,
        "fwd+bwd_s_first_call": time.perf_counter() - t0,
        "selection_s": sel_s,
        "grads_finite": finite,
    }


SWEEP = [  # (kv_block_n, kv_block_m, q_block_m, q_block_n, num_warps, num_stages)
    (64, 32, 64, 32, 8, 2),
    (128, 32, 128, 32, 8, 2),
    (128, 16, 128, 16, 8, 2),
    (64, 64, 64, 64, 8, 2),
    (64, 32, 64, 32, 4, 2),
    (64, 32, 64, 32, 8, 3),
    (32, 32, 32, 32, 4, 2),
]


def sweep(T, Hq, Hkv, D, dtype, rep, cfg) -> list:
    """Backward (deterministic) time per tile configuration of the local kernels, and per `seg` / `block_r`."""
    import dataclasses

    from freesolo.backends.triton.attention import attention_forward
    from freesolo.backends.triton.attention_bwd import attention_backward, default_bwd_tiles

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    beta = torch.ones(Hq, device=DEV, dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    saved = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
    base = default_bwd_tiles(D, dtype, q.device)
    configs = [
        dataclasses.replace(base, kv_block_n=a, kv_block_m=b, q_block_m=c, q_block_n=d, num_warps=e, num_stages=f)
        for a, b, c, d, e, f in SWEEP
    ]
    configs += [dataclasses.replace(base, seg=sg, block_r=br) for sg, br in ((256, 32), (4096, 32), (1024, 16), (1024, 64))]
    configs += [dataclasses.replace(base, num_warps_long=4), dataclasses.replace(base, block_q=2, num_warps_long=8)]
    configs += [dataclasses.replace(base, long_mode="union", block_u=bu, num_warps_long=8) for bu in (64, 32, 128)]
    out = []
    for tiles in configs:
        try:
            ms = _bench(
                lambda: attention_backward(do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, tiles=tiles), rep
            )
        except Exception as e:  # noqa: BLE001 (a configuration that does not compile / fit is reported)
            ms = f"error: {type(e).__name__}: {str(e)[:120]}"
        if isinstance(ms, float) and tiles.long_mode == "union":  # the union mode also has cheaper atomics
            try:
                ms = {"det": ms, "atomic": _bench(
                    lambda: attention_backward(
                        do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, tiles=tiles, deterministic=False
                    ), rep)}  # fmt: skip
            except Exception as e:  # noqa: BLE001
                ms = {"det": ms, "atomic": f"error: {type(e).__name__}"}
        out.append({"tiles": dataclasses.asdict(tiles), "bwd_ms": ms})
        print("  sweep", dataclasses.asdict(tiles), ms, flush=True)
    return out


def regs_report(dtypes=("bf16", "fp16", "fp32"), dims=(32, 64, 128)) -> list:
    """Compile every backward kernel for sm_90 with the GPU default tiles (no GPU needed) and report
    registers / spill stack from cuobjdump: a register-pressure check before spending GPU time."""
    import os as _os
    import subprocess
    import tempfile

    if _os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--regs compiles real kernels: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import freesolo.backends.triton.attention_bwd as m

    cuobj = _os.path.join(_os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    rows = []

    def build(fn, sig, consts, num_warps, num_stages=3):
        src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kern.asm["cubin"])
        usage = subprocess.run([cuobj, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        line = next((x for x in usage.splitlines() if "REG:" in x), "")
        fields = dict(t.split(":", 1) for t in line.replace("Resource usage:", "").split() if ":" in t)
        return {"kernel": fn.__name__, "regs": int(fields.get("REG", -1)), "stack": int(fields.get("STACK", -1))}

    for dt in dtypes:
        for D in dims:
            P, F, I = f"*{dt}", "*fp32", "*i64"
            tiles = m.default_bwd_tiles(D, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt], torch.device("cuda"))
            ieee = dt == "fp32"
            half, bd, bh = D // 2, max(16, D), max(16, D // 2)
            res = []
            sig = dict(DO=P, Q=P, K=P, V=P, O=P, IDX=I, BETA=F, LSE_LONG=F, RSTD=F, DOLONG=P, DQLONG=F, DELTA_LOC=F,
                       DELTA_LONG=F, DBETA_PART=F, DK_ACC=F, DV_ACC=F, T="i32", NROWS="i32", scale="fp32")  # fmt: skip
            for atomic in (False, True):
                c = dict(HQ=16, HKV=4, D=D, TOPK=4, CELL=32, BLOCK_D=bd, BLOCK_KS=128, BLOCK_Q=tiles.block_q, ATOMIC=atomic)
                res.append(build(m._bwd_long_query_kernel, sig, c, tiles.num_warps_long))
            sig = dict(Q=P, K=P, V=P, DOLONG=P, LSE_LONG=F, DELTA_LONG=F, READERS=I, OFFSETS=I, WORK_CELL=I, WORK_SEG=I,
                       NSEG=I, PART_BASE=I, DK_ACC=F, DV_ACC=F, PART_DK=F, PART_DV=F, T="i32", C="i32", NCELLS="i32",
                       scale="fp32")  # fmt: skip
            c = dict(HQ=16, HKV=4, D=D, CELL=32, BLOCK_D=bd, BLOCK_C=32, BLOCK_R=tiles.block_r, SEG=tiles.seg, IEEE=ieee)
            res.append(build(m._bwd_long_cell_kernel, sig, c, tiles.num_warps_long))
            sig = dict(NSEG=I, PART_BASE=I, PART_DK=F, PART_DV=F, DK_ACC=F, DV_ACC=F, T="i32", C="i32")
            res.append(build(m._bwd_long_reduce_kernel, sig, dict(HKV=4, D=D, CELL=32, BLOCK_D=bd, BLOCK_C=32), 4))
            sig = dict(DO=P, Q=P, K=P, V=P, O=P, IDX=I, UNION="*i32", COUNT="*i32", BETA=F, LSE_LONG=F, RSTD=F,
                       DOLONG=P, DQLONG=F, DELTA_LOC=F, DELTA_LONG=F, DBETA_PART=F, DK_ACC=F, DV_ACC=F, T="i32",
                       NT="i32", scale="fp32")  # fmt: skip
            c = dict(HQ=16, HKV=4, D=D, TOPK=4, K_P=4, CELL=32, BLOCK_D=bd, BLOCK_C=32, BLOCK_M=tiles.block_u,
                     IEEE=ieee, ATOMIC=False)  # fmt: skip
            res.append(build(m._bwd_long_tile_kernel, sig, c, tiles.num_warps_long))
            common = dict(HQ=16, HKV=4, HALF=half, BLOCK_H=bh, IEEE=ieee)
            sig = dict(DO=P, Q=P, K=P, V=P, COS=F, SIN=F, LSE_LOC=F, DELTA_LOC=F, DK_LONG=F, DV_LONG=F, DK=P, DV=P,
                       T="i32", W="i32", scale="fp32")  # fmt: skip
            c = dict(common, BLOCK_M=tiles.kv_block_m, BLOCK_N=tiles.kv_block_n, HAS_LONG=True, NUM_M=18)
            res.append(build(m._bwd_local_dkdv_kernel, sig, c, tiles.num_warps, tiles.num_stages))
            sig = dict(DO=P, Q=P, K=P, V=P, COS=F, SIN=F, LSE_LOC=F, DELTA_LOC=F, DQ_LONG=F, DQ=P, T="i32", W="i32",
                       scale="fp32")  # fmt: skip
            c = dict(common, BLOCK_M=tiles.q_block_m, BLOCK_N=tiles.q_block_n, NUM_N=19)
            res.append(build(m._bwd_local_dq_kernel, sig, c, tiles.num_warps, tiles.num_stages))
            for r in res:
                r.update(dtype=dt, D=D)
                print(f"{dt:5s} D={D:3d} {r['kernel']:26s} regs {r['regs']:3d} spill stack {r['stack']} B", flush=True)
            rows += res
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--peak-T", type=int, default=0, help="also measure FS-L fwd+bwd peak memory at this T")
    ap.add_argument("--no-baselines", action="store_true", help="skip SDPA and FlexAttention")
    ap.add_argument("--sweep", action="store_true", help="backward tile sweep at the first length")
    ap.add_argument("--regs", action="store_true", help="no GPU: sm_90 registers / spills of every kernel, then exit")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, T=64, small config: plumbing only")
    args = ap.parse_args(argv)
    global DEV
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        DEV = "cpu"
        args.lengths, args.no_baselines, args.dtype, args.heads, args.kv_heads = [64], True, "float32", 2, 1
    if args.regs:
        rows = regs_report()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("needs a CUDA device (or --dry-run)")
    dtype = getattr(torch, args.dtype)
    cfg = FreeSoloConfig(variant="fsl", window=WINDOW)
    if args.dry_run:
        cfg = FreeSoloConfig(variant="fsl", window=16, cell=4, block=8, pool=3, recent=2)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    payload = {"versions": _versions(), "shape": dict(B=1, Hq=H, Hkv=Hkv, D=D, dtype=args.dtype), "results": {}}
    print(json.dumps(payload["versions"]))
    t_start = time.perf_counter()
    for T in args.lengths:
        row = {"triton_fsl": triton_fsl(T, H, Hkv, D, dtype, args.rep, cfg)}
        try:
            row["triton_fsl_api"] = triton_fsl_api(T, H, Hkv, D, dtype, args.rep, cfg)
        except Exception as e:  # noqa: BLE001 (the custom op is another module; report, do not stop)
            row["triton_fsl_api"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print("   with selection (custom op):", json.dumps(row["triton_fsl_api"]), flush=True)
        if not args.no_baselines:
            row["sdpa_causal"] = sdpa_causal(T, H, Hkv, D, dtype, args.rep)
            row["flex_swa512"] = flex_swa512(T, H, Hkv, D, dtype, args.rep)
            for mode in ("det", "atomic"):
                ours = row["triton_fsl"][f"fwd+bwd_ms_{mode}"]
                row[f"ratio_{mode}_vs_sdpa"] = ours / row["sdpa_causal"]["fwd+bwd_ms"]
                row[f"ratio_{mode}_vs_flex"] = ours / row["flex_swa512"]["fwd+bwd_ms"]
                api = row["triton_fsl_api"].get(f"fwd+bwd_ms_{mode}")
                if api is not None:
                    row[f"ratio_api_{mode}_vs_sdpa"] = api / row["sdpa_causal"]["fwd+bwd_ms"]
                    row[f"ratio_api_{mode}_vs_flex"] = api / row["flex_swa512"]["fwd+bwd_ms"]
        payload["results"][str(T)] = row
        tf = row["triton_fsl"]
        line = (
            f"T={T:6d}  triton_fsl fwd {tf['fwd_ms']:.3f}  bwd det {tf['bwd_ms_det']:.3f} / atomic {tf['bwd_ms_atomic']:.3f}"
            f"  fwd+bwd det {tf['fwd+bwd_ms_det']:.3f} / atomic {tf['fwd+bwd_ms_atomic']:.3f} ms"
        )
        if not args.no_baselines:
            line += (
                f"  | sdpa {row['sdpa_causal']['fwd+bwd_ms']:.3f}  flex {row['flex_swa512']['fwd+bwd_ms']:.3f} ms"
                f"  | det/sdpa {row['ratio_det_vs_sdpa']:.2f}  det/flex {row['ratio_det_vs_flex']:.2f}"
            )
        print(line, flush=True)
        print("   kernels (det):", json.dumps(tf.get("kernels_ms_det", {})), flush=True)
    if args.sweep:
        payload["sweep"] = sweep(args.lengths[0], H, Hkv, D, dtype, args.rep, cfg)
    if args.peak_T:
        payload["peak"] = peak_memory(args.peak_T, H, Hkv, D, dtype, cfg)
        print("peak:", json.dumps(payload["peak"]), flush=True)
    payload["wall_s"] = time.perf_counter() - t_start
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
