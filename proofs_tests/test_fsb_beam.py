"""FS-B beam search and rerank (spec §6.4): L5 (wide beams are exhaustive), L9 (node-key count),
L2 (causality), tie rules, numba == float64 oracle, the tau error, and the public API."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig
from freesolo.backends.numba.fsb import select_cells_fsb_numba
from freesolo.reference.fsb import beam_search, fsb_costs, fsb_node_keys_count, head_forests, node_key, select_cells_fsb
from freesolo.reference.oracle import calibrate_tau
from freesolo.reference.primitives import cell_scores

from .helpers import SMALL, assert_selection_matches, random_qkv

# ---- independent statements of the expected results ------------------------------------------------


def rho_scores(q, k, cfg, b, i, h, cells) -> np.ndarray:
    """rho_h(i, c) = logsumexp_t(scale q_i . k_t) over the tokens of each cell (test's own code)."""
    Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    g = h // (Hq // Hkv)
    out = []
    for c in cells:
        logits = np.array([float(q[b, i, h] @ k[b, t, g]) for t in range(c * cfg.cell, (c + 1) * cfg.cell)])
        logits /= math.sqrt(D)
        out.append(logits.max() + math.log(np.exp(logits - logits.max()).sum()))
    return np.array(out)


def exhaustive_top_k(q, k, cfg) -> np.ndarray:
    """Top-K by rho among ALL available cells c < (i // block) * block / cell; ties larger c first."""
    B, T, Hq, _ = q.shape
    idx = np.full((B, T, Hq, cfg.top_k), -1, np.int64)
    for b in range(B):
        for i in range(T):
            n = (i // cfg.block) * cfg.block // cfg.cell
            for h in range(Hq):
                rho = rho_scores(q, k, cfg, b, i, h, range(n))
                best = sorted(range(n), key=lambda c: (rho[c], c), reverse=True)[: cfg.top_k]
                idx[b, i, h, : len(best)] = best
    return idx


def inputs(seed, B, T, Hkv, group, D, quantized=False, tau_shift=0.0):
    q, k, _ = random_qkv(seed, B, T, Hkv * group, Hkv, D)
    if quantized:  # coarse values: exact ties in keys, codes and scores
        q, k = np.rint(q * 2) / 2, np.rint(k * 2) / 2
    return q, k


def fsb_config(k, tau_shift=0.0, **fields) -> FreeSoloConfig:
    cfg = FreeSoloConfig(variant="fsb", **{**SMALL, **fields})
    tau = calibrate_tau(k, cfg) + tau_shift if k.shape[1] >= cfg.cell else np.zeros(k.shape[2])
    return cfg.replace(tau=tuple(tau))


shapes = {
    "seed": st.integers(0, 2**31),
    "T": st.integers(1, 200),
    "Hkv": st.sampled_from([1, 2]),
    "group": st.sampled_from([1, 2]),
    "D": st.sampled_from([2, 4, 8, 16]),
    "leaf_order": st.sampled_from(["content", "position"]),
}

# ---- L5 ---------------------------------------------------------------------------------------------


@given(**shapes, top_k=st.integers(1, 6))
def test_L5_beam_as_wide_as_the_widest_level_is_exhaustive(seed, T, Hkv, group, D, leaf_order, top_k):
    """beam >= the available cells: every cell is a candidate, FS-B = top-K by rho among all."""
    q, k = inputs(seed, 1, T, Hkv, group, D)
    cfg = fsb_config(k, leaf_order=leaf_order, top_k=top_k, beam=max(1, T // 4))
    expected = exhaustive_top_k(q, k, cfg)
    for got in (select_cells_fsb(q, k, cfg), select_cells_fsb_numba(q, k, cfg)):
        assert_selection_matches(got, expected, q, k, cfg, tol=1e-12, score_fn=rho_scores)
        assert np.array_equal(got, expected)  # random data: no ties, so exactly
    costs = fsb_costs(q, k, cfg)
    n_avail = (np.arange(T) // cfg.block) * cfg.block // cfg.cell
    assert np.array_equal(costs["cells_reranked"][0], np.repeat(n_avail[:, None], Hkv * group, axis=1))


@given(**shapes, radius_weight=st.sampled_from([0.0, 0.5, 1.0]))
def test_L5_each_forest_returns_its_top_beam_cells(seed, T, Hkv, group, D, leaf_order, radius_weight):
    """beam >= the nodes one level above the leaves (floor(n/2)): each forest returns exactly its
    top-`beam` cells by key = score (the leaf key is the cell score)."""
    q, k = inputs(seed, 1, T, Hkv, group, D)
    n_max = (T - 1) // 8 * 2 if T > 8 else 0
    cfg = fsb_config(k, leaf_order=leaf_order, radius_weight=radius_weight, beam=max(1, n_max // 2))
    Hq = Hkv * group
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    scale = 1.0 / math.sqrt(D)
    for (b, g), hf in head_forests(k, cfg).items():
        for h in range(g * group, (g + 1) * group):
            for i in range(8, T):
                n = (i // 8) * 2
                q_i = q[b, i, h]
                q_norm = math.sqrt(float(q_i @ q_i))

                def key(tree, level, m, q_i=q_i, q_norm=q_norm, i=i, h=h):
                    return node_key(
                        q_i, q_norm, i, tree, tree.node(level, m), scale, sigma[h], lam[h], 4, radius_weight
                    )

                for trees, cells in zip(hf.forests(n), (np.arange(n), hf.high_cells[hf.high_cells < n])):
                    assert cfg.beam >= len(cells) // 2
                    found, _ = beam_search(trees, key, cfg.beam)
                    scores = cell_scores(q_i, i, cells, hf.kbar, hf.a, sigma[h], lam[h], 4)
                    top = cells[np.argsort(-scores, kind="stable")[: cfg.beam]]
                    assert sorted(found) == sorted(top.tolist())


# ---- L9 and the cost counter --------------------------------------------------------------------------


def test_L9_node_key_count_closed_form_and_bound():
    """fsb_node_keys_count(n, beam) = sum_{l < H} (2 min(beam, n >> (l+1)) + bit_l(n)) <= the L9 bound."""
    for beam in range(1, 40):
        for n in range(0, 3000, 7 if beam > 5 else 1):
            count = fsb_node_keys_count(n, beam)
            H = n.bit_length() - 1
            assert count == sum(2 * min(beam, n >> (l + 1)) + (n >> l & 1) for l in range(H))
            if n:
                assert count <= 2 * beam * (math.floor(math.log2(n)) + 1) + n.bit_count()


@given(**shapes, beam=st.integers(1, 5))
def test_L9_counted_node_keys_match_the_data_independent_count(seed, T, Hkv, group, D, leaf_order, beam):
    """The instrumented counter == fsb_node_keys_count(n_j) + fsb_node_keys_count(high cells among
    n_j) for every query, on two different inputs (so the count depends on n only), oracle and
    numba; cells reranked <= 2*beam."""
    Hq = Hkv * group
    for s in (seed, seed + 1):
        q, k = inputs(s, 1, T, Hkv, group, D)
        cfg = fsb_config(k, leaf_order=leaf_order, beam=beam)
        costs = fsb_costs(q, k, cfg)
        _, numba_costs = select_cells_fsb_numba(q, k, cfg, return_costs=True)
        tau = cfg.tau_array(Hkv)
        for g, hf in ((g, head_forests(k, cfg)[(0, g)]) for g in range(Hkv)):
            for i in range(T):
                n = (i // 8) * 2
                n_high = int((hf.high_cells < n).sum())
                assert n_high == int((hf.a[:n] > tau[g]).sum())
                expected = fsb_node_keys_count(n, beam) + fsb_node_keys_count(n_high, beam)
                for h in range(g * group, (g + 1) * group):
                    assert costs["node_keys"][0, i, h] == expected
                    for n_ in (n, n_high):
                        assert fsb_node_keys_count(n_, beam) <= (
                            2 * beam * (math.floor(math.log2(n_)) + 1) + n_.bit_count() if n_ else 0
                        )
                    reranked = costs["cells_reranked"][0, i, h]
                    assert min(beam, n) <= reranked <= min(2 * beam, n)
        assert np.array_equal(costs["node_keys"], numba_costs["node_keys"])
        assert np.array_equal(costs["cells_reranked"], numba_costs["cells_reranked"])
        assert costs["node_keys"].shape == (1, T, Hq)


# ---- ties -----------------------------------------------------------------------------------------------


@given(T=st.integers(9, 200), beam=st.integers(1, 6), leaf_order=st.sampled_from(["content", "position"]))
def test_tie_rules(T, beam, leaf_order):
    """q = 0 and lam = 0: every key and every rho tie. The beam keeps the smaller segment start,
    then the smaller index in the level, so each forest returns the first `beam` leaves of its
    trees' leaf orders concatenated (largest tree first); the rerank keeps the larger cells first."""
    rng = np.random.default_rng(T)
    k = rng.standard_normal((1, T, 1, 4))
    q = np.zeros((1, T, 2, 4))
    cfg = fsb_config(k, leaf_order=leaf_order, beam=beam, lam=0.0, top_k=3)
    hf = head_forests(k, cfg)[(0, 0)]
    expected = np.full((1, T, 2, 3), -1, np.int64)
    for i in range(8, T):
        union = set()
        for trees in hf.forests((i // 8) * 2):  # the first `beam` leaves, trees largest first
            union |= set(np.concatenate([t.cells for t in trees] + [[]])[:beam].astype(int).tolist())
        best = sorted(union, reverse=True)[:3]
        expected[0, i, :, : len(best)] = best
    assert np.array_equal(select_cells_fsb(q, k, cfg), expected)
    assert np.array_equal(select_cells_fsb_numba(q, k, cfg), expected)


# ---- L2 causality -------------------------------------------------------------------------------------


@given(**shapes, cut=st.integers(0, 199), beam=st.integers(1, 4))
def test_L2_fsb_causality(seed, T, Hkv, group, D, leaf_order, cut, beam):
    """Changing tokens t > cut (q and k) changes no FS-B selection at positions <= cut."""
    cut = min(cut, T - 1)
    q, k = inputs(seed, 1, T, Hkv, group, D)
    cfg = fsb_config(k, leaf_order=leaf_order, beam=beam)  # tau is a fixed constant, not re-calibrated
    rng = np.random.default_rng(seed + 7)
    q2, k2 = q.copy(), k.copy()
    q2[:, cut + 1 :] = rng.standard_normal(q2[:, cut + 1 :].shape) * 3
    k2[:, cut + 1 :] = rng.standard_normal(k2[:, cut + 1 :].shape) * 3
    for select in (select_cells_fsb, select_cells_fsb_numba):
        a, b = select(q, k, cfg), select(q2, k2, cfg)
        assert np.array_equal(a[:, : cut + 1], b[:, : cut + 1])


# ---- numba == oracle --------------------------------------------------------------------------------


@given(
    **shapes,
    B=st.integers(1, 2),
    beam=st.integers(1, 4),
    top_k=st.integers(1, 5),
    quantized=st.booleans(),
    radius_weight=st.sampled_from([0.0, 0.5, 1.0]),
    hash_bits=st.sampled_from([1, 3, 16]),
    tau_shift=st.sampled_from([0.0, -0.3, 0.3]),
)
def test_numba_equals_oracle(
    seed, T, Hkv, group, D, leaf_order, B, beam, top_k, quantized, radius_weight, hash_bits, tau_shift
):
    """L8 for FS-B selection: numba == the float64 oracle (tie-aware on rho), costs equal;
    quantized inputs exercise exact ties; a subset of positions gives the same rows."""
    q, k = inputs(seed, B, T, Hkv, group, D, quantized)
    cfg = fsb_config(
        k,
        tau_shift,
        leaf_order=leaf_order,
        beam=beam,
        top_k=top_k,
        radius_weight=radius_weight,
        hash_bits=hash_bits,
        hash_seed=seed % 5,
    )
    ref = select_cells_fsb(q, k, cfg)
    got, costs = select_cells_fsb_numba(q, k, cfg, return_costs=True)
    assert got.dtype == np.int64 and got.shape == (B, T, Hkv * group, top_k)
    assert_selection_matches(got, ref, q, k, cfg, tol=1e-12, score_fn=rho_scores)
    assert (ref[:, : min(T, cfg.block)] == -1).all()  # block 0: nothing available
    ref_costs = fsb_costs(q, k, cfg)
    assert np.array_equal(costs["node_keys"], ref_costs["node_keys"])
    positions = np.random.default_rng(seed).choice(T, size=min(T, 5), replace=False)
    assert np.array_equal(select_cells_fsb_numba(q, k, cfg, positions=positions), got[:, positions])


def test_numba_equals_oracle_at_default_sizes():
    """Default config (window 512, cell 32, block 128, beam 16, 16-bit codes) at T = 1100."""
    q, k = inputs(11, 1, 1100, 1, 2, 16)
    k[..., :4] += 1.5  # shared direction
    cfg = FreeSoloConfig(variant="fsb")
    cfg = cfg.replace(tau=tuple(calibrate_tau(k, cfg)))
    ref = select_cells_fsb(q, k, cfg)
    got, costs = select_cells_fsb_numba(q, k, cfg, return_costs=True)
    assert np.array_equal(got, ref)
    assert np.array_equal(freesolo.select_cells(q, k, cfg, backend="numpy"), ref)
    assert np.array_equal(freesolo.select_cells(q, k, cfg, backend="numba"), ref)  # the backend uses numba/fsb.py
    hf = head_forests(k, cfg)[(0, 0)]
    for i in (0, 127, 128, 700, 1099):
        n = (i // 128) * 4
        expected = fsb_node_keys_count(n, 16) + fsb_node_keys_count(int((hf.high_cells < n).sum()), 16)
        assert (costs["node_keys"][0, i] == expected).all()
    assert (ref[0, 128:, :, 0] >= 0).all() and (ref[0, :128] == -1).all()
    with freesolo.use_backend("numpy"):
        cfg_pos = cfg.replace(leaf_order="position", radius_weight=0.0)
        assert np.array_equal(freesolo.select_cells(q, k, cfg_pos), select_cells_fsb_numba(q, k, cfg_pos))


# ---- errors ---------------------------------------------------------------------------------------------


def test_fsb_without_tau_raises_and_says_how_to_get_one():
    q, k = inputs(0, 1, 40, 1, 1, 4)
    cfg = FreeSoloConfig(variant="fsb", **SMALL)
    for call in (
        lambda: select_cells_fsb(q, k, cfg),
        lambda: select_cells_fsb_numba(q, k, cfg),
        lambda: freesolo.select_cells(q, k, cfg, backend="numpy"),
        lambda: freesolo.freesolo_attention(q, k, k, cfg, backend="numpy"),
    ):
        with pytest.raises(ValueError, match="calibrate_tau"):
            call()
    with pytest.raises(ValueError, match="tau has 3 values"):
        select_cells_fsb(q, k, cfg.replace(tau=(1.0, 2.0, 3.0)))


# ---- the beam walked from the spec, with node keys from scratch ---------------------------------


def spec_fsb_select(q, k, cfg) -> np.ndarray:
    """FS-B selection restated from spec §6.3-§6.4 in the test: the trees' shapes and leaf orders
    come from head_forests (checked against their definition in test_fsb_forest), everything else
    is recomputed here: node statistics from the leaf cells, the UB key, the height-aligned beam
    (the tallest root first, each shorter tree's root joining at its own height; ties by larger
    key, smaller segment start, smaller index), the union of both forests, the rho rerank."""
    B, T, Hq, D = q.shape
    Hkv, s = k.shape[2], cfg.cell
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    idx = np.full((B, T, Hq, cfg.top_k), -1, np.int64)
    for (b, g), hf in head_forests(k, cfg).items():
        C = T // s
        cells_k = k[b, : C * s, g].reshape(C, s, D)
        kbar, a = cells_k.mean(axis=1), np.linalg.norm(cells_k, axis=-1).max(axis=1)
        for h in range(g * (Hq // Hkv), (g + 1) * (Hq // Hkv)):
            for i in range(cfg.block, T):
                n = (i // cfg.block) * cfg.block // s
                qi = q[b, i, h]

                def key(tree, level, m, qi=qi, i=i, h=h, kbar=kbar, a=a):
                    under = tree.cells[m << level : (m + 1) << level]
                    mu = kbar[under].mean(axis=0)
                    rad = np.linalg.norm(kbar[under] - mu, axis=1).max()
                    prior = lam[h] * a[under].max() * math.erf(sigma[h] * (i - under.min() * s) / (2.0 * s))
                    return (qi @ mu + cfg.radius_weight * np.linalg.norm(qi) * rad) / math.sqrt(D) + prior

                union = set()
                for trees in hf.forests(n):
                    if not trees:
                        continue
                    root_of = {t.height: t for t in trees}
                    frontier = [(trees[0], 0)]
                    for level in range(trees[0].height - 1, -1, -1):
                        cands = [(t, 2 * m + d) for t, m in frontier for d in (0, 1)]
                        cands += [(root_of[level], 0)] if level in root_of else []
                        cands.sort(key=lambda tm, level=level: (-key(tm[0], level, tm[1]), tm[0].start, tm[1]))
                        frontier = cands[: cfg.beam]
                    union |= {int(t.cells[m]) for t, m in frontier}
                rho = rho_scores(q, k, cfg, b, i, h, sorted(union))
                best = sorted(zip(rho.tolist(), sorted(union)), reverse=True)[: cfg.top_k]
                idx[b, i, h, : len(best)] = [c for _, c in best]
    return idx


@given(
    seed=st.integers(0, 2**31),
    T=st.integers(40, 150),
    Hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    D=st.sampled_from([2, 4, 8]),
    leaf_order=st.sampled_from(["content", "position"]),
    beam=st.integers(1, 3),
    top_k=st.integers(1, 4),
    radius_weight=st.sampled_from([0.0, 1.0]),
    lam=st.sampled_from([0.0, 1.0]),
)
def test_beam_search_equals_the_spec_walk(seed, T, Hkv, group, D, leaf_order, beam, top_k, radius_weight, lam):
    """Small beams (pruning bites at every level): oracle and numba == the spec walk above."""
    q, k = inputs(seed, 1, T, Hkv, group, D)
    cfg = fsb_config(k, leaf_order=leaf_order, beam=beam, top_k=top_k, radius_weight=radius_weight, lam=lam)
    expected = spec_fsb_select(q, k, cfg)
    n_last = ((T - 1) // cfg.block) * cfg.block // cfg.cell
    assert n_last > 2 * beam, "the beam must prune somewhere"
    assert np.array_equal(select_cells_fsb(q, k, cfg), expected)
    assert np.array_equal(select_cells_fsb_numba(q, k, cfg), expected)
