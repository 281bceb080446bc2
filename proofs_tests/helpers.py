"""Shared test helpers: random inputs, small pruning configs, tie-aware selection comparison,
and an error report (max-abs and RMS-relative) that fails on NaN."""

from __future__ import annotations

import math

import numpy as np

from freesolo import FreeSoloConfig
from freesolo.reference.primitives import cell_scores, cell_stats

# Sizes small enough that pruning bites: window 16, cell 4, block 8, pool 3, recent 2.
SMALL = dict(window=16, cell=4, block=8, pool=3, recent=2, beam=2)


def random_qkv(seed: int, B: int, T: int, Hq: int, Hkv: int, D: int, scale: float = 1.0):
    """float64 q [B, T, Hq, D], k / v [B, T, Hkv, D] from a seeded generator."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hq, D)) * scale
    k = rng.standard_normal((B, T, Hkv, D)) * scale
    v = rng.standard_normal((B, T, Hkv, D))
    return q, k, v


def rms_rel_error(actual, expected) -> float:
    """RMS(actual - expected) / RMS(expected); NaN anywhere -> inf (so comparisons fail)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if not (np.isfinite(actual).all() and np.isfinite(expected).all()):
        return math.inf
    denom = math.sqrt(float(np.mean(expected**2))) or 1.0
    return math.sqrt(float(np.mean((actual - expected) ** 2))) / denom


def assert_close(actual, expected, rtol: float, name: str = "output") -> None:
    """Fail if the RMS-relative error exceeds rtol or anything is NaN; report max-abs too."""
    err = rms_rel_error(actual, expected)
    max_abs = float(np.max(np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))))
    assert err <= rtol, f"{name}: rms-rel error {err:.3e} > {rtol:.1e} (max-abs {max_abs:.3e})"


def fs_scores(q, k, cfg: FreeSoloConfig, b: int, i: int, h: int, cells) -> np.ndarray:
    """The oracle's float64 cell scores score_h(i, c) for the given cells."""
    Hq, Hkv = q.shape[2], k.shape[2]
    g = h // (Hq // Hkv)
    kbar, a = cell_stats(np.asarray(k[b, :, g], np.float64), cfg.cell)
    return cell_scores(
        np.asarray(q[b, i, h], np.float64),
        i,
        np.asarray(cells, np.int64),
        kbar,
        a,
        cfg.per_head("sigma", Hq)[h],
        cfg.per_head("lam", Hq)[h],
        cfg.cell,
    )


def assert_selection_matches(idx_test, idx_ref, q, k, cfg: FreeSoloConfig, tol: float, score_fn=fs_scores) -> int:
    """Tie-aware comparison of two selections [B, T, Hq, K].

    Where they differ, both must select the same number of cells and the sorted oracle scores
    of the two selections must agree within `tol` (a swap is allowed only at a near-tie).
    Returns the number of (b, i, h) rows that differ.
    """
    idx_test = np.asarray(idx_test)
    idx_ref = np.asarray(idx_ref)
    assert idx_test.shape == idx_ref.shape, (idx_test.shape, idx_ref.shape)
    assert idx_test.dtype == np.int64, idx_test.dtype
    differing = np.argwhere((np.sort(idx_test, axis=-1) != np.sort(idx_ref, axis=-1)).any(axis=-1))
    for b, i, h in differing:
        a_cells = [int(c) for c in idx_test[b, i, h] if c >= 0]
        r_cells = [int(c) for c in idx_ref[b, i, h] if c >= 0]
        assert len(a_cells) == len(r_cells), f"(b={b}, i={i}, h={h}): {a_cells} vs {r_cells}"
        a_scores = np.sort(score_fn(q, k, cfg, b, i, h, a_cells))
        r_scores = np.sort(score_fn(q, k, cfg, b, i, h, r_cells))
        gap = float(np.max(np.abs(a_scores - r_scores)))
        assert gap <= tol, (
            f"selection differs at (b={b}, i={i}, h={h}): {a_cells} vs {r_cells}, score gap {gap:.3e} > tol {tol:.1e}"
        )
    return len(differing)
