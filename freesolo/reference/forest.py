"""FS-B causal forests in float64 NumPy (spec §6.1-§6.3, §9, lemma L10).

A forest covers the first `n` elements of a sequence of cells (all cells, or the high-norm
cells `a_c > tau`), one perfect tree per set bit of `n` over aligned dyadic segments, largest
(oldest) first. Pieces, each small and loop-based:

- `hyperplanes`, `content_codes`: the r-bit integer content code of a cell (§6.2).
- `radix_argsort`: a stable LSD radix sort of codes (our own; tested against a stable argsort).
- `merge_by_code`: the stable merge of two code-sorted halves (a carry of the binary counter).
- `Tree`, `tree_stats`, `build_tree`, `batch_forest`: the batch construction.
- `StreamingForest`: the same forests grown one cell at a time by a binary counter (§9);
  `CausalForests`: the pair (all cells, high-norm cells) of one kv head, as a cache keeps it.

Shapes: M elements, D head dim, r code bits; a tree of height h has 2^h leaves and
N = 2^(h+1) - 1 nodes stored level by level (level 0 = the ordered leaves first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DIGIT_BITS",
    "QUANT_SCALE",
    "CausalForests",
    "ForestElements",
    "StreamingForest",
    "Tree",
    "batch_forest",
    "build_tree",
    "content_codes",
    "dyadic_segments",
    "hyperplanes",
    "level_offset",
    "merge_by_code",
    "merge_trees",
    "quantize",
    "radix_argsort",
    "tree_stats",
]

QUANT_SCALE = 4096.0  # Q(x) = rint(x * 2^12) as int64 (spec §6.2)
DIGIT_BITS = 8  # radix of the LSD sort: 256 buckets per pass


# ---- content codes (§6.2) ------------------------------------------------------------------
def hyperplanes(hash_seed: int, num_kv_heads: int, hash_bits: int, head_dim: int) -> np.ndarray:
    """U: int64 [Hkv, r, D] of +-1, from numpy.random.default_rng(hash_seed).choice([-1, 1])."""
    rng = np.random.default_rng(hash_seed)
    return rng.choice([-1, 1], size=(num_kv_heads, hash_bits, head_dim)).astype(np.int64)


def quantize(x: np.ndarray) -> np.ndarray:
    """Q(x) = rint(x * 2^12) as int64 (same on every backend)."""
    return np.rint(np.asarray(x, dtype=np.float64) * QUANT_SCALE).astype(np.int64)


def content_codes(kbar: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """kbar [M, D] float64, planes [r, D] int64 -> codes int64 [M] in [0, 2^r).

    Bit b (most significant first) is 1 iff sum_d planes[b, d] * Q(kbar[c, d]) > 0 (exact integers).
    """
    kbar = np.asarray(kbar, dtype=np.float64).reshape(-1, planes.shape[1])
    if kbar.size and float(np.abs(kbar).max()) * QUANT_SCALE * planes.shape[1] >= 2.0**62:
        raise ValueError(f"mean keys too large for the int64 content code: max |kbar| = {np.abs(kbar).max():.3e}")
    projections = quantize(kbar) @ planes.T  # int64 [M, r], exact
    r = planes.shape[0]
    codes = np.zeros(kbar.shape[0], dtype=np.int64)
    for b in range(r):
        codes |= (projections[:, b] > 0).astype(np.int64) << (r - 1 - b)
    return codes


# ---- sorting -------------------------------------------------------------------------------
def radix_argsort(codes: np.ndarray, key_bits: int, digit_bits: int = DIGIT_BITS) -> np.ndarray:
    """Stable LSD radix sort: the permutation [M] that sorts `codes` (int64 in [0, 2^key_bits)).

    Equal codes keep their input order (so position-ordered input sorts by (code, position)).
    One counting-sort pass per `digit_bits`-bit digit, least significant digit first.
    """
    codes = np.asarray(codes, dtype=np.int64)
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or (key_bits < 63 and codes.max() >> key_bits)):
        raise ValueError(f"codes must lie in [0, 2^{key_bits})")
    order = np.arange(codes.size, dtype=np.int64)
    buckets = 1 << digit_bits
    for shift in range(0, key_bits, digit_bits):
        digits = (codes[order] >> shift) & (buckets - 1)  # [M], the digit of each element in order
        counts = np.zeros(buckets, dtype=np.int64)
        for d in digits:
            counts[d] += 1
        next_slot = np.concatenate(([0], np.cumsum(counts)[:-1]))  # first slot of each bucket
        placed = np.empty_like(order)
        for element, d in zip(order, digits):  # in current order: stable
            placed[next_slot[d]] = element
            next_slot[d] += 1
        order = placed
    return order


def merge_by_code(left: np.ndarray, right: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Stable merge of two code-sorted lists of element ranks (every left rank < every right rank).

    left [n], right [n], codes indexed by rank -> [2n] sorted by (code, rank); ties take left first.
    """
    out = np.empty(len(left) + len(right), dtype=np.int64)
    x = y = 0
    for slot in range(len(out)):
        if y == len(right) or (x < len(left) and codes[left[x]] <= codes[right[y]]):
            out[slot] = left[x]
            x += 1
        else:
            out[slot] = right[y]
            y += 1
    return out


# ---- trees ---------------------------------------------------------------------------------
def dyadic_segments(n: int) -> list[tuple[int, int]]:
    """Forest shape over n elements: [(start, height)], one per set bit, largest first.

    n = 13 -> [(0, 3), (8, 2), (12, 0)]: segments [0,8) [8,12) [12,13).
    """
    segments, start = [], 0
    for height in range(max(n, 1).bit_length() - 1, -1, -1):
        if n >> height & 1:
            segments.append((start, height))
            start += 1 << height
    return segments


def level_offset(height: int, level: int) -> int:
    """Index of the first node of `level` in a tree of `height` stored level by level."""
    return (1 << (height + 1)) - (1 << (height - level + 1))


@dataclass
class ForestElements:
    """The element sequence of one forest, in position order (rank = index).

    kbar [M, D], a [M], cell [M] int64 (cell index c of each element), code [M] int64.
    """

    kbar: np.ndarray
    a: np.ndarray
    cell: np.ndarray
    code: np.ndarray

    @classmethod
    def from_cells(cls, kbar, a, cells, planes: np.ndarray | None) -> ForestElements:
        """Elements = the given cells (sorted increasing); codes from planes [r, D] (zeros if None)."""
        cells = np.asarray(cells, dtype=np.int64)
        kbar = np.asarray(kbar, dtype=np.float64)
        kb = kbar[cells].reshape(len(cells), kbar.shape[1])
        code = np.zeros(len(cells), np.int64) if planes is None else content_codes(kb, planes)
        return cls(kb, np.asarray(a, dtype=np.float64)[cells], cells, code)


@dataclass
class Tree:
    """A perfect tree over the aligned segment [start, start + 2^height) of a forest's elements.

    leaves [2^h] element ranks in leaf order, cells [2^h] their cell indices; per node, stored
    level by level (`level_offset`): mu [N, D] mean key, rad [N] exact covering radius,
    A [N] max a_c, e [N] int64 min position p_c = c * cell.
    """

    start: int
    height: int
    leaves: np.ndarray
    cells: np.ndarray
    mu: np.ndarray
    rad: np.ndarray
    A: np.ndarray
    e: np.ndarray

    def node(self, level: int, index: int) -> int:
        """Flat index of node `index` of `level` (children of node m at level l: 2m, 2m+1 at l-1)."""
        return level_offset(self.height, level) + index

    def leaf_cells(self, level: int, index: int) -> np.ndarray:
        """The cells under node (level, index), in leaf order."""
        return self.cells[index << level : (index + 1) << level]

    def same_as(self, other: Tree) -> bool:
        """Bit-identical leaf order and statistics."""
        return (
            (self.start, self.height) == (other.start, other.height)
            and np.array_equal(self.leaves, other.leaves)
            and np.array_equal(self.cells, other.cells)
            and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in ("mu", "rad", "A", "e"))
        )


def tree_stats(leaves: np.ndarray, elems: ForestElements, cell: int):
    """Node statistics of the perfect tree whose ordered leaves are the element ranks `leaves`.

    -> mu [N, D], rad [N], A [N], e [N] (spec §6.3; rad is the exact radius over leaves).
    """
    height = len(leaves).bit_length() - 1
    N = (1 << (height + 1)) - 1
    D = elems.kbar.shape[1]
    mu, rad, A = np.zeros((N, D)), np.zeros(N), np.zeros(N)
    e = np.zeros(N, dtype=np.int64)
    for level in range(height + 1):
        size = 1 << level
        for index in range(len(leaves) >> level):
            ranks = leaves[index * size : (index + 1) * size]
            node = level_offset(height, level) + index
            keys = elems.kbar[ranks]  # [size, D]
            mu[node] = keys.mean(axis=0) if size > 1 else keys[0]
            rad[node] = max(math.sqrt(float(d @ d)) for d in keys - mu[node]) if size > 1 else 0.0
            A[node] = elems.a[ranks].max()
            e[node] = int(elems.cell[ranks].min()) * cell
    return mu, rad, A, e


def _make_tree(start: int, leaves: np.ndarray, elems: ForestElements, cell: int) -> Tree:
    leaves = np.asarray(leaves, dtype=np.int64)
    mu, rad, A, e = tree_stats(leaves, elems, cell)
    return Tree(start, len(leaves).bit_length() - 1, leaves, elems.cell[leaves].copy(), mu, rad, A, e)


def build_tree(start: int, height: int, elems: ForestElements, leaf_order: str, code_bits: int, cell: int) -> Tree:
    """Batch construction of the tree of segment [start, start + 2^height) (radix-sorted leaves)."""
    ranks = np.arange(start, start + (1 << height), dtype=np.int64)
    if leaf_order == "content":
        ranks = ranks[radix_argsort(elems.code[ranks], code_bits)]
    elif leaf_order != "position":
        raise ValueError(f"leaf_order={leaf_order!r} must be 'content' or 'position'")
    return _make_tree(start, ranks, elems, cell)


def merge_trees(left: Tree, right: Tree, elems: ForestElements, leaf_order: str, cell: int) -> Tree:
    """The tree of two adjacent equal segments (a carry): merge the two sorted leaf lists."""
    if left.height != right.height or left.start + (1 << left.height) != right.start:
        raise ValueError(f"cannot merge segments ({left.start}, {left.height}) and ({right.start}, {right.height})")
    if leaf_order == "content":
        leaves = merge_by_code(left.leaves, right.leaves, elems.code)
    else:
        leaves = np.concatenate([left.leaves, right.leaves])
    return _make_tree(left.start, leaves, elems, cell)


def batch_forest(
    n: int, elems: ForestElements, leaf_order: str, code_bits: int, cell: int, cache: dict | None = None
) -> list[Tree]:
    """The forest over elements [0, n): one tree per segment of `dyadic_segments(n)`, largest first.

    Uses elements < n only. `cache` (a dict keyed by (start, height)) shares trees between calls.
    """
    if n > len(elems.cell):
        raise ValueError(f"n={n} exceeds the {len(elems.cell)} elements")
    trees = []
    for start, height in dyadic_segments(n):
        tree = None if cache is None else cache.get((start, height))
        if tree is None:
            tree = build_tree(start, height, elems, leaf_order, code_bits, cell)
            if cache is not None:
                cache[(start, height)] = tree
        trees.append(tree)
    return trees


# ---- streaming construction (§9, L10) -----------------------------------------------------
class StreamingForest:
    """A forest grown one element at a time by a binary counter.

    `append_cell(kbar_c, a_c, c)` adds an element (ranks 0, 1, ...); when the new element
    completes a segment (a carry), the two equal trees on top of the stack are merged (their
    sorted leaf lists merged by (code, position)). `trees` is always `batch_forest(count)`.
    With `keep_history=True` every tree ever built is kept, so `forest(n)` works for any
    n <= count (a cache whose queries lag the appended cells needs it).

    Args:
        head_dim: D. cell: tokens per cell (for e = c * cell).
        leaf_order: "content" or "position". planes: int64 [r, D] hyperplanes of this kv head
            (required for "content").
    """

    def __init__(
        self,
        head_dim: int,
        cell: int,
        leaf_order: str = "content",
        planes: np.ndarray | None = None,
        keep_history: bool = False,
    ):
        if leaf_order not in ("content", "position"):
            raise ValueError(f"leaf_order={leaf_order!r} must be 'content' or 'position'")
        if leaf_order == "content" and planes is None:
            raise ValueError("leaf_order='content' needs planes [r, D] (see hyperplanes)")
        self.head_dim, self.cell, self.leaf_order = int(head_dim), int(cell), leaf_order
        self.planes = None if planes is None else np.asarray(planes, dtype=np.int64)
        self.code_bits = 0 if planes is None else self.planes.shape[0]
        self.keep_history = keep_history
        self._kbar = np.zeros((16, self.head_dim))
        self._a = np.zeros(16)
        self._cell = np.zeros(16, dtype=np.int64)
        self._code = np.zeros(16, dtype=np.int64)
        self.count = 0
        self.trees: list[Tree] = []  # the current forest, largest first (the counter's stack)
        self.history: dict[tuple[int, int], Tree] = {}

    @property
    def elements(self) -> ForestElements:
        """Views of the appended elements [count]."""
        n = self.count
        return ForestElements(self._kbar[:n], self._a[:n], self._cell[:n], self._code[:n])

    def append_cell(self, kbar_c: np.ndarray, a_c: float, c: int) -> None:
        """Append one element: mean key kbar_c [D], max norm a_c, cell index c (increasing)."""
        kbar_c = np.asarray(kbar_c, dtype=np.float64)
        if kbar_c.shape != (self.head_dim,):
            raise ValueError(f"kbar_c shape {kbar_c.shape} must be [D={self.head_dim}]")
        if self.count and c <= self._cell[self.count - 1]:
            raise ValueError(
                f"cells must be appended in increasing order, got c={c} after {self._cell[self.count - 1]}"
            )
        if self.count == len(self._a):  # grow the buffers
            for name in ("_kbar", "_a", "_cell", "_code"):
                old = getattr(self, name)
                new = np.zeros((2 * len(old),) + old.shape[1:], dtype=old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
        rank = self.count
        self._kbar[rank], self._a[rank], self._cell[rank] = kbar_c, float(a_c), int(c)
        self._code[rank] = 0 if self.planes is None else content_codes(kbar_c[None], self.planes)[0]
        self.count += 1
        elems = self.elements
        tree = _make_tree(rank, np.array([rank]), elems, self.cell)
        self._push(tree)
        while len(self.trees) >= 2 and self.trees[-1].height == self.trees[-2].height:  # carry
            right, left = self.trees.pop(), self.trees.pop()
            self._push(merge_trees(left, right, elems, self.leaf_order, self.cell))

    def _push(self, tree: Tree) -> None:
        self.trees.append(tree)
        if self.keep_history:
            self.history[(tree.start, tree.height)] = tree

    def forest(self, n: int | None = None) -> list[Tree]:
        """The forest over the first n elements (default: all); n < count needs keep_history."""
        n = self.count if n is None else int(n)
        if n == self.count:
            return list(self.trees)
        if not 0 <= n < self.count:
            raise ValueError(f"n={n} must be in [0, count={self.count}]")
        if not self.keep_history:
            raise ValueError(f"forest(n={n}) of an earlier prefix needs keep_history=True (count={self.count})")
        return [self.history[seg] for seg in dyadic_segments(n)]

    # ---- state as plain arrays ----
    def state_dict(self) -> dict:
        """Plain numpy arrays: the appended elements and the leaf order of every kept tree.

        Node statistics are a deterministic function of leaf order and elements, rebuilt on load.
        """
        trees = list(self.history.values()) if self.keep_history else self.trees
        return {
            "head_dim": np.int64(self.head_dim),
            "cell": np.int64(self.cell),
            "leaf_order": np.array(self.leaf_order),
            "planes": np.zeros((0, self.head_dim), np.int64) if self.planes is None else self.planes.copy(),
            "keep_history": np.bool_(self.keep_history),
            "kbar": self._kbar[: self.count].copy(),
            "a": self._a[: self.count].copy(),
            "cells": self._cell[: self.count].copy(),
            "codes": self._code[: self.count].copy(),
            "tree_start": np.array([t.start for t in trees], np.int64),
            "tree_height": np.array([t.height for t in trees], np.int64),
            "stack_start": np.array([t.start for t in self.trees], np.int64),
            "tree_leaves": np.concatenate([t.leaves for t in trees]) if trees else np.zeros(0, np.int64),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> StreamingForest:
        planes = np.asarray(state["planes"], np.int64)
        leaf_order = str(state["leaf_order"])
        forest = cls(
            int(state["head_dim"]),
            int(state["cell"]),
            leaf_order,
            planes if planes.shape[0] else None,
            bool(state["keep_history"]),
        )
        n = len(state["a"])
        size = max(16, 1 << max(n, 1).bit_length())
        forest._kbar = np.zeros((size, forest.head_dim))
        forest._a, forest._cell, forest._code = np.zeros(size), np.zeros(size, np.int64), np.zeros(size, np.int64)
        forest._kbar[:n], forest._a[:n] = state["kbar"], state["a"]
        forest._cell[:n], forest._code[:n] = state["cells"], state["codes"]
        forest.count = n
        elems, offset, by_start = forest.elements, 0, {}
        for start, height in zip(state["tree_start"], state["tree_height"]):
            leaves = np.asarray(state["tree_leaves"][offset : offset + (1 << int(height))], np.int64)
            offset += 1 << int(height)
            tree = _make_tree(int(start), leaves, elems, forest.cell)
            by_start[(int(start), int(height))] = tree
            if forest.keep_history:
                forest.history[(int(start), int(height))] = tree
        stack = dyadic_segments(n)
        if [s for s, _ in stack] != [int(s) for s in state["stack_start"]]:
            raise ValueError("corrupt StreamingForest state: the stack does not match the element count")
        forest.trees = [by_start[seg] for seg in stack]
        return forest


class CausalForests:
    """The two FS-B forests of one kv head (all cells; cells with a_c > tau), grown together.

    append_cell(kbar_c, a_c, c) with c = 0, 1, 2, ...; forests(n) -> (all-cells forest over
    cells [0, n), high-norm forest over the high cells among [0, n)).
    """

    def __init__(
        self,
        head_dim: int,
        cell: int,
        tau: float,
        leaf_order: str = "content",
        planes: np.ndarray | None = None,
        keep_history: bool = False,
    ):
        self.tau = float(tau)
        self.all = StreamingForest(head_dim, cell, leaf_order, planes, keep_history)
        self.high = StreamingForest(head_dim, cell, leaf_order, planes, keep_history)
        self.high_prefix = [0]  # high_prefix[n] = number of high cells among [0, n)

    @property
    def count(self) -> int:
        return self.all.count

    def append_cell(self, kbar_c: np.ndarray, a_c: float, c: int) -> None:
        if c != self.all.count:
            raise ValueError(f"CausalForests expects cell {self.all.count} next, got c={c}")
        self.all.append_cell(kbar_c, a_c, c)
        if a_c > self.tau:
            self.high.append_cell(kbar_c, a_c, c)
        self.high_prefix.append(self.high.count)

    def forests(self, n: int | None = None) -> tuple[list[Tree], list[Tree]]:
        n = self.count if n is None else int(n)
        return self.all.forest(n), self.high.forest(self.high_prefix[n])

    def state_dict(self) -> dict:
        state = {"tau": np.float64(self.tau), "high_prefix": np.array(self.high_prefix, np.int64)}
        state.update({f"all.{k}": v for k, v in self.all.state_dict().items()})
        state.update({f"high.{k}": v for k, v in self.high.state_dict().items()})
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> CausalForests:
        new = cls.__new__(cls)
        new.tau = float(state["tau"])
        new.high_prefix = [int(x) for x in state["high_prefix"]]
        new.all = StreamingForest.from_state_dict({k[4:]: v for k, v in state.items() if k.startswith("all.")})
        new.high = StreamingForest.from_state_dict({k[5:]: v for k, v in state.items() if k.startswith("high.")})
        return new
