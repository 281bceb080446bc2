"""Is the Triton long kernel's online softmax what costs? A probe (issue 10), not a library path.

s28 tried a fixed per-row offset in the long kernel (`attention._long_fwd_kernel`): m_b =
scale * ||q_i|| * max over the row's selected cells of a_c (a_c = max key norm of cell c, an upper
bound of every logit of the row by Cauchy-Schwarz), so that a cell step neither reduces a row maximum
nor rescales the accumulator, with rows far below their bound redone by the online loop inside the
same kernel. On the H200 that kernel took 160 registers instead of 122 and was slower (FS-L 64k:
0.534 -> 0.583 ms, results/session_2026-12-03_s28/call1), and it was removed. This probe times the
bounded loop alone (`_probe_bound_kernel`: no redo path, so a row more than ~100 binades below its
bound would be wrong; the trained FS-L checkpoint's rows stay within 38 nats of it,
`long_bound_gap.py`) against the library's long kernel on the same unions, same run, and reports
registers, spills and the output difference. If the loop alone is clearly faster, the redo belongs
in a second launch over flagged tiles, not in the same kernel.

    python benchmarks/long_bound_probe.py --out $OUT/long_bound_probe.json   # H200, ~30 s
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_attention import _versions, bench_ms, write_json  # noqa: E402

import freesolo  # noqa: E402
from freesolo.backends.triton import attention as att  # noqa: E402
from freesolo.backends.triton.selection import cell_stats, select_cells  # noqa: E402

__all__ = ["main"]


@triton.jit
def _probe_bound_kernel(
    Q, K, V, IDX, UNION, NUNION, ORDER, BETA, O, LSE_LONG, RSTD, AMAX,
    T, Hq, Hkv, NT, C, qk_scale, eps,
    D: tl.constexpr, D_P: tl.constexpr, CELL: tl.constexpr, CELL_P: tl.constexpr, KSEL: tl.constexpr,
    K_P: tl.constexpr, BLOCK_M: tl.constexpr, U_MAX: tl.constexpr, HAS_ORDER: tl.constexpr,
):  # fmt: skip
    """`attention._long_fwd_kernel` (window-first: adds its term to O) with the fixed offsets."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    g = h // (Hq // Hkv)
    kv_stride = Hkv * D
    k_base = K + (b * T * Hkv + g) * D
    v_base = V + (b * T * Hkv + g) * D
    urow = UNION + (pid_bh * NT + pid_m) * U_MAX
    offs_m = att._tile_positions(ORDER, pid_bh, pid_m, T, BLOCK_M, HAS_ORDER)
    q, row_ok = att._load_rows(Q, b, h, T, Hq, offs_m, D, D_P)
    sel = att._load_sel(IDX, b, T, Hq, h, offs_m, row_ok, KSEL, K_P)
    a = tl.load(AMAX + (b * Hkv + g) * C + tl.where(sel >= 0, sel, 0), mask=sel >= 0, other=0.0)
    qf = q.to(tl.float32)
    m_b = qk_scale * tl.sqrt_rn(tl.sum(qf * qf, 1)) * tl.max(a, 1)
    dd = tl.arange(0, D_P)
    n_u = tl.load(NUNION + pid_bh * NT + pid_m)
    offs_c = tl.arange(0, CELL_P)
    c_ok = offs_c < CELL
    cell_offs = offs_c[:, None] * kv_stride + dd[None, :]
    kv_mask = c_ok[:, None] & (dd < D)[None, :]
    l_j = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    cell = tl.load(urow, mask=n_u > 0, other=0)
    cell_n = tl.load(urow + 1, mask=n_u > 1, other=0)
    kc, vc = att._cell_kv(k_base, v_base, cell, n_u > 0, cell_offs, kv_mask, kv_stride, CELL)
    for u in range(0, n_u):
        cell_nn = tl.load(urow + u + 2, mask=u + 2 < n_u, other=0)
        kc_n, vc_n = att._cell_kv(k_base, v_base, cell_n, u + 1 < n_u, cell_offs, kv_mask, kv_stride, CELL)
        hit = tl.sum((sel == cell).to(tl.int32), 1) > 0
        s = tl.dot(q, tl.trans(kc))
        p = tl.where(hit[:, None] & c_ok[None, :], tl.math.exp2(s * qk_scale - m_b[:, None]), 0.0)
        l_j += tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), vc, acc=acc)
        cell = cell_n
        cell_n = cell_nn
        kc = kc_n
        vc = vc_n
    att._long_store(acc, l_j, m_b, offs_m, b, h, T, Hq, BETA, eps, O, LSE_LONG, RSTD, 1, D=D, D_P=D_P, ADD_TO_OUT=True)


def _registers(kernel) -> list:
    rows = []
    for caches in kernel.device_caches.values():
        for compiled in caches[0].values():
            rows.append({"n_regs": int(compiled.n_regs), "n_spills": int(compiled.n_spills)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[65536, 131072])
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, D = 16, 64
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    records = []
    for T in args.lengths:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
        idx = select_cells(q, k, cfg, out_dtype=torch.int32)
        amax = cell_stats(k, cfg.cell)[1]
        tiles = att.default_tiles(D, q.dtype, dev)
        unions = att.forward_unions(idx, cfg, tiles)
        beta = torch.ones(H, device=dev)
        rows = tiles.union_rows
        NU = -(-T // rows)
        union, count, order = unions
        out_online = att._outputs(q, tiles)
        out_bound = att._outputs(q, tiles)
        for x in (out_online[0], out_bound[0]):
            x.zero_()  # window-first: the long kernel adds its term to o (here o_loc = 0)
        common = att._common_constexprs(D, cfg, tiles)

        def online():
            att._launch_long(q, k, v, idx, unions, beta, cfg, tiles, out_online)

        def bound():
            _probe_bound_kernel[(NU, H)](
                q, k, v, idx, union, count, order if order is not None else count, beta, out_bound[0], out_bound[2],
                out_bound[3], amax, T, H, H, NU, T // cfg.cell, att.LOG2E / math.sqrt(D), cfg.eps,
                D=common["D"], D_P=common["D_P"], CELL=common["CELL"], CELL_P=common["CELL_P"], KSEL=common["KSEL"],
                K_P=common["K_P"], BLOCK_M=rows, U_MAX=rows * cfg.top_k, HAS_ORDER=order is not None,
                num_warps=tiles.long_warps, num_stages=1,
            )  # fmt: skip

        for x in (out_online[0], out_bound[0]):
            x.zero_()
        online()
        bound()
        a, b = out_online[0].double(), out_bound[0].double()
        rms = float((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())
        lse_diff = float((out_online[2] - out_bound[2]).abs().nan_to_num(0.0).max())
        rec = dict(T=T, online_ms=bench_ms(online, dev, args.rep_ms), bound_ms=bench_ms(bound, dev, args.rep_ms),
                   rms_rel_o=rms, max_abs_lse_long=lse_diff, union_mean=float(count.float().mean()))  # fmt: skip
        records.append(rec)
        print(f"T={T:7d} long kernel online {rec['online_ms']:.3f} ms  bound loop alone {rec['bound_ms']:.3f} ms  "
              f"rms-rel {rms:.1e}  lse {lse_diff:.1e}  union {rec['union_mean']:.1f}", flush=True)  # fmt: skip
    kernels = {"_long_fwd_kernel": _registers(att._long_fwd_kernel), "_probe_bound_kernel": _registers(_probe_bound_kernel)}
    print(kernels)
    write_json(args.out, dict(meta=_versions(dev), cfg="fsl defaults, H 16, D 64, bf16, iid", records=records, kernels=kernels))


if __name__ == "__main__":
    main()
