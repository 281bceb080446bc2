"""The Triton selection kernels (`freesolo.backends.triton.selection`): cell statistics, FS-L
candidate pools, scoring + per-query top-K (spec §3, §4, §5, §7; lemmas L2, L3, L8, L12).

- `cell_stats` against a float64 torch computation (awkward T, D, cell, strided k);
- FS-L pools (`fsl_candidates`) exactly equal to the oracle's block candidates, with ties in a_c;
- `select_cells` (FS, FS-L) against the float64 oracle, tie-aware (a swap only at a near-tie),
  awkward T, GQA groups 1 / 2 / 3, small configs where pruning bites, per-head sigma / lam, exact
  score ties (larger cell first), the default config once;
- L12 bitwise: a row alone == the row in a batch; a prefix == the same rows of the full sequence;
  other queries of the tile and later tokens change no selected cell.
Outputs are allocated with torch.empty: a fixture poisons it (NaN / -2^30) so that an unwritten
element fails.

On a CPU machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in float32 on
tiny shapes; the CUDA tests (bf16 / fp16 / fp32, D 64 / 128, long T, int64 offsets) skip without a
GPU. On the H200:
    python -m pytest -q proofs_tests/test_triton_selection.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel
pytest.importorskip("triton", reason="triton is not installed: the Triton selection kernels cannot run")

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton.selection import cell_stats, fsl_candidates, select_cells  # noqa: E402
from freesolo.reference import oracle  # noqa: E402
from freesolo.reference.primitives import available_cells  # noqa: E402

from .helpers import assert_rows_select_reference, assert_selection_matches, random_qkv, triton_kernel_tests  # noqa: E402

CUDA, INTERPRETED, DEVICE, pytestmark = triton_kernel_tests()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 / fp16, D 64 / 128, long T run on the H200)")
# fp32 scores vs float64: |score| <= ~10 here, fp32 dot / erf errors are ~1e-6 of that.
TOL32 = 1e-4


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    """torch.empty returns NaN-filled float / -2^30-filled integer tensors: unwritten output fails."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        if x.is_floating_point():
            return x.fill_(float("nan"))
        if x.dtype == torch.bool:
            return x
        return x.fill_(max(-(2**30), torch.iinfo(x.dtype).min))  # int16 / int8 (the backward's plans): their minimum

    monkeypatch.setattr(torch, "empty", poisoned)


def _cfg(variant="fsl", **kw) -> FreeSoloConfig:
    base = dict(variant=variant, window=16, cell=4, block=8, pool=3, recent=2, top_k=3)
    base.update(kw)
    return FreeSoloConfig(**base)


def _t(x, dtype=torch.float32, device=DEVICE):
    return torch.as_tensor(np.ascontiguousarray(x)).to(device=device, dtype=dtype)


def _select(q, k, cfg, dtype=torch.float32, device=DEVICE, tiles=None) -> np.ndarray:
    idx = select_cells(_t(q, dtype, device), _t(k, dtype, device), cfg, tiles=tiles)
    assert idx.dtype == torch.int64 and idx.device.type == torch.device(device).type, (idx.dtype, idx.device)
    return idx.cpu().numpy()


def _tied_keys(seed: int, B: int, T: int, Hkv: int, D: int) -> np.ndarray:
    """k [B, T, Hkv, D] whose rows are v * e_d with v in {1, 2, 3}: every norm is an exact
    integer, so many cells share a_c (ties decided by the larger c)."""
    rng = np.random.default_rng(seed)
    k = np.zeros((B, T, Hkv, D))
    dims = rng.integers(0, D, size=(B, T, Hkv))
    vals = rng.integers(1, 4, size=(B, T, Hkv)).astype(np.float64)
    np.put_along_axis(k, dims[..., None], vals[..., None], axis=-1)
    return k


# ---- cell statistics -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,T,Hkv,D,cell",
    [(1, 1, 1, 8, 4), (2, 31, 2, 8, 4), (1, 33, 3, 16, 8), (2, 63, 1, 32, 4), (1, 129, 2, 16, 12), (1, 200, 1, 8, 64)],
    ids=lambda x: str(x),
)
def test_cell_stats_match_float64(B, T, Hkv, D, cell):
    """kbar (mean key) and amax (max key norm) of every complete cell, from a strided k."""
    rng = np.random.default_rng(T * 7 + D)
    k = rng.standard_normal((B, Hkv, T, D)) * 2.0
    k_strided = _t(k).transpose(1, 2)  # [B, T, Hkv, D], not contiguous
    assert not k_strided.is_contiguous() or T == 1 or Hkv == 1
    kbar, amax = cell_stats(k_strided, cell)
    C = T // cell
    assert kbar.shape == (B, Hkv, C, D) and amax.shape == (B, Hkv, C), (kbar.shape, amax.shape)
    assert kbar.dtype == torch.float32 and amax.dtype == torch.float32, (kbar.dtype, amax.dtype)
    k64 = torch.from_numpy(k.astype(np.float32).astype(np.float64))[:, :, : C * cell].reshape(B, Hkv, C, cell, D)
    ref_kbar = k64.mean(dim=3)
    ref_amax = torch.sqrt((k64 * k64).sum(-1)).amax(-1) if C else torch.zeros(B, Hkv, 0, dtype=torch.float64)
    err_kbar = (kbar.cpu().double() - ref_kbar).abs().max().item() if C else 0.0
    err_amax = ((amax.cpu().double() - ref_amax).abs() / ref_amax).max().item() if C else 0.0
    assert err_kbar <= 1e-6, f"kbar max-abs error {err_kbar:.2e} (B={B}, T={T}, Hkv={Hkv}, D={D}, cell={cell})"
    assert err_amax <= 1e-6, f"amax max-rel error {err_amax:.2e} (B={B}, T={T}, Hkv={Hkv}, D={D}, cell={cell})"


# ---- FS-L candidate pools (L3) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "T,cell,block,pool,recent,tied,chunk",
    [
        (200, 4, 8, 3, 2, False, 4),
        (200, 4, 8, 3, 2, True, 2),
        (200, 4, 8, 3, 2, True, None),  # default chunk 64 > C: the per-block kernel does it all
        (129, 4, 16, 2, 1, True, 8),
        (97, 4, 4, 4, 2, True, 2),  # block == cell: one cell leaves the recent window per block
        (150, 2, 32, 3, 1, True, 4),  # 16 cells per block, several scan steps per block
        (63, 4, 8, 64, 2, False, 16),  # pool larger than every older set
        (200, 4, 12, 3, 2, True, 8),  # 3 cells per block: blocks straddle scan steps
        (300, 4, 8, 5, 3, True, 16),  # odd recent window, 8 blocks per scan step
    ],
    ids=lambda x: str(x),
)
def test_fsl_pools_equal_oracle(T, cell, block, pool, recent, tied, chunk):
    """cand[b, g, j] == oracle.block_candidates(a, n_j) as sets, every block, pools exactly, for
    scan steps (`chunk`) smaller than, equal to and larger than the cells per block."""
    _check_pools(T, cell, block, pool, recent, tied, chunk, direct=False)


@pytest.mark.parametrize(
    "T,cell,block,pool,recent,tied",
    [(200, 4, 8, 3, 2, True), (97, 4, 4, 4, 2, True), (63, 4, 8, 64, 2, False), (150, 2, 32, 3, 1, True)],
    ids=lambda x: str(x),
)
def test_fsl_direct_pools_equal_oracle(T, cell, block, pool, recent, tied):
    """The short-sequence kernel that sorts each block's older cells (`direct`): the same sets as the
    oracle's, ties in a_c included, a pool larger than every older set, 16 cells per block."""
    _check_pools(T, cell, block, pool, recent, tied, None, direct=True)


def _check_pools(T, cell, block, pool, recent, tied, chunk, direct):
    B, Hkv, D = 2, 2, 8
    cfg = _cfg(cell=cell, block=block, window=block, pool=pool, recent=recent)
    k = _tied_keys(T, B, T, Hkv, D) if tied else random_qkv(T, B, T, 1, Hkv, D)[1]
    _, amax = cell_stats(_t(k), cell)
    cand = fsl_candidates(amax, T, cfg, chunk=chunk, direct=direct).cpu().numpy()
    nblocks = -(-T // block)
    assert cand.shape == (B, Hkv, nblocks, pool + recent) and cand.dtype == np.int32, (cand.shape, cand.dtype)
    ties = 0
    for b in range(B):
        for g in range(Hkv):
            a = np.sqrt((k[b, : (T // cell) * cell, g] ** 2).sum(-1)).reshape(-1, cell).max(-1)
            ties += len(a) - len(np.unique(a))
            for j in range(nblocks):
                expected = oracle.block_candidates(a, available_cells(j, block, cell), cfg)
                row = cand[b, g, j]
                got = np.sort(row[row >= 0])
                assert (row[row < 0] == -1).all(), f"(b={b}, g={g}, j={j}): pads must be -1, got {row}"
                assert len(np.unique(got)) == len(got), f"(b={b}, g={g}, j={j}): duplicate cells {row}"
                assert np.array_equal(got, expected), f"(b={b}, g={g}, j={j}): {got.tolist()} != {expected.tolist()}"
                assert len(got) <= pool + recent
    if tied:
        assert ties > 0, "the tied-keys input must produce equal a_c"


def test_fsl_direct_switch(monkeypatch):
    """FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS picks the sorting kernel up to that many cells (the same
    selections either way, with ties in a_c); bad values and a forced sort past its cap are errors."""
    from freesolo.backends.triton import selection

    monkeypatch.delenv(selection.ENV_FSL_DIRECT_MAX_CELLS, raising=False)
    assert selection.fsl_direct_max_cells() == selection.FSL_DIRECT_MAX_CELLS
    for bad in ("-1", "x", str(selection.DIRECT_CELLS_CAP + 1)):
        monkeypatch.setenv(selection.ENV_FSL_DIRECT_MAX_CELLS, bad)
        with pytest.raises(ValueError, match=selection.ENV_FSL_DIRECT_MAX_CELLS):
            selection.fsl_direct_max_cells()
    cfg = _cfg(pool=3, recent=2, top_k=2)
    T = 150
    q = random_qkv(5, 1, T, 2, 1, 8)[0]
    k = _tied_keys(5, 1, T, 1, 8)
    calls = []
    real_launch = selection.launch

    def counting_launch(kernel, *args, **kwargs):
        calls.append(kernel)
        return real_launch(kernel, *args, **kwargs)

    monkeypatch.setattr(selection, "launch", counting_launch)
    picked = {}
    for limit in ("0", str(T // cfg.cell)):
        monkeypatch.setenv(selection.ENV_FSL_DIRECT_MAX_CELLS, limit)
        calls.clear()
        picked[limit] = _select(q, k, cfg)
        direct_ran = selection._fsl_cand_direct_kernel in calls
        assert direct_ran == (limit != "0"), (limit, calls)
        assert (selection._fsl_pool_scan_kernel in calls) == (limit == "0"), (limit, calls)
    np.testing.assert_array_equal(picked["0"], picked[str(T // cfg.cell)])
    too_many = selection.DIRECT_CELLS_CAP + 1
    with pytest.raises(ValueError, match="direct=True"):
        fsl_candidates(torch.zeros(1, 1, too_many), 32 * too_many, FreeSoloConfig(), direct=True)


# ---- selection against the oracle (L8) -------------------------------------------------------

# (variant, B, T, Hq, Hkv, D, config overrides): awkward T, GQA groups 1 / 2 / 3, pruning bites.
SELECT_CASES = [
    ("fsl", 1, 1, 2, 1, 8, dict(top_k=2)),
    ("fsl", 2, 31, 2, 1, 8, dict(pool=2, recent=1, top_k=1)),
    ("fs", 2, 33, 3, 1, 16, dict(top_k=3)),
    ("fsl", 1, 63, 2, 2, 32, dict(cell=8, block=16, top_k=4, sigma=(2.0, 6.0), lam=(0.5, 2.0))),
    ("fs", 1, 129, 3, 1, 8, dict(top_k=4, sigma=(1.0, 4.0, 8.0), lam=(0.0, 1.0, 3.0))),
    ("fsl", 2, 129, 3, 1, 16, dict(pool=4, recent=2, top_k=2)),
    ("fs", 1, 200, 2, 2, 8, dict(block=16, top_k=4)),
    ("fsl", 1, 200, 4, 2, 16, dict(cell=8, block=16, window=32, pool=2, recent=1, top_k=3)),
]


@pytest.mark.parametrize("variant,B,T,Hq,Hkv,D,kw", SELECT_CASES, ids=lambda x: str(x))
def test_selection_matches_oracle(variant, B, T, Hq, Hkv, D, kw):
    """float32 selections == the float64 oracle's except at near-ties (gap <= TOL32)."""
    cfg = _cfg(variant, **kw)
    q, k, _ = random_qkv(T + D, B, T, Hq, Hkv, D)
    q, k = q.astype(np.float32).astype(np.float64), k.astype(np.float32).astype(np.float64)
    idx = _select(q, k, cfg)
    ref = oracle.select_cells(q, k, cfg)
    differ = assert_selection_matches(idx, ref, q, k, cfg, TOL32)
    assert differ <= max(1, idx.size // (cfg.top_k * 100)), f"{differ} rows differ at near-ties: too many"
    assert (idx[:, : min(T, cfg.block)] == -1).all(), "block 0 has no available cell"


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_float16_split_dot_matches_oracle(variant):
    """16-bit inputs take the split dot (q . kbar_hi + q . kbar_lo in q's dtype, fp32 accumulation;
    on CUDA on tensor cores): as exact as fp32 for selection, against the oracle on the rounded
    float16 inputs. (float16 also runs under the interpreter; bfloat16 is checked on CUDA.)"""
    cfg = _cfg(variant, top_k=3)
    q, k, _ = random_qkv(17, 1, 90, 2, 1, 32)
    q, k = q.astype(np.float16).astype(np.float64), k.astype(np.float16).astype(np.float64)
    idx = _select(q, k, cfg, dtype=torch.float16)
    assert_selection_matches(idx, oracle.select_cells(q, k, cfg), q, k, cfg, TOL32)


def test_selection_default_config_once():
    """The defaults of spec §1 (cell 32, block 128, pool 64, recent 8, top_k 4) at T = 1100."""
    cfg = FreeSoloConfig(variant="fsl")
    q, k, _ = random_qkv(11, 1, 1100, 2, 1, 16)
    q, k = q.astype(np.float32).astype(np.float64), k.astype(np.float32).astype(np.float64)
    idx = _select(q, k, cfg)
    assert_selection_matches(idx, oracle.select_cells(q, k, cfg), q, k, cfg, TOL32)
    assert (idx[:, 128:] >= 0).all(), "past block 0, every query has >= 4 available cells"


@pytest.mark.parametrize("count_rounds", [False, True])
@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_exact_score_ties_prefer_larger_cell(variant, count_rounds):
    """q = 0 and lam = 0 make every score exactly 0: the K largest candidates, descending (spec §7).
    With tied a_c, the FS-L pool keeps the more recent cells too (spec §5): exact equality. Both
    top-K round schedules of the scoring kernel (every round, counted per chunk)."""
    from freesolo.backends.triton.selection import ScoreTiles

    B, T, Hq, Hkv, D = 1, 96, 2, 1, 8
    cfg = _cfg(variant, lam=0.0, top_k=4)
    q = np.zeros((B, T, Hq, D))
    k = _tied_keys(5, B, T, Hkv, D)
    tiles = ScoreTiles(16, 16, 1, early_exit=False, count_rounds=count_rounds)
    idx = _select(q, k, cfg, tiles=tiles)
    ref = oracle.select_cells(q, k, cfg)
    assert np.array_equal(idx, ref), f"tie rule: first differing row {np.argwhere((idx != ref).any(-1))[:1].tolist()}"
    # independent statement for FS: the available cells n_j-1, n_j-2, ... in that order
    if variant == "fs":
        for i in range(cfg.block, T):
            n = (i // cfg.block) * cfg.block // cfg.cell
            expected = [c for c in range(n - 1, n - 1 - cfg.top_k, -1)]
            expected = [c if c >= 0 else -1 for c in expected]
            assert idx[0, i, 0].tolist() == expected, (i, idx[0, i, 0].tolist(), expected)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_score_kernel_switches_give_equal_selections(variant):
    """ScoreTiles.erf_skip (prior 1.0 without erf where every argument of a chunk is >= ERF_ONE)
    and the top-K round schedules (early exit, counted per chunk, every round) and the chunk width
    change no selected
    cell: bitwise against the
    kernel without them, on a config whose chunks are some skipped, some not (sigma 4, cell 4:
    erf is skipped from 8 tokens before the tile on; 16-cell chunks)."""
    from freesolo.backends.triton.selection import ERF_ONE, ScoreTiles

    cfg = _cfg(variant, pool=12, recent=4, top_k=3, sigma=(4.0, 0.25), lam=(1.0, 3.0))
    assert 4.0 / (2 * cfg.cell) * 8 >= ERF_ONE  # head 0 skips chunks 2 cells before its tile
    q, k, _ = random_qkv(29, 1, 230, 2, 1, 16)
    qt, kt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k))
    base = select_cells(qt, kt, cfg, tiles=ScoreTiles(16, 16, 1, early_exit=True, erf_skip=False))
    assert (base[0, 16:] >= 0).all()
    for tiles in (ScoreTiles(16, 16, 1, early_exit=True, erf_skip=True),
                  ScoreTiles(16, 16, 1, count_rounds=True, erf_skip=True),
                  ScoreTiles(16, 16, 1, early_exit=False, count_rounds=True, erf_skip=False),
                  ScoreTiles(16, 32, 1, early_exit=False, count_rounds=True),
                  ScoreTiles(16, 16, 1, early_exit=False, erf_skip=True)):  # fmt: skip
        assert torch.equal(select_cells(qt, kt, cfg, tiles=tiles), base), tiles
    assert select_cells(qt, kt, cfg, out_dtype=torch.int32).dtype == torch.int32
    with pytest.raises(TypeError, match="out_dtype"):
        select_cells(qt, kt, cfg, out_dtype=torch.float32)


def test_fsl_tail_chunk_gives_equal_selections():
    """ScoreTiles.fsl_tail (the candidates past the last full chunk scored in one narrower chunk)
    changes no selected cell: 40 candidates (pool 36 + recent 4) in chunks of 32 are one full chunk
    and a 16-wide tail; 16 candidates (pool 12 + 4) in chunks of 32 are a tail alone."""
    from freesolo.backends.triton.selection import ScoreTiles, fsl_tail_width

    assert fsl_tail_width(40, 32, True) == 16 and fsl_tail_width(16, 32, True) == 16
    assert fsl_tail_width(72, 32, True) == 16 and fsl_tail_width(72, 64, True) == 16
    assert fsl_tail_width(24, 32, True) == 0 and fsl_tail_width(64, 32, True) == 0 and fsl_tail_width(40, 32, False) == 0
    q, k, _ = random_qkv(31, 1, 420, 2, 1, 16)
    qt, kt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k))
    for pool, recent in ((36, 4), (12, 4)):
        cfg = _cfg("fsl", pool=pool, recent=recent, top_k=3, block=16)
        base = select_cells(qt, kt, cfg, tiles=ScoreTiles(16, 16, 1, early_exit=False))
        tail = select_cells(qt, kt, cfg, tiles=ScoreTiles(16, 32, 1, early_exit=False, fsl_tail=True))
        assert (base[0, 16:] >= 0).all()
        assert torch.equal(tail, base), (pool, recent)


@needs_cuda
def test_cuda_erf_is_one_from_erf_one_on():
    """The premise of ScoreTiles.erf_skip on the device: the compiled tl.math.erf returns exactly
    1.0 for every float32 x in [ERF_ONE, 8) (all 2^21 of them) and for a sweep of larger x."""
    import triton
    import triton.language as tl

    from freesolo.backends.triton.selection import ERF_ONE

    @triton.jit
    def erf_kernel(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N, other=0.0)
        tl.store(Y + offs, tl.math.erf(x), mask=offs < N)

    lo = np.float32(ERF_ONE).view(np.int32)
    hi = np.float32(8.0).view(np.int32)
    dense = np.arange(lo, hi, dtype=np.int32).view(np.float32)
    sweep = np.geomspace(8.0, 3.0e38, 100000).astype(np.float32)
    x = torch.from_numpy(np.concatenate([dense, sweep, [np.float32(np.inf)]])).cuda()
    y = torch.empty_like(x)
    erf_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    bad = (y != 1.0).nonzero()
    assert bad.numel() == 0, f"erf(x) != 1.0 at x = {x[bad[:5, 0]].tolist()} -> {y[bad[:5, 0]].tolist()}"


def test_fewer_candidates_than_k_pad_with_minus_one():
    """Block 1 of a block-8 / cell-4 config has 2 available cells: top_k = 4 lists 2 cells then -1, -1."""
    cfg = _cfg("fs", top_k=4)
    q, k, _ = random_qkv(3, 1, 16, 1, 1, 8)
    idx = _select(q, k, cfg)
    assert (idx[0, :8] == -1).all(), idx[0, :8]
    assert (idx[0, 8:, 0, 2:] == -1).all() and set(idx[0, 8, 0, :2].tolist()) == {0, 1}, idx[0, 8:]


# ---- L12 (and L2): bitwise row independence --------------------------------------------------


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_row_independence_bitwise(variant):
    """A row alone == the row in a batch; a prefix == the same rows of the full sequence; changing
    the other queries, or any token after i, changes no selected cell of query i."""
    cfg = _cfg(variant, top_k=3)
    B, T, Hq, Hkv, D = 2, 56, 2, 1, 8
    q, k, _ = random_qkv(21, B, T, Hq, Hkv, D)
    full = _select(q, k, cfg)
    alone = _select(q[1:2], k[1:2], cfg)
    assert np.array_equal(alone[0], full[1]), "row 1 alone != row 1 in a batch of 2"
    T0 = 37  # mid-block prefix
    prefix = _select(q[:, :T0], k[:, :T0], cfg)
    assert np.array_equal(prefix, full[:, :T0]), "prefix rows != the same rows of the full sequence"
    i = 45  # query in block 5 (its tile holds queries 40..47)
    q2, k2 = q.copy(), k.copy()
    rng = np.random.default_rng(0)
    q2[:, np.arange(T) != i] = rng.standard_normal(q2[:, np.arange(T) != i].shape) * 3  # every other query
    k2[:, i + 1 :] = rng.standard_normal(k2[:, i + 1 :].shape) * 3  # every later key
    changed = _select(q2, k2, cfg)
    assert np.array_equal(changed[:, i], full[:, i]), "query i's cells depend on other queries or later keys"
    assert not np.array_equal(changed, full), "the perturbation must change some other row (else the test is void)"


# ---- errors ----------------------------------------------------------------------------------


def test_errors_name_the_field():
    q = _t(np.zeros((1, 16, 2, 8)))
    k = _t(np.zeros((1, 16, 1, 8)))
    with pytest.raises(ValueError, match="variant"):
        select_cells(q, k, _cfg("fsb", tau=(1.0,)))
    with pytest.raises(ValueError, match="pool"):
        select_cells(q, k, _cfg("fsl", pool=5000))
    with pytest.raises(ValueError, match="Hq"):
        select_cells(_t(np.zeros((1, 16, 3, 8))), _t(np.zeros((1, 16, 2, 8))), _cfg("fs"))
    # a length whose per-head cell statistics pass int32 offsets (expanded views: no memory behind them)
    D, cell = 256, 4
    T = 2**31 // D * cell
    big = torch.zeros(1, 1, 1, D).expand(1, T, 1, D)
    with pytest.raises(ValueError, match="2\\^31"):
        select_cells(big, big, _cfg("fs", cell=cell))
    select_cells(q, k, _cfg("fs"))  # the check is not on for short T


# ---- CUDA: bf16 / fp16 / fp32, D 64 / 128, long T, int64 offsets -----------------------------


def _score_tol(dtype) -> float:
    """fp32 scoring of inputs exactly representable in fp32: the tolerance does not grow with dtype."""
    return 2e-4


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "variant,T,Hq,Hkv,D", [("fsl", 1000, 4, 2, 64), ("fs", 777, 3, 1, 128), ("fsl", 555, 2, 2, 128)], ids=str
)
def test_cuda_selection_matches_oracle(variant, T, Hq, Hkv, D, dtype):
    """CUDA kernels on bf16 / fp16 / fp32 inputs vs the oracle on float64 copies of the rounded inputs."""
    cfg = FreeSoloConfig(variant=variant, window=64, cell=8, block=32, pool=6, recent=2, top_k=4)
    q, k, _ = random_qkv(T, 1, T, Hq, Hkv, D)
    qt, kt = _t(q, dtype, "cuda"), _t(k, dtype, "cuda")
    q64, k64 = qt.double().cpu().numpy(), kt.double().cpu().numpy()
    idx = select_cells(qt, kt, cfg).cpu().numpy()
    ref = oracle.select_cells(q64, k64, cfg)
    differ = assert_selection_matches(idx, ref, q64, k64, cfg, _score_tol(dtype))
    assert differ <= idx.size // 400, f"{differ} rows differ at near-ties: too many"


@needs_cuda
@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_cuda_row_independence_bitwise(variant):
    """L12 on the GPU with default tile sizes: alone vs batch, prefix vs full (bf16)."""
    cfg = FreeSoloConfig(variant=variant)
    q, k, _ = random_qkv(1, 3, 2000, 4, 2, 64)
    qt, kt = _t(q, torch.bfloat16, "cuda"), _t(k, torch.bfloat16, "cuda")
    full = select_cells(qt, kt, cfg)
    assert torch.equal(select_cells(qt[2:3], kt[2:3], cfg)[0], full[2]), "row alone != row in batch"
    assert torch.equal(select_cells(qt[:, :1111], kt[:, :1111], cfg), full[:, :1111]), "prefix != full"


@needs_cuda
def test_cuda_int64_offsets_fsl_at_1m():
    """T * Hq * D = 2^31 + ...: int64 offsets. FS-L, defaults, bf16, T = 2^20 + 33, Hq = Hkv = 16,
    D = 128; sampled rows (first block, last block, around 2^31 / (Hq D)) against float64 torch."""
    torch.manual_seed(0)
    T, H, D = 2**20 + 33, 16, 128
    assert T * H * D > 2**31
    cfg = FreeSoloConfig(variant="fsl")
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    idx = select_cells(q, k, cfg)
    rows = [(0, 5, 0), (0, 200, 3), (0, T - 1, 15), (0, T - 300, 7), (0, 2**20 - 1, 9), (0, 2**20 + 32, 15)]
    assert_rows_select_reference(idx, q, k, cfg, rows, gap=2e-4)


@needs_cuda
@pytest.mark.parametrize("T", [4096, 8192, 32768])
def test_cuda_fsl_direct_candidates_equal_scan(T, monkeypatch):
    """The sorting candidate kernel (`direct`) against the pool scan on the device, default config
    (pool 64, recent 8, block 128): the same set in every block, on bf16 keys with ties in a_c (keys
    v * e_d) and on iid keys; then the same selections through `select_cells`."""
    cfg = FreeSoloConfig(variant="fsl")
    for keys in ("tied", "iid"):
        k = _tied_keys(T, 2, T, 2, 64) if keys == "tied" else random_qkv(T, 2, T, 1, 2, 64)[1]
        kt = _t(k, torch.bfloat16, "cuda")
        _, amax = cell_stats(kt, cfg.cell)
        scan = fsl_candidates(amax, T, cfg, direct=False)
        direct = fsl_candidates(amax, T, cfg, direct=True)
        assert torch.equal(scan.sort(-1).values, direct.sort(-1).values), (keys, T)
    q = _t(random_qkv(T + 1, 2, T, 4, 2, 64)[0], torch.bfloat16, "cuda")
    from freesolo.backends.triton import selection

    monkeypatch.setenv(selection.ENV_FSL_DIRECT_MAX_CELLS, "0")
    base = select_cells(q, kt, cfg)
    monkeypatch.setenv(selection.ENV_FSL_DIRECT_MAX_CELLS, str(selection.DIRECT_CELLS_CAP))
    assert torch.equal(select_cells(q, kt, cfg), base)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_fused_unions_equal_tile_unions(variant):
    """select_cells(..., union_rows) (the scoring kernel also writes each long tile's union) gives
    select_cells' selection and attention.tile_unions' unions on it, every element (unwritten
    output is poisoned): B 2, GQA, a partial last tile, queries with fewer cells than K, a query
    block of one and of two scoring tiles, a sequence of one query block (no older cell)."""
    from freesolo.backends.triton.attention import tile_unions
    from freesolo.backends.triton.selection import ScoreTiles, fuses_unions

    for T, block, tiles in ((37, 16, None), (48, 32, ScoreTiles(16, 16, 1, early_exit=False)), (9, 16, None)):
        cfg = _cfg(variant, block=block, window=32)
        q, k, _ = random_qkv(T, 2, T, 2, 1, 16)
        qt, kt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k))
        assert fuses_unions(cfg, 16, qt.dtype, 16, tiles)
        idx, union, count = select_cells(qt, kt, cfg, tiles=tiles, out_dtype=torch.int32, union_rows=16)
        want = select_cells(qt, kt, cfg, tiles=tiles, out_dtype=torch.int32)
        assert torch.equal(idx, want), (T, block)
        ref = tile_unions(want, 16, use_kernel=False)
        assert torch.equal(union, ref.union) and torch.equal(count, ref.count), (T, block)
        assert (count.sum() > 0) == (T > block)


def test_fused_unions_need_the_union_tiles():
    """union_rows that are not the scoring tiles (or do not divide the query block) is an error naming
    both; FS-B never fuses."""
    from freesolo.backends.triton.selection import ScoreTiles, fuses_unions

    q, k, _ = random_qkv(3, 1, 40, 2, 1, 16)
    qt, kt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k))
    cfg = _cfg("fsl", block=16)
    with pytest.raises(ValueError, match="union_rows=32: the scoring tiles \\(16 queries\\)"):
        select_cells(qt, kt, cfg, union_rows=32)
    assert not fuses_unions(_cfg("fsl", block=24, window=24), 16, qt.dtype, 16, ScoreTiles(16, 16, 1))
    assert not fuses_unions(_cfg("fsb", block=16), 16, qt.dtype, 16)


def test_forward_with_fused_unions_changes_no_bit(monkeypatch):
    """FREESOLO_TRITON_FUSED_UNIONS=1: `forward_with_selection` takes the selection and the unions from
    select_unions (the scoring kernel) on consecutive long tiles, and gives the bits of select + the
    union launch; sorted long tiles keep select (select_unions is not called); 2 is an error."""
    from freesolo.backends.torch._ops import rope_tables
    from freesolo.backends.triton import attention as att
    from freesolo.backends.triton.backend import _select_with_unions

    cfg = _cfg("fsl", block=16, window=16)
    q, k, v = random_qkv(5, 1, 40, 2, 1, 16)
    qt, kt, vt = (torch.as_tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v))
    beta = torch.tensor([1.0, -0.5], device=DEVICE)
    cos, sin = rope_tables(40, 16, cfg.rope_theta, DEVICE, torch.float32)
    tiles = att.AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True, window_first=True)
    calls = []

    def select(q_, k_):
        calls.append("select")
        return select_cells(q_, k_, cfg, out_dtype=torch.int32)

    def select_unions(q_, k_, rows):
        calls.append("fused")
        return _select_with_unions(q_, k_, cfg, rows)

    run = lambda: att.forward_with_selection(qt, kt, vt, select, beta, cos, sin, cfg, tiles, select_unions=select_unions)  # noqa: E731
    monkeypatch.setenv(att.ENV_FUSED_UNIONS, "0")
    ref_idx, ref = run()
    monkeypatch.setenv(att.ENV_FUSED_UNIONS, "1")
    got_idx, got = run()
    assert calls == ["select", "fused"]
    assert torch.equal(got_idx, ref_idx)
    for name, a, b in zip(("o", "lse_loc", "lse_long", "rstd"), got, ref):
        assert torch.equal(a, b), name
    monkeypatch.setattr(att, "SORTED_LONG_MIN_T", 0)
    sorted_tiles = att.AttentionTiles(32, 32, 1, 1, long_block=16, long_into_out=True, window_first=True, sorted_long=True)
    got_idx, got = att.forward_with_selection(qt, kt, vt, select, beta, cos, sin, cfg, sorted_tiles,
                                              select_unions=select_unions)  # fmt: skip
    assert calls[-1] == "select" and torch.equal(got[0], ref[0])
    monkeypatch.setenv(att.ENV_FUSED_UNIONS, "2")
    with pytest.raises(ValueError, match="FREESOLO_TRITON_FUSED_UNIONS=2 must be 0 or 1"):
        run()


@needs_cuda
@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_cuda_fused_unions_change_no_bit(variant, monkeypatch):
    """On the device, default config, bf16, GQA, B 2, T not a multiple of the tile: the fused
    unions equal the union kernel's, and the public API's forward and gradients with
    FREESOLO_TRITON_FUSED_UNIONS=1 are bitwise those with 0 (side stream, graph cache and all)."""
    import freesolo
    from freesolo.backends.triton import attention as att
    from freesolo.backends.triton.attention import tile_unions

    cfg = FreeSoloConfig(variant=variant)
    T = 4096 + 96
    q, k, v = (_t(x, torch.bfloat16, "cuda") for x in random_qkv(T + 7, 2, T, 8, 2, 64))
    idx, union, count = select_cells(q, k, cfg, out_dtype=torch.int32, union_rows=64)
    ref = tile_unions(idx, 64)
    assert torch.equal(union, ref.union) and torch.equal(count, ref.count)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv(att.ENV_FUSED_UNIONS, on)
        for _ in range(3):  # eager, then the graph cache's capture and replay
            with torch.no_grad():
                o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        freesolo.freesolo_attention(qg, kg, vg, cfg, backend="triton").float().square().sum().backward()
        outs[on] = (o, qg.grad, kg.grad, vg.grad)
    for name, a, b in zip(("o", "dq", "dk", "dv"), outs["1"], outs["0"]):
        assert torch.equal(a, b), name
