"""Backward of the fused Triton attention (`freesolo.backends.triton.attention_bwd`, spec §8).

The kernel is fed the forward's saved tensors (o, lse_loc, lse_long, rstd) computed here by a dense
float64 torch reference on the SAME selection, so the backward is tested alone; one test also runs
the Triton forward when it is importable. Gradients are compared with the torch backend's autograd
in float64 (same indices), and with central finite differences of the NumPy oracle.

On a CPU machine the kernels run interpreted (TRITON_INTERPRET=1, float32, small shapes); the CUDA
tests (bf16 / fp16 / fp32 vs a same-precision naive implementation, long FS-L rows) skip there.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not importable: the Triton backward cannot run")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: Triton kernels cannot run", allow_module_level=True)

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import backend as torch_backend  # noqa: E402
from freesolo.backends.torch._ops import rope, rope_tables  # noqa: E402
from freesolo.backends.triton.attention_bwd import (  # noqa: E402
    LONG_MODE_ENV,
    LONG_MODES,
    BwdTiles,
    attention_backward,
    default_bwd_tiles,
    default_long_mode,
    inverted_selection,
    cell_plan,
    inverted_slots,
    segment_plan,
    tiles_prerotate_default,
)
from freesolo.reference import oracle  # noqa: E402

from .helpers import assert_close, rms_rel_error  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the interpreter runs the CPU tests)")


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def naive_forward(q, k, v, idx, beta, cfg: FreeSoloConfig, dtype=torch.float64):
    """Dense masked FreeSolo attention in `dtype` (differentiable; T x T masks: small T only).

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; idx: int [B, T, Hq, K] (-1 padded); beta: [Hq].
    Returns:
        o [B, T, Hq, D] (dtype), lse_loc, lse_long, rstd fp32... in dtype [B, Hq, T].
    """
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float64)
    cos, sin = cos.to(dtype), sin.to(dtype)
    qh = q.permute(0, 2, 1, 3)  # (B, Hq, T, D)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(G, 1)  # (B, Hq, T, D)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(G, 1)
    scale = D**-0.5
    i = torch.arange(T, device=q.device)[:, None]
    t = torch.arange(T, device=q.device)[None, :]
    lg = (rope(qh, cos, sin) @ rope(kh, cos, sin).transpose(-1, -2)) * scale  # (B, Hq, T, T)
    lg = lg.masked_fill(~((t <= i) & (t > i - cfg.window)), float("-inf"))
    lse_loc = torch.logsumexp(lg.float(), -1)
    o_loc = torch.softmax(lg, -1) @ vh
    cells = idx.to(q.device).permute(0, 2, 1, 3).long()  # (B, Hq, T, K)
    tok_cell = (t // cfg.cell)[None, None, :, :, None]  # (1, 1, 1, T, 1)
    sel = ((tok_cell == cells[:, :, :, None, :]) & (cells[:, :, :, None, :] >= 0)).any(-1)  # (B, Hq, T, T)
    sel = sel & (t < (T // cfg.cell) * cfg.cell)
    lg2 = ((qh @ kh.transpose(-1, -2)) * scale).masked_fill(~sel, float("-inf"))
    lse_long = torch.logsumexp(lg2.float(), -1)
    mx = lg2.detach().amax(-1, keepdim=True)
    e = torch.where(sel, torch.exp(lg2 - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))), 0)
    den = e.sum(-1, keepdim=True)
    o_long = (e @ vh) / torch.where(den > 0, den, torch.ones_like(den))
    rstd = torch.rsqrt((o_long.float() ** 2).mean(-1) + cfg.eps)
    o = o_loc + beta.view(1, Hq, 1, 1) * o_long * torch.rsqrt((o_long**2).mean(-1, keepdim=True) + cfg.eps)
    return o.permute(0, 2, 1, 3), lse_loc, lse_long, rstd


def saved_tensors(q, k, v, idx, beta, cfg):
    """The forward's saved state from the float64 reference: o (q.dtype), lse_loc, lse_long, rstd fp32 [B, Hq, T]."""
    with torch.no_grad():
        o, lse_loc, lse_long, rstd = naive_forward(q, k, v, idx, beta, cfg, torch.float64)
    return o.to(q.dtype), lse_loc.float().contiguous(), lse_long.float().contiguous(), rstd.float().contiguous()


def torch_grads(q, k, v, beta, idx, cfg, do, dtype=torch.float64):
    """dq, dk, dv, dbeta of sum(o * do) by the torch backend's autograd in `dtype` on the same idx."""
    x = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v, beta)]
    o = torch_backend.attention(x[0], x[1], x[2], cfg, x[3], idx=idx)
    return torch.autograd.grad(o, x, do.to(dtype))


def make_inputs(seed, B, T, Hq, Hkv, D, cfg, dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g)
    k = torch.randn(B, T, Hkv, D, generator=g)
    # a few high-norm keys so FS-L pools and selections are not uniform
    k = k * (1 + 2 * (torch.rand(B, T, Hkv, 1, generator=g) > 0.8))
    v = torch.randn(B, T, Hkv, D, generator=g)
    beta = 0.5 + torch.rand(Hq, generator=g)
    do = torch.randn(B, T, Hq, D, generator=g)
    q, k, v, do = (x.to(device=device, dtype=dtype) for x in (q, k, v, do))
    beta = beta.to(device)
    idx = torch_backend.select_cells(q.float(), k.float(), cfg)
    return q, k, v, beta, do, idx


def run_backward(q, k, v, beta, do, idx, cfg, deterministic=True, saved=None, tiles=None):
    o, lse_loc, lse_long, rstd = saved if saved is not None else saved_tensors(q, k, v, idx, beta, cfg)
    T, D = q.shape[1], q.shape[3]
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    return attention_backward(
        do, q, k, v, o, idx, beta.float(), lse_loc, lse_long, rstd, cos, sin, cfg, deterministic=deterministic, tiles=tiles
    )


@pytest.fixture
def nan_poison(monkeypatch):
    """torch.empty / empty_like of float dtypes return NaN-filled tensors: an unwritten element fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    def poisoned_like(*args, **kwargs):
        x = empty_like(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(torch, "empty_like", poisoned_like)


def _check(got, ref, rtol, what):
    for name, a, r in zip(("dq", "dk", "dv", "dbeta"), got, ref):
        assert a.shape == r.shape, f"{what}: {name} shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert_close(a.double().cpu().numpy(), r.double().cpu().numpy(), rtol, f"{what}: {name}")


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ---------------------------------------------------------------------------------------------

# (B, T, Hq, Hkv, D, config): awkward T, GQA group sizes 1, 2, 3, cells 4-8, blocks 8-16, windows 16-32, top_k 1-4
CASES = [
    (1, 1, 2, 1, 32, dict(window=16, cell=4, block=8, top_k=2, pool=3, recent=2)),
    (2, 31, 3, 3, 32, dict(window=16, cell=4, block=8, top_k=1, pool=3, recent=2)),
    (1, 33, 4, 2, 32, dict(window=16, cell=8, block=16, top_k=3, pool=2, recent=1)),
    (1, 63, 3, 1, 64, dict(window=32, cell=4, block=16, top_k=4, pool=3, recent=2)),
    (1, 129, 2, 2, 32, dict(window=32, cell=8, block=16, top_k=2, pool=3, recent=2, variant="fs")),
]


def _case_id(c):
    B, T, Hq, Hkv, D, kw = c
    return f"B{B}-T{T}-H{Hq}x{Hkv}-D{D}-w{kw['window']}-s{kw['cell']}-K{kw['top_k']}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_grads_match_torch_backend_float64(case, nan_poison):
    """fp32 kernel gradients vs the torch backend's float64 autograd on the same selection: rel RMS < 1e-5."""
    B, T, Hq, Hkv, D, kw = case
    cfg = FreeSoloConfig(**kw)
    q, k, v, beta, do, idx = make_inputs(1, B, T, Hq, Hkv, D, cfg)
    got = run_backward(q, k, v, beta, do, idx, cfg)
    ref = torch_grads(q, k, v, beta, idx, cfg, do)
    assert got[0].dtype == q.dtype and got[1].dtype == k.dtype and got[3].dtype == torch.float32
    _check(got, ref, 1e-5, _case_id(case))


@pytest.mark.parametrize(
    "tiles",
    [
        BwdTiles(32, 16, 16, 32, block_r=16, block_q=4, seg=32, num_warps=4, num_stages=1, num_warps_long=4),
        BwdTiles(16, 32, 32, 16, block_r=32, block_q=1, seg=32, num_warps=4, num_stages=1, num_warps_long=4),
    ],
    ids=["kv32x16-q16x32", "kv16x32-q32x16"],  # every tl.dot dimension >= 16 (the GPU's minimum)
)
@pytest.mark.parametrize("prerotate", [True, False], ids=["prerot", "rot-in-kernel"])
def test_uneven_tiles(tiles, prerotate, nan_poison):
    """Tile shapes other than the defaults (thin / wide, window not a multiple of a tile), local kernels
    on pre-rotated q / k (default) or rotating in the kernel (before issue 11): same gradients."""
    cfg = FreeSoloConfig(window=24, cell=4, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(13, 1, 45, 2, 1, 32, cfg)
    got = run_backward(q, k, v, beta, do, idx, cfg, tiles=dataclasses.replace(tiles, prerotate=prerotate))
    _check(got, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, f"uneven tiles, prerotate={prerotate}")


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_union_long_mode(deterministic, nan_poison):
    """long_mode="union" (query tiles over their cell union with tl.dot, per-(tile, cell) atomics in
    the atomic mode) gives the same gradients as the torch backend."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(14, 2, 41, 4, 2, 32, cfg)
    tiles = dataclasses.replace(default_bwd_tiles(32, q.dtype, q.device), long_mode="union", block_u=16)
    got = run_backward(q, k, v, beta, do, idx, cfg, deterministic, tiles=tiles)
    _check(got, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, f"union mode, deterministic={deterministic}")


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("mode", LONG_MODES)
def test_every_long_mode_matches_torch_float64(mode, deterministic, nan_poison):
    """The A/B switch: every long-branch mode ("cell" the default, "gather" and "union" the modes before
    issue 11), deterministic and atomic, against the torch backend's float64 autograd (GQA group 2)."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(15, 2, 43, 4, 2, 32, cfg)
    tiles = dataclasses.replace(default_bwd_tiles(32, q.dtype, q.device), long_mode=mode, block_u=16)
    got = run_backward(q, k, v, beta, do, idx, cfg, deterministic, tiles=tiles)
    _check(got, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, f"long_mode={mode}, deterministic={deterministic}")


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_cell_mode_chunks_of_queries(deterministic, nan_poison):
    """The "cell" mode in chunks of `long_chunk` positions (uneven last chunk, hot cells split into
    segments): same gradients as one chunk (fp32 rounding) and as torch float64; bitwise run to run."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=2, recent=1)
    q, k, v, beta, do, idx = make_inputs(16, 2, 45, 4, 1, 32, cfg)
    saved = saved_tensors(q, k, v, idx, beta, cfg)
    base = default_bwd_tiles(32, q.dtype, q.device)
    assert base.long_mode == "cell"
    chunked = dataclasses.replace(base, long_chunk=13, seg=base.block_r)
    a = run_backward(q, k, v, beta, do, idx, cfg, deterministic, saved, chunked)
    if deterministic:
        b = run_backward(q, k, v, beta, do, idx, cfg, deterministic, saved, chunked)
        for name, x, y in zip(("dq", "dk", "dv", "dbeta"), a, b):
            assert torch.equal(x, y), f"{name}: chunked cell mode differs between two runs"
    _check(a, run_backward(q, k, v, beta, do, idx, cfg, deterministic, saved, base), 1e-6, "13-position chunks vs one")
    _check(a, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, "chunked cell mode vs torch float64")


def test_default_long_mode_env_switch(monkeypatch):
    """FREESOLO_TRITON_BWD_LONG picks the default mode (A/B timing in one process); a bad value is an error."""
    monkeypatch.delenv(LONG_MODE_ENV, raising=False)
    assert default_long_mode(True) == "cell" and default_long_mode(False) == "cell"
    assert tiles_prerotate_default()
    monkeypatch.setenv(LONG_MODE_ENV, "legacy")
    assert default_long_mode(True) == "gather" and default_long_mode(False) == "union"
    assert not tiles_prerotate_default()
    monkeypatch.setenv(LONG_MODE_ENV, "gather")
    assert default_long_mode(False) == "gather"
    monkeypatch.setenv(LONG_MODE_ENV, "fast")
    with pytest.raises(ValueError, match=LONG_MODE_ENV):
        default_long_mode(True)
    with pytest.raises(ValueError, match="long_mode"):
        BwdTiles(long_mode="fast")
    with pytest.raises(ValueError, match="long_chunk"):
        BwdTiles(long_chunk=0)


def test_legacy_env_default_matches_torch(monkeypatch):
    """With FREESOLO_TRITON_BWD_LONG=legacy and no tiles, both modes run the pre-issue-11 paths."""
    monkeypatch.setenv(LONG_MODE_ENV, "legacy")
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(17, 1, 33, 2, 1, 32, cfg)
    ref = torch_grads(q, k, v, beta, idx, cfg, do)
    for det in (True, False):
        _check(run_backward(q, k, v, beta, do, idx, cfg, det), ref, 1e-5, f"legacy default, deterministic={det}")


def test_inverted_slots_list_every_entry_in_order():
    """slots/offsets hold, for every (b, kv head, cell), exactly the flat idx entries that read it, ascending;
    also for a chunk of positions (a strided view) with the whole sequence's cell count."""
    g = torch.Generator().manual_seed(18)
    B, T, Hq, Hkv, K, C = 2, 24, 6, 2, 3, 7
    full = torch.randint(-1, C, (B, T + 5, Hq, K), generator=g)
    idx = full[:, 3 : 3 + T]
    slots, offsets = inverted_slots(idx, Hkv, C)
    assert slots.dtype == torch.int64 and offsets.shape == (B * Hkv * C + 1,) and int(offsets[0]) == 0
    G = Hq // Hkv
    flat = idx.reshape(-1)
    for b in range(B):
        for kvh in range(Hkv):
            for c in range(C):
                key = (b * Hkv + kvh) * C + c
                want = [
                    ((b * T + i) * Hq + h) * K + kk
                    for i in range(T)
                    for h in range(kvh * G, (kvh + 1) * G)
                    for kk in range(K)
                    if int(idx[b, i, h, kk]) == c
                ]
                got = slots[int(offsets[key]) : int(offsets[key + 1])].tolist()
                assert got == want, f"entries of (b={b}, g={kvh}, c={c}): {got} != {want}"
                assert all(int(flat[x]) == c for x in got)
    assert int(offsets[-1]) == int((idx >= 0).sum())


def test_atomic_mode_matches_deterministic():
    """deterministic=False (tl.atomic_add into fp32 buffers; per query and, by default, per tile and cell)
    agrees with the inverted selection to fp32 rounding."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(2, 1, 40, 4, 2, 32, cfg)
    saved = saved_tensors(q, k, v, idx, beta, cfg)
    det = run_backward(q, k, v, beta, do, idx, cfg, True, saved)
    gather = dataclasses.replace(default_bwd_tiles(32, q.dtype, q.device), long_mode="gather")
    ato = run_backward(q, k, v, beta, do, idx, cfg, False, saved, gather)  # per-query atomics
    _check(ato, det, 1e-6, "atomic (gather) vs deterministic")
    ref = torch_grads(q, k, v, beta, idx, cfg, do)
    _check(ato, ref, 1e-5, "atomic (gather) vs torch float64")
    _check(run_backward(q, k, v, beta, do, idx, cfg, False, saved), ref, 1e-5, "atomic (default tiles) vs torch")


def test_deterministic_bitwise_run_to_run():
    """The deterministic mode returns the same bits on repeated calls (no atomics, fixed-order sums)."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(3, 1, 48, 3, 1, 32, cfg)
    saved = saved_tensors(q, k, v, idx, beta, cfg)
    a = run_backward(q, k, v, beta, do, idx, cfg, True, saved)
    b = run_backward(q, k, v, beta, do, idx, cfg, True, saved)
    for name, x, y in zip(("dq", "dk", "dv", "dbeta"), a, b):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs"


def test_hot_cells_split_into_segments(nan_poison):
    """Cells read by more than `seg` readers are split into segments and reduced in a fixed order:
    same gradients as one segment per cell (to fp32 rounding), bitwise run to run."""
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=2, recent=1)
    q, k, v, beta, do, idx = make_inputs(12, 1, 48, 4, 1, 32, cfg)
    saved = saved_tensors(q, k, v, idx, beta, cfg)
    base = default_bwd_tiles(32, q.dtype, q.device)
    small = dataclasses.replace(base, seg=base.block_r)  # the smallest segment
    _, offsets = inverted_selection(idx, 1, cfg.cell)
    assert int((offsets[1:] - offsets[:-1]).max()) > small.seg, "some cell must be read by more than one segment"
    one = dataclasses.replace(small, seg=4096)
    a = run_backward(q, k, v, beta, do, idx, cfg, True, saved, small)
    b = run_backward(q, k, v, beta, do, idx, cfg, True, saved, small)
    for name, x, y in zip(("dq", "dk", "dv", "dbeta"), a, b):
        assert torch.equal(x, y), f"{name}: split segments differ between two runs"
    _check(a, run_backward(q, k, v, beta, do, idx, cfg, True, saved, one), 1e-6, "seg 16 vs one segment")
    _check(a, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, "seg 16 vs torch float64")


@pytest.mark.parametrize(
    "B,T,Hq,Hkv,K,C,t0,tc,seg,min_seg,dtype",
    [
        (2, 29, 6, 2, 3, 7, 3, 24, 4, 1, torch.int32),  # a chunk of positions (t0 > 0), GQA, split cells
        (1, 40, 4, 4, 4, 9, 0, 40, 8, 0, torch.int64),  # unread cells get no work item (min_seg 0)
        (3, 17, 2, 1, 2, 1, 0, 17, 16, 1, torch.int32),  # one cell per kv head
        (1, 300, 8, 2, 4, 70, 0, 300, 32, 1, torch.int32),  # more than one block of 1024 entries / cells
        (1, 12, 2, 1, 2, 33000, 0, 12, 4, 1, torch.int32),  # 33000 cells: int32 sort keys (int16 up to 32767)
    ],
)
def test_cell_plan_equals_the_torch_references(B, T, Hq, Hkv, K, C, t0, tc, seg, min_seg, dtype):
    """`cell_plan` (Triton kernels around one sort) gives the tensors of `inverted_slots` +
    `segment_plan` element for element, -1 entries, empty and many-reader cells included."""
    g = torch.Generator().manual_seed(29 + T)
    idx = torch.randint(-1, C, (B, T, Hq, K), generator=g, dtype=torch.int64)
    idx[:, : T // 3, :, 0] = C - 1  # a popular cell: several segments
    idx = idx.to(dtype).to(DEV)
    slots, offsets = inverted_slots(idx[:, t0 : t0 + tc], Hkv, C)
    want = (slots, offsets) + segment_plan(offsets, B * tc * Hq * K, seg, min_seg)
    got = cell_plan(idx, t0, tc, Hkv, C, seg, min_seg)
    names = ("slots", "offsets", "work_cell", "work_seg", "nseg", "part_base")
    for name, x, y in zip(names, got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        assert torch.equal(x, y), f"{name} differs from the torch reference"
    assert got[-1] == want[-1], "num_slots"
    assert int(got[4].max()) > 1, "the case must split a cell into several segments"


def test_segment_plan_covers_every_reader_once():
    """Work items tile each cell's reader range exactly (segments of `seg`, idle items at the end)."""
    offsets = torch.tensor([0, 0, 5, 5, 23, 24], dtype=torch.int64)  # counts 0, 5, 0, 18, 1
    work_cell, work_seg, nseg, part_base, num_slots = segment_plan(offsets, 24, 4)
    assert nseg.tolist() == [1, 2, 1, 5, 1]
    items = [(int(c), int(j)) for c, j in zip(work_cell, work_seg) if int(c) < 5]
    assert items == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4), (4, 0)]
    assert part_base.tolist()[1] == 0 and part_base.tolist()[3] == 2 and num_slots >= 7


def test_finite_differences_of_the_oracle():
    """Directional derivatives of L = sum(o * do) by central differences of the float64 NumPy oracle
    (same selection) match <grad, u> of the kernel's fp32 gradients, for q, k, v and beta."""
    cfg = FreeSoloConfig(window=8, cell=4, block=8, top_k=2, pool=2, recent=1)
    B, T, Hq, Hkv, D = 1, 20, 2, 1, 8
    q, k, v, beta, do, idx = make_inputs(4, B, T, Hq, Hkv, D, cfg, device="cpu")
    if CUDA:
        q, k, v, beta, do, idx = (x.cuda() for x in (q, k, v, beta, do, idx))
    grads = [g.double().cpu().numpy() for g in run_backward(q, k, v, beta, do, idx, cfg)]
    x0 = [t.double().cpu().numpy() for t in (q, k, v, beta)]
    idx_np, do_np = idx.cpu().numpy(), do.double().cpu().numpy()
    assert (idx_np >= 0).any(), "the case must select cells (long branch exercised)"

    def loss(qq, kk, vv, bb):
        o = oracle.combine(
            oracle.local_attention(qq, kk, vv, cfg), oracle.long_range_readout(qq, kk, vv, idx_np, cfg), bb, cfg.eps
        )
        return float((o * do_np).sum())

    rng = np.random.default_rng(0)
    eps = 1e-6
    for j, name in enumerate(("q", "k", "v", "beta")):
        u = rng.standard_normal(x0[j].shape)
        plus = [x.copy() for x in x0]
        minus = [x.copy() for x in x0]
        plus[j] += eps * u
        minus[j] -= eps * u
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        an = float((grads[j] * u).sum())
        assert abs(fd - an) <= 1e-4 * max(1.0, abs(fd)), f"d{name}: finite difference {fd:.8g} vs kernel {an:.8g}"


def test_inverted_selection_lists_every_reader_in_order():
    """readers/offsets hold, for every (b, kv head, cell), exactly the (b, i, h) that selected it, ascending."""
    g = torch.Generator().manual_seed(5)
    B, T, Hq, Hkv, K, s = 2, 24, 6, 2, 3, 4
    C = T // s
    idx = torch.randint(-1, C, (B, T, Hq, K), generator=g)
    readers, offsets = inverted_selection(idx, Hkv, s)
    assert offsets.shape == (B * Hkv * C + 1,) and int(offsets[0]) == 0
    G = Hq // Hkv
    for b in range(B):
        for kvh in range(Hkv):
            for c in range(C):
                key = (b * Hkv + kvh) * C + c
                want = [
                    (b * T + i) * Hq + h
                    for i in range(T)
                    for h in range(kvh * G, (kvh + 1) * G)
                    for kk in range(K)
                    if int(idx[b, i, h, kk]) == c
                ]
                got = readers[int(offsets[key]) : int(offsets[key + 1])].tolist()
                assert got == want, f"readers of (b={b}, g={kvh}, c={c}): {got} != {want}"


def test_no_cell_rows_and_short_sequences(nan_poison):
    """T < cell (no cell exists) and rows whose idx is all -1 (lse_long = -inf): finite gradients, local branch only."""
    cfg = FreeSoloConfig(window=16, cell=8, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(6, 1, 7, 2, 1, 32, cfg)
    assert (idx < 0).all()
    got = run_backward(q, k, v, beta, do, idx, cfg)
    ref = torch_grads(q, k, v, beta, idx, cfg, do)
    _check(got, ref, 1e-5, "T=7 < cell")
    assert torch.isfinite(got[3]).all()


def test_input_errors_name_the_field():
    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(7, 1, 9, 2, 1, 32, cfg)
    o, lse_loc, lse_long, rstd = saved_tensors(q, k, v, idx, beta, cfg)
    cos, sin = rope_tables(9, 32, cfg.rope_theta, q.device, torch.float32)
    with pytest.raises(ValueError, match="lse_long"):
        attention_backward(do, q, k, v, o, idx, beta, lse_loc, lse_long[:, :, :5], rstd, cos, sin, cfg)
    with pytest.raises(ValueError, match="idx"):
        attention_backward(do, q, k, v, o, idx[..., :1], beta, lse_loc, lse_long, rstd, cos, sin, cfg)
    with pytest.raises(TypeError, match="dtype"):
        attention_backward(do, q, k.double(), v, o, idx, beta, lse_loc, lse_long, rstd, cos, sin, cfg)
    with pytest.raises(ValueError, match="Hkv"):
        attention_backward(do, q, k[:, :, :0], v[:, :, :0], o, idx, beta, lse_loc, lse_long, rstd, cos, sin, cfg)


def test_with_triton_forward_saved_tensors():
    """End to end with the Triton forward's saved tensors."""
    from freesolo.backends.triton.attention import attention_forward

    cfg = FreeSoloConfig(window=16, cell=4, block=8, top_k=2, pool=3, recent=2)
    q, k, v, beta, do, idx = make_inputs(8, 1, 37, 2, 1, 32, cfg)
    cos, sin = rope_tables(37, 32, cfg.rope_theta, q.device, torch.float32)
    saved = attention_forward(q, k, v, idx, beta.float(), cos, sin, cfg)
    ref_saved = saved_tensors(q, k, v, idx, beta, cfg)
    for name, a, r in zip(("o", "lse_loc", "lse_long", "rstd"), saved, ref_saved):
        fa, fr = torch.nan_to_num(a.double(), neginf=-1e30), torch.nan_to_num(r.double(), neginf=-1e30)
        assert_close(fa.cpu().numpy(), fr.cpu().numpy(), 1e-5, f"forward {name}")
    got = run_backward(q, k, v, beta, do, idx, cfg, saved=saved)
    _check(got, torch_grads(q, k, v, beta, idx, cfg, do), 1e-5, "triton forward + backward")


# ---------------------------------------------------------------------------------------------
# CUDA tests (the lead runs them on the H200)
# ---------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("mode", ["cell", "gather"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_cuda_grads_within_4x_naive_same_precision(dtype, deterministic, mode):
    """Spec §13: error vs float64 at most 4x the error of a naive dense implementation in the same dtype."""
    cfg = FreeSoloConfig(window=128, cell=16, block=64, top_k=4, pool=16, recent=4)
    B, T, Hq, Hkv, D = 2, 1000, 6, 2, 64
    q, k, v, beta, do, idx = make_inputs(9, B, T, Hq, Hkv, D, cfg, dtype=dtype)
    ref = torch_grads(q, k, v, beta, idx, cfg, do, torch.float64)
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)] + [beta.to(dtype).requires_grad_(True)]
    o_naive = naive_forward(x[0], x[1], x[2], idx, x[3], cfg, dtype)[0]
    naive = torch.autograd.grad(o_naive, x, do)
    with torch.no_grad():
        o = naive_forward(q, k, v, idx, beta, cfg, torch.float64)
    saved = (o[0].to(dtype), o[1].float(), o[2].float(), o[3].float())
    tiles = dataclasses.replace(default_bwd_tiles(D, dtype, q.device), long_mode=mode)
    got = run_backward(q, k, v, beta, do, idx, cfg, deterministic, saved, tiles)
    for name, a, n, r in zip(("dq", "dk", "dv", "dbeta"), got, naive, ref):
        err, base = rms_rel_error(a.double().cpu(), r.cpu()), rms_rel_error(n.double().cpu(), r.cpu())
        assert err <= 4 * base + 1e-6, f"{dtype} {mode} {name}: error {err:.3e} > 4 x naive {base:.3e}"


@needs_cuda
@pytest.mark.parametrize("chunk", [65536, 1536], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("mode", ["cell", "gather"])
def test_cuda_deterministic_bitwise(mode, chunk):
    cfg = FreeSoloConfig()
    q, k, v, beta, do, idx = make_inputs(10, 1, 4096, 16, 4, 64, cfg, dtype=torch.bfloat16)
    saved = saved_tensors(q, k, v, idx, beta, cfg)
    tiles = dataclasses.replace(default_bwd_tiles(64, q.dtype, q.device), long_mode=mode, long_chunk=chunk)
    a = run_backward(q, k, v, beta, do, idx, cfg, True, saved, tiles)
    b = run_backward(q, k, v, beta, do, idx, cfg, True, saved, tiles)
    for name, x, y in zip(("dq", "dk", "dv", "dbeta"), a, b):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs on CUDA ({mode}, chunk {chunk})"
    if mode == "cell":  # and agrees with the pre-issue-11 path
        old = run_backward(q, k, v, beta, do, idx, cfg, True, saved, dataclasses.replace(tiles, long_mode="gather"))
        for name, x, y in zip(("dq", "dk", "dv", "dbeta"), a, old):
            err = rms_rel_error(x.double().cpu(), y.double().cpu())
            assert err < 1e-2, f"{name}: cell vs gather mode rel RMS {err:.3e}"


@needs_cuda
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_long_sequence_matches_torch_backend(variant):
    """FS-L / FS at T = 65536 (H 16, D 64, bf16): finite gradients equal to the torch backend's (fp32 compute)
    on the same selection, with the Triton forward's saved tensors."""
    from freesolo.backends.triton.attention import attention_forward

    cfg = FreeSoloConfig(variant=variant)
    B, T, Hq, Hkv, D = 1, 65536, 16, 16, 64
    q, k, v, beta, do, idx = make_inputs(11, B, T, Hq, Hkv, D, cfg, dtype=torch.bfloat16)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, torch.float32)
    saved = attention_forward(q, k, v, idx, beta.float(), cos, sin, cfg)
    got = run_backward(q, k, v, beta, do, idx, cfg, True, saved)
    ref = torch_grads(q, k, v, beta, idx, cfg, do, torch.float32)
    for name, a, r in zip(("dq", "dk", "dv", "dbeta"), got, ref):
        assert torch.isfinite(a).all(), f"{name} has non-finite entries at T={T}"
        err = rms_rel_error(a.double().cpu(), r.double().cpu())
        assert err < 2e-2, f"{variant} {name}: rel RMS {err:.3e} vs the torch backend at T={T}"
