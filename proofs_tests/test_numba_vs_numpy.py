"""Lemma L8 for the numba backend: numba == the float64 NumPy oracle (spec §11), plus the counted
costs of spec §10 (L9 for FS-L, exact n_j for FS).

Selection is tested apart from arithmetic (the readout is fed the oracle's indices), then the
whole path. Both sides are float64: selections must agree up to swaps at score gaps <= 1e-9,
and on integer-valued inputs (where every score is computed exactly, so ties are real) they
must be identical, order included: that is what checks the tie-breaking (larger c first).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig
from freesolo.backends.numba import backend as nbb
from freesolo.reference import oracle
from freesolo.reference.primitives import available_cells, cell_stats, fsl_candidates

from .helpers import SMALL, assert_close, assert_selection_matches, random_qkv

SEL_TOL = 1e-9  # decisive score gap below which float64 implementations may swap cells
OUT_TOL = 1e-10  # rms-relative output error
AWKWARD_T = (1, 31, 33, 127, 129, 1000)
HEAD_DIMS = (2, 6, 64)
GROUPS = (1, 2, 4)


@st.composite
def shapes(draw, ts=AWKWARD_T):
    """(B, T, Hq, Hkv, D) with awkward T and D and GQA groups 1, 2, 4; big T keeps B*Hq small."""
    T = draw(st.sampled_from(ts))
    D = draw(st.sampled_from(HEAD_DIMS))
    group = draw(st.sampled_from(GROUPS))
    if T >= 1000:
        B, Hkv = 1, 1
    else:
        B = draw(st.integers(1, 2))
        Hkv = draw(st.integers(1, 2))
    return B, T, group * Hkv, Hkv, D


def _beta(Hq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 1).uniform(-2.0, 2.0, Hq)


def _check_all(q, k, v, cfg: FreeSoloConfig, beta: np.ndarray) -> None:
    """Selection (tie-aware), local branch, readout on the oracle's indices, and the whole output."""
    idx_ref = oracle.select_cells(q, k, cfg)
    idx = nbb.select_cells(q, k, cfg)
    assert idx.dtype == np.int64 and idx.shape == idx_ref.shape
    assert_selection_matches(idx, idx_ref, q, k, cfg, tol=SEL_TOL)

    loc_ref = oracle.local_attention(q, k, v, cfg)
    assert_close(nbb.local_attention(q, k, v, cfg), loc_ref, OUT_TOL, "local branch")
    long_ref = oracle.long_range_readout(q, k, v, idx_ref, cfg)
    assert_close(nbb.long_range_readout(q, k, v, idx_ref, cfg), long_ref, OUT_TOL, "readout (oracle idx)")

    out_ref = oracle.combine(loc_ref, long_ref, beta, cfg.eps)
    out = freesolo.freesolo_attention(q, k, v, cfg, beta=beta, backend="numba")
    assert_close(out, out_ref, OUT_TOL, "output")


@given(shape=shapes(), variant=st.sampled_from(["fs", "fsl"]), seed=st.integers(0, 2**16))
def test_small_config_matches_oracle(shape, variant, seed):
    """SMALL sizes (window 16, cell 4, block 8, pool 3, recent 2): pruning and top-K bite."""
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = FreeSoloConfig(variant=variant, top_k=2, **SMALL)
    _check_all(q, k, v, cfg, _beta(Hq, seed))


@given(
    variant=st.sampled_from(["fs", "fsl"]),
    T=st.sampled_from([1089, 1100, 1153]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_default_config_matches_oracle(variant, T, group, seed):
    """Paper sizes (window 512, cell 32, block 128, K 4) at T ~ 1100, per-head sigma / lambda."""
    q, k, v = random_qkv(seed, 1, T, group, 1, 64)
    rng = np.random.default_rng(seed)
    cfg = FreeSoloConfig(
        variant=variant,
        pool=4,
        recent=2,
        sigma=tuple(rng.uniform(0.5, 8.0, group)),
        lam=tuple(rng.uniform(0.0, 3.0, group)),
    )
    _check_all(q, k, v, cfg, _beta(group, seed))


@given(shape=shapes(ts=(31, 33, 127, 129)), variant=st.sampled_from(["fs", "fsl"]), seed=st.integers(0, 2**16))
def test_exact_ties_identical_to_oracle(shape, variant, seed):
    """Integer-valued q, k (cell 4): scores are exact in both, ties are real and must be broken
    the same way (larger c first, in the pool and in top-K), and the order must be identical."""
    B, T, Hq, Hkv, D = shape
    rng = np.random.default_rng(seed)
    q = rng.integers(-1, 2, (B, T, Hq, D)).astype(np.float64) * rng.integers(0, 2)  # often q = 0
    k = rng.integers(-1, 2, (B, T, Hkv, D)).astype(np.float64)
    cfg = FreeSoloConfig(variant=variant, top_k=3, **SMALL)
    idx_ref = oracle.select_cells(q, k, cfg)
    idx = nbb.select_cells(q, k, cfg)
    np.testing.assert_array_equal(idx, idx_ref)


@given(
    shape=shapes(ts=(1, 33, 129, 1000)), seed=st.integers(0, 2**16), pool=st.integers(1, 6), recent=st.integers(1, 4)
)
def test_fsl_pool_and_counted_costs(shape, seed, pool, recent):
    """FS-L: each block's candidate set equals the oracle's parallel form; cells scored per query
    == |C_j| <= P+W (L9); tokens read == window tokens + s * selected cells <= w + K*s."""
    B, T, Hq, Hkv, D = shape
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = FreeSoloConfig(variant="fsl", window=16, cell=4, block=8, pool=pool, recent=recent, top_k=2)
    costs = nbb.count_costs(q, k, cfg)
    nb = (T + cfg.block - 1) // cfg.block
    group = Hq // Hkv
    cand, ncand = nbb.block_candidates(nbb.cell_stats(k, cfg)[1], T, cfg)
    np.testing.assert_array_equal(costs["candidates_per_block"], ncand)
    for b in range(B):
        for g in range(Hkv):
            a = cell_stats(k[b, :, g], cfg.cell)[1]
            for j in range(nb):
                ref = fsl_candidates(a, available_cells(j, cfg.block, cfg.cell), pool, recent)
                got = np.sort(cand[b, g, j, : ncand[b, g, j]])
                np.testing.assert_array_equal(got, ref, err_msg=f"pool of block {j}, b={b}, kv head {g}")
                assert np.all(cand[b, g, j, ncand[b, g, j] :] == -1)
                rows = slice(j * cfg.block, min(T, (j + 1) * cfg.block))
                heads = slice(g * group, (g + 1) * group)
                assert np.all(costs["cells_scored"][b, rows, heads] == len(ref))
    assert costs["cells_scored"].max(initial=0) <= pool + recent
    _check_tokens(costs, q, k, cfg)


@given(shape=shapes(ts=(1, 33, 129, 1000)), seed=st.integers(0, 2**16))
def test_fs_counted_costs_exact(shape, seed):
    """FS scores exactly n_j cells per query of block j; tokens read as for FS-L."""
    B, T, Hq, Hkv, D = shape
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    cfg = FreeSoloConfig(variant="fs", **SMALL)
    costs = nbb.count_costs(q, k, cfg)
    n_j = (np.arange(T) // cfg.block) * cfg.block // cfg.cell  # [T]
    np.testing.assert_array_equal(costs["cells_scored"], np.broadcast_to(n_j[None, :, None], (B, T, Hq)))
    assert int(costs["total_cells_scored"]) == B * Hq * int(n_j.sum())
    _check_tokens(costs, q, k, cfg)


def _check_tokens(costs, q, k, cfg: FreeSoloConfig) -> None:
    T = q.shape[1]
    idx = oracle.select_cells(q, k, cfg)
    window_tokens = np.minimum(np.arange(T) + 1, cfg.window)  # [T]
    expected = window_tokens[None, :, None] + cfg.cell * (idx >= 0).sum(axis=-1)  # [B, T, Hq]
    np.testing.assert_array_equal(costs["tokens_read"], expected)
    np.testing.assert_array_equal(costs["cells_selected"], (idx >= 0).sum(axis=-1))
    assert int(costs["total_tokens_read"]) == int(expected.sum())
    assert costs["tokens_read"].max() <= cfg.window + cfg.top_k * cfg.cell


@given(shape=shapes(ts=(33, 129)), variant=st.sampled_from(["fs", "fsl"]), seed=st.integers(0, 2**16))
def test_large_logits_match_oracle(shape, variant, seed):
    """Inputs scaled by 30: softmax weights span far more than exp's range (underflow to 0),
    the position prior is dwarfed by q . kbar; outputs still agree with the oracle."""
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D, scale=30.0)
    cfg = FreeSoloConfig(variant=variant, top_k=2, **SMALL)
    _check_all(q, k, v, cfg, _beta(Hq, seed))


def test_vectorised_exp_matches_libm():
    """The kernels' exp: <= 2 ulp from math.exp down to -708, exactly 0 below, exactly 1 at 0."""
    import math

    from freesolo.backends.numba.kernels import _exp_nonpositive

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            -rng.uniform(0, 1, 5000) * rng.choice([1e-300, 1e-8, 1.0, 50.0, 700.0, 800.0], 5000),
            [0.0, -0.0, -708.0, -708.0001, -1e300],
        ]
    )
    y = x.copy()
    _exp_nonpositive(y, 0, len(y), np.empty(len(y), dtype=np.int64))
    ref = np.array([math.exp(t) for t in x])
    normal = x >= -708.0
    assert np.all(np.abs(y[normal] - ref[normal]) <= 4.5e-16 * ref[normal])
    assert np.all(y[~normal] == 0.0) and np.all(y[x == 0.0] == 1.0)
    y = x.copy()
    _exp_nonpositive(y, 7, 11, np.empty(len(y), dtype=np.int64))  # only [lo, hi) is touched
    np.testing.assert_array_equal(y[:7], x[:7])
    np.testing.assert_array_equal(y[11:], x[11:])


def test_cost_arrays_shapes_and_types():
    q, k, _ = random_qkv(0, 2, 70, 4, 2, 6)
    costs = nbb.count_costs(q, k, FreeSoloConfig(variant="fsl", **SMALL))
    assert costs["cells_scored"].shape == (2, 70, 4) and costs["cells_scored"].dtype == np.int64
    assert costs["tokens_read"].shape == (2, 70, 4) and costs["tokens_read"].dtype == np.int64
    assert costs["candidates_per_block"].shape == (2, 2, 9)
    assert costs["total_cells_scored"].shape == ()


def test_readout_rejects_bad_indices():
    q, k, v = random_qkv(0, 1, 40, 2, 1, 4)
    cfg = FreeSoloConfig(**SMALL)
    bad = np.full((1, 40, 2, 2), -1, dtype=np.int64)
    bad[0, 20, 1, 0] = 10  # only cells 0..9 exist
    with pytest.raises(ValueError, match="idx values"):
        nbb.long_range_readout(q, k, v, bad, cfg)
    with pytest.raises(ValueError, match="idx shape"):
        nbb.long_range_readout(q, k, v, bad[:, :39], cfg)
    with pytest.raises(TypeError, match="integer"):
        nbb.long_range_readout(q, k, v, bad.astype(np.float64), cfg)


def test_no_selected_cell_gives_local_only():
    """Block 0 reads no cell: o == o_loc there, for any beta."""
    q, k, v = random_qkv(3, 1, 20, 2, 1, 6)
    cfg = FreeSoloConfig(**SMALL)
    out = nbb.attention(q, k, v, cfg, np.array([5.0, -3.0]))
    loc = nbb.local_attention(q, k, v, cfg)
    np.testing.assert_array_equal(out[:, : cfg.block], loc[:, : cfg.block])
    assert np.abs(out[:, cfg.block :] - loc[:, cfg.block :]).max() > 0.1


def test_fsb_uses_shared_readout():
    """FS-B on numba = its selection, then the same local branch / readout / combine as FS-L."""
    from freesolo.backends.numba.fsb import select_cells_fsb_numba

    q, k, v = random_qkv(5, 1, 129, 4, 2, 6)
    cfg = FreeSoloConfig(variant="fsb", tau=tuple(oracle.calibrate_tau(k, FreeSoloConfig(**SMALL))), **SMALL)
    beta = _beta(4, 5)
    idx = select_cells_fsb_numba(q, k, cfg)
    np.testing.assert_array_equal(nbb.select_cells(q, k, cfg), idx)
    ref = oracle.combine(
        oracle.local_attention(q, k, v, cfg), oracle.long_range_readout(q, k, v, idx, cfg), beta, cfg.eps
    )
    assert_close(nbb.attention(q, k, v, cfg, beta), ref, OUT_TOL, "fsb output")
