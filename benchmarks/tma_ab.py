"""A/B of the Triton forward's two big kernels with TMA loads (issue 10, s35): the window kernel
(`_attention_fwd_kernel`, window_first: o = o_loc) and the long readout (`_long_fwd_kernel`,
adding beta_h * rmsnorm(o_long) into o) against copies whose key / value tiles come from host-side
tensor descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`, 3-D [B, T, Hkv * D] views,
zero fill outside [0, T)), on the same inputs, same run.

Why: at 64k (H16 D64 bf16) the window kernel takes 0.60 ms, 229 TFLOPS of useful work against
SDPA's ~450 at the same shape, and the long readout 0.51 ms; both re-load 64-row key / value tiles
through pointer tensors. TMA moves the tiles with one instruction per tile, frees the registers of
the address tensors and lets triton's pipeliner run the loads asynchronously (mbarriers).

Per length (4k, 16k, 64k; B 1, H 16, D 64, bf16, iid keys, FS-L selection of the Triton backend):
- window: the production kernel (one launch over the whole rotated k; production launches per
  rotation chunk) against TMA variants (block_m, block_n, warps, stages);
- long: the production kernel (sorted tiles from 32k as in production) against TMA variants
  (stages, the hand prefetch on / off);
- the bits: max |diff| of o (and lse) against the production kernel.
Medians of triton.testing.do_bench. Writes JSON (--out) and prints a table. ~1 minute on an H200:
    python benchmarks/tma_ab.py --out $OUT/tma_ab.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton._common import NEG_BIG, padded_dims, rope_rotate  # noqa: E402
from freesolo.backends.triton.backend import rope_cos_sin  # noqa: E402
from freesolo.backends.triton.selection import select_cells  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _win_steps_tma(
    acc, l_i, m_i, qr, m0, kr_desc, v_desc, b, col, n_lo, n_hi, T, W, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    dtype = qr.dtype
    rn = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    for n0 in tl.range(n_lo, n_hi, BLOCK_N, warp_specialize=WS):
        kr = kr_desc.load([b, n0, col]).reshape(BLOCK_N, D)
        s = tl.dot(qr, tl.trans(kr))
        if MASKED:
            delta = (m0 - n0).to(tl.int32) + rm[:, None] - rn[None, :]
            col_ok = rn < tl.minimum(T - n0, BLOCK_N).to(tl.int32)
            s = tl.where((delta >= 0) & (delta < W) & col_ok[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([b, n0, col]).reshape(BLOCK_N, D)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _window_tma_kernel(
    Q, kr_desc, v_desc, COS, SIN, O, LSE_LOC, T, Hq, Hkv, W, qk_scale,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """o = o_loc (q's dtype) and lse_loc of the RoPE window, key / value tiles by TMA (D == D_P)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    g = h // (Hq // Hkv)
    dtype = Q.dtype.element_ty
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = offs_m < T
    dd = tl.arange(0, D)
    q_rows = Q + ((b * T + offs_m) * Hq + h) * D
    d_half = tl.where(dd < HALF, dd, dd - HALF)
    partner = tl.where(dd < HALF, dd + HALF, dd - HALF)
    q_mask = row_ok[:, None] & (dd < D)[None, :]
    q = tl.load(q_rows[:, None] + dd[None, :], mask=q_mask, other=0.0)
    q_swap = tl.load(q_rows[:, None] + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    rope_offs = offs_m[:, None] * HALF + d_half[None, :]
    cq = tl.load(COS + rope_offs, mask=q_mask, other=0.0)
    sq = tl.load(SIN + rope_offs, mask=q_mask, other=0.0)
    qr = (q.to(tl.float32) * cq + tl.where((dd < HALF)[None, :], -q_swap, q_swap) * sq).to(dtype)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    lo = (tl.maximum(m0 - W + 1, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.maximum(((m0 + BLOCK_M - W + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    full_hi = tl.maximum(((m0 + 1) // BLOCK_N) * BLOCK_N, full_lo)
    hi = tl.minimum(m0 + BLOCK_M, T)
    col = (g * D).to(tl.int32)
    b32 = b.to(tl.int32)
    lo32 = lo.to(tl.int32)
    full_lo32 = full_lo.to(tl.int32)
    full_hi32 = full_hi.to(tl.int32)
    hi32 = hi.to(tl.int32)
    acc, l_i, m_i = _win_steps_tma(acc, l_i, m_i, qr, m0, kr_desc, v_desc, b32, col, lo32, tl.minimum(full_lo32, hi32),
                                   T, W, qk_scale, D, BLOCK_M, BLOCK_N, True, WS)  # fmt: skip
    acc, l_i, m_i = _win_steps_tma(acc, l_i, m_i, qr, m0, kr_desc, v_desc, b32, col, full_lo32, full_hi32,
                                   T, W, qk_scale, D, BLOCK_M, BLOCK_N, False, WS)  # fmt: skip
    acc, l_i, m_i = _win_steps_tma(acc, l_i, m_i, qr, m0, kr_desc, v_desc, b32, col, full_hi32, hi32,
                                   T, W, qk_scale, D, BLOCK_M, BLOCK_N, True, WS)  # fmt: skip
    l_i = tl.where(row_ok, l_i, 1.0)
    o_loc = acc / l_i[:, None]
    lse_loc = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    o_offs = ((b * T + offs_m) * Hq + h)[:, None] * D + dd[None, :]
    tl.store(O + o_offs, o_loc.to(dtype), mask=q_mask)
    tl.store(LSE_LOC + (b * Hq + h) * T + offs_m, lse_loc, mask=row_ok)


@triton.jit
def _long_tma_kernel(
    Q, k_desc, v_desc, IDX, UNION, NUNION, ORDER, BETA, O, LSE_LONG, RSTD, T, Hq, Hkv, NT, qk_scale, eps,
    D: tl.constexpr, CELL: tl.constexpr, KSEL: tl.constexpr, K_P: tl.constexpr, BLOCK_M: tl.constexpr,
    U_MAX: tl.constexpr, PREFETCH: tl.constexpr, HAS_ORDER: tl.constexpr,
):  # fmt: skip
    """`_long_fwd_kernel` (ADD_TO_OUT, stats on) with the cells' keys / values by TMA (D == D_P, CELL >= 16)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    g = h // (Hq // Hkv)
    urow = UNION + (pid_bh * NT + pid_m) * U_MAX
    offs_m = att._tile_positions(ORDER, pid_bh, pid_m, T, BLOCK_M, HAS_ORDER)
    q, row_ok = att._load_rows(Q, b, h, T, Hq, offs_m, D, D)
    sel = att._load_sel(IDX, b, T, Hq, h, offs_m, row_ok, KSEL, K_P)
    n_u = tl.load(NUNION + pid_bh * NT + pid_m)
    c_ok = tl.arange(0, CELL) < CELL
    col = (g * D).to(tl.int32)
    b32 = b.to(tl.int32)
    m_j = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_j = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if PREFETCH:
        cell = tl.load(urow, mask=n_u > 0, other=0)
        kc = k_desc.load([b32, cell * CELL, col]).reshape(CELL, D)
        vc = v_desc.load([b32, cell * CELL, col]).reshape(CELL, D)
    for u in range(0, n_u):
        if PREFETCH:
            cell_n = tl.load(urow + u + 1, mask=u + 1 < n_u, other=0)
            kc_n = k_desc.load([b32, cell_n * CELL, col]).reshape(CELL, D)
            vc_n = v_desc.load([b32, cell_n * CELL, col]).reshape(CELL, D)
        else:
            cell = tl.load(urow + u)
            kc = k_desc.load([b32, cell * CELL, col]).reshape(CELL, D)
            vc = v_desc.load([b32, cell * CELL, col]).reshape(CELL, D)
        acc, l_j, m_j = att._cell_step(acc, l_j, m_j, q, sel, cell, kc, vc, c_ok, qk_scale, CELL, CELL)
        if PREFETCH:
            cell = cell_n
            kc = kc_n
            vc = vc_n
    att._long_store(acc, l_j, m_j, offs_m, b, h, T, Hq, BETA, eps, O, LSE_LONG, RSTD, 1, D, D, True)


def _desc(x: torch.Tensor, rows: int, D: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, T, Hkv, _ = x.shape
    x3 = x.view(B, T, Hkv * D)
    return TensorDescriptor(x3, shape=[B, T, Hkv * D], strides=list(x3.stride()), block_shape=[1, rows, D])


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the entries where they differ (equal infinities count as equal)."""
    a, b = a.float(), b.float()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return float(torch.where(same, 0.0, (a - b).abs()).max())


def _bench(fn, rep):
    if rep <= 0:  # CPU check: run once, no timing
        fn()
        return float("nan")
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


WINDOW_VARIANTS = {  # name -> (block_m, block_n, num_warps, num_stages, maxnreg[, warp_specialize])
    "tma64x64w4s2": (64, 64, 4, 2, 128),
    "tma128x64w8s2-ws": (128, 64, 8, 2, None, True),
    "tma64x64w4s2-ws": (64, 64, 4, 2, None, True),
    "tma64x64w4s3": (64, 64, 4, 3, None),
    "tma64x64w4s2-nocap": (64, 64, 4, 2, None),
    "tma128x64w8s2": (128, 64, 8, 2, None),
    "tma128x64w8s3": (128, 64, 8, 3, None),
    "tma128x128w8s2": (128, 128, 8, 2, None),
    "tma64x128w4s2": (64, 128, 4, 2, None),
}
LONG_VARIANTS = {  # name -> (prefetch, num_warps, num_stages)
    "tma-pf-w4s1": (True, 4, 1),
    "tma-nopf-w4s1": (False, 4, 1),
    "tma-nopf-w4s2": (False, 4, 2),
    "tma-nopf-w4s3": (False, 4, 3),
    "tma-pf-w4s2": (True, 4, 2),
    "tma-nopf-w4s4": (False, 4, 4),
    "tma-nopf-w8s3": (False, 8, 3),
}
PTR_LONG_VARIANTS = {  # name -> (prefetch, num_warps, num_stages): pointer loads (the production kernel)
    "ptr-nopf-w4s2": (False, 4, 2),
    "ptr-nopf-w4s3": (False, 4, 3),
    "ptr-pf-w4s2": (True, 4, 2),
}


def run_length(T: int, rep: int, H: int = 16, D: int = 64, device="cuda", dtype=torch.bfloat16, cfg=None,
               tiles=None, window_variants=None, long_variants=None) -> dict:
    """One length: every variant timed (CUDA; rep 0: not timed) and compared with the production kernels."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, H, D, device=device).to(dtype) for _ in range(3))
    cfg = cfg or FreeSoloConfig(variant="fsl", window=512)
    tiles = tiles or att.default_tiles(D, dtype, q.device)
    window_variants = WINDOW_VARIANTS if window_variants is None else window_variants
    long_variants = LONG_VARIANTS if long_variants is None else long_variants
    cos, sin = rope_cos_sin(T, D, cfg.rope_theta, q.device)
    kr = torch.empty_like(k)
    rope_rotate(k, cos, sin, out=kr)
    beta = torch.ones(H, device=device)
    rec: dict = {"T": T, "window": {}, "long": {}}
    # ---- window, production kernel (one launch over all tiles, the rotated k whole)
    NT = -(-T // tiles.block_m)
    o_ref = torch.empty_like(q)
    lse_ref = torch.empty(1, H, T, device=device)
    ph = att._placeholder(q.device)
    phi = att._placeholder(q.device, torch.int32)
    extra = {} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}

    def prod_window():
        att.launch(att._attention_fwd_kernel, (NT, H),
            q, k, kr, v, phi, phi, phi, beta, o_ref, cos, sin, o_ref, lse_ref, ph, ph,
            T, H, H, NT, 0, T, 0, cfg.window, LOG2E / math.sqrt(D), cfg.eps, 1,
            HALF=D // 2, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, U_MAX=tiles.union_rows * cfg.top_k,
            WINDOW_PHASES=True, HAS_LONG=False, READ_LONG=False,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **att._common_constexprs(D, cfg, tiles), **extra,
        )  # fmt: skip

    rec["window"]["prod"] = {"ms": _bench(prod_window, rep)}
    prod_window()
    o_win = o_ref.clone()
    lse_win = lse_ref.clone()
    for name, (bm, bn, nw, ns, cap, *ws) in window_variants.items():
        ws = bool(ws and ws[0])
        o = torch.empty_like(q)
        lse = torch.empty_like(lse_ref)
        kd, vd = _desc(kr, bn, D), _desc(v, bn, D)
        kw = {} if cap is None else {"maxnreg": cap}

        def fn(o=o, lse=lse, kd=kd, vd=vd, bm=bm, bn=bn, nw=nw, ns=ns, kw=kw, ws=ws):
            _window_tma_kernel[(-(-T // bm), H)](q, kd, vd, cos, sin, o, lse, T, H, H, cfg.window,
                LOG2E / math.sqrt(D), D=D, HALF=D // 2, BLOCK_M=bm, BLOCK_N=bn, WS=ws, num_warps=nw, num_stages=ns, **kw)  # fmt: skip

        try:
            ms = _bench(fn, rep)
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
            rec["window"][name] = {
                "ms": ms,
                "o_maxdiff": _maxdiff(o, o_win),
                "lse_maxdiff": _maxdiff(lse, lse_win),
                "bitwise": bool(torch.equal(o, o_win)),
            }
        except Exception as exc:  # noqa: BLE001
            rec["window"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    # ---- long: production kernel on the production selection / unions
    idx = select_cells(q, k, cfg, out_dtype=torch.int32)
    unions = att.forward_unions(idx, cfg, tiles)
    outputs = att._outputs(q, tiles, True)
    rows = tiles.union_rows
    NU = -(-T // rows)
    rec["union_mean"] = float(unions.count.float().mean())

    def prod_long():
        outputs[0].copy_(o_win)
        att._launch_long(q, k, v, idx, unions, beta, cfg, tiles, outputs)

    def copy_only():
        outputs[0].copy_(o_win)

    rec["long"]["copy_only"] = {"ms": _bench(copy_only, rep)}
    rec["long"]["prod"] = {"ms": _bench(prod_long, rep)}
    prod_long()
    o_long_ref = outputs[0].clone()
    lse_long_ref = outputs[2].clone()
    for name, (pf, nw, ns) in PTR_LONG_VARIANTS.items():  # the production kernel, other stages / prefetch
        o = torch.empty_like(q)
        outs = (o, None, torch.empty_like(lse_long_ref), torch.empty_like(lse_long_ref), o)
        consts = dict(att._common_constexprs(D, cfg, tiles), PREFETCH=pf)

        def fn(outs=outs, nw=nw, ns=ns, consts=consts):
            outs[0].copy_(o_win)
            union, count, order = unions
            att.launch(att._long_fwd_kernel, (NU, H),
                q, k, v, idx, union, count, order if order is not None else count, beta, outs[0],
                outs[2], outs[3], T, H, H, NU, LOG2E / math.sqrt(D), cfg.eps, 1,
                BLOCK_M=rows, U_MAX=rows * cfg.top_k, ADD_TO_OUT=True, HAS_ORDER=order is not None,
                num_warps=nw, num_stages=ns, **consts)  # fmt: skip

        try:
            ms = _bench(fn, rep)
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
            rec["long"][name] = {"ms": ms, "o_maxdiff": _maxdiff(o, o_long_ref), "bitwise": bool(torch.equal(o, o_long_ref))}
        except Exception as exc:  # noqa: BLE001
            rec["long"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    for name, (pf, nw, ns) in long_variants.items():
        o = torch.empty_like(q)
        lse_l = torch.empty_like(lse_long_ref)
        rstd = torch.empty_like(lse_long_ref)
        kd, vd = _desc(k, cfg.cell, D), _desc(v, cfg.cell, D)
        order = unions.order if unions.order is not None else unions.count

        def fn(o=o, lse_l=lse_l, rstd=rstd, kd=kd, vd=vd, pf=pf, nw=nw, ns=ns, order=order):
            o.copy_(o_win)
            _long_tma_kernel[(NU, H)](q, kd, vd, idx, unions.union, unions.count, order, beta, o, lse_l, rstd,
                T, H, H, NU, LOG2E / math.sqrt(D), cfg.eps, D=D, CELL=cfg.cell, KSEL=cfg.top_k,
                K_P=triton.next_power_of_2(cfg.top_k), BLOCK_M=rows, U_MAX=rows * cfg.top_k, PREFETCH=pf,
                HAS_ORDER=unions.order is not None, num_warps=nw, num_stages=ns)  # fmt: skip

        try:
            ms = _bench(fn, rep)
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
            rec["long"][name] = {
                "ms": ms,
                "o_maxdiff": _maxdiff(o, o_long_ref),
                "lse_maxdiff": _maxdiff(lse_l, lse_long_ref),
                "bitwise": bool(torch.equal(o, o_long_ref)),
            }
        except Exception as exc:  # noqa: BLE001
            rec["long"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--long-only", action="store_true", help="time the long readout variants only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from triton_attention_bench import gpu_payload

    payload = gpu_payload(shape="H16-D64 bf16 B1, FS-L iid keys", lengths=args.lengths)
    payload["runs"] = []
    for T in args.lengths:
        rec = run_length(T, args.rep, window_variants={} if args.long_only else None)
        payload["runs"].append(rec)
        print(f"T={T} union mean {rec['union_mean']:.1f}")
        for part in ("window", "long"):
            base = rec[part]["prod"]["ms"]
            for name, r in rec[part].items():
                if "ms" in r:
                    extra = "" if "o_maxdiff" not in r else f"  o diff {r['o_maxdiff']:.2e} bitwise {r['bitwise']}"
                    print(f"  {part:6s} {name:22s} {r['ms'] * 1e3:8.1f} us  x{r['ms'] / base:5.2f}{extra}")
                else:
                    print(f"  {part:6s} {name:22s} {r['error']}")
        sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(payload, fh, indent=1)
        print("saved", args.out)


if __name__ == "__main__":
    main()
