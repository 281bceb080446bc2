"""FS-B forests (spec §6.1-§6.3): content codes, our LSD radix sort, dyadic segments, node
statistics, streaming == batch construction (lemma L10), numba forests == oracle forests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from freesolo.backends.numba.fsb import build_flat_forest, radix_argsort_numba
from freesolo.reference.forest import (
    CausalForests,
    ForestElements,
    StreamingForest,
    batch_forest,
    build_tree,
    content_codes,
    dyadic_segments,
    hyperplanes,
    level_offset,
    merge_by_code,
    quantize,
    radix_argsort,
)

# ---- radix sort ----------------------------------------------------------------------------------


@given(
    key_bits=st.integers(1, 62),
    n=st.integers(0, 300),
    alphabet=st.integers(1, 40),
    seed=st.integers(0, 2**31),
)
def test_radix_sort_is_stable_argsort(key_bits, n, alphabet, seed):
    """Our LSD radix sort (NumPy and numba) == np.argsort(kind="stable"), duplicates included."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**key_bits, size=alphabet, dtype=np.int64)  # few distinct codes
    codes = values[rng.integers(0, alphabet, size=n)]
    expected = np.argsort(codes, kind="stable")
    assert np.array_equal(radix_argsort(codes, key_bits), expected)
    assert np.array_equal(radix_argsort_numba(codes, key_bits), expected)


def test_radix_sort_rejects_out_of_range_codes():
    with pytest.raises(ValueError, match="codes must lie"):
        radix_argsort(np.array([0, 8], np.int64), 3)


@given(n=st.integers(0, 64), key_bits=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_merge_by_code_is_stable_sort(n, key_bits, seed):
    """Merging two code-sorted halves == stable sort of the whole by (code, rank)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**key_bits, size=2 * n, dtype=np.int64)
    left = np.argsort(codes[:n], kind="stable")
    right = n + np.argsort(codes[n:], kind="stable")
    assert np.array_equal(merge_by_code(left, right, codes), np.argsort(codes, kind="stable"))


# ---- codes and segments ----------------------------------------------------------------------------


def test_dyadic_segments_example_and_shape():
    assert dyadic_segments(13) == [(0, 3), (8, 2), (12, 0)]
    assert dyadic_segments(0) == []
    for n in range(1, 600):
        segments = dyadic_segments(n)
        assert len(segments) == n.bit_count()
        start = 0
        for (s, h), nxt in zip(segments, segments[1:] + [(n, -1)]):
            assert s == start and s % (1 << h) == 0 and h > nxt[1]  # aligned, largest first
            start += 1 << h
        assert start == n


def test_content_code_definition():
    """Bit b (MSB first) is 1 iff sum_d U[h, b, d] * rint(kbar[d] * 2^12) > 0; U from the seed."""
    rng = np.random.default_rng(5)
    kbar = rng.standard_normal((40, 6))
    U = hyperplanes(3, 2, 10, 6)
    assert U.shape == (2, 10, 6) and set(np.unique(U)) <= {-1, 1}
    assert np.array_equal(U, np.random.default_rng(3).choice([-1, 1], size=(2, 10, 6)))
    codes = content_codes(kbar, U[1])
    for c in range(40):
        bits = "".join(
            "1" if int(sum(int(U[1, b, d]) * int(np.rint(kbar[c, d] * 4096)) for d in range(6))) > 0 else "0"
            for b in range(10)
        )
        assert codes[c] == int(bits, 2)
    assert np.array_equal(quantize(np.array([0.5 / 4096, -1.5 / 4096])), [0, -2])  # rint: half to even


# ---- trees -------------------------------------------------------------------------------------------


def _elements(seed: int, M: int, D: int, code_bits: int, cell: int = 4) -> ForestElements:
    rng = np.random.default_rng(seed)
    kbar = rng.standard_normal((M, D))
    if M > 3:
        kbar[M // 2] = kbar[1]  # a duplicate code
    a = np.abs(rng.standard_normal(M)) + 1
    cells = np.sort(rng.choice(4 * M + 1, size=M, replace=False)).astype(np.int64)  # a subsequence
    planes = hyperplanes(seed % 7, 1, code_bits, D)[0]
    return ForestElements.from_cells(_scatter(kbar, cells), _scatter(a, cells), cells, planes)


def _scatter(values, cells):
    out = np.zeros((int(cells.max(initial=-1)) + 1,) + values.shape[1:])
    out[cells] = values
    return out


def _check_tree_definition(tree, elems: ForestElements, leaf_order: str, cell: int):
    """Perfect tree, leaves sorted by (code, position) or by position, and exact node statistics."""
    size = 1 << tree.height
    ranks = np.arange(tree.start, tree.start + size)
    assert sorted(tree.leaves.tolist()) == ranks.tolist()
    if leaf_order == "content":
        keys = list(zip(elems.code[tree.leaves].tolist(), tree.leaves.tolist()))
        assert keys == sorted(keys)
    else:
        assert np.array_equal(tree.leaves, ranks)
    assert np.array_equal(tree.cells, elems.cell[tree.leaves])
    for level in range(tree.height + 1):
        for index in range(size >> level):
            node = tree.node(level, index)
            under = tree.leaves[index << level : (index + 1) << level]
            keys = elems.kbar[under]
            np.testing.assert_allclose(tree.mu[node], keys.mean(axis=0), rtol=1e-12, atol=1e-12)
            radius = np.linalg.norm(keys - keys.mean(axis=0), axis=1).max()
            np.testing.assert_allclose(tree.rad[node], radius, rtol=1e-12, atol=1e-12)
            assert tree.A[node] == elems.a[under].max()
            assert tree.e[node] == elems.cell[under].min() * cell
    assert level_offset(tree.height, tree.height) == len(tree.rad) - 1


@given(
    M=st.integers(0, 70),
    D=st.sampled_from([2, 3, 8]),
    code_bits=st.integers(1, 20),
    leaf_order=st.sampled_from(["content", "position"]),
    seed=st.integers(0, 2**31),
)
def test_streaming_forest_equals_batch_forest(M, D, code_bits, leaf_order, seed):
    """L10: the forest grown by the binary counter (carries merge sorted halves) is the batch
    forest (radix-sorted segments) for every prefix: same leaf order and statistics, bit for bit;
    with keep_history every earlier prefix's forest too; state_dict round-trips."""
    cell = 4
    elems = _elements(seed, M, D, code_bits, cell)
    planes = hyperplanes(seed % 7, 1, code_bits, D)[0]
    stream = StreamingForest(D, cell, leaf_order, planes if leaf_order == "content" else None, keep_history=True)
    plain = StreamingForest(D, cell, leaf_order, planes if leaf_order == "content" else None)
    for rank in range(M):
        for forest in (stream, plain):
            forest.append_cell(elems.kbar[rank], elems.a[rank], int(elems.cell[rank]))
        batch = batch_forest(rank + 1, elems, leaf_order, code_bits, cell)
        for forest in (stream, plain):
            assert [(t.start, t.height) for t in forest.trees] == dyadic_segments(rank + 1)
            assert all(s.same_as(b) for s, b in zip(forest.trees, batch))
        for tree in batch:
            _check_tree_definition(tree, elems, leaf_order, cell)
    for n in range(M + 1):
        batch = batch_forest(n, elems, leaf_order, code_bits, cell)
        assert all(s.same_as(b) for s, b in zip(stream.forest(n), batch))
        assert len(stream.forest(n)) == len(batch)
    if M > 1:
        with pytest.raises(ValueError, match="keep_history"):
            plain.forest(M - 1)
    # state_dict round trip, then both continue identically
    for forest in (stream, plain):
        restored = StreamingForest.from_state_dict(forest.state_dict())
        assert all(a.same_as(b) for a, b in zip(restored.trees, forest.trees))
        extra = np.random.default_rng(seed + 1).standard_normal((3, D))
        for x in range(3):
            for f in (forest, restored):
                f.append_cell(extra[x], 2.0 + x, int(elems.cell.max(initial=0)) + 1 + x)
        assert all(a.same_as(b) for a, b in zip(restored.trees, forest.trees))


@given(
    M=st.integers(1, 60),
    n=st.integers(0, 60),
    leaf_order=st.sampled_from(["content", "position"]),
    seed=st.integers(0, 2**31),
)
def test_node_statistics_use_prefix_cells_only(M, n, leaf_order, seed):
    """L10: the forest over elements [0, n) does not change when elements >= n change."""
    n = min(n, M)
    elems = _elements(seed, M, 4, 8)
    other = ForestElements(elems.kbar.copy(), elems.a.copy(), elems.cell.copy(), elems.code.copy())
    rng = np.random.default_rng(seed)
    other.kbar[n:] = rng.standard_normal(other.kbar[n:].shape) * 5
    other.a[n:] = rng.random(M - n) * 9
    other.code[n:] = rng.integers(0, 256, M - n)
    before = batch_forest(n, elems, leaf_order, 8, 4)
    after = batch_forest(n, other, leaf_order, 8, 4)
    assert len(before) == len(after) and all(x.same_as(y) for x, y in zip(before, after))


@given(C=st.integers(0, 50), leaf_order=st.sampled_from(["content", "position"]), seed=st.integers(0, 2**31))
def test_causal_forests_pair(C, leaf_order, seed):
    """CausalForests (all cells, cells with a > tau) == the two batch forests for every n."""
    rng = np.random.default_rng(seed)
    D, cell, r = 4, 4, 8
    kbar, a = rng.standard_normal((C, D)), rng.random(C) * 3
    tau = 1.5
    planes = hyperplanes(0, 1, r, D)[0]
    p = planes if leaf_order == "content" else None
    pair = CausalForests(D, cell, tau, leaf_order, p, keep_history=True)
    for c in range(C):
        pair.append_cell(kbar[c], a[c], c)
    restored = CausalForests.from_state_dict(pair.state_dict())
    all_e = ForestElements.from_cells(kbar, a, np.arange(C), p)
    high_cells = np.flatnonzero(a > tau)
    high_e = ForestElements.from_cells(kbar, a, high_cells, p)
    for n in range(C + 1):
        for forests in (pair.forests(n), restored.forests(n)):
            f_all, f_high = forests
            b_all = batch_forest(n, all_e, leaf_order, r, cell)
            b_high = batch_forest(int((high_cells < n).sum()), high_e, leaf_order, r, cell)
            assert len(f_all) == len(b_all) and all(x.same_as(y) for x, y in zip(f_all, b_all))
            assert len(f_high) == len(b_high) and all(x.same_as(y) for x, y in zip(f_high, b_high))
            assert all(set(t.cells.tolist()) <= set(high_cells.tolist()) for t in f_high)


@given(
    M=st.integers(0, 45),
    D=st.sampled_from([2, 5, 8]),
    code_bits=st.integers(1, 16),
    leaf_order=st.sampled_from(["content", "position"]),
    seed=st.integers(0, 2**31),
)
def test_numba_forest_equals_oracle_forest(M, D, code_bits, leaf_order, seed):
    """Every aligned dyadic tree built by numba == the oracle's tree (leaf order exact, A and e
    exact, mu and rad to rounding)."""
    cell = 4
    elems = _elements(seed, M, D, code_bits, cell)
    planes = hyperplanes(seed % 7, 1, code_bits, D)[0] if leaf_order == "content" else None
    full_kbar, full_a = _scatter(elems.kbar, elems.cell), _scatter(elems.a, elems.cell)
    flat = build_flat_forest(full_kbar, full_a, elems.cell, planes, code_bits, cell)
    for height in range(max(M, 1).bit_length() if M else 0):
        for m in range(M >> height):
            tree = build_tree(m << height, height, elems, leaf_order, code_bits, cell)
            base = flat.height_base[height] + m * ((2 << height) - 1)
            nodes = slice(base, base + (2 << height) - 1)
            assert np.array_equal(flat.leaf_cell[base : base + (1 << height)], tree.cells)
            assert np.array_equal(flat.A[nodes], tree.A) and np.array_equal(flat.e[nodes], tree.e)
            np.testing.assert_allclose(flat.mu[nodes], tree.mu, rtol=1e-13, atol=1e-13)
            np.testing.assert_allclose(flat.rad[nodes], tree.rad, rtol=1e-13, atol=1e-13)
