"""Counted cost (spec §10, lemma L9) and the fits of `freesolo.complexity`.

The structural counter's closed forms are checked three ways: against brute-force loops written
here from the spec, against the oracle's own candidate sets, and against the instrumented
counters of the numba path (`freesolo.backends.numba.backend.count_costs`) and of the FS-B oracle
(`reference.fsb.fsb_costs`). Exponents of the counted total cost over T in [16k, 1M] are
deterministic and tested; measured time is not.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig
from freesolo.complexity import counted as cc
from freesolo.complexity.fits import fit_cost_model, loglog_slope, nnls_small, t_quantile
from freesolo.complexity.measured import measure_point, peak_memory, tau_for_keys
from freesolo.reference.primitives import available_cells, cell_stats, fsl_candidates

from .helpers import SMALL, random_qkv

SMALL_CFG = FreeSoloConfig(**SMALL)


# ---- strategies -------------------------------------------------------------------------------
@st.composite
def configs(draw, variant="fsl"):
    cell = draw(st.sampled_from([1, 2, 4, 8]))
    block = cell * draw(st.integers(1, 4))
    window = block * draw(st.integers(1, 3))
    top_k = draw(st.integers(1, 5))
    return FreeSoloConfig(
        variant=variant,
        cell=cell,
        block=block,
        window=window,
        top_k=top_k,
        pool=draw(st.integers(1, 6)),
        recent=draw(st.integers(1, 4)),
        beam=draw(st.integers(max(1, top_k), 8)),
    )


def _brute_beam_keys(n: int, beam: int) -> int:
    """Spec §6.4 walked level by level with explicit node lists (segment start, index in level)."""
    if n == 0:
        return 0
    H = n.bit_length() - 1
    # trees: one per set bit, largest first; tree of height h starts at the sum of larger bits
    starts, start = {}, 0
    for h in range(H, -1, -1):
        if n >> h & 1:
            starts[h] = start
            start += 1 << h
    frontier = [(starts[H], 0)]  # the root of the tallest tree: no key needed
    keys = 0
    for level in range(H - 1, -1, -1):
        cands = [(s, 2 * m + d) for s, m in frontier for d in (0, 1)]
        if level in starts:
            cands.append((starts[level], 0))
        keys += len(cands)
        frontier = cands[:beam]  # which ones are kept does not change how many
    return keys


# ---- closed forms vs brute force ------------------------------------------------------------
def test_beam_node_keys_matches_level_walk_and_l9():
    n = np.arange(0, 2100)
    for beam in (1, 2, 3, 5, 16):
        keys = cc.beam_node_keys(n, beam)
        brute = np.array([_brute_beam_keys(int(x), beam) for x in n])
        np.testing.assert_array_equal(keys, brute)
        assert np.all(keys <= cc.l9_node_key_bound(n, beam))  # L9, per forest
    big = np.array([2**20 - 1, 2**20, 2**25 + 12345, 3 * 2**30])
    assert np.all(cc.beam_node_keys(big, 16) <= cc.l9_node_key_bound(big, 16))
    assert cc.beam_node_keys(np.array(2**20), 16) == 2 * (16 * 16 + 8 + 4 + 2 + 1)  # levels 1..20


def test_beam_node_keys_exhaustive_when_beam_is_large():
    # beam >= every level's node count: every node but the first root gets a key: 2n - popcount(n) - 1
    n = np.arange(1, 600)
    np.testing.assert_array_equal(cc.beam_node_keys(n, 1024), 2 * n - cc.popcount(n) - 1)


def test_popcount_and_floor_log2():
    n = np.array([0, 1, 2, 3, 255, 256, 2**40 + 7])
    np.testing.assert_array_equal(cc.popcount(n), [bin(int(x)).count("1") for x in n])
    with pytest.raises(ValueError, match="non-negative"):
        cc.popcount(np.array([-1]))


def test_forest_build_cost_matches_segment_enumeration():
    for n in list(range(0, 70)) + [1000, 4097]:
        segs = sorted_el = radius = nodes = 0
        for level in range(1, max(n, 1).bit_length() + 1):
            size = 1 << level
            for _m in range(n // size):  # aligned [m*size, (m+1)*size) inside [0, n)
                segs += 1
                sorted_el += size
                radius += level * size  # every internal node visits its leaves
                nodes += size - 1
        cost = cc.forest_build_cost(np.array(n))
        assert (
            int(cost["segments"]),
            int(cost["sorted_elements"]),
            int(cost["radius_visits"]),
            int(cost["nodes"]),
        ) == (segs, sorted_el, radius, nodes), n
    assert int(cc.forest_build_cost(np.array(64), "position")["sorted_elements"]) == 0
    with pytest.raises(ValueError, match="leaf_order"):
        cc.forest_build_cost(np.array(4), "random")


@given(cfg=configs("fs"), T=st.integers(1, 700))
def test_fs_total_cells_scored_closed_form(cfg, T):
    brute = sum(available_cells(i // cfg.block, cfg.block, cfg.cell) for i in range(T))
    assert cc.fs_total_cells_scored_closed_form(T, cfg) == brute
    per_query = cc.count_per_query(T, cfg, num_heads=3, num_kv_heads=1)
    assert per_query["cells_scored"].shape == (1, T, 3)
    assert int(per_query["cells_scored"].sum()) == 3 * brute
    assert cc.count_totals(T, cfg, num_heads=3)["cells_scored"] == 3 * brute


@given(cfg=configs("fsl"), T=st.integers(1, 600), seed=st.integers(0, 3))
def test_fsl_cells_scored_is_the_oracle_candidate_count_and_at_most_p_plus_w(cfg, T, seed):
    a = np.random.default_rng(seed).standard_normal(T // cfg.cell + 1)
    counts = cc.count_per_query(T, cfg)["cells_scored"][0, :, 0]  # [T]
    for i in range(T):
        n = available_cells(i // cfg.block, cfg.block, cfg.cell)
        assert counts[i] == len(fsl_candidates(a, n, cfg.pool, cfg.recent))
    assert counts.max(initial=0) <= cfg.pool + cfg.recent  # L9 for FS-L


def test_fsl_per_query_at_most_p_plus_w_at_1m_and_constant_state():
    cfg = FreeSoloConfig()
    T = 1 << 20
    per_query = cc.count_per_query(T, cfg)
    assert per_query["cells_scored"].max() == cfg.pool + cfg.recent
    assert per_query["tokens_read"].max() == cfg.window + cfg.top_k * cfg.cell  # spec §10: <= w + K*s
    # L7 (model): the FS-L state does not grow once the window and the pool are full
    T0 = cfg.window + (cfg.pool + cfg.recent) * cfg.cell + cfg.block
    T0 = -(-T0 // cfg.block) * cfg.block
    sizes = {cc.state_bytes(T, cfg.replace(variant="fsl"), 2, 64) for T in range(T0, T0 + 64 * cfg.block, cfg.block)}
    assert len(sizes) == 1
    assert cc.state_bytes(1 << 16, cfg.replace(variant="fs"), 2, 64) * 2 == pytest.approx(
        cc.state_bytes(1 << 17, cfg.replace(variant="fs"), 2, 64), rel=1e-6
    )


def test_tokens_read_formula_by_hand():
    cfg = SMALL_CFG  # window 16, cell 4, block 8, top_k 4
    per_query = cc.count_per_query(40, cfg.replace(variant="fs"))
    tokens = per_query["tokens_read"][0, :, 0]
    expected = [min(i + 1, 16) + 4 * min(4, (i // 8) * 2) for i in range(40)]
    np.testing.assert_array_equal(tokens, expected)


# ---- the high-norm forest input -------------------------------------------------------------
def test_cell_max_norms_and_tau_match_the_oracle():
    _, k, _ = random_qkv(3, 2, 77, 2, 2, 6)
    a = cc.cell_max_norms(k, 4)  # [B, Hkv, C]
    for b in range(2):
        for g in range(2):
            np.testing.assert_allclose(a[b, g], cell_stats(k[b, :, g], 4)[1], rtol=1e-12)
    cfg = FreeSoloConfig(cell=4, block=8, window=16)
    np.testing.assert_allclose(cc.tau_from_norms(a), freesolo.calibrate_tau(k, cfg), rtol=1e-12)
    np.testing.assert_allclose(tau_for_keys(k, cfg), freesolo.calibrate_tau(k, cfg), rtol=1e-12)
    prefix = cc.high_norm_prefix_counts(a, cc.tau_from_norms(a))  # [B, Hkv, C+1]
    assert prefix.shape == (2, 2, 20) and prefix[..., 0].max() == 0
    np.testing.assert_array_equal(prefix[..., -1], (a > cc.tau_from_norms(a)[None, :, None]).sum(-1))


def test_random_cell_max_norms_prefixes_are_causal():
    long = cc.random_cell_max_norms(4096, 32, 1, 2, 16, seed=5, chunk=1024)
    short = cc.random_cell_max_norms(2048, 32, 1, 2, 16, seed=5, chunk=1024)
    np.testing.assert_array_equal(long[..., :64], short)


def test_fsb_counts_need_high_prefix():
    with pytest.raises(ValueError, match="high-norm"):
        cc.count_per_block(100, SMALL_CFG.replace(variant="fsb"))


# ---- cross-checks against the instrumented counters -------------------------------------------
@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("T,Hq,Hkv", [(1, 1, 1), (63, 2, 1), (111, 4, 2), (300, 2, 2)])
def test_structural_counts_equal_numba_count_costs(variant, T, Hq, Hkv):
    from freesolo.backends.numba.backend import count_costs

    cfg = SMALL_CFG.replace(variant=variant)
    q, k, _ = random_qkv(T + Hq, 2, T, Hq, Hkv, 8)
    inst = count_costs(q, k, cfg)
    ours = cc.count_per_query(T, cfg, Hq, Hkv, batch=2)
    np.testing.assert_array_equal(ours["cells_scored"], inst["cells_scored"])
    np.testing.assert_array_equal(ours["tokens_read"], inst["tokens_read"])
    np.testing.assert_array_equal(ours["cells_selected"], inst["cells_selected"])
    totals = cc.count_totals(T, cfg, Hq, Hkv, batch=2)
    assert totals["cells_scored"] == int(inst["total_cells_scored"])
    assert totals["tokens_read"] == int(inst["total_tokens_read"])
    if variant == "fsl":
        assert inst["cells_scored"].max(initial=0) <= cfg.pool + cfg.recent


@pytest.mark.parametrize("T,Hq,Hkv,beam", [(100, 2, 1, 2), (131, 2, 2, 3), (64, 1, 1, 16)])
def test_structural_fsb_counts_against_fsb_oracle(T, Hq, Hkv, beam):
    from freesolo.reference.fsb import fsb_costs, select_cells_fsb

    q, k, _ = random_qkv(T * beam, 1, T, Hq, Hkv, 8)
    cfg = SMALL_CFG.replace(variant="fsb", beam=beam, top_k=2)
    tau = freesolo.calibrate_tau(k, cfg)
    cfg = cfg.replace(tau=tuple(tau))
    inst = fsb_costs(q, k, cfg)
    a = cc.cell_max_norms(k, cfg.cell)
    high = cc.high_norm_prefix_counts(a, tau)
    ours = cc.count_per_query(T, cfg, Hq, Hkv, high_prefix=high)
    np.testing.assert_array_equal(ours["node_keys"], inst["node_keys"])
    # rerank de-duplicates: between the larger forest's leaves and the structural (no-overlap) bound
    n = cc.available_per_query(T, cfg)[None, :, None]  # [1, T, 1]
    assert np.all(inst["cells_reranked"] <= ours["cells_reranked"])
    assert np.all(inst["cells_reranked"] >= np.minimum(beam, n))
    # L9 per forest: the sum over both forests is below the sum of the bounds
    bound = cc.l9_node_key_bound(n, beam) * 2
    assert np.all(inst["node_keys"] <= bound)
    idx = select_cells_fsb(q, k, cfg)
    np.testing.assert_array_equal((idx >= 0).sum(-1), ours["cells_selected"])


# ---- exponents of the counted total cost (deterministic) --------------------------------------
@pytest.fixture(scope="module")
def counted_rows():
    Ts = [1 << p for p in range(14, 21)]  # 16k .. 1M
    return Ts, cc.counted_sweep(Ts, ["fs", "fsl", "fsb"], FreeSoloConfig(), num_heads=2, num_kv_heads=1, dim=64)


def _slope(rows, variant, key):
    pts = [(r["T"], r[key]) for r in rows if r["variant"] == variant]
    T, y = np.array(pts, dtype=np.float64).T
    return loglog_slope(T, y)


def test_counted_exponents_16k_to_1m(counted_rows):
    _, rows = counted_rows
    fsl, fs, fsb = (_slope(rows, v, "selection_work") for v in ("fsl", "fs", "fsb"))
    assert abs(fsl.slope - 1.0) <= 0.03, fsl
    assert fs.slope >= 1.9, fs
    assert fsb.slope <= 1.15, fsb
    assert fsb.slope > fsl.slope  # the log factor is visible
    # the same bands for the two pure selection counts
    assert abs(_slope(rows, "fsl", "cells_scored").slope - 1.0) <= 0.03
    assert _slope(rows, "fs", "cells_scored").slope >= 1.9
    # readout (tokens read) is linear for every variant
    for v in ("fs", "fsl", "fsb"):
        assert abs(_slope(rows, v, "tokens_read").slope - 1.0) <= 0.01


def test_counted_fsb_per_query_bounded_by_l9(counted_rows):
    _, rows = counted_rows
    cfg = FreeSoloConfig()
    for r in rows:
        if r["variant"] == "fsb":
            n = (r["T"] - 1) // cfg.block * cfg.block // cfg.cell
            assert r["node_keys_per_query"] <= 2 * int(cc.l9_node_key_bound(np.array(n), cfg.beam))
            assert r["cells_reranked_per_query"] <= 2 * cfg.beam
            assert r["build_radius"] > 0 and r["build_sorted"] > 0


def test_counted_model_fit_picks_the_right_term(counted_rows):
    _, rows = counted_rows
    T = [r["T"] for r in rows if r["variant"] == "fs"]
    fs = fit_cost_model(T, [r["selection_work"] for r in rows if r["variant"] == "fs"])
    fsl = fit_cost_model(T, [r["selection_work"] for r in rows if r["variant"] == "fsl"])
    assert fs.dominant == "N^2" and fs.rel_rms < 0.02
    assert fsl.dominant == "N" and fsl.rel_rms < 0.02


# ---- fits on synthetic data -----------------------------------------------------------------
@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.37, 2.0])
def test_loglog_slope_recovers_known_exponents(exponent):
    N = np.geomspace(1e3, 1e6, 8)
    exact = loglog_slope(N, 3.0 * N**exponent)
    assert exact.slope == pytest.approx(exponent, abs=1e-12)
    assert exact.high - exact.low < 1e-9 and exact.r2 == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(200):
        fit = loglog_slope(N, 3.0 * N**exponent * np.exp(rng.normal(0, 0.1, N.size)))
        hits += fit.low <= exponent <= fit.high
    assert 180 <= hits <= 199  # a 95% interval covers the truth ~95% of the time


def test_t_quantile_matches_tables():
    # two-sided 95% and 99% critical values from standard t tables
    table = {
        1: (12.706, 63.657),
        2: (4.303, 9.925),
        3: (3.182, 5.841),
        5: (2.571, 4.032),
        10: (2.228, 3.169),
        30: (2.042, 2.750),
        120: (1.980, 2.617),
    }
    for dof, (t95, t99) in table.items():
        assert t_quantile(0.975, dof) == pytest.approx(t95, abs=1e-3)
        assert t_quantile(0.995, dof) == pytest.approx(t99, abs=1e-3)
        assert t_quantile(0.025, dof) == pytest.approx(-t95, abs=1e-3)
    assert t_quantile(0.5, 4) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_nnls_small_is_optimal_and_feasible():
    rng = np.random.default_rng(1)
    for _ in range(50):
        A, b = rng.standard_normal((9, 3)), rng.standard_normal(9)
        x = nnls_small(A, b)
        assert np.all(x >= 0)
        res = np.sum((A @ x - b) ** 2)
        # KKT: the gradient is zero on the support and points into the constraint off it
        grad = A.T @ (A @ x - b)
        assert np.all(np.abs(grad[x > 0]) < 1e-8) and np.all(grad[x == 0] >= -1e-8)
        for _trial in range(20):  # no random feasible point does better
            z = np.abs(rng.standard_normal(3)) * rng.integers(0, 2, 3)
            assert np.sum((A @ z - b) ** 2) >= res - 1e-12


def test_loglog_slope_validation():
    with pytest.raises(ValueError, match="positive"):
        loglog_slope([1, 2, 3], [1, 0, 2])
    with pytest.raises(ValueError, match="at least 2"):
        loglog_slope([1], [1])
    with pytest.raises(ValueError, match="distinct"):
        loglog_slope([4, 4], [1, 2])
    assert math.isnan(loglog_slope([1, 2], [1, 4]).stderr)


def test_fit_cost_model_recovers_coefficients():
    N = np.geomspace(2**10, 2**22, 13)
    y = 5.0 * N + 0.25 * N * np.log2(N) ** 2 + 1e-4 * N**2
    fit = fit_cost_model(N, y)
    assert (fit.a, fit.b, fit.c) == pytest.approx((5.0, 0.25, 1e-4), rel=1e-6)
    assert fit.rel_rms < 1e-9 and fit.dominant == "N^2"
    lin = fit_cost_model(N, 7 * N)
    assert lin.a == pytest.approx(7) and lin.b == pytest.approx(0, abs=1e-12) and lin.dominant == "N"
    mid = fit_cost_model(N, 3 * N * np.log2(N) ** 2)
    assert mid.dominant == "N log2(N)^2" and mid.shares[1] == pytest.approx(1.0)
    # non-negativity: a sub-linear cost cannot get a negative coefficient
    sub = fit_cost_model(N, N**0.5)
    assert min(sub.a, sub.b, sub.c) >= 0


# ---- measured cost and the CLI (smoke: timing is not tested) ----------------------------------
def test_peak_memory_sees_a_large_allocation():
    with peak_memory("cpu") as mem:
        x = np.ones(8_000_000)  # 61 MiB
        x[::512] = 2
        del x
    assert mem.bytes >= 55 * 2**20, (mem.bytes, mem.method)


def test_measure_point_numpy_backend():
    row = measure_point("fsb", "numpy", 48, SMALL_CFG, num_heads=2, dim=8, repeats=2)
    assert row["status"] == "ok" and row["time_s"] > 0 and row["runs"] >= 1 and row["peak_bytes"] >= 0


def test_scaling_cli_writes_csv_json_png(tmp_path, capsys):
    from freesolo.complexity.scaling import scaling_main

    out = tmp_path / "out"
    argv = [
        "--backend",
        "numpy",
        "--T",
        "64,128",
        "--counted-T-max",
        "4k",
        "--T-min",
        "64",
        "--fit-T-min",
        "512",
        "--window",
        "16",
        "--cell",
        "4",
        "--block",
        "8",
        "--pool",
        "3",
        "--recent",
        "2",
        "--beam",
        "2",
        "--heads",
        "1",
        "--dim",
        "8",
        "--repeats",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert scaling_main(argv) == 0
    for name in ("counted.csv", "measured.csv", "scaling.json", "scaling.png"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "scaling.json").read_text())
    assert {r["variant"] for r in result["measured"]} == {"fs", "fsl", "fsb"}
    assert all(r["status"] == "ok" for r in result["measured"])
    assert result["fits"]["counted_selection_work"]["fs"]["slope"]["slope"] > 1.8
    printed = capsys.readouterr().out
    assert "selection exponent" in printed and "forward (attention) exponent" in printed
