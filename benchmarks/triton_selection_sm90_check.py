"""Compile the Triton selection kernels (FS / FS-L, and the FS-B search) for sm_90 (H100 / H200) on any machine, no GPU needed, and
print registers and spill bytes (local stack) per thread of each kernel at the default sizes.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute but not that they compile, nor
their register pressure: this does, with triton's bundled ptxas / cuobjdump. A few minutes on a
2-core CPU.

Usage (repository root; TRITON_INTERPRET must be unset):
    python benchmarks/triton_selection_sm90_check.py
    python benchmarks/triton_selection_sm90_check.py fsb    # the FS-B prefill and decode searches only
    python benchmarks/triton_selection_sm90_check.py score  # the FS / FS-L scoring + top-K kernel only
    python benchmarks/triton_selection_sm90_check.py forward  # the split forward's long / window kernels
Look for: every line "ok", STACK:0 (no spills).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before triton decorates the kernels
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton import fsb_search as FSB  # noqa: E402
from freesolo.backends.triton import selection as S  # noqa: E402

__all__ = ["TARGET", "forward_check", "fsb_check", "fsb_main", "main", "score_check", "usage"]

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def usage(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3, maxnreg=None) -> str:
    """Compile fn for sm_90; return cuobjdump's 'REG:.. STACK:..' resource line."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    options = {"num_warps": num_warps, "num_stages": num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return " ".join(line.split()[:3])


def main() -> None:
    cfg = FreeSoloConfig()
    s, P, W, K = cfg.cell, cfg.pool, cfg.recent, cfg.top_k
    chunk = S.pool_chunk(P)
    p_pad = triton.next_power_of_2(P)
    for D in (64, 128):
        bt = min(triton.next_power_of_2(s), 4096 // D)
        r = usage(
            S._cell_stats_kernel,
            {"K": "*bf16", "KBAR": "*fp32", "AMAX": "*fp32", "C": "i32", "HKV": "i32", "stride_kb": "i64",
             "stride_kt": "i32", "stride_kh": "i32", "stride_kd": "i32"},
            {"D": D, "CELL": s, "CELLS_PER_PROG": max(1, min(64, 8192 // (bt * D))), "BLOCK_T": bt, "BLOCK_D": D},
            4,
        )
        print(f"ok  _cell_stats_kernel D={D}: {r}")
    r = usage(
        S._fsl_pool_scan_kernel,
        {"AMAX": "*fp32", "BASE": "*i32", "C": "i32", "M_LAST": "i32", "NCHUNKS": "i32"},
        {"POOL": P, "P_PAD": p_pad, "CHUNK": chunk},
        max(1, min(8, p_pad * chunk // 512)),
    )
    print(f"ok  _fsl_pool_scan_kernel P={P} chunk={chunk}: {r}")
    r = usage(
        S._fsl_cand_kernel,
        {"AMAX": "*fp32", "BASE": "*i32", "CAND": "*i32", "C": "i32", "NBLOCKS": "i32", "NCHUNKS": "i32"},
        {"POOL": P, "RECENT": W, "CELLS_PER_BLOCK": cfg.block // s, "CHUNK": chunk, "U_TILE": 64,
         "R_PAD": triton.next_power_of_2(W)},
        4,
    )
    print(f"ok  _fsl_cand_kernel: {r}")
    score_check(cfg)
    fsb_main(cfg)


def score_check(cfg) -> None:
    """The FS / FS-L scoring + top-K kernel at its default tiles, every dtype, D 64 / 128."""
    s, P, W, K = cfg.cell, cfg.pool, cfg.recent, cfg.top_k
    for dtype in ("fp32", "bf16", "fp16"):
        for fsl in (True, False):
            for D in (64, 128):
                tiles = S.score_tiles(cfg.replace(variant="fsl" if fsl else "fs"), D, None)
                r = usage(
                    S._score_topk_kernel,
                    {"Q": "*" + dtype, "KBAR": "*fp32", "AMAX": "*fp32", "CAND": "*i32", "SIGMA": "*fp32",
                     "LAM": "*fp32", "IDX": "*i64", "T": "i32", "C": "i32", "NBLOCKS": "i32", "HQ": "i32",
                     "HKV": "i32", "stride_qb": "i64", "stride_qt": "i32", "stride_qh": "i32", "stride_qd": "i32",
                     "scale": "fp32"},
                    {"D": D, "CELL": s, "QBLOCK": cfg.block, "TILES_PER_BLOCK": triton.cdiv(cfg.block, tiles.block_m),
                     "TOP_K": K, "K_PAD": max(2, triton.next_power_of_2(K)), "FSL": fsl, "N_CAND": P + W,
                     "SPLIT_DOT": dtype != "fp32", "EARLY_EXIT": tiles.early_exit,
                     "COUNT_ROUNDS": tiles.count_rounds,
                     "ERF_SKIP": tiles.erf_skip, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                     "BLOCK_D": D},
                    tiles.num_warps,
                    tiles.num_stages,
                )
                print(f"ok  _score_topk_kernel {dtype} {'fsl' if fsl else 'fs'} D={D} {tiles}: {r}")


def forward_check() -> None:
    """The split forward's long kernel and window kernel (bf16, D 64, the default tiles) with each
    value of their window-first switches (ADD_TO_OUT / READ_LONG). The pointers are not specialized
    as 16-byte aligned here (a launch does that), so the counts are upper bounds of a real launch's."""
    from freesolo.backends.triton import attention as A

    common = dict(D=64, D_P=64, CELL=32, CELL_P=32, KSEL=4, K_P=4, PREFETCH=True)
    ptrs = ("Q", "K", "V", "IDX", "UNION", "NUNION", "ORDER", "BETA", "LONG_TERM", "LSE_LONG", "RSTD")
    kinds = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "IDX": "*i32", "UNION": "*i32", "NUNION": "*i32",
             "ORDER": "*i32", "BETA": "*fp32", "LONG_TERM": "*bf16", "LSE_LONG": "*fp32", "RSTD": "*fp32"}  # fmt: skip
    long_sig = {**{p: kinds[p] for p in ptrs}, "T": "i32", "Hq": "i32", "Hkv": "i32", "NT": "i32", "qk_scale": "fp32",
                "eps": "fp32"}  # fmt: skip
    for add, order in ((False, False), (True, False), (True, True)):
        constexprs = {**common, "BLOCK_M": 64, "U_MAX": 256, "ADD_TO_OUT": add, "HAS_ORDER": order}
        r = usage(A._long_fwd_kernel, long_sig, constexprs, 4, 1)
        print(f"ok  _long_fwd_kernel ADD_TO_OUT={add} HAS_ORDER={order}: {r}")
    key_sig = {"IDX": "*i32", "KEY": "*i64", "T": "i32", "T_PAD": "i32", "Hq": "i32", "BITS": "i32", "SLOTS": "i32"}
    r = usage(A._order_key_kernel, key_sig, {"KSEL": 4, "K_P": 4, "POS_BITS": 12, "BLOCK": 256}, 4, 1)
    print(f"ok  _order_key_kernel: {r}")
    union_sig = {"IDX": "*i32", "ORDER": "*i32", "UNION": "*i32", "COUNT": "*i32", "T": "i32", "Hq": "i32", "NT": "i32"}
    for order in (False, True):
        r = usage(A._tile_union_kernel, union_sig, {"KSEL": 4, "BLOCK_M": 64, "U_MAX": 256, "U_P": 256, "HAS_ORDER": order}, 4, 1)
        print(f"ok  _tile_union_kernel HAS_ORDER={order}: {r}")
    window_sig = {"Q": "*bf16", "K": "*bf16", "KR": "*bf16", "V": "*bf16", "IDX": "*i32", "UNION": "*i32",
                  "NUNION": "*i32", "BETA": "*fp32", "LONG_TERM": "*bf16", "COS": "*fp32", "SIN": "*fp32", "O": "*bf16",
                  "LSE_LOC": "*fp32", "LSE_LONG": "*fp32", "RSTD": "*fp32", "T": "i32", "Hq": "i32", "Hkv": "i32",
                  "NT": "i32", "TILE0": "i32", "KR_T": "i32", "KR_START": "i32", "W": "i32", "qk_scale": "fp32",
                  "eps": "fp32"}  # fmt: skip
    for read in (True, False):
        constexprs = {**common, "HALF": 32, "BLOCK_M": 64, "BLOCK_N": 64, "U_MAX": 256, "WINDOW_PHASES": True,
                      "HAS_LONG": False, "READ_LONG": read}  # fmt: skip
        r = usage(A._attention_fwd_kernel, window_sig, constexprs, 4, 2, maxnreg=128)
        print(f"ok  _attention_fwd_kernel READ_LONG={read} (maxnreg 128): {r}")


def fsb_main(cfg) -> None:
    """The FS-B prefill search at its default launch, then `fsb_check`."""
    s, K = cfg.cell, cfg.top_k
    # FS-B search (default launch: 4 warps). 2026-12-01: beam 16, D 64: REG:243 STACK:0 (2 warps
    # spill 400 B, 8 warps REG:204); beam 32 spills at 4 warps (944 B).
    fsb_sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "mu_ptr": "*fp32", "rad_ptr": "*fp32", "a_ptr": "*fp32",
               "e_ptr": "*i64", "cell_ptr": "*i64", "base_ptr": "*i64", "hp_ptr": "*i64", "sigma_ptr": "*fp32",
               "lam_ptr": "*fp32", "out_ptr": "*i64", "found_ptr": "*i64", "trace_idx_ptr": "*i64", "trace_key_ptr": "*fp32",
               "trace_i": "i32", "trace_h": "i32", "T": "i32", "N": "i32", "C1": "i32",
               "HB": "i32", "G": "i32", "scale": "fp32", "radius_weight": "fp32", "two_cell": "fp32", "D": "i32"}
    for D in (64, 128):
        r = usage(
            FSB._fsb_search_kernel, fsb_sig,
            {"BLOCK_D": D, "CELL": s, "QBLOCK": cfg.block, "W": cfg.beam, "WP": triton.next_power_of_2(cfg.beam),
             "K": K, "KP": triton.next_power_of_2(K), "FOUND": False, "TRACE": False,
             "TRACE_LEVELS": FSB.TRACE_LEVELS},
            4,
        )  # fmt: skip
        print(f"ok  _fsb_search_kernel beam={cfg.beam} D={D}: {r}")
    fsb_check(cfg)


def fsb_check(cfg) -> None:
    """The FS-B prefill search at its default one warp, and the decode search (bf16 archive keys)."""
    s, K = cfg.cell, cfg.top_k
    fsb_sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "mu_ptr": "*fp32", "rad_ptr": "*fp32", "a_ptr": "*fp32",
               "e_ptr": "*i64", "cell_ptr": "*i64", "base_ptr": "*i64", "hp_ptr": "*i64", "sigma_ptr": "*fp32",
               "lam_ptr": "*fp32", "out_ptr": "*i64", "found_ptr": "*i64", "trace_idx_ptr": "*i64", "trace_key_ptr": "*fp32",
               "trace_i": "i32", "trace_h": "i32", "T": "i32", "N": "i32", "C1": "i32",
               "HB": "i32", "G": "i32", "scale": "fp32", "radius_weight": "fp32", "two_cell": "fp32", "D": "i32"}  # fmt: skip
    forest = {f"{name}_{f}_ptr": kind for f in "ah" for name, kind in
              (("mu", "*fp32"), ("rad", "*fp32"), ("a", "*fp32"), ("e", "*i64"), ("cell", "*i64"), ("base", "*i64"))}  # fmt: skip
    decode_sig = {"q_ptr": "*bf16", "pos_ptr": "*i64", **forest, "n_high_ptr": "*i64",
                  "sigma_ptr": "*fp32", "lam_ptr": "*fp32", "found_ptr": "*i64", "stride_qb": "i64", "stride_qh": "i64",
                  "Na": "i32", "Nh": "i32", "Hkv": "i32", "G": "i32", "scale": "fp32", "radius_weight": "fp32",
                  "two_cell": "fp32", "D": "i32"}  # fmt: skip
    rerank_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "found_ptr": "*i64", "out_ptr": "*i64", "stride_qb": "i64",
                  "stride_qh": "i64", "S": "i32", "Hkv": "i32", "G": "i32", "scale": "fp32", "D": "i32"}  # fmt: skip
    common = {"CELL": s, "W": cfg.beam, "WP": triton.next_power_of_2(cfg.beam), "K": K, "KP": triton.next_power_of_2(K)}
    for D in (64, 128):
        r = usage(FSB._fsb_search_kernel, fsb_sig, {"BLOCK_D": D, "QBLOCK": cfg.block, "FOUND": False, "TRACE": False,
                                                      "TRACE_LEVELS": FSB.TRACE_LEVELS, **common}, 1)  # fmt: skip
        print(f"ok  _fsb_search_kernel 1 warp beam={cfg.beam} D={D}: {r}")
        search = {"BLOCK_D": D, "CELL": s, "QBLOCK": cfg.block, "W": cfg.beam, "WP": common["WP"]}
        r = usage(FSB._fsb_decode_search_kernel, decode_sig, search, 1)
        print(f"ok  _fsb_decode_search_kernel 1 warp beam={cfg.beam} D={D}: {r}")
        rerank = {"BLOCK_D": D, "CELL": s, "WP": common["WP"], "K": K, "KP": common["KP"]}
        r = usage(FSB._fsb_decode_rerank_kernel, rerank_sig, rerank, 1)
        print(f"ok  _fsb_decode_rerank_kernel 1 warp beam={cfg.beam} D={D}: {r}")


if __name__ == "__main__":
    if sys.argv[1:] == ["fsb"]:
        fsb_check(FreeSoloConfig(variant="fsb"))
    elif sys.argv[1:] == ["score"]:
        score_check(FreeSoloConfig())
    elif sys.argv[1:] == ["forward"]:
        forward_check()
    else:
        main()
