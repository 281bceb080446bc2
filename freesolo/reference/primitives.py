"""Float64 building blocks of the oracle (spec §2-§5, §7), one small function each.

Everything here works on one sequence and one head at a time and is written for clarity, not
speed. Shapes: T tokens, D head dim, C = T // cell complete cells.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "rope",
    "cell_stats",
    "position_prior",
    "cell_scores",
    "available_cells",
    "fsl_candidates",
    "FslPoolStream",
    "top_k_cells",
    "rmsnorm",
    "softmax_readout",
]


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Half-split RoPE. x [T, D] (D even), positions [T] -> [T, D] rotated at absolute positions."""
    T, D = x.shape
    half = D // 2
    inv_freq = theta ** (-2.0 * np.arange(half, dtype=np.float64) / D)  # [D/2]
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[:, :half], x[:, half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)  # [T, D]


def cell_stats(k: np.ndarray, cell: int) -> tuple[np.ndarray, np.ndarray]:
    """k [T, D] (one kv head, unrotated) -> kbar [C, D] mean key, a [C] max key norm; C = T // cell."""
    C = k.shape[0] // cell
    kbar = np.zeros((C, k.shape[1]))
    a = np.zeros(C)
    for c in range(C):
        tokens = k[c * cell : (c + 1) * cell]  # [cell, D]
        kbar[c] = tokens.mean(axis=0)
        a[c] = max(math.sqrt(float(t @ t)) for t in tokens)
    return kbar, a


def position_prior(i: int, cells: np.ndarray, sigma: float, cell: int) -> np.ndarray:
    """g(i, c) = erf(sigma * (i - p_c) / (2 * cell)), p_c = c * cell. cells [n] -> [n]."""
    return np.array([math.erf(sigma * (i - c * cell) / (2.0 * cell)) for c in cells], dtype=np.float64)


def cell_scores(
    q_i: np.ndarray,
    i: int,
    cells: np.ndarray,
    kbar: np.ndarray,
    a: np.ndarray,
    sigma: float,
    lam: float,
    cell: int,
) -> np.ndarray:
    """score(i, c) = scale * q_i . kbar_c + lam * a_c * g(i, c) for c in cells [n] -> [n]."""
    scale = 1.0 / math.sqrt(q_i.shape[0])
    cells = np.asarray(cells, dtype=np.int64)
    return scale * (kbar[cells] @ q_i) + lam * a[cells] * position_prior(i, cells, sigma, cell)


def available_cells(block_index: int, block: int, cell: int) -> int:
    """n_j: the number of cells available to every query of block j (cells c < n_j)."""
    return block_index * block // cell


def _by_norm_then_recency(a: np.ndarray, cells) -> list[int]:
    """Cells sorted by (a_c, c) descending: larger max-norm first, ties to the more recent cell."""
    return sorted((int(c) for c in cells), key=lambda c: (a[c], c), reverse=True)


def fsl_candidates(a: np.ndarray, n_avail: int, pool: int, recent: int) -> np.ndarray:
    """FS-L candidate set (parallel form): W most recent available cells + top-P older by (a, c).

    a [C] max key norms; returns the sorted cell indices [<= pool + recent].
    """
    first_recent = max(0, n_avail - recent)
    recent_cells = list(range(first_recent, n_avail))
    older = range(0, first_recent)
    pooled = _by_norm_then_recency(a, older)[:pool]
    return np.array(sorted(pooled + recent_cells), dtype=np.int64)


class FslPoolStream:
    """FS-L candidate set (streaming form): at each block boundary the cells leaving the recent
    window compete with the kept pool on (a_c, c); losers are dropped for ever (spec §5)."""

    def __init__(self, pool: int, recent: int):
        self.pool, self.recent = pool, recent
        self.n_avail = 0
        self.kept: list[int] = []  # pooled old cells, at most `pool`

    def advance(self, a: np.ndarray, n_avail: int) -> np.ndarray:
        """Make cells [0, n_avail) available (a [>= n_avail]); returns the candidate set, sorted."""
        if n_avail < self.n_avail:
            raise ValueError(f"n_avail={n_avail} went backwards from {self.n_avail}")
        old_first_recent = max(0, self.n_avail - self.recent)
        first_recent = max(0, n_avail - self.recent)
        leaving = range(old_first_recent, first_recent)
        self.kept = _by_norm_then_recency(a, self.kept + list(leaving))[: self.pool]
        self.n_avail = n_avail
        return np.array(sorted(self.kept + list(range(first_recent, n_avail))), dtype=np.int64)


def top_k_cells(cells: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """The k cells of largest score (ties: larger cell first), ordered by descending score, -1 padded."""
    order = sorted(range(len(cells)), key=lambda n: (scores[n], cells[n]), reverse=True)[:k]
    out = np.full(k, -1, dtype=np.int64)
    out[: len(order)] = [cells[n] for n in order]
    return out


def rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    """x [D] -> x / sqrt(mean(x^2) + eps)."""
    return x / math.sqrt(float(np.mean(x * x)) + eps)


def softmax_readout(q_i: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(scale * keys @ q_i) @ values. q_i [D], keys/values [n, D] (n >= 1) -> [D]."""
    logits = keys @ q_i / math.sqrt(q_i.shape[0])  # [n]
    weights = np.exp(logits - logits.max())
    return (weights / weights.sum()) @ values
