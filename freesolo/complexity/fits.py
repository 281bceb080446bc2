"""Fits of cost against sequence length N: a log-log slope with a t-interval, and a non-negative
least-squares fit of the model `a*N + b*N*log2(N)^2 + c*N^2` (spec §10's three regimes).

NumPy only: the Student-t quantile is computed here (Simpson integration of the density and
bisection) and the three-term NNLS is solved exactly by enumerating the supports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["SlopeFit", "ModelFit", "loglog_slope", "fit_cost_model", "MODEL_TERMS", "t_quantile", "nnls_small"]

MODEL_TERMS = ("N", "N log2(N)^2", "N^2")


@dataclass(frozen=True)
class SlopeFit:
    """y ~ C * N^slope by least squares on (log N, log y); [low, high] is the `level` t-interval."""

    slope: float
    intercept: float  # natural log of C
    stderr: float  # standard error of the slope (nan with 2 points)
    low: float
    high: float
    level: float
    points: int
    r2: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if self.points < 3:
            return f"{self.slope:.3f} (2 points, no CI)"
        return f"{self.slope:.3f} [{self.low:.3f}, {self.high:.3f}]"


@dataclass(frozen=True)
class ModelFit:
    """y ~ a*N + b*N*log2(N)^2 + c*N^2 with a, b, c >= 0, least squares on the relative error."""

    a: float
    b: float
    c: float
    rel_rms: float  # RMS of (model - y) / y over the points
    dominant: str  # the term contributing most at the largest N
    shares: tuple  # each term's share of the model at the largest N, in MODEL_TERMS order

    def as_dict(self) -> dict:
        return asdict(self)

    def predict(self, N) -> np.ndarray:
        N = np.asarray(N, dtype=np.float64)
        return self.a * N + self.b * N * np.log2(N) ** 2 + self.c * N**2


def _t_cdf(x: float, dof: int) -> float:
    """P(T <= x) for Student's t with `dof` degrees of freedom (Simpson's rule, 4000 intervals)."""
    if x == 0:
        return 0.5
    log_norm = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    t = np.linspace(0.0, abs(x), 4001)
    pdf = np.exp(log_norm - (dof + 1) / 2 * np.log1p(t * t / dof))
    h = abs(x) / 4000
    area = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
    return 0.5 + math.copysign(area, x)


def t_quantile(p: float, dof: int) -> float:
    """The p-quantile of Student's t with `dof` >= 1 degrees of freedom (0 < p < 1), to ~1e-7."""
    if not 0 < p < 1 or dof < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    if p < 0.5:
        return -t_quantile(1 - p, dof)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, dof) < p:  # heavy tails (dof = 1): grow the bracket
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2


def nnls_small(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0, for A [n, m] with few columns (m <= 8), exactly.

    The optimum is the unconstrained least-squares solution on its own support, so the best
    feasible solution over all 2^m - 1 supports is the global one (the problem is convex).
    """
    A, b = np.asarray(A, dtype=np.float64), np.asarray(b, dtype=np.float64)
    m = A.shape[1]
    if m > 8:
        raise ValueError(f"nnls_small enumerates supports: at most 8 columns, got {m}")
    best, best_res = np.zeros(m), float(np.sum(b * b))
    for mask in range(1, 1 << m):
        cols = [j for j in range(m) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if np.all(sol >= 0):
            x = np.zeros(m)
            x[cols] = sol
            res = float(np.sum((A @ x - b) ** 2))
            if res < best_res:
                best, best_res = x, res
    return best


def _clean(N: Sequence[float], y: Sequence[float], min_points: int) -> tuple[np.ndarray, np.ndarray]:
    N = np.asarray(N, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if N.shape != y.shape or N.ndim != 1:
        raise ValueError(f"N and y must be 1-D of one length, got shapes {N.shape} and {y.shape}")
    if N.size < min_points:
        raise ValueError(f"a fit needs at least {min_points} points, got {N.size}")
    if not (np.all(np.isfinite(N)) and np.all(np.isfinite(y))):
        raise ValueError("N and y must be finite")
    if np.any(N <= 0) or np.any(y <= 0):
        raise ValueError("N and y must be positive (log-log fit)")
    if np.unique(N).size < 2:
        raise ValueError("N needs at least two distinct values")
    return N, y


def loglog_slope(N: Sequence[float], y: Sequence[float], level: float = 0.95) -> SlopeFit:
    """Least-squares slope of log y against log N with a Student-t confidence interval.

    Args:
        N: sizes [n] (> 0); y: costs [n] (> 0); level: confidence level of the interval.
    """
    N, y = _clean(N, y, 2)
    x, z = np.log(N), np.log(y)
    xm, zm = x.mean(), z.mean()
    sxx = float(np.sum((x - xm) ** 2))
    slope = float(np.sum((x - xm) * (z - zm)) / sxx)
    intercept = float(zm - slope * xm)
    resid = z - (intercept + slope * x)
    ss_tot = float(np.sum((z - zm) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else 1.0
    dof = N.size - 2
    if dof == 0:
        return SlopeFit(slope, intercept, math.nan, math.nan, math.nan, level, N.size, r2)
    stderr = math.sqrt(float(np.sum(resid**2)) / dof / sxx)
    half = t_quantile(0.5 + level / 2, dof) * stderr
    return SlopeFit(slope, intercept, stderr, slope - half, slope + half, level, N.size, r2)


def fit_cost_model(N: Sequence[float], y: Sequence[float]) -> ModelFit:
    """Non-negative least squares of y against [N, N log2(N)^2, N^2], weighted by 1/y (relative error).

    Columns are scaled to unit norm before the (exact) NNLS so the three terms are comparable.
    """
    N, y = _clean(N, y, 1)
    design = np.stack([N, N * np.log2(N) ** 2, N**2], axis=1) / y[:, None]  # [n, 3], rows / y
    norms = np.linalg.norm(design, axis=0)
    coef_scaled = nnls_small(design / norms, np.ones_like(y))
    a, b, c = (float(v) for v in coef_scaled / norms)
    fit = ModelFit(a, b, c, 0.0, "", ())
    rel_rms = float(np.sqrt(np.mean((fit.predict(N) / y - 1.0) ** 2)))
    n_max = N.max()
    terms = np.array([a * n_max, b * n_max * math.log2(n_max) ** 2, c * n_max**2])
    shares = tuple(float(v) for v in terms / terms.sum()) if terms.sum() > 0 else (0.0, 0.0, 0.0)
    dominant = MODEL_TERMS[int(np.argmax(terms))]
    return ModelFit(a, b, c, rel_rms, dominant, shares)
