"""Small run of every Triton kernel of the forward and backward (FS-L, FS, FS-B readout; the fused
and the split long kernel; deterministic and atomic backward) and of the fused decode (single and
split kernels, the FS-L block boundary in torch and in Triton, the FS-B decode search and its
forest carries) and of the FS-B search and tree builder for compute-sanitizer (memcheck / racecheck):

    compute-sanitizer --tool memcheck python benchmarks/sanitize_triton.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_triton.py [forward_backward] [decode] [fsb_search] [fsb_build] [fsb_build_small]
    compute-sanitizer --tool racecheck python benchmarks/sanitize_triton.py fsl_direct   # the s46 candidate kernel alone
    compute-sanitizer --tool racecheck python benchmarks/sanitize_triton.py d128   # forward + backward at D 128
    compute-sanitizer --tool racecheck python benchmarks/sanitize_triton.py decode_fsb   # FS-B decode alone, builds traced
    python benchmarks/sanitize_triton.py fsb_build_repeat decode_fsb_repeat   # repeated runs, bitwise (no sanitizer)

The decode part prefills its caches with the torch backend, whose local window calls SDPA; racecheck
reports shared-memory hazards inside cuDNN's SDPA kernels (a peer's kernel: s19 `sanitize_fsb`). With
FREESOLO_SANITIZE_CUDNN=0 the run turns cuDNN's SDPA off (`torch.backends.cuda.enable_cudnn_sdp`),
so that a racecheck log lists the hazards of freesolo's kernels only.
"""

from __future__ import annotations

import os

os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")  # the kernels launched eagerly, call by call (s33: CUDA-graph cache)

import torch

import freesolo


def decode():
    from freesolo import FreeSoloCache
    from freesolo.streaming.torch_state import DecodeTiles

    B, T, Hq, Hkv, D = 2, 150, 4, 2, 32
    for variant in ("fsl", "fs"):
        cfg = freesolo.FreeSoloConfig(variant=variant, window=32, cell=8, block=16, pool=4, recent=2, top_k=2)
        q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        tiles = {"single": DecodeTiles(impl="single"), "split": DecodeTiles(impl="split", window_chunk=16)}
        if variant == "fsl":  # the fused Triton FS-L boundary
            tiles["split_tb"] = DecodeTiles(impl="split", window_chunk=16, boundary="triton")
        for name, t in tiles.items():
            cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", decode_kernel="triton", decode_tiles=t,
                                  dtype=torch.bfloat16, device="cuda")
            cache.extend(q[:, :100], k[:, :100], v[:, :100])
            outs = [cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]) for i in range(100, T)]
            torch.cuda.synchronize()
            print("decode", variant, name, "ok", bool(torch.isfinite(torch.cat(outs, 1)).all()))
    decode_fsb()


def decode_fsb(seed=None):
    """FS-B: the Triton decode search (one launch per step) over the streaming forests (trees
    built by `fsb_build`). Returns (outputs [B, 50, Hq, D], the cache's state dict)."""
    from freesolo import FreeSoloCache

    if seed is not None:
        torch.manual_seed(seed)
    B, T, Hq, Hkv, D = 2, 150, 4, 2, 32
    cfg = freesolo.FreeSoloConfig(variant="fsb", window=32, cell=8, block=16, beam=4, top_k=2)
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    cfg = cfg.replace(tau=freesolo.calibrate_tau(k.float(), cfg))
    cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", decode_kernel="triton", dtype=torch.bfloat16, device="cuda")
    cache.extend(q[:, :100], k[:, :100], v[:, :100])
    outs = torch.cat([cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]) for i in range(100, T)], 1)
    torch.cuda.synchronize()
    print("decode fsb triton-search ok", bool(torch.isfinite(outs).all()))
    return outs, cache.state_dict()


def _trace_builds():
    """Print the arguments of every FS-B tree build (`fsb_build.build_tree_slot`) before it runs."""
    from freesolo.backends.triton import fsb_build as fb

    original = fb.build_tree_slot

    def traced(fields, lo, elems, first, changed, h, cell, leaf_order, outward, **kwargs):
        mu = fields["mu"]
        print(f"build: h {h} lo {lo} D {mu.shape[-1]} {mu.dtype} rows {mu.shape[0] * mu.shape[1]} leaf_order {leaf_order} "
              f"outward {outward} changed {changed.flatten().tolist()} first {first.flatten().tolist()} {kwargs}", flush=True)  # fmt: skip
        return original(fields, lo, elems, first, changed, h, cell, leaf_order, outward, **kwargs)

    fb.build_tree_slot = traced


def _tensors(tree, prefix=""):
    """The tensors of a nested dict / list / tuple, by path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def decode_fsb_repeat(runs=20):
    """The FS-B decode of `decode_fsb` from the same inputs `runs` times: outputs and every tensor
    of the cache's state bitwise equal to the first run's? (no sanitizer)"""
    first_out, first_state = decode_fsb(seed=1)
    first_state = _tensors(first_state)
    differ = []
    for run in range(1, runs):
        out, state = decode_fsb(seed=1)
        names = [n for n, t in _tensors(state).items() if not torch.equal(t, first_state[n])]
        if names or not torch.equal(out, first_out):
            differ.append((run, bool(torch.equal(out, first_out)), names))
    print(f"decode fsb repeated {runs} times: runs differing from the first: {len(differ)}", differ)


def fsb_build(D=40, cases=((5, None), (9, 2)), num_warps=None, repeats=1):
    """The FS-B tree-slot builder (`fsb_build._build_tree_slot`): bottom programs only (h 5) and
    top programs with small leaf chunks (h 9, chunks of 4 leaves), float32 and float64, half the
    rows changed, D 40 (padded lanes). `fsb_build_small`: the decode's trees (D 32, h 0 ... 4, one
    bottom program of at most 16 leaves), where s32 call1's racecheck of the decode reported
    write-write hazards at the bottom program's radius reduction."""
    from freesolo.backends.triton.fsb_build import _build_tree_slot

    B, Hkv, M = 2, 3, 700
    for dtype in (torch.float32, torch.float64):
        for h, log_chunk in cases:
            N = (2 << h) - 1 + 5
            fields = {
                "mu": torch.zeros(B, Hkv, N, D, dtype=dtype, device="cuda"),
                "rad": torch.zeros(B, Hkv, N, dtype=dtype, device="cuda"),
                "A": torch.zeros(B, Hkv, N, dtype=dtype, device="cuda"),
                "e": torch.zeros(B, Hkv, N, dtype=torch.int64, device="cuda"),
                "cell": torch.zeros(B, Hkv, N, dtype=torch.int64, device="cuda"),
            }
            elems = {
                "kbar": torch.randn(B, Hkv, M, D, dtype=dtype, device="cuda"),
                "a": torch.rand(B, Hkv, M, dtype=dtype, device="cuda"),
                "cells": torch.arange(M, device="cuda").expand(B, Hkv, M).contiguous(),
                "codes": torch.randint(0, 5, (B, Hkv, M), device="cuda"),
            }
            first = torch.randint(0, M - (1 << h), (B, Hkv), device="cuda")
            changed = torch.rand(B, Hkv, device="cuda") < 0.5
            builds = []
            for _ in range(repeats):
                for t in fields.values():
                    t.zero_()
                _build_tree_slot(fields, 5, elems, first, changed, h, 32, "content", True, log_chunk=log_chunk,
                                 num_warps=num_warps)  # fmt: skip
                builds.append({name: t.clone() for name, t in fields.items()})
            torch.cuda.synchronize()
            differ = sum(any(not torch.equal(b[n], builds[0][n]) for n in b) for b in builds[1:])
            print("fsb_build", dtype, f"h {h} D {D} warps {num_warps or 'default'}", "ok",
                  bool(torch.isfinite(fields["mu"]).all()), f"builds differing from the first: {differ} of {repeats - 1}")  # fmt: skip


def main(parts=("forward_backward", "decode", "fsb_search", "fsb_build", "fsb_build_small")):
    """Runs the named parts (command-line arguments; default all)."""
    import os

    torch.manual_seed(0)
    if os.environ.get("FREESOLO_SANITIZE_CUDNN", "1") == "0":
        torch.backends.cuda.enable_cudnn_sdp(False)
        print("cuDNN SDPA off")
    if "forward_backward" in parts:
        for long_block in (None, 16):  # the default tiles, then the long kernel over 16-query tiles
            forward_backward(long_block)
        from freesolo.backends.triton import attention as att

        saved = att.ROTATION_CHUNK_BYTES, att.ROTATION_CHUNK_MIN_POSITIONS
        att.ROTATION_CHUNK_BYTES, att.ROTATION_CHUNK_MIN_POSITIONS = 1, 64  # the window kernel per 64-query chunk
        forward_backward(None)
        att.ROTATION_CHUNK_BYTES, att.ROTATION_CHUNK_MIN_POSITIONS = saved
        saved_min_t, att.SORTED_LONG_MIN_T = att.SORTED_LONG_MIN_T, 0  # the long tiles sorted by selection at any T
        forward_backward(None)
        att.SORTED_LONG_MIN_T = saved_min_t
    if "d128" in parts:  # the D 128 16-bit default tiles (s51: the window kernel on 64x64 tiles, 4 warps, no cap)
        forward_backward(None, D=128)
    if "forward_backward" in parts or "fsl_direct" in parts:
        fsl_direct()
    if "forward_backward" in parts or "fused_unions" in parts:
        fused_unions()
    if "decode" in parts:
        decode()
    if "fsb_search" in parts:
        fsb_search()
    if "fsb_build" in parts:
        fsb_build()
    small = tuple((h, None) for h in range(5))
    if "decode_fsb" in parts:  # the FS-B decode alone, every tree build traced
        _trace_builds()
        decode_fsb()
    if "decode_fsb_repeat" in parts:
        decode_fsb_repeat()
    if "fsb_build_small" in parts:  # default warps, then one warp (no cross-warp reduction)
        fsb_build(D=32, cases=small)
        fsb_build(D=32, cases=small, num_warps=1)
    if "fsb_build_repeat" in parts:  # no sanitizer: do repeated builds of the same inputs give the same bits?
        fsb_build(D=32, cases=small, repeats=200)
        fsb_build(cases=((5, None), (9, 2)), repeats=50)


def fsl_direct():
    """The FS-L candidates of short sequences by one sorting launch (`_fsl_cand_direct_kernel`, s46):
    the forward + backward with it on, then the kernel alone on the default config at 1k / 8k / 32k
    keys (N_PAD 64: the 64 pool slots pad 31 cells; 256 on 4 warps; 1024 at the cap)."""
    from freesolo.backends.triton import selection

    os.environ[selection.ENV_FSL_DIRECT_MAX_CELLS] = str(selection.DIRECT_CELLS_CAP)
    forward_backward(None)
    del os.environ[selection.ENV_FSL_DIRECT_MAX_CELLS]
    cfg = freesolo.FreeSoloConfig(variant="fsl")
    for T in (1000, 8192, 32768):
        k = torch.randn(2, T, 2, 64, device="cuda", dtype=torch.bfloat16)
        _, amax = selection.cell_stats(k, cfg.cell)
        cand = selection.fsl_candidates(amax, T, cfg, direct=True)
        torch.cuda.synchronize()
        print("fsl_direct", T, "ok", tuple(cand.shape), int(cand.max()))


def fused_unions():
    """The tile unions written by the scoring kernel (FREESOLO_TRITON_FUSED_UNIONS=1, s48): the forward +
    backward with 32-query long tiles (the scoring tiles of block 32), then `select_cells` with
    union_rows on the default config at 4k + 96 (GQA, B 2, a partial last tile)."""
    from freesolo.backends.triton import attention as att
    from freesolo.backends.triton import selection

    os.environ[att.ENV_FUSED_UNIONS] = "1"
    forward_backward(32)
    os.environ.pop("FREESOLO_TRITON_LONG_BLOCK", None)
    for variant in ("fsl", "fs"):
        cfg = freesolo.FreeSoloConfig(variant=variant)
        q = torch.randn(2, 4192, 8, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 4192, 2, 64, device="cuda", dtype=torch.bfloat16)
        idx, union, count = selection.select_cells(q, k, cfg, out_dtype=torch.int32, union_rows=64)
        torch.cuda.synchronize()
        print("fused_unions", variant, "ok", tuple(union.shape), int(count.max()))
    del os.environ[att.ENV_FUSED_UNIONS]


def fsb_search():
    """The Triton FS-B beam search + rerank (issue 12), MHA and GQA, T not a multiple of the block:
    the per-query rerank and the tile rerank (the default), node rows in chunks of 16 dims (the
    default; D 32: two chunks) and all at once."""
    from freesolo.backends.triton import fsb_search as search

    modes = (("query", 16), ("tile", 16), ("tile", None))
    for Hq, Hkv in ((4, 4), (4, 2)):
        cfg = freesolo.FreeSoloConfig(variant="fsb", window=64, cell=8, block=32, beam=4, top_k=2)
        q = torch.randn(2, 301, Hq, 32, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 301, Hkv, 32, device="cuda", dtype=torch.bfloat16)
        cfg = cfg.replace(tau=freesolo.calibrate_tau(k.float(), cfg))
        for rerank, chunk in modes:
            os.environ[search.RERANK_ENV], search.SEARCH_DIM_CHUNK = rerank, chunk
            idx = search.fsb_select_cells(q, k, cfg)
            torch.cuda.synchronize()
            print("fsb_search", Hq, Hkv, f"rerank={rerank} dim_chunk={chunk}", "ok", tuple(idx.shape), int(idx.max()))
    del os.environ[search.RERANK_ENV]
    search.SEARCH_DIM_CHUNK = 16


def forward_backward(long_block, D=32):
    """FS-L / FS / FS-B forward + backward through the API, bf16, B 2, T 301, Hq 4, Hkv 2, head dim D;
    long_block: FREESOLO_TRITON_LONG_BLOCK (None: the default tiles of D)."""
    import os

    if long_block is None:
        os.environ.pop("FREESOLO_TRITON_LONG_BLOCK", None)
    else:
        os.environ["FREESOLO_TRITON_LONG_BLOCK"] = str(long_block)
    for variant in ("fsl", "fs", "fsb"):
        cfg = freesolo.FreeSoloConfig(variant=variant, window=64, cell=8, block=32, pool=4, recent=2, top_k=2)
        q = torch.randn(2, 301, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 301, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 301, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        if variant == "fsb":
            cfg = cfg.replace(tau=freesolo.calibrate_tau(k.detach().float(), cfg))
        o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
        o.float().square().sum().backward()
        torch.cuda.synchronize()
        print("D", D, "long_block", long_block, variant, "ok", bool(torch.isfinite(q.grad).all()))


if __name__ == "__main__":
    import sys

    main(tuple(sys.argv[1:]) or ("forward_backward", "decode", "fsb_search", "fsb_build", "fsb_build_small"))
