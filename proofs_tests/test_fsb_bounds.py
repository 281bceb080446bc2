"""Lemma L4 (spec §6.3): UB_h(i, n) >= score_h(i, c) for every node n of every block's forests
and every leaf c under it; a leaf's key is its score. Negative control: the invalid radius
"distance to the children's centres" is caught by the same check."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from freesolo import FreeSoloConfig
from freesolo.reference.fsb import head_forests, node_key
from freesolo.reference.oracle import calibrate_tau
from freesolo.reference.primitives import cell_scores

from .helpers import SMALL, random_qkv

TOL = 1e-9  # float64 rounding slack of the bound (relative to 1 + |score|)


def exact_radius(tree, level, index):
    return tree.rad[tree.node(level, index)]


def children_centres_radius(tree, level, index):
    """INVALID radius (test helper): max distance from mu_n to its two children's centres."""
    if level == 0:
        return 0.0
    mu = tree.mu[tree.node(level, index)]
    return max(float(np.linalg.norm(tree.mu[tree.node(level - 1, 2 * index + d)] - mu)) for d in (0, 1))


def bound_violations(q, k, cfg: FreeSoloConfig, radius=exact_radius) -> list:
    """Check UB(i, n) >= score(i, c) for every block, query, head, forest, node and leaf under it.

    UB is computed from the forest's node statistics with `radius(tree, level, index)` as the
    radius; scores from the oracle's `cell_scores` (independent of the trees).
    Returns the violations [(b, i, h, node, cell, UB, score)].
    """
    _, T, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    sigma, lam = cfg.per_head("sigma", Hq), cfg.per_head("lam", Hq)
    violations = []
    for (b, g), hf in head_forests(k, cfg).items():
        for h in range(g * (Hq // Hkv), (g + 1) * (Hq // Hkv)):
            for j in range(1, (T + cfg.block - 1) // cfg.block):
                n_avail = j * cfg.block // cfg.cell
                queries = range(j * cfg.block, min(T, (j + 1) * cfg.block))
                scores = {
                    i: cell_scores(q[b, i, h], i, np.arange(n_avail), hf.kbar, hf.a, sigma[h], lam[h], cfg.cell)
                    for i in queries
                }  # [n_avail] per query
                for trees in hf.forests(n_avail):
                    for tree in trees:
                        for level in range(tree.height + 1):
                            for index in range(1 << (tree.height - level)):
                                node = tree.node(level, index)
                                rad = radius(tree, level, index)
                                under = tree.leaf_cells(level, index)
                                assert under.max() < n_avail  # causal: only available cells
                                for i in queries:
                                    q_i = q[b, i, h]
                                    q_norm = math.sqrt(float(q_i @ q_i))
                                    ub = scale * (float(tree.mu[node] @ q_i) + q_norm * rad) + lam[h] * tree.A[
                                        node
                                    ] * math.erf(sigma[h] * (i - tree.e[node]) / (2.0 * cfg.cell))
                                    for c in under:
                                        s = scores[i][c]
                                        if ub < s - TOL * (1 + abs(s)):
                                            violations.append((b, i, h, node, int(c), ub, s))
                                    if radius is exact_radius:  # the beam's key is this UB (§6.3)
                                        for w in (1.0, 0.5, 0.0):
                                            key = node_key(
                                                q_i, q_norm, i, tree, node, scale, sigma[h], lam[h], cfg.cell, w
                                            )
                                            want = ub - (1.0 - w) * scale * q_norm * rad
                                            assert abs(key - want) <= 1e-12 * (1 + abs(want)), (node, w, key, want)
                                    if level == 0:  # a leaf's key is its score (to rounding)
                                        key = node_key(
                                            q_i, q_norm, i, tree, node, scale, sigma[h], lam[h], cfg.cell, 1.0
                                        )
                                        assert abs(key - scores[i][under[0]]) <= 1e-12 * (1 + abs(key))
    return violations


@given(
    seed=st.integers(0, 2**31),
    T=st.integers(1, 140),
    Hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    D=st.sampled_from([2, 4, 8]),
    leaf_order=st.sampled_from(["content", "position"]),
    sigma=st.floats(0.5, 8.0),
    lam=st.sampled_from([0.0, 0.3, 1.0, 3.0]),
    offset=st.floats(0.0, 2.0),
)
def test_L4_upper_bound_on_every_node_of_every_block(seed, T, Hkv, group, D, leaf_order, sigma, lam, offset):
    q, k, _ = random_qkv(seed, 1, T, Hkv * group, Hkv, D)
    k = k + offset * np.random.default_rng(seed).standard_normal(D)  # a shared key direction, as in real keys
    cfg = FreeSoloConfig(variant="fsb", leaf_order=leaf_order, sigma=sigma, lam=lam, hash_bits=6, **SMALL)
    tau = calibrate_tau(k, cfg) if T >= cfg.cell else np.zeros(Hkv)
    cfg = cfg.replace(tau=tuple(tau))
    assert bound_violations(q, k, cfg) == []


def _fixed_example():
    """Four cells (position order) whose pairs share one centre: the root's children's centres
    coincide with the root's, so the invalid radius is 0 while the cells lie at distance 3."""
    cfg = FreeSoloConfig(variant="fsb", leaf_order="position", tau=(100.0,), **SMALL)
    T, D = 24, 2
    k = np.zeros((1, T, 1, D))
    for c, key in enumerate([(3, 0), (-3, 0), (0, 3), (0, -3)]):
        k[0, 4 * c : 4 * c + 4, 0] = key
    q = np.zeros((1, T, 1, D))
    q[0, :, 0] = (5.0, 0.0)
    return q, k, cfg


def test_L4_negative_control_fixed_example():
    """The same check catches the invalid radius (distance to the children's centres)."""
    q, k, cfg = _fixed_example()
    assert bound_violations(q, k, cfg) == []
    bad = bound_violations(q, k, cfg, radius=children_centres_radius)
    assert bad and all(ub < s for *_, ub, s in bad)
    assert {c for *_, c, _, _ in bad} == {0}  # the leaf pointing at the query escapes the ball


@given(seed=st.integers(0, 2**31), leaf_order=st.sampled_from(["content", "position"]))
def test_L4_negative_control_on_random_keys(seed, leaf_order):
    """Random keys, queries aimed at the leaf farthest from the root's centre: the exact radius
    holds, the children's-centres radius is violated."""
    T, D = 72, 8
    _, k, _ = random_qkv(seed, 1, T, 1, 1, D)
    cfg = FreeSoloConfig(variant="fsb", leaf_order=leaf_order, tau=(1e9,), lam=0.0, hash_bits=4, **SMALL)
    hf = head_forests(k, cfg)[(0, 0)]
    tree = hf.forests(16)[0][0]  # the block-8 forest (n = 16) is one tree of height 4
    assert tree.height == 4
    root = tree.node(4, 0)
    far = int(np.argmax(np.linalg.norm(hf.kbar[tree.cells] - tree.mu[root], axis=1)))
    q = np.zeros((1, T, 1, D))
    q[0, :, 0] = 10.0 * (hf.kbar[tree.cells[far]] - tree.mu[root])
    assert bound_violations(q, k, cfg) == []
    assert bound_violations(q, k, cfg, radius=children_centres_radius)
