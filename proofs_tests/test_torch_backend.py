"""The torch backend against the float64 oracle (CPU; spec §7, §8, §13, lemma L8).

- selections (FS, FS-L, FS-B) tie-aware against the oracle, float64 and float32;
- outputs: float64 <= 1e-9, float32 <= 1e-5 rms-rel; with the oracle's indices the readout is
  tested apart from selection (fla style);
- gradients against an independent dense masked formulation built from the indices (below),
  `torch.autograd.gradcheck`, and bf16 / fp16 within 2x (4x for gradients) of a naive
  same-precision implementation;
- chunking changes nothing; memory grows linearly in T (no T x T tensor is ever created).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import freesolo
from freesolo import FreeSoloConfig
from freesolo.backends.torch import attention, select_cells
from freesolo.reference import oracle

from .helpers import assert_close, assert_selection_matches, off_grid_tau, random_qkv, rms_rel_error

# ---- strategies ------------------------------------------------------------------------------


@st.composite
def problems(draw, variants=("fs", "fsl"), max_t: int = 80):
    """(cfg, B, T, Hq, Hkv, D, seed) with small sizes so pruning and chunk boundaries bite."""
    cell = draw(st.sampled_from([2, 4]))
    block = cell * draw(st.integers(1, 3))
    cfg = FreeSoloConfig(
        variant=draw(st.sampled_from(variants)),
        window=block + draw(st.integers(0, 10)),
        cell=cell,
        block=block,
        top_k=draw(st.integers(1, 4)),
        pool=draw(st.integers(1, 4)),
        recent=draw(st.integers(1, 3)),
        beam=draw(st.integers(1, 4)),
        sigma=draw(st.sampled_from([0.5, 4.0])),
        lam=draw(st.sampled_from([0.0, 1.0, 3.0])),
        leaf_order=draw(st.sampled_from(["content", "position"])),
        hash_bits=draw(st.sampled_from([3, 16])),
        radius_weight=draw(st.sampled_from([0.0, 1.0])),
    )
    # edge lengths, any length, and (most often) lengths past block 2, where cells are selected,
    # top-K, the FS-L pool and the FS-B beam prune (shorter ones mostly exercise the local branch only)
    long_t = st.integers(min(max_t, 3 * block + 1), max_t)
    T = draw(st.one_of(long_t, st.sampled_from([1, 2 * block - 1, 2 * block + 1]), long_t, st.integers(1, max_t)))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    B = draw(st.integers(1, 2))
    D = draw(st.sampled_from([2, 4, 8]))
    seed = draw(st.integers(0, 2**31 - 1))
    return cfg, B, T, Hq, Hkv, D, seed


def _with_tau(cfg: FreeSoloConfig, k: np.ndarray) -> FreeSoloConfig:
    if cfg.variant != "fsb":
        return cfg
    if k.shape[1] < cfg.cell:
        return cfg.replace(tau=(0.0,) * k.shape[2])
    return cfg.replace(tau=off_grid_tau(k, cfg))  # calibrate_tau's median sits on a cell's a_c


def rho_scores(q, k, cfg, b, i, h, cells):
    """FS-B's rerank score rho_h(i, c) for the given cells (float64)."""
    Hq, Hkv = q.shape[2], k.shape[2]
    g = h // (Hq // Hkv)
    qi = np.asarray(q[b, i, h], np.float64)
    out = []
    for c in cells:
        logits = np.asarray(k[b, c * cfg.cell : (c + 1) * cfg.cell, g], np.float64) @ qi / math.sqrt(len(qi))
        out.append(logits.max() + math.log(np.exp(logits - logits.max()).sum()))
    return np.array(out)


def _t(x, dtype=torch.float64, grad=False):
    return torch.tensor(x, dtype=dtype).requires_grad_(grad)


# ---- an independent dense formulation (float64 or any dtype), given the selection ---------


def dense_reference(q, k, v, idx, cfg: FreeSoloConfig, beta):
    """o [B, T, Hq, D] from T x T masks built from idx [B, T, Hq, K]; every op in q's dtype."""
    _, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    dt = q.dtype
    half = D // 2
    dev = q.device
    inv = cfg.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=dev) / D)
    ang = torch.arange(T, dtype=torch.float64, device=dev)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cos(ang).to(dt)[:, None, :], torch.sin(ang).to(dt)[:, None, :]

    def rot(x):  # [B, T, H, D]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)  # [B, T, Hq, D]
    i = torch.arange(T, device=dev)[:, None]
    t = torch.arange(T, device=dev)[None, :]
    local = (t <= i) & (t > i - cfg.window)  # [T, T]
    lg = torch.einsum("bihd,bthd->bhit", rot(q), rot(kk)) / math.sqrt(D)
    o_loc = torch.einsum("bhit,bthd->bihd", torch.softmax(lg.masked_fill(~local, -math.inf), -1), vv)
    cells = idx.permute(0, 2, 1, 3)  # [B, Hq, T, K]
    sel = ((t // cfg.cell)[None, None, :, :, None] == cells[:, :, :, None, :]) & (cells[:, :, :, None, :] >= 0)
    sel = sel.any(-1)  # [B, Hq, T, T]
    any_sel = sel.any(-1, keepdim=True)
    lg2 = torch.einsum("bihd,bthd->bhit", q, kk) / math.sqrt(D)
    lg2 = torch.where(sel, lg2, torch.full_like(lg2, -math.inf))
    lg2 = torch.where(any_sel, lg2, torch.zeros_like(lg2))
    p2 = torch.softmax(lg2, -1) * any_sel
    o_long = torch.einsum("bhit,bthd->bihd", p2, vv)
    rms = torch.rsqrt((o_long * o_long).mean(-1, keepdim=True) + cfg.eps)
    return o_loc + beta.to(dt)[None, None, :, None] * o_long * rms


# ---- selection -------------------------------------------------------------------------------


@given(problems(variants=("fs", "fsl")))
def test_fs_fsl_selection_matches_oracle(problem):
    cfg, B, T, Hq, Hkv, D, seed = problem
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    ref = oracle.select_cells(q, k, cfg)
    got = select_cells(_t(q), _t(k), cfg, chunk_tokens=2 * cfg.block).numpy()
    assert_selection_matches(got, ref, q, k, cfg, tol=1e-9)
    q32, k32 = q.astype(np.float32), k.astype(np.float32)
    ref32 = oracle.select_cells(q32.astype(np.float64), k32.astype(np.float64), cfg)
    got32 = select_cells(_t(q32, torch.float32), _t(k32, torch.float32), cfg).numpy()
    assert_selection_matches(got32, ref32, q32, k32, cfg, tol=2e-5)


@given(problems(variants=("fsb",), max_t=60))
def test_fsb_selection_matches_oracle(problem):
    from freesolo.reference.fsb import select_cells_fsb

    cfg, B, T, Hq, Hkv, D, seed = problem
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = _with_tau(cfg, k)
    ref = select_cells_fsb(q, k, cfg)
    got = select_cells(_t(q), _t(k), cfg, chunk_tokens=cfg.block).numpy()
    assert_selection_matches(got, ref, q, k, cfg, tol=1e-9, score_fn=rho_scores)
    assert np.array_equal(got, ref), "float64 FS-B selection differs from the oracle"


def test_fsb_selection_exhaustive_beam_equals_top_rho():
    """L5 through the torch path: a beam as wide as the widest level keeps every cell."""
    cfg = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=64, top_k=3, hash_bits=4)
    q, k, _ = random_qkv(3, 1, 120, 2, 1, 8)
    cfg = _with_tau(cfg, k)
    got = select_cells(_t(q), _t(k), cfg).numpy()
    for i in range(cfg.block, 120, 7):
        n = i // cfg.block * cfg.block // cfg.cell
        rho = rho_scores(q, k, cfg, 0, i, 1, range(n))
        expect = sorted(range(n), key=lambda c: (rho[c], c), reverse=True)[:3]
        assert list(got[0, i, 1][: len(expect)]) == expect


def test_fsb_beam_and_rerank_chunks_change_nothing():
    """FS-B searches chunks of blocks and reranks sub-chunks of them: any split gives the oracle's selection."""
    from freesolo.backends.torch.fsb import fsb_select
    from freesolo.reference.fsb import select_cells_fsb

    q, k, _ = random_qkv(1, 1, 200, 2, 1, 8)
    cfg = _with_tau(FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=3, top_k=3, hash_bits=6), k)
    ref = select_cells_fsb(q, k, cfg)
    q4 = _t(q).permute(0, 2, 1, 3).reshape(1, 1, 2, 200, 8)  # (B, Hkv, G, T, D)
    k4 = _t(k).permute(0, 2, 1, 3)  # (B, Hkv, T, D)
    sigma, lam = torch.full((1, 2), 4.0, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    for beam_blocks, rerank_blocks in [(25, 1), (25, 3), (4, 4), (7, 2)]:
        got = fsb_select(q4, k4, cfg, sigma, lam, beam_blocks, rerank_blocks)
        np.testing.assert_array_equal(got.reshape(1, 2, 200, 3).permute(0, 2, 1, 3).numpy(), ref)


def test_selection_chunk_scope_changes_nothing_and_restores():
    """`selection_chunk_scope` (the eval's long FS-B chunks) gives the oracle's selection at every
    size, restores the default on exit, and refuses a size <= 0."""
    from freesolo.backends.torch import selection_chunk_scope
    from freesolo.backends.torch._ops import selection_chunk_tokens
    from freesolo.reference.fsb import select_cells_fsb

    q, k, _ = random_qkv(2, 1, 150, 2, 1, 8)
    cfg = _with_tau(FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=3, top_k=3, hash_bits=6), k)
    ref = select_cells_fsb(q, k, cfg)
    for tokens in (8, 40, 150, 4096):
        with selection_chunk_scope(tokens):
            assert selection_chunk_tokens() == tokens
            np.testing.assert_array_equal(select_cells(_t(q), _t(k), cfg).numpy(), ref)
        assert selection_chunk_tokens() is None
    with pytest.raises(ValueError, match="must be positive"):
        with selection_chunk_scope(0):
            pass


def test_tie_breaks_are_exact():
    """Equal scores / norms: the larger cell wins (spec §5, §7), independent of sort internals."""
    cfg = FreeSoloConfig(variant="fsl", window=8, cell=2, block=4, pool=2, recent=1, top_k=2, lam=1.0)
    T = 40
    k = np.zeros((1, T, 1, 4))
    k[0, :, 0, 0] = 1.0  # every cell has the same mean and norm: all scores tie at fixed i
    q = np.zeros((1, T, 1, 4))
    got = select_cells(_t(q), _t(k), cfg).numpy()
    ref = oracle.select_cells(q, k, cfg)
    np.testing.assert_array_equal(got, ref)
    got_fs = select_cells(_t(q), _t(k), cfg.replace(variant="fs")).numpy()
    np.testing.assert_array_equal(got_fs, oracle.select_cells(q, k, cfg.replace(variant="fs")))


@pytest.mark.parametrize("beam", [1, 2, 3])
@pytest.mark.parametrize("leaf_order", ["content", "position"])
def test_fsb_tie_breaks_are_exact(beam, leaf_order):
    """Identical keys and lam = 0: every node key ties, so the beam keeps nodes by (segment start,
    index in level) and the rerank by larger c; the torch path must equal the oracle exactly."""
    from freesolo.reference.fsb import select_cells_fsb

    T = 76
    k = np.zeros((1, T, 1, 4))
    k[0, :, 0] = [1.0, 0.5, -0.25, 2.0]  # dyadic: every mean is exact, every radius 0
    k[0, 40:48, 0] *= 2.0  # two high-norm cells
    q = np.random.default_rng(0).standard_normal((1, T, 2, 4))
    cfg = FreeSoloConfig(
        variant="fsb",
        window=8,
        cell=4,
        block=4,
        beam=beam,
        top_k=2,
        lam=0.0,
        tau=(3.0,),
        leaf_order=leaf_order,
        hash_bits=4,
    )
    np.testing.assert_array_equal(select_cells(_t(q), _t(k), cfg).numpy(), select_cells_fsb(q, k, cfg))


# ---- outputs ---------------------------------------------------------------------------------


@given(problems(variants=("fs", "fsl")), st.sampled_from([None, 3]))
def test_output_matches_oracle(problem, chunk_blocks):
    cfg, B, T, Hq, Hkv, D, seed = problem
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    beta = np.random.default_rng(seed).standard_normal(Hq)
    ref = oracle.attention(q, k, v, cfg, beta)
    ct = None if chunk_blocks is None else chunk_blocks * cfg.block
    out = attention(_t(q), _t(k), _t(v), cfg, _t(beta), chunk_tokens=ct).numpy()
    assert_close(out, ref, 1e-9, "float64 output")
    # float32: compare where the selection agrees; the readout alone with the oracle's indices
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    ref32 = oracle.attention(*(x.astype(np.float64) for x in (q32, k32, v32)), cfg, beta)
    idx_ref = oracle.select_cells(q32.astype(np.float64), k32.astype(np.float64), cfg)
    idx_got = select_cells(_t(q32, torch.float32), _t(k32, torch.float32), cfg).numpy()
    o32 = attention(
        _t(q32, torch.float32), _t(k32, torch.float32), _t(v32, torch.float32), cfg, _t(beta, torch.float32)
    )
    assert o32.dtype == torch.float32
    if np.array_equal(np.sort(idx_got, -1), np.sort(idx_ref, -1)):
        assert_close(o32.numpy(), ref32, 1e-5, "float32 output")
    o32_idx = attention(
        _t(q32, torch.float32),
        _t(k32, torch.float32),
        _t(v32, torch.float32),
        cfg,
        _t(beta, torch.float32),
        idx=torch.from_numpy(idx_ref),
    )
    assert_close(o32_idx.numpy(), ref32, 1e-5, "float32 readout with the oracle's indices")


@given(problems(variants=("fsb",), max_t=48))
def test_fsb_output_matches_oracle(problem):
    cfg, B, T, Hq, Hkv, D, seed = problem
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = _with_tau(cfg, k)
    beta = np.linspace(-1.0, 2.0, Hq)
    ref = oracle.attention(q, k, v, cfg, beta)
    out = attention(_t(q), _t(k), _t(v), cfg, _t(beta)).numpy()
    assert_close(out, ref, 1e-9, "float64 FS-B output")


def test_public_api_roundtrip():
    """freesolo_attention(backend="torch"): torch in -> torch out (dtype kept), numpy in -> numpy out."""
    cfg = FreeSoloConfig(variant="fsl", window=16, cell=4, block=8, pool=3, recent=2)
    q, k, v = random_qkv(0, 1, 50, 4, 2, 8)
    ref = oracle.attention(q, k, v, cfg, np.ones(4))
    out = freesolo.freesolo_attention(q, k, v, cfg, backend="torch")
    assert isinstance(out, np.ndarray)
    assert_close(out, ref, 1e-9)
    o16 = freesolo.freesolo_attention(
        _t(q, torch.bfloat16), _t(k, torch.bfloat16), _t(v, torch.bfloat16), cfg, backend="torch"
    )
    assert o16.dtype == torch.bfloat16 and o16.shape == (1, 50, 4, 8)
    idx = freesolo.select_cells(_t(q), _t(k), cfg, backend="torch")
    assert idx.dtype == torch.int64
    np.testing.assert_array_equal(idx.numpy(), oracle.select_cells(q, k, cfg))


def test_bad_inputs_raise():
    cfg = FreeSoloConfig(variant="fsl", window=16, cell=4, block=8)
    q, k, v = (_t(x) for x in random_qkv(0, 1, 20, 2, 1, 4))
    with pytest.raises(ValueError, match="idx shape"):
        attention(q, k, v, cfg, idx=torch.zeros(1, 20, 2, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="beta"):
        attention(q, k, v, cfg, beta=np.ones(2))
    with pytest.raises(ValueError, match="tau"):
        select_cells(q, k, cfg.replace(variant="fsb"))


def test_causality():
    """L2 for the torch path: changing tokens after i changes neither o[i] nor its selection."""
    for variant in ("fs", "fsl", "fsb"):
        cfg = FreeSoloConfig(variant=variant, window=12, cell=4, block=8, pool=2, recent=1, beam=2, top_k=2, tau=(2.5,))
        q, k, v = random_qkv(5, 1, 64, 2, 1, 6)
        o1 = attention(_t(q), _t(k), _t(v), cfg).numpy()
        i1 = select_cells(_t(q), _t(k), cfg).numpy()
        for x in (q, k, v):
            x[:, 37:] = np.random.default_rng(1).standard_normal(x[:, 37:].shape) * 3
        o2 = attention(_t(q), _t(k), _t(v), cfg).numpy()
        i2 = select_cells(_t(q), _t(k), cfg).numpy()
        np.testing.assert_array_equal(o1[:, :37], o2[:, :37])
        np.testing.assert_array_equal(i1[:, :37], i2[:, :37])


# ---- gradients -------------------------------------------------------------------------------


def _grads(fn, tensors):
    for x in tensors:
        x.grad = None
    out = fn(*tensors)
    g = torch.from_numpy(np.random.default_rng(7).standard_normal(tuple(out.shape))).to(out.dtype)
    (out.float() * g.float()).sum().backward() if out.dtype != torch.float64 else (out * g).sum().backward()
    return out.detach(), [x.grad.detach().clone() for x in tensors]


@given(
    problems(variants=("fs", "fsl", "fsb"), max_t=48),
    st.sampled_from([1, 2, 5]),
    st.sampled_from(["union", "gather", "auto", "wide"]),
)
def test_gradients_match_dense_formulation(problem, chunk_blocks, long_path):
    cfg, B, T, Hq, Hkv, D, seed = problem
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = _with_tau(cfg, k)
    beta = np.random.default_rng(seed + 1).standard_normal(Hq)
    idx = select_cells(_t(q), _t(k), cfg)  # the selection is a constant of the gradient
    xs = [_t(x, grad=True) for x in (q, k, v, beta)]
    ct = chunk_blocks * cfg.block
    out, grads = _grads(lambda a, b, c, d: attention(a, b, c, cfg, d, chunk_tokens=ct, long_path=long_path), xs)
    ref_out, ref_grads = _grads(lambda a, b, c, d: dense_reference(a, b, c, idx, cfg, d), xs)
    assert_close(out.numpy(), ref_out.numpy(), 1e-9, "output vs dense")
    for name, g, r in zip(("dq", "dk", "dv", "dbeta"), grads, ref_grads):
        assert_close(g.numpy(), r.numpy(), 1e-9, name)


def test_gradcheck_tiny():
    """gradcheck: full Jacobians on a tiny FS-L problem, random projections (fast mode) for all variants."""
    for variant in ("fs", "fsl", "fsb"):
        cfg = FreeSoloConfig(variant=variant, window=6, cell=2, block=4, pool=2, recent=1, top_k=2, beam=2, tau=(1.0,))
        q, k, v = random_qkv(11, 1, 13, 4, 2, 4)
        beta = np.array([0.5, -1.0, 2.0, 1.5])
        xs = tuple(_t(x, grad=True) for x in (q, k, v, beta))
        idx = select_cells(xs[0].detach(), xs[1].detach(), cfg)
        fn = lambda a, b, c, d, cfg=cfg, idx=idx: attention(a, b, c, cfg, d, idx=idx, chunk_tokens=4)
        assert torch.autograd.gradcheck(fn, xs, fast_mode=True)
    # full Jacobians, with the selection inside the op (fixed under gradcheck's tiny perturbations)
    cfg = FreeSoloConfig(variant="fsl", window=4, cell=2, block=2, pool=1, recent=1, top_k=1)
    q, k, v = random_qkv(12, 1, 9, 2, 1, 2)
    xs = tuple(_t(x, grad=True) for x in (q, k, v, np.array([0.7, -1.2])))
    assert torch.autograd.gradcheck(lambda a, b, c, d: attention(a, b, c, cfg, d, chunk_tokens=2), xs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["fsl", "fsb"])
def test_low_precision_within_2x_naive(dtype, variant):
    """bf16 / fp16 vs float64 of the same rounded inputs: output error <= 2x, gradients <= 4x the
    error of the naive same-precision dense implementation (spec §13), same selection."""
    cfg = FreeSoloConfig(variant=variant, window=32, cell=4, block=16, pool=4, recent=2, top_k=3, beam=4, tau=(2.8,))
    q, k, v = random_qkv(4, 2, 96, 4, 2, 16)
    beta = np.array([1.0, 0.5, -0.7, 1.3])
    lo = [_t(x, dtype) for x in (q, k, v, beta)]
    hi = [x.to(torch.float64).requires_grad_(True) for x in lo]
    lo = [x.requires_grad_(True) for x in lo]
    idx = select_cells(hi[0].detach(), hi[1].detach(), cfg)
    ref_out, ref_g = _grads(lambda a, b, c, d: dense_reference(a, b, c, idx, cfg, d), hi)
    out, g = _grads(lambda a, b, c, d: attention(a, b, c, cfg, d, idx=idx), lo)
    naive_out, naive_g = _grads(lambda a, b, c, d: dense_reference(a, b, c, idx, cfg, d), lo)
    assert out.dtype == dtype
    err, naive = rms_rel_error(out.double(), ref_out), rms_rel_error(naive_out.double(), ref_out)
    assert err <= 2 * naive, f"output error {err:.2e} > 2x naive {naive:.2e}"
    for name, a, n, r in zip(("dq", "dk", "dv", "dbeta"), g, naive_g, ref_g):
        e, en = rms_rel_error(a.double(), r), rms_rel_error(n.double(), r)
        assert e <= 4 * en, f"{name} error {e:.2e} > 4x naive {en:.2e}"
    # the backend's own selection in low precision agrees with float64 up to near-ties
    got = select_cells(lo[0].detach(), lo[1].detach(), cfg).numpy()
    if variant == "fsl":
        qd, kd = hi[0].detach().numpy(), hi[1].detach().numpy()
        assert_selection_matches(got, idx.numpy(), qd, kd, cfg, tol=1e-5)


# ---- chunking and memory ---------------------------------------------------------------------


@pytest.mark.parametrize("long_path", ["union", "gather", "auto", "wide"])
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_chunk_size_changes_nothing(variant, long_path):
    cfg = FreeSoloConfig(variant=variant, window=20, cell=4, block=8, pool=3, recent=2, top_k=2, beam=3, tau=(2.9,))
    q, k, v = random_qkv(2, 2, 101, 4, 2, 8)
    results = []
    for ct in (8, 24, 104):  # 104 >= T: one chunk (a larger chunk only pads more)
        xs = [_t(x, grad=True) for x in (q, k, v, np.ones(4))]
        idx = select_cells(xs[0].detach(), xs[1].detach(), cfg, chunk_tokens=ct)
        out, grads = _grads(
            lambda a, b, c, d, ct=ct: attention(a, b, c, cfg, d, chunk_tokens=ct, long_path=long_path), xs
        )
        results.append((idx, out, grads))
    for idx, out, grads in results[1:]:
        assert torch.equal(idx, results[0][0])
        assert_close(out.numpy(), results[0][1].numpy(), 1e-12)
        for g, g0 in zip(grads, results[0][2]):
            assert_close(g.numpy(), g0.numpy(), 1e-12)


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_readout_modes_edges_match_dense(variant):
    """Every readout mode, with the backend's own selection (FS-L: its candidate buffers), chunks
    of 1, 3 and 8 blocks, T = 203 (not a whole number of chunks): block 0 reads no cell, blocks 1
    and 2 fewer than top_k (cells of 4 tokens, blocks of 8, K = 3), the FS-L pool prunes; output
    and gradients equal the dense masked formulation built from the selection (float64)."""
    cfg = FreeSoloConfig(variant=variant, window=16, cell=4, block=8, pool=3, recent=2, top_k=3, beam=3)
    q, k, v = random_qkv(3, 2, 203, 4, 2, 8)
    cfg = _with_tau(cfg, k)
    beta = np.random.default_rng(4).standard_normal(4)
    idx = select_cells(_t(q), _t(k), cfg)
    assert bool((idx[:, 8:16] < 0).any()) and bool((idx[:, :8] < 0).all())  # fewer than K, none
    xs = [_t(x, grad=True) for x in (q, k, v, beta)]
    ref_out, ref_grads = _grads(lambda a, b, c, d: dense_reference(a, b, c, idx, cfg, d), xs)
    for mode in ("auto", "union", "gather", "wide"):
        for ct in (8, 24, 64):
            fn = lambda a, b, c, d, ct=ct, mode=mode: attention(a, b, c, cfg, d, chunk_tokens=ct, long_path=mode)  # noqa: E731
            out, grads = _grads(fn, xs)
            assert_close(out.numpy(), ref_out.numpy(), 1e-9, f"{mode} chunk {ct}: output vs dense")
            for name, g, r in zip(("dq", "dk", "dv", "dbeta"), grads, ref_grads):
                assert_close(g.numpy(), r.numpy(), 1e-9, f"{mode} chunk {ct}: {name}")


def test_readout_mode_from_environment(monkeypatch):
    """FREESOLO_TORCH_READOUT picks the mode when the caller passes none (read at every call);
    an unknown value is an error naming the variable; an explicit long_path wins."""
    from freesolo.backends.torch.attention import READOUT_ENV, readout_mode

    cfg = FreeSoloConfig(variant="fs", window=16, cell=4, block=8, top_k=2)
    q, k, v = (_t(x) for x in random_qkv(5, 1, 80, 2, 1, 8))
    want = {m: attention(q, k, v, cfg, chunk_tokens=32, long_path=m) for m in ("gather", "wide")}
    monkeypatch.delenv(READOUT_ENV, raising=False)
    assert readout_mode() == "auto" and readout_mode("gather") == "gather"
    for m in ("gather", "wide"):
        monkeypatch.setenv(READOUT_ENV, m)
        assert readout_mode() == m
        assert torch.equal(attention(q, k, v, cfg, chunk_tokens=32), want[m])
        assert torch.equal(freesolo.freesolo_attention(q, k, v, cfg, backend="torch"), attention(q, k, v, cfg))
    monkeypatch.setenv(READOUT_ENV, "gather")
    assert torch.equal(attention(q, k, v, cfg, chunk_tokens=32, long_path="wide"), want["wide"])
    monkeypatch.setenv(READOUT_ENV, "fast")
    with pytest.raises(ValueError, match=READOUT_ENV):
        attention(q, k, v, cfg)
    with pytest.raises(ValueError, match="long_path"):
        attention(q, k, v, cfg, long_path="fast")


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def _largest(variant: str, T: int) -> int:
    cfg = FreeSoloConfig(variant=variant, window=64, cell=8, block=32, pool=4, recent=2, top_k=2, beam=2, tau=(2.8,))
    q, k, v = (_t(x, torch.float32, grad=True) for x in random_qkv(0, 1, T, 2, 1, 8))
    mode = _LargestTensor()
    with mode:
        attention(q, k, v, cfg, chunk_tokens=128).sum().backward()
    return mode.largest


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_memory_grows_linearly(variant):
    """No T x T tensor: the largest tensor of forward + backward grows ~linearly in T."""
    small, large = _largest(variant, 1024), _largest(variant, 4096)
    assert large <= 4096 * 4096 // 32, f"a tensor of {large} elements at T=4096"
    bound = 5.0 if variant == "fsb" else 4.2  # FS-B node tables: O((T/s) log(T/s) D)
    assert large <= bound * small, f"largest tensor grew {large / small:.2f}x for 4x T"
