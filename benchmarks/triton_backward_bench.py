"""GPU benchmark of the Triton FreeSolo backward (issue 11): the backward before and after issue 11 in
ONE run, against SDPA causal and FlexAttention SWA-512.

Providers (B = 1, bf16, Hq = Hkv = 16, D = 64 unless told otherwise; median of `triton.testing.do_bench`):
- `triton_fsl[<variant>]`: `attention_forward` + `attention_backward` of freesolo/backends/triton on FS-L
  indices precomputed by the torch backend's selection (not timed), deterministic (`det`) and atomic
  modes; `bwd_ms_*` times the backward alone, `fwd+bwd_ms_*` both; `kernels_ms_det` is one profiled
  backward per kernel. Variants (BwdTiles fields over `default_bwd_tiles`):
    old            long_mode "gather" (det) / "union" (atomic), prerotate False: the backward before issue 11
    new            the defaults: long_mode "cell", prerotate True
    new_long_only  long_mode "cell", prerotate False (attribution: long branch change alone; det only)
- `triton_fsl_api[<variant>]`: the whole op through the backend's custom op (Triton selection included,
  autograd), deterministic, old = environment FREESOLO_TRITON_BWD_LONG=legacy, new = unset;
- `sdpa_causal`: torch.nn.functional.scaled_dot_product_attention(is_causal=True), fwd+bwd;
- `flex_swa512`: compiled FlexAttention with a causal sliding window of 512, fwd+bwd.
Same-run ratios and the issue-11 bars (64k: fwd+bwd <= SDPA / 6 and <= 4 x Flex; 4k: <= 2 x SDPA) are
printed and saved.

Usage (GPU machine, repository root; < 150 s on an H200):
    python benchmarks/triton_backward_bench.py --out $OUT/triton_backward.json
    python benchmarks/triton_backward_bench.py --lengths 16384 --sweep --no-baselines --out $OUT/sweep.json
    python benchmarks/triton_backward_bench.py --lengths 4096 --peak-T 1048576   # + peak memory at 1M
Without a GPU (any machine with triton): registers / spills of every backward kernel compiled for sm_90
    python benchmarks/triton_backward_bench.py --regs
CPU plumbing check (interpreter, tiny sizes, no timing meaning):
    TRITON_INTERPRET=1 python benchmarks/triton_backward_bench.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

import torch

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # eager kernels, as measured before the CUDA-graph cache (s33)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import backend as torch_backend  # noqa: E402
from freesolo.backends.torch._ops import rope_tables  # noqa: E402

WINDOW = 512
DEV = "cuda"  # "cpu" in --dry-run (Triton interpreter, tiny sizes: checks the plumbing, not speed)
ENV = "FREESOLO_TRITON_BWD_LONG"


def _git() -> dict:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = {}
    for key, cmd in (("commit", ["git", "rev-parse", "HEAD"]), ("status", ["git", "status", "--porcelain"])):
        try:
            out[key] = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception as e:  # noqa: BLE001 (a copy without .git: say so)
            out[key] = f"unavailable: {type(e).__name__}"
    out["commit"] = out["commit"] or os.environ.get("FREESOLO_GIT_COMMIT", "unknown (no .git)")
    out["dirty"] = bool(out.pop("status", ""))
    return out


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


def variant_tiles(name: str, det: bool, D: int, dtype):
    """BwdTiles of a named variant (see the module docstring)."""
    from freesolo.backends.triton.attention_bwd import default_bwd_tiles

    base = default_bwd_tiles(D, dtype, torch.device(DEV))
    if name == "old":
        return dataclasses.replace(base, long_mode="gather" if det else "union", prerotate=False)
    if name == "new":
        return dataclasses.replace(base, long_mode="cell", prerotate=True)
    if name == "new_long_only":
        return dataclasses.replace(base, long_mode="cell", prerotate=False)
    raise ValueError(f"unknown variant {name!r}")


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
    grads = {}
    plan = [("old", True), ("old", False), ("new", True), ("new", False), ("new_long_only", True)]
    for variant, det in plan:
        tiles = variant_tiles(variant, det, D, dtype)
        mode = "det" if det else "atomic"
        r = res.setdefault(variant, {"tiles": dataclasses.asdict(tiles) if det else None})
        if not det:
            r["tiles_atomic"] = dataclasses.asdict(tiles)

        def bwd(det=det, tiles=tiles):
            return attention_backward(
                do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, deterministic=det, tiles=tiles
            )

        def both(det=det, tiles=tiles):
            o, ll, lg, rs = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
            return attention_backward(
                do, q, k, v, o, idx, beta, ll, lg, rs, cos, sin, cfg, deterministic=det, tiles=tiles
            )

        grads[(variant, det)] = bwd()
        r[f"bwd_ms_{mode}"] = _bench(bwd, rep)
        if variant == "new_long_only":
            continue
        r[f"fwd+bwd_ms_{mode}"] = _bench(both, rep)
        if DEV != "cuda":
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        both()
        torch.cuda.synchronize()
        r[f"peak_gib_{mode}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if profile and det:
            r["kernels_ms_det"] = _kernel_breakdown(bwd)
    # agreement of the paths (same inputs): rel RMS of new vs old gradients, and det bitwise run to run
    agree = {}
    for det in (True, False):
        a, b = grads[("new", det)], grads[("old", det)]
        agree["det" if det else "atomic"] = {
            n: float((x.double() - y.double()).pow(2).mean().sqrt() / y.double().pow(2).mean().sqrt().clamp_min(1e-30))
            for n, x, y in zip(("dq", "dk", "dv", "dbeta"), a, b)
        }
    again = variant_tiles("new", True, D, dtype)
    g2 = attention_backward(do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, deterministic=True, tiles=again)
    agree["new_det_bitwise_run_to_run"] = all(torch.equal(x, y) for x, y in zip(grads[("new", True)], g2))
    res["agreement_new_vs_old_rel_rms"] = agree
    return res


def triton_fsl_api(T, Hq, Hkv, D, dtype, rep, cfg) -> dict:
    """The whole op through the backend's custom op (Triton selection included), deterministic fwd+bwd,
    old (FREESOLO_TRITON_BWD_LONG=legacy) and new (unset) backward."""
    from freesolo.backends.triton.backend import deterministic, triton_attention

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    for x in (q, k, v):
        x.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            triton_attention(q, k, v, cfg)

    def both():
        with deterministic(True):
            triton_attention(q, k, v, cfg).backward(do)

    res = {"fwd_ms": _bench(fwd, rep)}
    previous = os.environ.get(ENV)
    try:
        for name, value in (("old", "legacy"), ("new", None)):
            if value is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = value
            res[f"fwd+bwd_ms_det_{name}"] = _bench(both, rep)
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
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
            out[e.key[:60]] = round(t / 1e3, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:14])


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
    """Peak memory (GiB, beyond the inputs and the selection) of one FS-L fwd+bwd (deterministic, new) at T."""
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
    out = {"T": T, "selection_s": sel_s}
    for variant in ("old", "new"):
        tiles = variant_tiles(variant, True, D, dtype)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        o, ll, lg, rs = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
        g = attention_backward(do, q, k, v, o, idx, beta, ll, lg, rs, cos, sin, cfg, deterministic=True, tiles=tiles)
        torch.cuda.synchronize()
        out[variant] = {
            "peak_gib_beyond_inputs": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "fwd+bwd_s_first_call": time.perf_counter() - t0,
            "grads_finite": all(bool(torch.isfinite(x).all()) for x in g),
        }
        del o, ll, lg, rs, g
    out["inputs_gib"] = torch.cuda.memory_allocated() / 2**30
    return out


SWEEP_LOCAL = [  # (kv_block_n, kv_block_m, q_block_m, q_block_n, num_warps, num_stages)
    (64, 32, 64, 32, 8, 2),
    (128, 32, 128, 32, 8, 2),
    (64, 64, 64, 64, 8, 2),
    (64, 32, 64, 32, 4, 2),
    (64, 32, 64, 32, 4, 3),
    (128, 64, 128, 64, 8, 3),
    (64, 32, 64, 32, 8, 3),  # s21: more pipelining, and thinner steps at 4 warps
    (64, 16, 64, 16, 4, 2),
    (128, 32, 64, 32, 8, 2),
    (64, 64, 128, 32, 8, 2),
]
SWEEP_LONG = [  # (block_r, seg, num_warps_long, block_rows); the first is the default
    (32, 1024, 8, 16),
    (32, 1024, 4, 16),
    (64, 1024, 8, 16),
    (64, 2048, 8, 16),
    (16, 512, 4, 16),
    (32, 256, 8, 16),
    (32, 4096, 8, 16),
    (32, 1024, 8, 32),
    (32, 1024, 8, 64),
]


def sweep(T, Hq, Hkv, D, dtype, rep, cfg) -> list:
    """Backward (deterministic, new) time per tile configuration of the local and of the long kernels."""
    from freesolo.backends.triton.attention import attention_forward
    from freesolo.backends.triton.attention_bwd import attention_backward

    q, k, v, do = _inputs(T, Hq, Hkv, D, dtype)
    with torch.no_grad():
        idx = torch_backend.select_cells(q, k, cfg)
    beta = torch.ones(Hq, device=DEV, dtype=torch.float32)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    saved = attention_forward(q, k, v, idx, beta, cos, sin, cfg)
    base = variant_tiles("new", True, D, dtype)
    configs = [
        dataclasses.replace(base, kv_block_n=a, kv_block_m=b, q_block_m=c, q_block_n=d, num_warps=e, num_stages=f)
        for a, b, c, d, e, f in SWEEP_LOCAL
    ]
    configs += [
        dataclasses.replace(base, block_r=a, seg=b, num_warps_long=c, block_rows=d) for a, b, c, d in SWEEP_LONG
    ]
    configs += [dataclasses.replace(base, long_chunk=16384)]
    out = []
    for tiles in configs:
        try:
            ms = _bench(
                lambda: attention_backward(do, q, k, v, saved[0], idx, beta, *saved[1:], cos, sin, cfg, tiles=tiles), rep
            )
        except Exception as e:  # noqa: BLE001 (a configuration that does not compile / fit is reported)
            ms = f"error: {type(e).__name__}: {str(e)[:120]}"
        out.append({"tiles": dataclasses.asdict(tiles), "bwd_ms_det": ms})
        print("  sweep", {k: v for k, v in dataclasses.asdict(tiles).items()}, ms, flush=True)
    return out


def regs_report(dtypes=("bf16", "fp16", "fp32"), dims=(32, 64, 128)) -> list:
    """Compile every backward kernel for sm_90 with the GPU default tiles (no GPU needed) and report
    registers / spill stack from cuobjdump: a register-pressure check before spending GPU time."""
    import subprocess as sp
    import tempfile

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--regs compiles real kernels: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import freesolo.backends.triton.attention_bwd as m

    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    rows = []

    def build(fn, sig, consts, num_warps, num_stages=3):
        src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kern.asm["cubin"])
        usage = sp.run([cuobj, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        line = next((x for x in usage.splitlines() if "REG:" in x), "")
        fields = dict(t.split(":", 1) for t in line.replace("Resource usage:", "").split() if ":" in t)
        return {"kernel": fn.__name__, "regs": int(fields.get("REG", -1)), "stack": int(fields.get("STACK", -1))}

    for dt in dtypes:
        for D in dims:
            P, F, I = f"*{dt}", "*fp32", "*i64"
            tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
            tiles = m.default_bwd_tiles(D, tdt, torch.device("cuda"))
            ieee = dt == "fp32"
            half, bd, bh = D // 2, max(16, D), max(16, D // 2)
            res = []
            sig = dict(DO=P, Q=P, K=P, V=P, O=P, IDX=I, BETA=F, LSE_LONG=F, RSTD=F, DOLONG=P, DQLONG=F, DELTA_LOC=F,
                       DELTA_LONG=F, DBETA_PART=F, DK_ACC=F, DV_ACC=F, T="i32", NROWS="i32", scale="fp32")  # fmt: skip
            c = dict(HQ=16, HKV=4, D=D, TOPK=4, CELL=32, BLOCK_D=bd, BLOCK_KS=128, BLOCK_Q=tiles.block_q, ATOMIC=False)
            res.append(build(m._bwd_long_query_kernel, sig, c, tiles.num_warps_long))
            cell = dict(HQ=16, HKV=4, D=D, TOPK=4, CELL=32, BLOCK_D=bd, BLOCK_C=32, BLOCK_R=tiles.block_r,
                        SEG=tiles.seg, IEEE=ieee)  # fmt: skip
            sig = dict(Q=P, K=P, V=P, LSE_LONG=F, SLOTS=I, OFFSETS=I, WORK_CELL=I, WORK_SEG=I, OPART=F, T="i32",
                       T0="i32", TC="i32", C="i32", NCELLS="i32", scale="fp32")  # fmt: skip
            res.append(build(m._bwd_cell_olong_kernel, sig, cell, tiles.num_warps_long))
            sig = dict(DO=P, O=P, IDX=I, OPART=F, BETA=F, RSTD=F, DOLONG=P, DELTA_LOC=F, DELTA_LONG=F, DBETA_PART=F,
                       T="i32", T0="i32", TC="i32", NR="i32")  # fmt: skip
            rows_c = dict(HQ=16, D=D, TOPK=4, BLOCK_D=bd, BLOCK_Q=tiles.block_rows)
            res.append(build(m._bwd_long_rows_kernel, sig, rows_c, 8))
            sig = dict(Q=P, K=P, V=P, DOLONG=P, LSE_LONG=F, DELTA_LONG=F, SLOTS=I, OFFSETS=I, WORK_CELL=I, WORK_SEG=I,
                       NSEG=I, PART_BASE=I, QPART=F, DK_ACC=F, DV_ACC=F, PART_DK=F, PART_DV=F, T="i32", T0="i32",
                       TC="i32", C="i32", NCELLS="i32", accum="i32", scale="fp32")  # fmt: skip
            for atomic in (False, True):
                res.append(build(m._bwd_cell_grad_kernel, sig, dict(cell, ATOMIC=atomic), tiles.num_warps_long))
                res[-1]["kernel"] += f"[atomic={atomic}]"
            sig = dict(IDX=I, QPART=F, DQLONG=F, T="i32", T0="i32", TC="i32", NR="i32")
            res.append(build(m._bwd_sum_parts_kernel, sig, rows_c, 8))
            sig = dict(NSEG=I, PART_BASE=I, PART_DK=F, PART_DV=F, DK_ACC=F, DV_ACC=F, T="i32", C="i32", accum="i32")
            res.append(build(m._bwd_long_reduce_kernel, sig, dict(HKV=4, D=D, CELL=32, BLOCK_D=bd, BLOCK_C=32), 4))
            common = dict(HQ=16, HKV=4, HALF=half, BLOCK_H=bh, IEEE=ieee)
            for prerot in (False, True):
                sig = dict(DO=P, Q=P, K=P, V=P, COS=F, SIN=F, LSE_LOC=F, DELTA_LOC=F, DK_LONG=F, DV_LONG=F, DK=P,
                           DV=P, T="i32", W="i32", scale="fp32")  # fmt: skip
                c = dict(common, BLOCK_M=tiles.kv_block_m, BLOCK_N=tiles.kv_block_n, HAS_LONG=True, NUM_M=18,
                         PREROT=prerot)  # fmt: skip
                res.append(build(m._bwd_local_dkdv_kernel, sig, c, tiles.num_warps, tiles.num_stages))
                res[-1]["kernel"] += f"[prerot={prerot}]"
                sig = dict(DO=P, Q=P, K=P, V=P, COS=F, SIN=F, LSE_LOC=F, DELTA_LOC=F, DQ_LONG=F, IDX=I, DQ=P,
                           T="i32", W="i32", scale="fp32")  # fmt: skip
                c = dict(common, BLOCK_M=tiles.q_block_m, BLOCK_N=tiles.q_block_n, NUM_N=19, PREROT=prerot,
                         LONG_PARTS=4 if prerot else 0)  # fmt: skip
                res.append(build(m._bwd_local_dq_kernel, sig, c, tiles.num_warps, tiles.num_stages))
                res[-1]["kernel"] += f"[prerot={prerot}]"
            for r in res:
                r.update(dtype=dt, D=D)
                print(f"{dt:5s} D={D:3d} {r['kernel']:38s} regs {r['regs']:3d} spill stack {r['stack']} B", flush=True)
            rows += res
    return rows


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--peak-T", type=int, default=0, help="also measure FS-L fwd+bwd peak memory at this T")
    ap.add_argument("--no-baselines", action="store_true", help="skip SDPA and FlexAttention")
    ap.add_argument("--no-api", action="store_true", help="skip the custom-op (selection included) timing")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile")
    ap.add_argument("--sweep", action="store_true", help="backward tile sweep at the first length")
    ap.add_argument("--sweep-only", action="store_true", help="only the tile sweep (at the first length)")
    ap.add_argument("--regs", action="store_true", help="no GPU: sm_90 registers / spills of every kernel, then exit")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, T=64, small config: plumbing only")
    args = ap.parse_args(argv)
    global DEV
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        DEV = "cpu"
        args.lengths, args.no_baselines, args.dtype, args.heads, args.kv_heads = [64], True, "float32", 2, 1
        args.no_api = True
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
    payload = {
        "versions": _versions(),
        "git": _git(),
        "shape": dict(B=1, Hq=H, Hkv=Hkv, D=D, dtype=args.dtype, variant="fsl", window=cfg.window, keys="iid randn"),
        "timing": f"triton.testing.do_bench median, rep={args.rep} ms",
        "results": {},
    }
    print(json.dumps(payload["versions"]), json.dumps(payload["git"]))
    t_start = time.perf_counter()
    args.sweep = args.sweep or args.sweep_only
    for T in [] if args.sweep_only else args.lengths:
        row = {"triton_fsl": triton_fsl(T, H, Hkv, D, dtype, args.rep, cfg, profile=not args.no_profile)}
        if not args.no_api:
            try:
                row["triton_fsl_api"] = triton_fsl_api(T, H, Hkv, D, dtype, args.rep, cfg)
            except Exception as e:  # noqa: BLE001 (the custom op is another module; report, do not stop)
                row["triton_fsl_api"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if not args.no_baselines:
            row["sdpa_causal"] = sdpa_causal(T, H, Hkv, D, dtype, args.rep)
            row["flex_swa512"] = flex_swa512(T, H, Hkv, D, dtype, args.rep)
            sd, fx = row["sdpa_causal"]["fwd+bwd_ms"], row["flex_swa512"]["fwd+bwd_ms"]
            ratios = {}
            for variant in ("old", "new"):
                for mode in ("det", "atomic"):
                    ours = row["triton_fsl"][variant][f"fwd+bwd_ms_{mode}"]
                    ratios[f"{variant}_{mode}"] = {"vs_sdpa": ours / sd, "vs_flex": ours / fx}
            row["ratios_fwd+bwd"] = ratios
            new = row["triton_fsl"]["new"]["fwd+bwd_ms_det"]
            if T == 65536:
                row["bars"] = {"64k <= sdpa/6": new <= sd / 6, "64k <= 4 x flex": new <= 4 * fx}
            if T == 4096:
                row["bars"] = {"4k <= 2 x sdpa": new <= 2 * sd}
        payload["results"][str(T)] = row
        tf = row["triton_fsl"]
        o, n = tf["old"], tf["new"]
        line = (
            f"T={T:6d} fwd {tf['fwd_ms']:.3f} | bwd det old {o['bwd_ms_det']:.3f} new {n['bwd_ms_det']:.3f}"
            f" (cell long + old local {tf['new_long_only']['bwd_ms_det']:.3f})"
            f" | fwd+bwd det old {o['fwd+bwd_ms_det']:.3f} new {n['fwd+bwd_ms_det']:.3f}"
            f"  atomic old {o['fwd+bwd_ms_atomic']:.3f} new {n['fwd+bwd_ms_atomic']:.3f} ms"
        )
        if not args.no_baselines:
            line += (
                f" | sdpa {row['sdpa_causal']['fwd+bwd_ms']:.3f} flex {row['flex_swa512']['fwd+bwd_ms']:.3f}"
                f" | new det/sdpa {row['ratios_fwd+bwd']['new_det']['vs_sdpa']:.3f}"
                f" /flex {row['ratios_fwd+bwd']['new_det']['vs_flex']:.2f} bars {row.get('bars', {})}"
            )
        print(line, flush=True)
        if "triton_fsl_api" in row:
            print("   api (selection included):", json.dumps(row["triton_fsl_api"]), flush=True)
        print("   agreement:", json.dumps(tf["agreement_new_vs_old_rel_rms"]), flush=True)
        for variant in ("old", "new"):
            print(f"   kernels {variant} det:", json.dumps(tf[variant].get("kernels_ms_det", {})), flush=True)
    if args.sweep:
        payload["sweep"] = sweep(args.lengths[0], H, Hkv, D, dtype, args.rep, cfg)
    if args.peak_T:
        payload["peak"] = peak_memory(args.peak_T, H, Hkv, D, dtype, cfg)
        print("peak:", json.dumps(payload["peak"]), flush=True)
    payload["wall_s"] = time.perf_counter() - t_start
    print(f"wall {payload['wall_s']:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
