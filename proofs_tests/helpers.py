"""Shared test helpers: random inputs, small pruning configs, tie-aware selection comparison,
and an error report (max-abs and RMS-relative) that fails on NaN."""

from __future__ import annotations

import math

import numpy as np

from freesolo import FreeSoloConfig

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
    """float64 cell scores score_h(i, c) for the given cells, written from spec §3-§4 with no
    call into freesolo.reference (so tests that use it check the oracle, not restate it):
    kbar_c = mean of the cell's keys, a_c = max key norm, p_c = c*s,
    score = q_i . kbar_c / sqrt(D) + lam_h * a_c * erf(sigma_h * (i - p_c) / (2 s))."""
    Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    g = h // (Hq // Hkv)
    s = cfg.cell
    sigma, lam = cfg.per_head("sigma", Hq)[h], cfg.per_head("lam", Hq)[h]
    q_i = np.asarray(q[b, i, h], np.float64)
    out = []
    for c in cells:
        keys = np.asarray(k[b, int(c) * s : (int(c) + 1) * s, g], np.float64)  # [s, D]
        assert keys.shape[0] == s, f"cell {c} is not complete"
        kbar = keys.sum(axis=0) / s
        a = max(math.sqrt(sum(float(x) * float(x) for x in row)) for row in keys)
        prior = math.erf(sigma * (i - int(c) * s) / (2.0 * s))
        out.append(float(q_i @ kbar) / math.sqrt(D) + lam * a * prior)
    return np.array(out, dtype=np.float64)


def independent_selection(q, k, cfg: FreeSoloConfig) -> np.ndarray:
    """FS / FS-L selection [B, T, Hq, K] written from spec §3, §5, §7 alone (no freesolo.reference):
    n_j = j*Bq/s; FS-L keeps the W most recent available cells [max(0, n_j-W), n_j) plus the P
    older cells of largest (a_c, c); top-K by (score, c) descending, -1 padded."""
    B, T, Hq, D = q.shape
    Hkv, s = k.shape[2], cfg.cell
    idx = np.full((B, T, Hq, cfg.top_k), -1, dtype=np.int64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            norms = np.sqrt((np.asarray(k[b, : (T // s) * s, g], np.float64) ** 2).sum(-1)).reshape(-1, s)
            a = norms.max(axis=1) if norms.size else np.zeros(0)
            for i in range(T):
                n_j = (i // cfg.block) * cfg.block // s
                if cfg.variant == "fs":
                    cand = list(range(n_j))
                else:
                    lo = max(0, n_j - cfg.recent)
                    older = sorted(range(lo), key=lambda c: (a[c], c), reverse=True)[: cfg.pool]
                    cand = older + list(range(lo, n_j))
                if not cand:
                    continue
                sc = fs_scores(q, k, cfg, b, i, h, cand)
                best = sorted(zip(sc.tolist(), cand), reverse=True)[: cfg.top_k]
                idx[b, i, h, : len(best)] = [c for _, c in best]
    return idx


def assert_selection_matches(idx_test, idx_ref, q, k, cfg: FreeSoloConfig, tol: float, score_fn=fs_scores) -> int:
    """Tie-aware comparison of two selections [B, T, Hq, K].

    Where they differ, both must select the same number of cells and the sorted oracle scores
    of the two selections must agree within `tol` (a swap is allowed only at a near-tie).
    Rows that differ only in order must list the cells by descending score (spec §7), up to `tol`.
    Returns the number of (b, i, h) rows that differ.
    """
    idx_test = np.asarray(idx_test)
    idx_ref = np.asarray(idx_ref)
    assert idx_test.shape == idx_ref.shape, (idx_test.shape, idx_ref.shape)
    assert idx_test.dtype == np.int64, idx_test.dtype
    for b, i, h in np.argwhere((idx_test != idx_ref).any(axis=-1)):
        row = [int(c) for c in idx_test[b, i, h] if c >= 0]
        assert list(idx_test[b, i, h, len(row) :]) == [-1] * (idx_test.shape[-1] - len(row)), "-1 pads come last"
        scores = score_fn(q, k, cfg, b, i, h, row)
        assert np.all(np.diff(scores) <= tol), f"(b={b}, i={i}, h={h}): {row} not by descending score {scores}"
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


class TorchCellScores:
    """float64 cell scores (spec §3-§4, as `fs_scores`) of torch tensors on their device, for long
    sequences: each (b, kv head)'s cell statistics (mean key kbar_c, max key norm a_c) are computed
    once. q [B, T, Hq, D], k [B, T, Hkv, D], any float dtype. Called as `assert_selection_matches`'
    score_fn (its q / k / cfg arguments are ignored: the ones given here are used)."""

    def __init__(self, q, k, cfg: FreeSoloConfig):
        self.q, self.k, self.cfg = q, k, cfg
        Hq = q.shape[2]
        self.sigma = [float(x) for x in cfg.per_head("sigma", Hq)]
        self.lam = [float(x) for x in cfg.per_head("lam", Hq)]
        self._stats: dict = {}

    def stats(self, b: int, g: int):
        """(kbar float64 [C, D], a float64 [C]) of batch row b, kv head g (C = T // cell)."""
        if (b, g) not in self._stats:
            s, D = self.cfg.cell, self.k.shape[3]
            C = self.k.shape[1] // s
            cells = self.k[b, : C * s, g].double().view(C, s, D)
            self._stats[(b, g)] = (cells.mean(1), cells.norm(dim=-1).amax(1))
        return self._stats[(b, g)]

    def torch_scores(self, b: int, i: int, h: int, cells):
        """float64 torch [len(cells)]: score_h(i, c) of query (b, i, h) for the given cells."""
        import torch

        Hq, Hkv, D = self.q.shape[2], self.k.shape[2], self.q.shape[3]
        kbar, a = self.stats(b, h // (Hq // Hkv))
        cells = torch.as_tensor(cells, device=a.device, dtype=torch.int64)
        dist = (i - cells * self.cfg.cell).double()
        prior = torch.erf(self.sigma[h] * dist / (2.0 * self.cfg.cell))
        return kbar[cells] @ self.q[b, i, h].double() / math.sqrt(D) + self.lam[h] * a[cells] * prior

    def __call__(self, _q, _k, _cfg, b, i, h, cells) -> np.ndarray:
        return self.torch_scores(int(b), int(i), int(h), [int(c) for c in cells]).cpu().numpy()

    def reference_cells(self, b: int, i: int, h: int) -> list:
        """The float64 selection of query (b, i, h) from spec §3-§5, §7: FS every available cell,
        FS-L the P older cells of largest (a_c, c) plus the W most recent; top-K by (score, c)."""
        import torch

        cfg = self.cfg
        Hq, Hkv = self.q.shape[2], self.k.shape[2]
        _, a = self.stats(b, h // (Hq // Hkv))
        n = (i // cfg.block) * cfg.block // cfg.cell
        if cfg.variant == "fsl":
            m = max(0, n - cfg.recent)
            rev = torch.arange(m, device=a.device).flip(0)  # (a desc, c desc): c desc, then a stable sort on a
            order = torch.sort(a[rev], descending=True, stable=True).indices
            cand = torch.cat([rev[order][: cfg.pool], torch.arange(m, n, device=a.device)])
        else:
            cand = torch.arange(n, device=a.device)
        sc = self.torch_scores(b, i, h, cand).tolist()
        ranked = sorted(zip(sc, cand.tolist()), reverse=True)[: cfg.top_k]
        return [c for _, c in ranked]


def assert_rows_select_reference(idx, q, k, cfg: FreeSoloConfig, rows, gap: float, scores=None) -> None:
    """idx [B, T, Hq, K] (torch, -1 padded) holds, at each (b, i, h) of `rows`, the float64 reference
    selection of spec §3-§5 (`TorchCellScores.reference_cells`), or a set of as many cells whose
    sorted float64 scores are within `gap` of the reference's (a near-tie)."""
    scores = scores or TorchCellScores(q, k, cfg)
    for b, i, h in rows:
        want = scores.reference_cells(b, i, h)
        got = [int(c) for c in idx[b, i, h].tolist()]
        if got == want + [-1] * (cfg.top_k - len(want)):
            continue
        real = [c for c in got if c >= 0]
        assert len(real) == len(want), f"(b={b}, i={i}, h={h}): {got} vs {want}"
        diff = np.sort(scores(q, k, cfg, b, i, h, real)) - np.sort(scores(q, k, cfg, b, i, h, want))
        assert np.abs(diff).max() <= gap, f"(b={b}, i={i}, h={h}): {got} vs {want}, score gap {np.abs(diff).max():.2e}"


def off_grid_tau(k, cfg: FreeSoloConfig) -> tuple:
    """A per-kv-head FS-B threshold for tests that compare two backends: freesolo.calibrate_tau's
    median, moved halfway to the next larger a_c. The median of an odd number of cells IS one
    cell's a_c, so `a_c > tau` for that cell is decided by the last ulp of a_c, which float64
    backends may round differently (sqrt of a differently ordered sum): a tie in the input, not
    a backend error. Off the grid, every cell is > tau or < tau by a decisive margin."""
    import freesolo

    k = np.asarray(k, np.float64)
    B, T, Hkv, D = k.shape
    tau = np.asarray(freesolo.calibrate_tau(k, cfg), np.float64)
    C = T // cfg.cell
    a = np.sqrt((k[:, : C * cfg.cell] ** 2).sum(-1)).reshape(B, C, cfg.cell, Hkv).max(axis=2)  # [B, C, Hkv]
    out = []
    for g in range(Hkv):
        above = np.sort(a[:, :, g].ravel())
        above = above[above > tau[g] * (1 + 1e-9)]
        out.append(float((tau[g] + above[0]) / 2) if len(above) else float(tau[g] * (1 + 1e-6) + 1e-6))
    return tuple(out)


def triton_kernel_tests() -> tuple:
    """(CUDA, INTERPRETED, DEVICE, pytestmark) for a test module of Triton kernels: they run on a
    CUDA device, or on the CPU under TRITON_INTERPRET=1 (the module sets it before triton is
    imported on a machine without CUDA); otherwise every test of the module is skipped, saying why."""
    import os

    import pytest
    import torch

    cuda = torch.cuda.is_available()
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    mark = pytest.mark.skipif(
        not (cuda or interpreted),
        reason="no CUDA device and TRITON_INTERPRET is not set: the Triton kernels cannot run here",
    )
    return cuda, interpreted, "cuda" if cuda else "cpu", mark


def record_jit_runs(monkeypatch) -> list:
    """From now on (for the test), every call of triton's `JITFunction.run` appends the kernel's
    name to the returned list and then runs as before: a launch that took `_common.launch`'s fast
    path leaves no name."""
    from freesolo.backends.triton import _common

    hits: list = []
    original = _common.JITFunction.run

    def counting_run(self, *args, **kwargs):
        hits.append(self.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_common.JITFunction, "run", counting_run)
    return hits
