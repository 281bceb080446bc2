"""Lemmas L1, L2, L3, L5 (FS-L/FS and dense clauses) and oracle == dense formulation (spec §11)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig
from freesolo.reference import dense, oracle
from freesolo.reference.primitives import (
    FslPoolStream,
    available_cells,
    cell_stats,
    fsl_candidates,
    position_prior,
    rope,
)

from .helpers import SMALL, assert_close, assert_selection_matches, fs_scores, independent_selection, random_qkv
from .strategies import seeds, shapes, small_configs


def _numpy(q, k, v, cfg, beta=None):
    return freesolo.freesolo_attention(q, k, v, cfg, beta=beta, backend="numpy")


# ---- L1: the position prior of an available cell is at least erf(sigma/2) ------------------
@given(cfg=small_configs(), i=st.integers(0, 2000), sigma=st.floats(0.0, 16.0))
def test_L1_prior_lower_bound_on_available_cells(cfg, i, sigma):
    j = i // cfg.block
    cells = np.arange(available_cells(j, cfg.block, cfg.cell))
    if len(cells) == 0:
        assert j == 0, "only block 0 has no available cell"
        return
    g = position_prior(i, cells, sigma, cfg.cell)
    assert np.all(g >= math.erf(sigma / 2) - 1e-15), (i, cells[g < math.erf(sigma / 2)])
    # and the newest available cell ends at or before the block start
    assert (cells[-1] + 1) * cfg.cell <= j * cfg.block


# ---- L2: causality --------------------------------------------------------------------------
@given(shape=shapes(max_t=100), cfg=small_configs(), seed=seeds, data=st.data())
def test_L2_causality(shape, cfg, seed, data):
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    i0 = data.draw(st.integers(0, T - 1), label="i0")
    q2, k2, v2 = random_qkv(seed + 1, B, T, Hq, Hkv, D)
    q2[:, : i0 + 1], k2[:, : i0 + 1], v2[:, : i0 + 1] = q[:, : i0 + 1], k[:, : i0 + 1], v[:, : i0 + 1]
    for c in (cfg.replace(variant="fs"), cfg.replace(variant="fsl")):  # both, on every example
        o1, o2 = _numpy(q, k, v, c), _numpy(q2, k2, v2, c)
        s1 = freesolo.select_cells(q, k, c, backend="numpy")
        s2 = freesolo.select_cells(q2, k2, c, backend="numpy")
        np.testing.assert_array_equal(s1[:, : i0 + 1], s2[:, : i0 + 1])
        np.testing.assert_array_equal(o1[:, : i0 + 1], o2[:, : i0 + 1])


# ---- L3: FS-L streaming pool == parallel pool; |C_j| <= P + W --------------------------------
@given(
    n_cells=st.integers(0, 120),
    pool=st.integers(1, 10),
    recent=st.integers(1, 6),
    cells_per_block=st.integers(1, 4),
    seed=seeds,
    levels=st.integers(1, 5),
)
def test_L3_streaming_pool_equals_parallel(n_cells, pool, recent, cells_per_block, seed, levels):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, levels, size=n_cells).astype(np.float64)  # few levels: many ties in a_c
    stream = FslPoolStream(pool, recent)
    for j in range(n_cells // cells_per_block + 2):
        n_avail = min(n_cells, j * cells_per_block)
        streamed = stream.advance(a, n_avail)
        parallel = fsl_candidates(a, n_avail, pool, recent)
        np.testing.assert_array_equal(streamed, parallel)
        # independent statement of the rule: recent window + top-P older cells by (a_c, c) descending
        first_recent = max(0, n_avail - recent)
        order = np.lexsort((np.arange(first_recent), a[:first_recent]))[::-1]  # a desc, then c desc
        expected = np.sort(np.concatenate([order[:pool], np.arange(first_recent, n_avail)]))
        np.testing.assert_array_equal(parallel, expected)
        assert len(parallel) <= pool + recent
        assert len(parallel) == min(n_avail, pool + recent)


def test_L3_pool_prefers_norm_then_recency():
    a = np.array([5.0, 1.0, 5.0, 3.0, 9.0, 0.0, 0.0])
    # older cells [0, 5); recent [5, 7); top-2 by (a, c): cell 4 (9.0), then cell 2 (5.0, more recent than 0)
    np.testing.assert_array_equal(fsl_candidates(a, 7, pool=2, recent=2), [2, 4, 5, 6])


# ---- selection: the top-K by score among the candidates, ordered, padded ---------------------
@given(shape=shapes(max_t=100), cfg=small_configs(), seed=seeds)
def test_selection_is_top_k_of_candidates(shape, cfg, seed):
    B, T, Hq, Hkv, D = shape
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    idx = freesolo.select_cells(q, k, cfg, backend="numpy")
    assert idx.shape == (B, T, Hq, cfg.top_k) and idx.dtype == np.int64
    for b in range(B):
        for h in range(Hq):
            _, a = cell_stats(k[b, :, h // (Hq // Hkv)], cfg.cell)
            for i in range(T):
                n_avail = available_cells(i // cfg.block, cfg.block, cfg.cell)
                cand = oracle.block_candidates(a, n_avail, cfg)
                row = idx[b, i, h]
                chosen = row[row >= 0]
                assert np.all(row[len(chosen) :] == -1), "padding must come last"
                assert len(chosen) == min(cfg.top_k, len(cand))
                assert set(chosen) <= set(cand.tolist())
                if len(chosen) == 0:
                    continue
                s_chosen = fs_scores(q, k, cfg, b, i, h, chosen)
                assert np.all(np.diff(s_chosen) <= 0), "ordered by descending score"
                rest = sorted(set(cand.tolist()) - set(chosen.tolist()))
                if rest:
                    s_rest = fs_scores(q, k, cfg, b, i, h, rest)
                    assert s_chosen.min() >= s_rest.max()


@given(shape=shapes(max_t=100), cfg=small_configs(), seed=seeds)
def test_oracle_selection_equals_independent_statement(shape, cfg, seed):
    """The oracle's selection == the spec's rule restated in the test (helpers.independent_selection:
    its own kbar, a_c, erf prior, n_j, FS-L pool and top-K), up to float64 near-ties, and every row
    is ordered by descending independent score. Catches an oracle that is consistent with itself
    but not with §3-§5, §7 (a wrong prior, statistic or availability)."""
    B, T, Hq, Hkv, D = shape
    q, k, _ = random_qkv(seed, B, T, Hq, Hkv, D)
    idx = freesolo.select_cells(q, k, cfg, backend="numpy")
    expected = independent_selection(q, k, cfg)
    assert_selection_matches(idx, expected, q, k, cfg, tol=1e-12)
    for b, i, h in np.ndindex(B, T, Hq):
        chosen = [int(c) for c in idx[b, i, h] if c >= 0]
        if len(chosen) > 1:
            assert np.all(np.diff(fs_scores(q, k, cfg, b, i, h, chosen)) <= 1e-12), (b, i, h, chosen)


def test_independent_selection_bites():
    """The independent rule is not vacuous at SMALL sizes: cells are selected, and FS-L differs from FS."""
    q, k, _ = random_qkv(3, 1, 120, 2, 1, 8)
    fsl = FreeSoloConfig(variant="fsl", top_k=2, **SMALL)
    sel = independent_selection(q, k, fsl)
    assert (sel[:, SMALL["block"] :] >= 0).all() and (sel[:, : SMALL["block"]] == -1).all()
    assert (sel != independent_selection(q, k, fsl.replace(variant="fs"))).any()


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("zero_q", [False, True])
def test_exact_ties_follow_the_spec(backend, variant, zero_q):
    """Integer keys, lam = 0, D = 4: every score and norm is exact, so ties are real. Each backend
    must equal the independent statement exactly, order included: ties in the pool and in top-K go
    to the larger c (spec §5, §7). zero_q: every score ties, so the K largest candidates win."""
    if backend == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng(17)
    B, T, Hq, Hkv, D = 2, 75, 2, 1, 4
    q = np.zeros((B, T, Hq, D)) if zero_q else rng.integers(-1, 2, (B, T, Hq, D)).astype(np.float64)
    k = rng.integers(-1, 2, (B, T, Hkv, D)).astype(np.float64)
    cfg = FreeSoloConfig(variant=variant, top_k=3, lam=0.0, **SMALL)
    expected = independent_selection(q, k, cfg)
    if zero_q and variant == "fs":
        n_j = (np.arange(T) // cfg.block) * cfg.block // cfg.cell
        for i in range(T):
            top = list(range(n_j[i] - 1, max(-1, n_j[i] - 1 - cfg.top_k), -1))
            assert expected[0, i, 0, : len(top)].tolist() == top
    got = freesolo.select_cells(q, k, cfg, backend=backend)
    np.testing.assert_array_equal(np.asarray(got), expected)


# ---- L5: FS-L with P + W >= available cells equals FS ---------------------------------------
@given(shape=shapes(max_t=100), cfg=small_configs(variant="fsl"), seed=seeds)
def test_L5_fsl_with_large_pool_equals_fs(shape, cfg, seed):
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    n_max = T // cfg.cell
    fsl = cfg.replace(pool=max(1, n_max), recent=1)
    fs = cfg.replace(variant="fs")
    np.testing.assert_array_equal(
        freesolo.select_cells(q, k, fsl, backend="numpy"), freesolo.select_cells(q, k, fs, backend="numpy")
    )
    np.testing.assert_array_equal(_numpy(q, k, v, fsl), _numpy(q, k, v, fs))


def _rope_complex(x, pos, theta):
    """Half-split RoPE written as a complex rotation (independent of primitives.rope): the pair
    (x[m], x[m + D/2]) is the complex number x[m] + i x[m + D/2], turned by pos * theta^(-2m/D)."""
    D = x.shape[-1]
    z = x[:, : D // 2] + 1j * x[:, D // 2 :]
    z = z * np.exp(1j * pos[:, None] * theta ** (-2.0 * np.arange(D // 2) / D))
    return np.concatenate([z.real, z.imag], axis=1)


def test_oracle_rope_is_the_half_split_form():
    rng = np.random.default_rng(1)
    for D in (2, 6, 64):
        x, pos = rng.standard_normal((40, D)), np.arange(1000, 1040)
        np.testing.assert_allclose(rope(x, pos, 500.0), _rope_complex(x, pos, 500.0), rtol=0, atol=1e-11)


def _dense_reference(q, k, v, cfg, beta):
    """Dense causal RoPE attention + beta * rmsnorm(full NoPE attention over available tokens),
    written independently of the oracle with plain matrices."""
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    pos = np.arange(T)
    rope = _rope_complex  # not the oracle's
    causal = pos[None, :] <= pos[:, None]  # [T, T]
    available = pos[None, :] < (pos[:, None] // cfg.block) * cfg.block  # tokens of cells c < n_j
    out = np.zeros_like(q)

    def attend(qh, kh, vh, mask):
        logits = np.where(mask, qh @ kh.T / math.sqrt(D), -np.inf)
        m = logits.max(axis=1, keepdims=True)
        m[~np.isfinite(m)] = 0.0
        w = np.exp(logits - m)
        s = w.sum(axis=1, keepdims=True)
        return (w @ vh) / np.where(s > 0, s, 1.0)

    for b in range(B):
        for h in range(Hq):
            g = h // group
            loc = attend(
                rope(q[b, :, h], pos, cfg.rope_theta), rope(k[b, :, g], pos, cfg.rope_theta), v[b, :, g], causal
            )
            lng = attend(q[b, :, h], k[b, :, g], v[b, :, g], available)
            out[b, :, h] = loc + beta[h] * lng / np.sqrt(np.mean(lng**2, axis=1, keepdims=True) + cfg.eps)
    return out


@given(shape=shapes(max_t=70), cfg=small_configs(), seed=seeds)
def test_L5_everything_selected_is_dense_attention(shape, cfg, seed):
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    n_max = max(1, T // cfg.cell)
    big = cfg.replace(top_k=n_max, pool=n_max, recent=n_max, window=max(T, cfg.block))
    beta = np.linspace(0.5, 1.5, Hq)
    assert_close(_numpy(q, k, v, big, beta), _dense_reference(q, k, v, big, beta), 1e-12)


# ---- the oracle agrees with its dense masked formulation -------------------------------------
@given(shape=shapes(max_t=140), cfg=small_configs(), seed=seeds)
def test_oracle_equals_dense_formulation(shape, cfg, seed):
    B, T, Hq, Hkv, D = shape
    q, k, v = random_qkv(seed, B, T, Hq, Hkv, D)
    beta = np.linspace(-1.0, 2.0, Hq)
    idx = oracle.select_cells(q, k, cfg)
    assert_close(oracle.attention(q, k, v, cfg, beta), dense.dense_attention(q, k, v, idx, cfg, beta), 1e-12)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("T", [1000, 1100])
def test_defaults_oracle_equals_dense(variant, T):
    cfg = FreeSoloConfig(variant=variant)
    q, k, v = random_qkv(T, 1, T, 2, 1, 64)
    idx = oracle.select_cells(q, k, cfg)
    assert (idx[:, : cfg.block] == -1).all(), "block 0 reads nothing"
    assert (idx[:, cfg.block :] >= 0).all(), "later blocks read top_k cells"
    assert_close(
        oracle.attention(q, k, v, cfg, np.ones(2)), dense.dense_attention(q, k, v, idx, cfg, np.ones(2)), 1e-12
    )


def test_small_config_prunes():
    """The SMALL config really prunes: FS-L and FS select differently somewhere."""
    q, k, _ = random_qkv(3, 1, 200, 2, 1, 8)
    fsl = FreeSoloConfig(variant="fsl", **SMALL)
    fs = fsl.replace(variant="fs")
    assert (freesolo.select_cells(q, k, fsl, backend="numpy") != freesolo.select_cells(q, k, fs, backend="numpy")).any()


def test_rope_is_relative():
    """rope(q, i) . rope(k, t) depends on i - t only."""
    rng = np.random.default_rng(0)
    qv, kv = rng.standard_normal((1, 8)), rng.standard_normal((1, 8))
    a = rope(qv, np.array([10]), 10000.0) @ rope(kv, np.array([3]), 10000.0).T
    b = rope(qv, np.array([107]), 10000.0) @ rope(kv, np.array([100]), 10000.0).T
    assert abs((a - b).item()) < 1e-12


def test_calibrate_tau_is_median_of_cell_max_norms():
    q, k, _ = random_qkv(5, 2, 130, 2, 2, 6)
    cfg = FreeSoloConfig(**SMALL)
    tau = freesolo.calibrate_tau(k, cfg)
    assert tau.shape == (2,)
    for g in range(2):
        norms = np.concatenate([cell_stats(k[b, :, g], cfg.cell)[1] for b in range(2)])
        assert len(norms) == 2 * (130 // cfg.cell)
        assert tau[g] == np.median(norms)
        # independently of the oracle's cell_stats: max token norm per complete cell, all batch rows
        C = 130 // cfg.cell
        a = np.linalg.norm(k[:, : C * cfg.cell, g], axis=-1).reshape(2, C, cfg.cell).max(axis=-1)
        assert abs(tau[g] - np.median(a.ravel())) <= 1e-12
