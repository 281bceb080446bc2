"""The fused Triton forward kernel (`freesolo.backends.triton.attention.attention_forward`) on given
selections (spec §2, §7, §13; lemma L12).

Selection is tested elsewhere (test_triton_selection.py): here the kernel reads the indices of the
torch backend / the oracle (fla style) and must reproduce
- o against the float64 oracle (local branch + long readout + combine with the same idx):
  float32 rms-rel < 1e-5; bf16 / fp16 within 2x the error of the naive same-precision dense
  implementation (spec §13);
- lse_loc, lse_long, rstd against a float64 dense recomputation written here;
- L12 bitwise: a row alone == the row in a batch; a prefix == the same rows of the full
  sequence; a query's bits do not change when the other queries of its tile select other cells.
Outputs are allocated by the kernel's host code with torch.empty: a fixture poisons every
torch.empty with NaN so that an unwritten element fails.

On a CPU machine the kernel runs under Triton's interpreter (TRITON_INTERPRET=1) in float32
(triton 3.6's interpreter computes tl.dot of bfloat16 operands wrongly, so 16-bit runs are GPU
tests); the CUDA tests (bf16 / fp16 / fp32, long T, int64 offsets) skip without a GPU. Run on the H200:
    HYPOTHESIS_PROFILE=ci python -m pytest -q proofs_tests/test_triton_attention.py
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles any kernel
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import select_cells  # noqa: E402
from freesolo.backends.torch._ops import rope_tables  # noqa: E402
from freesolo.backends.triton.attention import AttentionTiles, attention_forward, tile_unions  # noqa: E402
from freesolo.reference import oracle  # noqa: E402

from .helpers import assert_close, random_qkv, rms_rel_error, triton_kernel_tests  # noqa: E402

CUDA, INTERPRETED, DEVICE, pytestmark = triton_kernel_tests()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 / fp16 / long T run on the H200)")


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors (fla's trick): unwritten output fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


def _cfg(**kw) -> FreeSoloConfig:
    base = dict(variant="fs", window=16, cell=4, block=8, pool=3, recent=2, top_k=3)
    base.update(kw)
    return FreeSoloConfig(**base)


def _selection(q, k, cfg) -> np.ndarray:
    """int64 [B, T, Hq, K] of the torch backend in float64 (== the oracle's up to near-ties)."""
    return select_cells(torch.from_numpy(q), torch.from_numpy(k), cfg).numpy()


def _run(q, k, v, idx, beta, cfg, dtype=torch.float32, device=DEVICE, tiles=None):
    """The kernel on numpy inputs; returns (o, lse_loc, lse_long, rstd) as float64 numpy arrays."""

    def t(x, dt):
        return torch.as_tensor(np.ascontiguousarray(x)).to(device=device, dtype=dt)

    T, D = q.shape[1], q.shape[3]
    cos, sin = rope_tables(T, D, cfg.rope_theta, device, torch.float32)
    qt, kt, vt = (t(x, dtype) for x in (q, k, v))
    it = t(idx, torch.as_tensor(idx).dtype)
    out = attention_forward(qt, kt, vt, it, t(beta, torch.float32), cos, sin, cfg, tiles)
    assert out[0].dtype == dtype and out[0].shape == q.shape
    return [x.detach().double().cpu().numpy() for x in out]


def _oracle(q, k, v, idx, cfg, beta) -> np.ndarray:
    """float64 o [B, T, Hq, D] of spec §7 for the selection idx (oracle loops)."""
    o_loc = oracle.local_attention(q, k, v, cfg)
    return oracle.combine(o_loc, oracle.long_range_readout(q, k, v, idx, cfg), beta, cfg.eps)


def dense_stats(q, k, v, idx, cfg):
    """float64 dense recomputation (T x T masks) of the statistics the backward reads:
    lse_loc, lse_long, rstd [B, Hq, T] (lse_long = -inf and rstd = 1/sqrt(eps) where no cell)."""
    q, k, v = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    half = D // 2
    inv = cfg.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]  # [T, 1, D/2]

    def rot(x):  # [B, T, H, D], complex-free half-split rotation
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)  # [B, T, Hq, D]
    i = torch.arange(T)[:, None]
    t = torch.arange(T)[None, :]
    local = (t <= i) & (t > i - cfg.window)
    lg = torch.einsum("bihd,bthd->bhit", rot(q), rot(kk)) / math.sqrt(D)
    lse_loc = torch.logsumexp(lg.masked_fill(~local, -math.inf), -1)
    cells = torch.as_tensor(idx, dtype=torch.int64).permute(0, 2, 1, 3)  # [B, Hq, T, K]
    cells = cells[:, :, :, None, :]  # [B, Hq, T, 1, K]
    sel = (((t // cfg.cell)[None, None, :, :, None] == cells) & (cells >= 0)).any(-1)  # [B, Hq, T, T]
    lg2 = torch.einsum("bihd,bthd->bhit", q, kk) / math.sqrt(D)
    lse_long = torch.logsumexp(lg2.masked_fill(~sel, -math.inf), -1)  # -inf where nothing selected
    p = torch.where(sel, torch.exp(lg2 - torch.where(sel.any(-1), lse_long, 0.0)[..., None]), 0.0)
    o_long = torch.einsum("bhit,bthd->bhid", p, vv)
    rstd = 1.0 / torch.sqrt((o_long**2).mean(-1) + cfg.eps)
    return lse_loc.numpy(), lse_long.numpy(), rstd.numpy()


def _check_stats(got, q, k, v, idx, cfg, rtol):
    lse_loc, lse_long, rstd = dense_stats(q, k, v, idx, cfg)
    assert_close(got[1], lse_loc, rtol, "lse_loc")
    none = ~(np.asarray(idx) >= 0).any(-1).transpose(0, 2, 1)  # [B, Hq, T]: rows with no cell
    assert np.all(got[2][none] == -np.inf), "lse_long must be -inf where no cell is selected"
    if (~none).any():
        assert_close(got[2][~none], lse_long[~none], rtol, "lse_long")
    assert_close(got[3], rstd, rtol, "rstd")
    assert np.allclose(got[3][none], 1 / math.sqrt(cfg.eps), rtol=1e-6), "rstd where no cell: 1/sqrt(eps)"


# (B, T, Hq, Hkv, D, cfg overrides): awkward T (1, 31, 33, 63, 129, 200), D 8 / 16 / 32,
# GQA groups 1, 2, 3, cells 4 / 8, blocks 8 / 16, windows 16 - 32, top_k 1 - 4, FS and FS-L.
CASES = [
    (1, 1, 2, 1, 8, dict()),
    (2, 31, 3, 1, 16, dict(top_k=2)),
    (1, 33, 4, 2, 8, dict(variant="fsl", top_k=4)),
    (1, 63, 2, 2, 32, dict(window=24, top_k=1)),
    # the long loop without prefetch, the window as one masked loop
    (1, 63, 3, 1, 16, dict(top_k=4, tiles=AttentionTiles(32, 32, 1, 1, prefetch=False, window_phases=False))),
    (1, 129, 3, 1, 16, dict(variant="fsl", cell=8, block=16, window=32, pool=4, recent=2, top_k=3)),
    (1, 200, 2, 1, 16, dict(variant="fsl", cell=8, block=16, window=20, pool=3, recent=2, top_k=2)),
    # window >> tiles: the unmasked interior key tiles of the local loop (the default CPU tiles
    # of 32 never have one at windows <= 32), tiles smaller than the window and than T
    # (D 24: padded to 32 lanes, so the unmasked phase masks the padding dims)
    (1, 100, 2, 1, 24, dict(window=48, cell=8, block=16, top_k=2, tiles=AttentionTiles(16, 16, 1, 1))),
    # the long branch in its own kernel over 16-query tiles (smaller unions), with and without
    # prefetch, and over tiles larger than the window kernel's (long_block 64 > block_m 32)
    (2, 77, 3, 1, 16, dict(variant="fsl", top_k=3, tiles=AttentionTiles(32, 32, 1, 1, long_block=16))),
    (
        1,
        129,
        2,
        2,
        24,
        dict(
            cell=8,
            block=16,
            window=32,
            top_k=2,
            tiles=AttentionTiles(32, 32, 1, 1, prefetch=False, long_block=64, maxnreg=128),
        ),
    ),
]


def _case_id(c):
    B, T, Hq, Hkv, D, kw = c
    return f"B{B}-T{T}-Hq{Hq}-Hkv{Hkv}-D{D}-" + "-".join(f"{k}{v}" for k, v in kw.items() if k != "tiles")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_float32_matches_oracle(case):
    """float32 o vs the float64 oracle (same idx) < 1e-5 rms-rel; statistics vs float64 dense."""
    B, T, Hq, Hkv, D, kw = case
    kw = dict(kw)
    tiles = kw.pop("tiles", None)
    cfg = _cfg(**kw)
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in random_qkv(T + D, B, T, Hq, Hkv, D))
    beta = np.linspace(-1.0, 1.5, Hq)
    idx = _selection(q, k, cfg)
    got = _run(q, k, v, idx, beta, cfg, tiles=tiles)
    assert_close(got[0], _oracle(q, k, v, idx, cfg, beta), 1e-5, "o")
    _check_stats(got, q, k, v, idx, cfg, 1e-5)


def test_any_order_int32_and_padding_in_the_middle():
    """idx in any order, int32, -1 pads anywhere: same output bits as the sorted int64 selection
    up to summation order (the kernel reads cells in ascending order whatever idx lists)."""
    cfg = _cfg(top_k=3)
    q, k, v = random_qkv(5, 1, 48, 2, 1, 16)
    beta = np.array([0.7, -1.2])
    idx = _selection(q, k, cfg)
    rng = np.random.default_rng(0)
    shuffled = np.take_along_axis(idx, rng.permuted(np.argsort(idx, -1), axis=-1), -1).astype(np.int32)
    a = _run(q, k, v, idx, beta, cfg)
    b = _run(q, k, v, shuffled, beta, cfg)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert_close(a[0], _oracle(q, k, v, idx, cfg, beta), 1e-5, "o")


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
def test_tile_unions(use_kernel):
    """Each tile's union: the distinct cells of its queries, ascending, -1 padded, with its count
    (torch sorts, and the Triton kernel that CUDA uses: tl.sort + neighbour dedup + prefix sum)."""
    rng = np.random.default_rng(1)
    B, T, Hq, K, bm = (1, 7, 2, 3, 4) if use_kernel else (2, 13, 3, 2, 4)  # kernel: few programs (slow tl.sort)
    idx = rng.integers(-1, 9, size=(B, T, Hq, K))
    idx[0, 0, 0] = [5, 5, -1] if use_kernel else [5, 5]  # a duplicate inside one query
    union, count, _ = tile_unions(torch.from_numpy(idx).to(DEVICE), bm, use_kernel=use_kernel)
    NT = -(-T // bm)
    assert union.shape == (B * Hq, NT, bm * K) and count.shape == (B * Hq, NT) and union.dtype == torch.int32
    union, count = union.cpu(), count.cpu()
    for b in range(B):
        for h in range(Hq):
            for j in range(NT):
                want = sorted({int(c) for c in idx[b, bm * j : bm * j + bm, h].ravel() if c >= 0})
                row = union[b * Hq + h, j].tolist()
                assert row == want + [-1] * (bm * K - len(want)), (b, h, j, row, want)
                assert count[b * Hq + h, j] == len(want)


@needs_cuda
def test_cuda_union_kernel_matches_torch_sorts():
    """The union kernel (tl.sort, one launch) == the torch sorts on a large random selection."""
    g = torch.Generator(device="cuda").manual_seed(2)
    idx = torch.randint(-1, 300, (2, 3001, 5, 4), device="cuda", generator=g)
    for block_m in (32, 64, 128):
        a = tile_unions(idx, block_m, use_kernel=True)
        b = tile_unions(idx, block_m, use_kernel=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"block_m={block_m}"


@pytest.mark.parametrize("D", [8, 48])
def test_rope_rotate_matches_torch_rope(D):
    """_common.rope_rotate (the keys of the window, rotated once) == the torch backend's RoPE."""
    from freesolo.backends.torch._ops import rope
    from freesolo.backends.triton._common import rope_rotate

    x = torch.randn(2, 37, 3, D, device=DEVICE)
    cos, sin = rope_tables(37, D, 10000.0, DEVICE, torch.float32)
    want = rope(x.permute(0, 2, 1, 3), cos, sin).permute(0, 2, 1, 3)  # rope works on [..., T, D]
    assert_close(rope_rotate(x, cos, sin).cpu().numpy(), want.cpu().numpy(), 1e-6, "rope_rotate")


# ---- L12: bitwise row independence ------------------------------------------------------------


def _bitwise_equal(a, b, where: str):
    for name, x, y in zip(("o", "lse_loc", "lse_long", "rstd"), a, b):
        assert np.array_equal(x, y, equal_nan=False), f"{where}: {name} differs (max {np.nanmax(np.abs(x - y)):.3e})"


@pytest.mark.parametrize("dtype", ["fp32"] + (["bf16", "fp16"] if CUDA else []))
def test_l12_row_alone_equals_row_in_batch(dtype):
    """Batch row 1 of 3 alone (B = 1) gives the same bits as inside the batch."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cfg = _cfg(variant="fsl", top_k=2)
    q, k, v = random_qkv(7, 3, 45, 2, 1, 16)
    beta = np.array([1.0, -0.5])
    idx = _selection(q, k, cfg)
    full = _run(q, k, v, idx, beta, cfg, dt)
    alone = _run(q[1:2], k[1:2], v[1:2], idx[1:2], beta, cfg, dt)
    _bitwise_equal([x[1:2] for x in full], alone, "row 1 alone vs in batch")


def test_l12_prefix_equals_full_sequence():
    """The first 45 positions of a 70-token sequence give the same bits as the 45-token prefix run
    alone (later tokens, later queries' selections and the tile padding change nothing)."""
    cfg = _cfg(variant="fs", top_k=3)
    q, k, v = random_qkv(8, 1, 70, 3, 1, 16)
    beta = np.array([1.0, -0.5, 2.0])
    idx = _selection(q, k, cfg)
    full = _run(q, k, v, idx, beta, cfg)
    P = 45
    pre = _run(q[:, :P], k[:, :P], v[:, :P], idx[:, :P], beta, cfg)
    _bitwise_equal([full[0][:, :P]] + [x[..., :P] for x in full[1:]], pre, "prefix vs full")


@pytest.mark.parametrize(
    "tiles",
    [None, AttentionTiles(32, 32, 1, 1, long_block=16)],
    ids=["fused", "long-block-16"],
)
def test_l12_other_queries_selections_change_nothing(tiles):
    """Queries 40 and 41 keep their cells; every other query of the sequence selects other cells
    (including cells between theirs, so the tile's union interleaves new cells): the two rows'
    bits do not change, while the changed rows do change."""
    cfg = _cfg(variant="fs", top_k=2)
    q, k, v = random_qkv(9, 1, 48, 2, 1, 16)
    beta = np.array([1.0, 1.0])
    idx = np.full((1, 48, 2, 2), -1, dtype=np.int64)
    idx[0, 8:, :, 0] = 0  # every query with available cells reads cell 0 ...
    idx[0, 40:42, :, :] = [[1, 7], [1, 7]]  # ... except 40 and 41: cells 1 and 7
    other = idx.copy()
    rng = np.random.default_rng(3)
    for i in range(8, 48):
        if i in (40, 41):
            continue
        n_avail = (i // cfg.block) * cfg.block // cfg.cell
        other[0, i, :, :] = [rng.choice(n_avail, size=2, replace=False) for _ in range(2)]
    other[0, 44, :, :] = [[3, 5], [2, 6]]  # cells strictly between 1 and 7, in the same tile
    other[0, 42, :, :] = [[2, 4], [3, 6]]  # and in the same 16-query long tile
    a = _run(q, k, v, idx, beta, cfg, tiles=tiles)
    b = _run(q, k, v, other, beta, cfg, tiles=tiles)
    keep = [40, 41]
    rows = [[x[:, keep] for x in r[:1]] + [x[..., keep] for x in r[1:]] for r in (a, b)]
    _bitwise_equal(rows[0], rows[1], "rows 40, 41")
    assert not np.array_equal(a[0][:, 44], b[0][:, 44]), "row 44 selects other cells: its output must change"
    assert_close(b[0], _oracle(q, k, v, other, cfg, beta), 1e-5, "o (other selections)")


def test_long_block_equals_fused_path():
    """The separate long kernel (long_block 16 and 64) gives the fused kernel's outputs and
    statistics: the same per-row steps over smaller or larger unions (float32; equal to
    rounding: different tile shapes may round differently on a GPU)."""
    cfg = _cfg(variant="fsl", top_k=3)
    q, k, v = random_qkv(11, 2, 90, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    ref = _run(q, k, v, idx, beta, cfg, tiles=AttentionTiles(32, 32, 1, 1))
    for long_block in (16, 64):
        got = _run(q, k, v, idx, beta, cfg, tiles=AttentionTiles(32, 32, 1, 1, long_block=long_block))
        for name, x, y in zip(("o", "lse_loc", "lse_long", "rstd"), got, ref):
            fin = np.isfinite(y)
            assert np.array_equal(fin, np.isfinite(x)), f"long_block={long_block}: {name} finite pattern"
            assert_close(x[fin], y[fin], 1e-6, f"long_block={long_block} {name}")


def test_long_into_out_equals_fp32_buffer():
    """AttentionTiles.long_into_out (the long kernel writes its term into o, the window kernel adds
    o_loc there) gives the same bits as the fp32 hand-over buffer for float32 inputs, every output
    and statistic; it needs the separate long kernel."""
    cfg = _cfg(variant="fsl", top_k=3)
    q, k, v = random_qkv(12, 2, 90, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    for long_block in (16, 64):
        ref = _run(q, k, v, idx, beta, cfg, tiles=AttentionTiles(32, 32, 1, 1, long_block=long_block))
        got = _run(q, k, v, idx, beta, cfg, tiles=AttentionTiles(32, 32, 1, 1, long_block=long_block, long_into_out=True))
        _bitwise_equal(got, ref, f"long_into_out, long_block={long_block}")
    with pytest.raises(ValueError, match="long_into_out"):
        AttentionTiles(32, 32, 1, 1, long_into_out=True)


def test_window_first_equals_long_into_out():
    """AttentionTiles.window_first (the window kernel writes o = o_loc, then the long kernel adds its
    term) gives the same bits as long_into_out for float32 inputs (the fp32 sum o_loc + long term is
    the same either way), every output and statistic; `forward_with_selection` with a selection
    function gives attention_forward's outputs on that selection; window_first needs long_into_out."""
    from freesolo.backends.triton.attention import forward_with_selection

    cfg = _cfg(variant="fsl", top_k=3)
    q, k, v = random_qkv(13, 2, 90, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    for long_block in (16, 64):
        into = AttentionTiles(32, 32, 1, 1, long_block=long_block, long_into_out=True)
        first = AttentionTiles(32, 32, 1, 1, long_block=long_block, long_into_out=True, window_first=True)
        ref = _run(q, k, v, idx, beta, cfg, tiles=into)
        _bitwise_equal(_run(q, k, v, idx, beta, cfg, tiles=first), ref, f"window_first, long_block={long_block}")
        T, D = q.shape[1], q.shape[3]
        cos, sin = rope_tables(T, D, cfg.rope_theta, DEVICE, torch.float32)
        qt, kt, vt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v))
        calls = []

        def select(q_, k_):
            calls.append(1)
            return torch.as_tensor(idx, device=DEVICE)

        got_idx, got = forward_with_selection(qt, kt, vt, select, torch.as_tensor(beta, dtype=torch.float32, device=DEVICE),
                                              cos, sin, cfg, first)  # fmt: skip
        assert len(calls) == 1 and np.array_equal(got_idx.cpu().numpy(), idx)
        _bitwise_equal([x.double().cpu().numpy() for x in got], ref, f"forward_with_selection, long_block={long_block}")
    with pytest.raises(ValueError, match="window_first"):
        AttentionTiles(32, 32, 1, 1, long_block=16, window_first=True)


def test_sorted_long_tiles_change_no_bit(monkeypatch):
    """AttentionTiles.sorted_long (the long tiles hold queries sorted by selection,
    `long_query_order`) gives the bits of consecutive tiles, every output and statistic (spec L12:
    a row's steps are its own cells in ascending order whatever tile it lands in), with GQA, B 2,
    a partial last tile and queries without cells; and matches the oracle."""
    from freesolo.backends.triton import attention as att

    monkeypatch.setattr(att, "SORTED_LONG_MIN_T", 0)  # sort at any length (the default skips short sequences)
    cfg = _cfg(variant="fsl", top_k=3)
    q, k, v = random_qkv(14, 2, 90, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    for long_block in (16, 64):
        for first in (False, True):
            plain = AttentionTiles(32, 32, 1, 1, long_block=long_block, long_into_out=True, window_first=first)
            ref = _run(q, k, v, idx, beta, cfg, tiles=plain)
            got = _run(q, k, v, idx, beta, cfg, tiles=dataclasses.replace(plain, sorted_long=True))
            _bitwise_equal(got, ref, f"sorted_long, long_block={long_block}, window_first={first}")
    assert_close(got[0], _oracle(q, k, v, idx, cfg, beta), 1e-5, "o (sorted_long)")


@pytest.mark.parametrize("dtype", ["fp32"] + (["bf16", "fp16"] if CUDA else []))
def test_long_tma_loads_change_no_bit(monkeypatch, dtype):
    """AttentionTiles.long_tma (the long kernel's cell tiles through tensor descriptors, compiler
    pipelined) gives the bits of the pointer loads, every output and statistic, with GQA, B 2, T
    not a multiple of the cell or the tile, sorted and consecutive tiles, window_first on and off;
    and matches the oracle. Cells of 16 (a descriptor box needs >= 16 rows here: tl.dot's width)."""
    from freesolo.backends.triton import attention as att

    if CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9 or more (this GPU runs the pointer loads)")
    monkeypatch.setattr(att, "SORTED_LONG_MIN_T", 0)  # sort at any length (the default skips short sequences)
    made = []
    descriptor = att._kv_descriptor
    monkeypatch.setattr(att, "_kv_descriptor", lambda x, cell: made.append(cell) or descriptor(x, cell))
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cfg = _cfg(variant="fsl", window=32, cell=16, block=32, pool=3, recent=1, top_k=2)
    q, k, v = random_qkv(31, 2, 171, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    assert (idx >= 0).sum() > 100, "too few selected cells: the long kernel would read nothing"
    for first in (False, True):
        for sort in (False, True):
            plain = AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True, window_first=first, sorted_long=sort)
            ref = _run(q, k, v, idx, beta, cfg, dt, tiles=plain)
            got = _run(q, k, v, idx, beta, cfg, dt, tiles=dataclasses.replace(plain, long_tma=True))
            _bitwise_equal(got, ref, f"long_tma, window_first={first}, sorted={sort}, {dtype}")
    assert made == [cfg.cell] * 8, f"the TMA path ran {len(made) // 2} of 4 times"
    if dtype == "fp32":
        assert_close(got[0], _oracle(q, k, v, idx, cfg, beta), 1e-5, "o (long_tma)")
    with pytest.raises(ValueError, match="long_tma"):
        AttentionTiles(32, 32, 1, 1, long_tma=True)


def test_long_tma_layout_rules():
    """`_long_tma_ok`: descriptors only where TMA can describe the cell tiles (cell and D powers
    of two in [16, 256], heads D apart with contiguous elements, 16-byte aligned base and strides);
    otherwise the pointer loads run, with the same bits (a contiguous k whose base is not aligned)."""
    from freesolo.backends.triton.attention import _long_tma_ok

    k = torch.zeros(2, 40, 3, 16, device=DEVICE)
    if CUDA and torch.cuda.get_device_capability()[0] < 9:
        assert not _long_tma_ok(k, k, 16), "a GPU below sm_90 has no TMA"
        return
    assert _long_tma_ok(k, k, 16) and _long_tma_ok(k, k, 32)
    assert not _long_tma_ok(k, k, 8), "a cell of 8 rows is below tl.dot's width"
    assert not _long_tma_ok(k, k, 24), "a cell of 24 is not a power of two"
    k24 = torch.zeros(2, 40, 3, 24, device=DEVICE)
    assert not _long_tma_ok(k24, k24, 16), "D 24 is not a power of two"
    wide = torch.zeros(2, 40, 3, 32, device=DEVICE)[..., :16]  # heads 32 elements apart
    assert not _long_tma_ok(wide, wide, 16)
    odd = torch.zeros(2 * 40 * 3 * 16 + 1, device=DEVICE)[1:].view(2, 40, 3, 16)  # base 4 bytes past alignment
    assert not _long_tma_ok(odd, odd, 16)
    # a call with such a k runs the pointer loads: the same bits as with long_tma off
    cfg = _cfg(variant="fsl", window=32, cell=16, block=32, pool=3, recent=1, top_k=2)
    q, kk, v = random_qkv(32, 1, 100, 2, 1, 16)
    beta = np.array([1.0, -0.5])
    idx = torch.as_tensor(_selection(q, kk, cfg), device=DEVICE)
    T, D = q.shape[1], q.shape[3]
    cos, sin = rope_tables(T, D, cfg.rope_theta, DEVICE, torch.float32)
    qt, vt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, v))
    k_odd = torch.zeros(kk.size + 1, device=DEVICE)[1:].view(kk.shape)  # contiguous, base not 16-byte aligned
    k_odd.copy_(torch.as_tensor(kk, dtype=torch.float32))
    assert not _long_tma_ok(k_odd, k_odd, cfg.cell)
    bt = torch.as_tensor(beta, dtype=torch.float32, device=DEVICE)
    plain = AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True, window_first=True)
    ref = attention_forward(qt, k_odd.clone(), vt, idx, bt, cos, sin, cfg, plain)
    got = attention_forward(qt, k_odd, vt, idx, bt, cos, sin, cfg, dataclasses.replace(plain, long_tma=True))
    _bitwise_equal([x.double().cpu().numpy() for x in got], [x.double().cpu().numpy() for x in ref], "unaligned k, long_tma")


@needs_cuda
def test_cuda_default_tiles_take_tma_on_hopper(monkeypatch):
    """default_tiles: long_tma for the split 16-bit kernels on sm_90+ only, when LONG_TMA_DEFAULT
    or FREESOLO_TRITON_LONG_TMA=1 asks for it; off with FREESOLO_TRITON_LONG_TMA=0 (read at each call)."""
    from freesolo.backends.triton.attention import ENV_LONG_TMA, LONG_TMA_DEFAULT, default_tiles

    dev = torch.device("cuda", torch.cuda.current_device())
    hopper = torch.cuda.get_device_capability(dev)[0] >= 9
    monkeypatch.delenv(ENV_LONG_TMA, raising=False)
    tiles = default_tiles(64, torch.bfloat16, dev)
    assert tiles.long_block > 0 and tiles.long_tma == (hopper and LONG_TMA_DEFAULT)
    monkeypatch.setenv(ENV_LONG_TMA, "1")
    assert default_tiles(64, torch.bfloat16, dev).long_tma == hopper
    assert not default_tiles(64, torch.float32, dev).long_tma, "fp32 runs the fused kernel (no long_block)"
    monkeypatch.setenv(ENV_LONG_TMA, "0")
    assert not default_tiles(64, torch.bfloat16, dev).long_tma


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
def test_long_query_order(use_kernel):
    """long_query_order: per (b, h) and chunk of positions a permutation of the chunk, sorted by
    the key of `order_key_layout` (the query's cells ascending, absent as the largest id,
    lexicographic over the packed slots), ties in position order; the key packs only what fits;
    tile_unions over the order are the unions of the ordered positions."""
    from freesolo.backends.triton.attention import long_query_order, order_key_layout

    assert order_key_layout(2048, 4, 4096) == (11, 4) and order_key_layout(4096, 4, 4096) == (12, 4)
    assert order_key_layout(2**15, 4, 4096) == (15, 3) and order_key_layout(2**20, 4, 4096) == (20, 2)
    rng = np.random.default_rng(4)
    B, T, Hq, K, cell, chunk = (1, 21, 2, 3, 4, 8) if use_kernel else (2, 37, 3, 3, 4, 16)
    idx = rng.integers(-1, 6, size=(B, T, Hq, K))
    idx[0, 1, 0] = [2, -1, 0]  # absent in the middle: sorts as (0, 2, absent)
    order = long_query_order(torch.from_numpy(idx).to(DEVICE), cell, use_kernel=use_kernel, chunk=chunk)
    assert order.dtype == torch.int32 and order.shape == (B * Hq, T)
    bits, slots = order_key_layout(-(-T // cell), K, chunk)
    assert slots == K
    for b in range(B):
        for h in range(Hq):
            keys = [tuple(sorted((1 << bits) - 1 if c < 0 else int(c) for c in idx[b, t, h])) for t in range(T)]
            want = []
            for c0 in range(0, T, chunk):
                want += sorted(range(c0, min(T, c0 + chunk)), key=lambda t: (keys[t], t))
            assert order[b * Hq + h].tolist() == want, (b, h)
    bm = 4
    union, count, got_order = tile_unions(torch.from_numpy(idx).to(DEVICE), bm, use_kernel=use_kernel, order=order)
    assert got_order is order
    for b in range(B):
        for h in range(Hq):
            rows = order[b * Hq + h].tolist()
            for j in range(-(-T // bm)):
                want = sorted({int(c) for t in rows[bm * j : bm * j + bm] for c in idx[b, t, h] if c >= 0})
                assert union[b * Hq + h, j].tolist() == want + [-1] * (bm * K - len(want)), (b, h, j)
                assert count[b * Hq + h, j] == len(want)
    with pytest.raises(ValueError, match="order must be int32"):
        tile_unions(torch.from_numpy(idx).to(DEVICE), bm, order=order.long())
    with pytest.raises(ValueError, match="chunk=12 must be a power of two"):
        long_query_order(torch.from_numpy(idx).to(DEVICE), cell, chunk=12)


@needs_cuda
def test_cuda_sorted_long_kernels_match(monkeypatch):
    """On the GPU: the key kernel's order == the torch keys' order, the union kernel over an order
    == the torch sorts over it (large random selections, several key chunks), and sorted long
    tiles change no bit of the bf16 forward."""
    from freesolo.backends.triton import attention as att

    g = torch.Generator(device="cuda").manual_seed(5)
    idx = torch.randint(-1, 300, (2, 30001, 5, 4), device="cuda", generator=g)
    for chunk in (None, 1024):
        a = att.long_query_order(idx, 32, use_kernel=True, chunk=chunk)
        b = att.long_query_order(idx, 32, use_kernel=False, chunk=chunk)
        assert torch.equal(a, b), f"chunk={chunk}"
    for block_m in (16, 64):
        x = tile_unions(idx, block_m, use_kernel=True, order=a)
        y = tile_unions(idx, block_m, use_kernel=False, order=a)
        assert torch.equal(x.union, y.union) and torch.equal(x.count, y.count), f"block_m={block_m}"
    cfg = FreeSoloConfig(variant="fsl")
    q, k, v = (torch.randn(1, 8192, 4, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    idx = select_cells(q.float(), k.float(), cfg).to(torch.int32)
    beta = torch.ones(4, device="cuda")
    cos, sin = rope_tables(8192, 64, cfg.rope_theta, q.device, torch.float32)
    tiles = att.default_tiles(64, torch.bfloat16, q.device)
    assert tiles.sorted_long
    monkeypatch.setattr(att, "SORTED_LONG_MIN_T", 0)  # sort at 8192 positions (the default starts at 32768)
    ref = attention_forward(q, k, v, idx, beta, cos, sin, cfg, dataclasses.replace(tiles, sorted_long=False))
    got = attention_forward(q, k, v, idx, beta, cos, sin, cfg, tiles)
    for name, x, y in zip(("o", "lse_loc", "lse_long", "rstd"), got, ref):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("long_block", [0, 16])
def test_rotation_chunks_do_not_change_bits(monkeypatch, long_block):
    """The window kernel runs once per chunk of query tiles over that chunk's rotated keys
    (`rotation_chunk_tiles`): with one 32-query tile per chunk (the window spans 3 chunks; B 2,
    GQA, T not a multiple of the tile) every output and statistic has the bits of one launch over
    all keys rotated at once."""
    from freesolo.backends.triton import attention as att

    cfg = _cfg(variant="fsl", window=80, top_k=3)
    q, k, v = random_qkv(21, 2, 150, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    tiles = AttentionTiles(32, 32, 1, 1, long_block=long_block)
    ref = _run(q, k, v, idx, beta, cfg, tiles=tiles)
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32) > -(-150 // 32)  # the reference is one launch
    # a sequence whose rotated keys fit ROTATION_ONE_CHUNK_FACTOR budgets is one chunk (paper sizes:
    # B 1, H 16, D 64, bf16, 64-query tiles: up to T = 16384), a longer one is cut at the budget
    assert att.rotation_chunk_tiles(1, 16, 64, 2, 64, T=16384) == 16384 // 64
    assert att.rotation_chunk_tiles(1, 16, 64, 2, 64, T=16385) == (att.ROTATION_CHUNK_BYTES // (16 * 64 * 2)) // 64
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32, T=150) == -(-150 // 32)
    monkeypatch.setattr(att, "ROTATION_CHUNK_BYTES", 1)
    monkeypatch.setattr(att, "ROTATION_CHUNK_MIN_POSITIONS", 32)
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32) == 1
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32, T=150) == 1
    got = _run(q, k, v, idx, beta, cfg, tiles=tiles)
    _bitwise_equal(got, ref, f"one tile per rotation chunk, long_block={long_block}")


@pytest.mark.parametrize("long_block", [0, 16])
def test_forward_without_saved_statistics(monkeypatch, long_block):
    """save_stats=False (a forward without gradients): o has the bits of the forward that saves the
    statistics, the statistics come back as None, and the rotated keys take their bytes (here: three
    rotation chunks instead of five); through the API, a call where nothing requires grad gives the
    bits of one whose inputs require grad."""
    import freesolo
    from freesolo.backends.triton import attention as att

    cfg = _cfg(variant="fsl", window=40, top_k=3)
    q, k, v = random_qkv(23, 2, 150, 4, 2, 16)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    tiles = AttentionTiles(32, 32, 1, 1, long_block=long_block)
    monkeypatch.setattr(att, "ROTATION_CHUNK_BYTES", 2 * 150 * 2 * 16 * 4 // 5)  # B T Hkv D fp32: a fifth of k
    monkeypatch.setattr(att, "ROTATION_CHUNK_MIN_POSITIONS", 32)
    monkeypatch.setattr(att, "ROTATION_ONE_CHUNK_FACTOR", 0)  # (the whole k would fit two budgets with the statistics' bytes)
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32) == 1
    assert att.rotation_chunk_tiles(2, 2, 16, 4, 32, 12 * 2 * 4 * 150) == 2  # + the statistics' bytes: 3 launches, not 5
    ref = _run(q, k, v, idx, beta, cfg, tiles=tiles)
    T, D = q.shape[1], q.shape[3]
    cos, sin = rope_tables(T, D, cfg.rope_theta, DEVICE, torch.float32)
    qt, kt, vt, it = (torch.as_tensor(x).to(DEVICE) for x in (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), idx))
    bt = torch.as_tensor(beta, dtype=torch.float32, device=DEVICE)
    got = attention_forward(qt, kt, vt, it, bt, cos, sin, cfg, tiles, save_stats=False)
    assert got[1] is None and got[2] is None and got[3] is None
    assert np.array_equal(got[0].double().cpu().numpy(), ref[0]), "o without saved statistics"
    with freesolo.use_backend("triton"):
        plain = freesolo.freesolo_attention(qt, kt, vt, cfg)
        qg = qt.clone().requires_grad_(True)
        graded = freesolo.freesolo_attention(qg, kt, vt, cfg)
    assert graded.requires_grad and not plain.requires_grad
    assert torch.equal(plain, graded.detach()), "a forward without gradients must give the same bits"


def test_forward_allocations_stay_below_a_rotated_copy_of_k(monkeypatch):
    """The forward's memory design, checked on its allocations: with the long term written into o
    (long_into_out) no [B, T, Hq, D] hand-over buffer exists, and the rotated keys live in one
    buffer of at most (chunk + window + 2 * block_n) positions, not a rotated copy of all of k.
    Every tensor `launch_forward` allocates is recorded through torch.empty / empty_like."""
    from freesolo.backends.triton import attention as att

    cfg = _cfg(variant="fsl", window=40, top_k=3)
    B, T, Hq, Hkv, D = 2, 300, 4, 2, 16
    q, k, v = random_qkv(31, B, T, Hq, Hkv, D)
    beta = np.array([1.0, -0.5, 0.25, 2.0])
    idx = _selection(q, k, cfg)
    monkeypatch.setattr(att, "ROTATION_CHUNK_BYTES", 1)
    monkeypatch.setattr(att, "ROTATION_CHUNK_MIN_POSITIONS", 64)
    tiles = AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True)
    sizes = []
    empty, empty_like = torch.empty, torch.empty_like  # the NaN-poisoning versions of the fixture

    def record(x):
        sizes.append((x.numel(), x.dtype))
        return x

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: record(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: record(empty_like(*a, **kw)))
    _run(q, k, v, idx, beta, cfg, tiles=tiles)
    span = 64 + cfg.window + 2 * tiles.block_n  # positions of one rotation chunk's keys
    full_o = B * T * Hq * D
    assert sizes.count((full_o, torch.float32)) == 1, sizes  # o itself (float32 inputs); no hand-over buffer
    big = [n for n, dt in sizes if n > B * span * Hkv * D and n != full_o]
    assert not big, f"allocations larger than one rotation chunk of keys: {big} (span {span})"


def test_window_tiles_switch(monkeypatch):
    """FREESOLO_TRITON_WINDOW_TILES (s50, an A/B switch) sets the window kernel's tile in default_tiles
    (the long tile stays); a malformed value is refused with the variable's name; the forward with
    another window tile equals the default one up to summation order and matches the oracle."""
    from freesolo.backends.triton import attention as att

    monkeypatch.delenv(att.ENV_WINDOW_TILES, raising=False)
    assert att.window_tiles_env() is None
    base = att.default_tiles(16, torch.float32, torch.device(DEVICE))
    for bad in ("64x64x4", "48x64x4x2", "64x8x4x2", "64x64x3x2", "64x64x4x5", "64,64,4,2", "big"):
        monkeypatch.setenv(att.ENV_WINDOW_TILES, bad)
        with pytest.raises(ValueError, match=att.ENV_WINDOW_TILES):
            att.default_tiles(16, torch.float32, torch.device(DEVICE))
    monkeypatch.setenv(att.ENV_WINDOW_TILES, "16X64x2x3")
    tiles = att.default_tiles(16, torch.float32, torch.device(DEVICE))
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (16, 64, 2, 3)
    assert (tiles.long_block, tiles.maxnreg) == (base.long_block, base.maxnreg)
    cfg = _cfg(top_k=3)
    q, k, v = random_qkv(13, 1, 75, 2, 1, 16)
    beta = np.array([0.6, -0.9])
    idx = _selection(q, k, cfg)
    for text in ("16x16x1x1", "64x32x1x1"):
        monkeypatch.setenv(att.ENV_WINDOW_TILES, text)
        tiles = att.default_tiles(16, torch.float32, torch.device(DEVICE))
        got = _run(q, k, v, idx, beta, cfg, tiles=tiles)
        monkeypatch.delenv(att.ENV_WINDOW_TILES)
        want = _run(q, k, v, idx, beta, cfg)
        for name, x, y in zip(("o", "lse_loc", "lse_long", "rstd"), got, want):  # (lse_long -inf where no cell)
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{text} {name}")
        assert_close(got[0], _oracle(q, k, v, idx, cfg, beta), 1e-5, f"{text} o vs the oracle")


def test_tiles_switches():
    """AttentionTiles validates long_block / maxnreg; the environment switches reach default_tiles;
    launch_forward refuses a union computed for other tile rows."""
    from freesolo.backends.triton import attention as att

    with pytest.raises(ValueError, match="long_block=24"):
        AttentionTiles(32, 32, 1, 1, long_block=24)
    with pytest.raises(ValueError, match="maxnreg=7"):
        AttentionTiles(32, 32, 1, 1, maxnreg=7)
    base = att.default_tiles(16, torch.float32, torch.device(DEVICE))
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(att.ENV_LONG_BLOCK, "16")
        mp.setenv(att.ENV_MAXNREG, "128")
        tiles = att.default_tiles(16, torch.float32, torch.device(DEVICE))
        assert (tiles.long_block, tiles.maxnreg, tiles.union_rows) == (16, None, 16)  # no cap for fp32
        assert tiles.block_m == base.block_m
        assert att.default_tiles(16, torch.bfloat16, torch.device(DEVICE)).maxnreg == 128
        assert tiles.long_into_out and tiles.window_first and tiles.sorted_long  # the defaults of the split kernels
        mp.setenv(att.ENV_SORTED_LONG, "0")
        assert not att.default_tiles(16, torch.float32, torch.device(DEVICE)).sorted_long
        mp.delenv(att.ENV_SORTED_LONG)
        mp.setenv(att.ENV_WINDOW_FIRST, "0")
        assert not att.default_tiles(16, torch.float32, torch.device(DEVICE)).window_first
        mp.setenv(att.ENV_LONG_INTO_OUT, "0")
        assert not att.default_tiles(16, torch.float32, torch.device(DEVICE)).long_into_out
        mp.setenv(att.ENV_LONG_INTO_OUT, "1")
        assert att.default_tiles(16, torch.float32, torch.device(DEVICE)).long_into_out
        mp.setenv(att.ENV_WINDOW_FIRST, "1")
        assert att.default_tiles(16, torch.float32, torch.device(DEVICE)).window_first
        mp.setenv(att.ENV_LONG_INTO_OUT, "0")  # window_first needs the long term in o: the switch does not apply
        assert not att.default_tiles(16, torch.float32, torch.device(DEVICE)).window_first
        mp.setenv(att.ENV_LONG_INTO_OUT, "1")
        mp.setenv(att.ENV_LONG_BLOCK, "0")  # the fused kernel has no hand-over: the switches do not apply
        tiles = att.default_tiles(16, torch.float32, torch.device(DEVICE))
        assert not tiles.long_into_out and not tiles.window_first and not tiles.sorted_long
        mp.setenv(att.ENV_LONG_BLOCK, "x")
        with pytest.raises(ValueError, match=att.ENV_LONG_BLOCK):
            att.default_tiles(16, torch.float32, torch.device(DEVICE))
    finally:
        mp.undo()
    args = _inputs(T=40)
    q, k, v, idx, beta, cos, sin = args
    unions = tile_unions(idx, 32)
    with pytest.raises(ValueError, match="tile_unions\\(idx, 16\\)"):
        att.launch_forward(q, k, v, idx, unions, beta, cos, sin, _cfg(top_k=2),
                           AttentionTiles(32, 32, 1, 1, long_block=16))  # fmt: skip
    sorted_tiles = AttentionTiles(32, 32, 1, 1, long_block=16, sorted_long=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(att, "SORTED_LONG_MIN_T", 0)
        with pytest.raises(ValueError, match="sorted_long=True .* but the unions were made without an order"):
            att.launch_forward(q, k, v, idx, tile_unions(idx, 16), beta, cos, sin, _cfg(top_k=2), sorted_tiles)
    assert att.forward_unions(idx, _cfg(top_k=2), sorted_tiles).order is None  # T 40 < SORTED_LONG_MIN_T
    with pytest.MonkeyPatch.context() as mp:  # the environment's threshold overrides the module's
        mp.setenv(att.ENV_SORTED_LONG_MIN_T, "40")
        assert att.forward_unions(idx, _cfg(top_k=2), sorted_tiles).order is not None
        mp.setenv(att.ENV_SORTED_LONG_MIN_T, "41")
        assert att.forward_unions(idx, _cfg(top_k=2), sorted_tiles).order is None
        mp.setenv(att.ENV_SORTED_LONG_MIN_T, "soon")
        with pytest.raises(ValueError, match="FREESOLO_TRITON_SORTED_LONG_MIN_T='soon' must be an integer"):
            att.forward_unions(idx, _cfg(top_k=2), sorted_tiles)
    with pytest.raises(ValueError, match="sorted_long=True needs the separate long kernel"):
        AttentionTiles(32, 32, 1, 1, sorted_long=True)
    with pytest.raises(ValueError, match="long_maxnreg needs the separate long kernel"):
        AttentionTiles(32, 32, 1, 1, long_maxnreg=64)
    with pytest.raises(ValueError, match="long_maxnreg=300 must be None or in"):
        AttentionTiles(32, 32, 1, 1, long_block=16, long_maxnreg=300)
    # a register cap changes no arithmetic: the same bits (the interpreter ignores it; the CUDA run checks it)
    capped = AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True, long_maxnreg=64)
    plain = dataclasses.replace(capped, long_maxnreg=None)
    ref = att.launch_forward(q, k, v, idx, tile_unions(idx, 16), beta, cos, sin, _cfg(top_k=2), plain)
    got = att.launch_forward(q, k, v, idx, tile_unions(idx, 16), beta, cos, sin, _cfg(top_k=2), capped)
    assert all(torch.equal(a, b) for a, b in zip(got, ref) if a is not None)


# ---- errors ------------------------------------------------------------------------------------


def _inputs(B=1, T=8, Hq=2, Hkv=1, D=16, K=2, dtype=torch.float32):
    q = torch.randn(B, T, Hq, D, dtype=dtype, device=DEVICE)
    k = torch.randn(B, T, Hkv, D, dtype=dtype, device=DEVICE)
    v = torch.randn(B, T, Hkv, D, dtype=dtype, device=DEVICE)
    idx = torch.full((B, T, Hq, K), -1, dtype=torch.int64, device=DEVICE)
    beta = torch.ones(Hq, dtype=torch.float32, device=DEVICE)
    cos, sin = rope_tables(T, D, 10000.0, DEVICE, torch.float32)
    return [q, k, v, idx, beta, cos, sin]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda a: a.__setitem__(0, a[0][..., :15]), "k .* and v .* must both be"),
        (lambda a: a.__setitem__(3, a[3][..., :1].contiguous()), "idx shape"),
        (lambda a: a.__setitem__(3, a[3].float()), "idx dtype"),
        (lambda a: a.__setitem__(4, a[4][:1]), "beta must be float32"),
        (lambda a: a.__setitem__(5, a[5][:3]), "cos must be float32"),
        (lambda a: a.__setitem__(1, a[1].double()), "k dtype"),
        (lambda a: a.__setitem__(0, a[0].transpose(1, 2).contiguous().transpose(1, 2)), "q must be contiguous"),
    ],
    ids=["shape", "idx-shape", "idx-dtype", "beta", "cos", "dtype", "contiguous"],
)
def test_bad_inputs_raise(edit, match):
    args = _inputs()
    edit(args)
    with pytest.raises((ValueError, TypeError), match=match):
        attention_forward(*args, _cfg(top_k=2))


@pytest.mark.parametrize("D", [7, 258])
def test_unsupported_head_dim_raises(D):
    args = _inputs(D=D + 1 if D % 2 else D)
    if D % 2:  # odd D: build the tensors by hand (rope_tables needs an even D)
        args[0], args[1], args[2] = (x[..., :D].contiguous() for x in args[:3])
    with pytest.raises(ValueError, match=f"D={D}"):
        attention_forward(*args, _cfg(top_k=2))


# ---- CUDA: bf16 / fp16 / fp32, long T, int64 offsets ---------------------------------------------


@needs_cuda
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cuda_matches_oracle(dtype, D):
    """fp32: < 1e-5 rms-rel vs the oracle; bf16 / fp16: within 2x the error of the naive dense
    implementation in the same dtype (spec §13), both against float64 on the same rounded inputs."""
    from .test_torch_backend import dense_reference

    cfg = FreeSoloConfig(variant="fsl", window=64, cell=16, block=32, pool=6, recent=3, top_k=3)
    B, T, Hq, Hkv = 2, 333, 6, 2
    q, k, v = random_qkv(D, B, T, Hq, Hkv, D)
    q, k, v = (torch.from_numpy(x).to(dtype).double().numpy() for x in (q, k, v))  # rounded inputs
    beta = np.linspace(-1.0, 1.5, Hq)
    idx = _selection(q, k, cfg)
    ref = _oracle(q, k, v, idx, cfg, beta)
    got = _run(q, k, v, idx, beta, cfg, dtype, "cuda")
    if dtype == torch.float32:
        assert_close(got[0], ref, 1e-5, "o fp32")
        _check_stats(got, q, k, v, idx, cfg, 1e-5)
        return
    lo = [torch.from_numpy(x).to("cuda", dtype) for x in (q, k, v)]
    naive = dense_reference(*lo, torch.from_numpy(idx).cuda(), cfg, torch.from_numpy(beta).to("cuda", dtype))
    err, err_naive = rms_rel_error(got[0], ref), rms_rel_error(naive.double().cpu().numpy(), ref)
    assert err <= 2 * err_naive, f"{dtype} o error {err:.2e} > 2x naive {err_naive:.2e}"
    _check_stats(got, q, k, v, idx, cfg, 1e-2)


@needs_cuda
@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_cuda_long_sequence_matches_torch_backend(variant):
    """T = 8191, H 16, D 64 at the default sizes: the fp32 kernel vs the torch backend (float64) with
    the same idx < 1e-5 rms-rel, the bf16 kernel < 1e-2 (on the same bf16-rounded inputs)."""
    from freesolo.backends.torch import attention

    cfg = FreeSoloConfig(variant=variant)
    B, T, Hq, Hkv, D = 1, 8191, 16, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g) for H in (Hq, Hkv, Hkv))
    beta = torch.linspace(-1, 1.5, Hq, device="cuda")
    idx = select_cells(q, k, cfg)
    ref = attention(q.double(), k.double(), v.double(), cfg, beta.double(), idx=idx)
    cos, sin = rope_tables(T, D, cfg.rope_theta, "cuda", torch.float32)
    o = attention_forward(q, k, v, idx, beta, cos, sin, cfg)[0]
    assert_close(o.double().cpu().numpy(), ref.cpu().numpy(), 1e-5, "fp32 o")
    lo = [x.bfloat16() for x in (q, k, v)]
    ref = attention(*(x.double() for x in lo), cfg, beta.double(), idx=idx).cpu().numpy()
    o = attention_forward(*lo, idx, beta, cos, sin, cfg)[0].double().cpu().numpy()
    # the 2x-naive rule of spec §13 is checked at T = 333 (test_cuda_matches_oracle); here a bf16
    # bound (a few ulps of 2^-8: operands rounded to bf16 before the tensor-core dots)
    assert_close(o, ref, 1e-2, "bf16 o")


@needs_cuda
def test_cuda_int64_offsets():
    """T * Hq * D > 2^31 (B 1, T 2^21 + 1000, Hq 16, D 64, bf16): rows at the end of the sequence,
    whose element offsets pass 2^31, match a float64 recomputation of those rows."""
    cfg = FreeSoloConfig(variant="fsl", window=64, cell=32, block=64, top_k=2)
    B, T, Hq, Hkv, D = 1, 2**21 + 1000, 16, 1, 64
    assert T * Hq * D > 2**31
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for H in (Hq, Hkv, Hkv))
    pos = torch.arange(T, device="cuda")
    n_avail = (pos // cfg.block) * cfg.block // cfg.cell  # [T]
    first = torch.where(n_avail >= 1, n_avail - 1, -1)  # the most recent available cell
    second = torch.where(n_avail >= 3, n_avail // 2, -1)  # and a middle one (distinct from it)
    idx = torch.stack([first, second], -1)[None, :, None, :].expand(B, T, Hq, 2).contiguous()
    beta = torch.ones(Hq, device="cuda")
    cos, sin = rope_tables(T, D, cfg.rope_theta, "cuda", torch.float32)
    o = attention_forward(q, k, v, idx, beta, cos, sin, cfg)[0]
    rows = torch.tensor([0, T // 2, T - 2000, T - 1], device="cuda")
    for i in rows.tolist():
        lo = max(0, i - cfg.window + 1)
        sub = slice(lo, i + 1)
        # recompute row i from the window's tokens and its cells, float64
        qi = q[0, i].double()  # [Hq, D]
        cos_i, sin_i = cos.double(), sin.double()

        def rot(x, p):
            h = D // 2
            c, s = cos_i[p], sin_i[p]
            return torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)

        kw = rot(k[0, sub, 0].double(), torch.arange(lo, i + 1, device="cuda"))  # [n, D]
        lg = rot(qi, i) @ kw.T / math.sqrt(D)  # [Hq, n]
        o_loc = torch.softmax(lg, -1) @ v[0, sub, 0].double()
        cells = [int(c) for c in idx[0, i, 0] if c >= 0]
        if cells:
            tok = torch.cat([torch.arange(c * cfg.cell, (c + 1) * cfg.cell, device="cuda") for c in cells])
            p = torch.softmax(qi @ k[0, tok, 0].double().T / math.sqrt(D), -1)
            o_long = p @ v[0, tok, 0].double()
            o_loc = o_loc + o_long / torch.sqrt((o_long**2).mean(-1, keepdim=True) + cfg.eps)
        assert_close(o[0, i].double().cpu().numpy(), o_loc.cpu().numpy(), 2e-2, f"row {i}")
