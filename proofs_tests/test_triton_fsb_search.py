"""The Triton FS-B search (`freesolo.backends.triton.fsb_search`, spec §6.4-§6.5, §7; L12).

- the beams (each forest's found cells, in beam order) equal the torch backend's level-wise search
  on the same tables, and the selection equals the torch backend's float32 selection and the
  float64 oracle's (random inputs, both leaf orders, radius weights 0 / 0.5 / 1, beams 1-5, GQA);
- exact arithmetic (integer keys, no prior, no radius term): keys tie everywhere, and the beams
  and selections still equal the torch search's and the oracle's (the tie rules);
- L12 bitwise: a row alone == the row beside a row of 1e3x norms; a prefix == the same queries of
  the full sequence;
- bad input raises.
On a CPU machine the kernel runs under the interpreter (TRITON_INTERPRET=1) on tiny shapes (a
program per query and head: slow); the CUDA test (paper sizes, bf16 inputs) skips without a GPU.
On CUDA the compiled kernel is unverified (`CUDA_UNVERIFIED`): the cases that failed on the H200
are skipped there unless FREESOLO_TEST_UNVERIFIED_FSB=1 (the next GPU run sets it), and the
refusal of CUDA inputs is tested.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel
pytest.importorskip("triton", reason="triton is not installed: the Triton FS-B search cannot run")

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import select_cells as torch_select  # noqa: E402
from freesolo.backends.torch.fsb import beam_search_forests, block_element_counts, build_row_forests  # noqa: E402
from freesolo.backends.triton.fsb_search import CUDA_UNVERIFIED, MAX_BEAM, trace_search  # noqa: E402
from freesolo.backends.triton.fsb_search import fsb_select_cells as _fsb_select_cells  # noqa: E402
from freesolo.reference.fsb import select_cells_fsb  # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not (CUDA or INTERPRETED),
    reason="no CUDA device and TRITON_INTERPRET is not set: the Triton kernels cannot run here",
)
# On the H200 these cases gave wrong beams (a lost slot, a shared slot) and one read out of
# bounds (which poisons the CUDA context of every later test in the process) before the rewrite:
# on CUDA they run only when asked, and `test_cuda_refused_without_opt_in` checks the refusal.
KNOWN_WRONG_ON_CUDA = pytest.mark.skipif(
    CUDA and os.environ.get("FREESOLO_TEST_UNVERIFIED_FSB", "0") == "0",
    reason="failed on the H200 before the rewrite (set FREESOLO_TEST_UNVERIFIED_FSB=1 to run them): " + CUDA_UNVERIFIED,
)


def fsb_select_cells(*args, **kwargs):
    """The kernel under test (on CUDA only with its explicit opt-in: the tests that run there are
    those that passed on the H200)."""
    return _fsb_select_cells(*args, allow_unverified=True, **kwargs)


def torch_beams(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig) -> torch.Tensor:
    """The torch backend's beams on the same float32 tables: int64 [B, T, Hq, 2 * beam]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    Bq = cfg.block
    nb = -(-T // Bq)
    sigma = torch.as_tensor(cfg.per_head("sigma", Hq), dtype=torch.float32, device=q.device).view(Hkv, G)
    lam = torch.as_tensor(cfg.per_head("lam", Hq), dtype=torch.float32, device=q.device).view(Hkv, G)
    rows = []
    for b in range(B):
        k4 = k[b : b + 1].float().permute(0, 2, 1, 3).contiguous()  # (1, Hkv, T, D)
        q4 = q[b : b + 1].float().permute(0, 2, 1, 3).reshape(1, Hkv, G, T, D)
        q4 = torch.nn.functional.pad(q4, (0, 0, 0, nb * Bq - T)).reshape(1, Hkv, G, nb, Bq, D)
        tables, high_prefix = build_row_forests(k4, cfg, outward=True)
        n = block_element_counts(high_prefix, 0, nb, cfg)
        pos = torch.arange(nb * Bq, dtype=torch.float32, device=q.device).view(nb, Bq)
        found = beam_search_forests(tables, n, q4, torch.linalg.vector_norm(q4, dim=-1), pos, sigma, lam, cfg)
        rows.append(found.reshape(Hq, nb * Bq, -1)[:, :T].permute(1, 0, 2))  # (T, Hq, 2 * beam)
    return torch.stack(rows)


def emulate_trace(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, row: int, i: int, hq: int):
    """Spec §6.4's level-wise beam search of query i, head hq, row `row`, in float64 on the torch
    backend's tables: per forest, a list over levels (top first) of the beam as [(index in level,
    key)], in beam order (key desc, index asc). The reference of `trace_search`."""
    import math

    T, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    h = hq // (Hq // k.shape[2])
    k4 = k[row : row + 1].float().permute(0, 2, 1, 3).contiguous()
    tables, high_prefix = build_row_forests(k4, cfg, outward=True)
    mu, rad, A, e = (getattr(tables, n)[0, h].double().cpu().numpy() for n in ("mu", "rad", "A", "e"))
    base = tables.base.cpu().numpy()
    qv = q[row, i, hq].double().cpu().numpy()
    qn = float(np.linalg.norm(qv))
    sig, lam = cfg.per_head("sigma", Hq)[hq], cfg.per_head("lam", Hq)[hq]
    n_all = (i // cfg.block) * cfg.block // cfg.cell
    counts = [n_all, int(high_prefix[0, h, n_all])]

    def key(f):
        prior = lam * A[f] * math.erf(sig * (i - e[f]) / (2 * cfg.cell))
        return D**-0.5 * (float(mu[f] @ qv) + cfg.radius_weight * qn * rad[f]) + prior

    def offset(th, lvl):
        return (1 << (th + 1)) - (1 << (th - lvl + 1))

    traces = []
    for forest, n in enumerate(counts):
        levels, frontier = [], []  # frontier: (tree base, tree height, tree start, index in level)
        for lvl in range(n.bit_length() - 1, -1, -1):
            cands = [(tb, th, ts, 2 * ix + c) for tb, th, ts, ix in frontier for c in (0, 1)]
            if (n >> lvl) & 1:
                ts = (n >> (lvl + 1)) << (lvl + 1)
                cands.append((int(base[forest, lvl]) + (ts >> lvl) * ((2 << lvl) - 1), lvl, ts, 0))
            scored = [(key(tb + offset(th, lvl) + ix), (ts >> lvl) + ix, (tb, th, ts, ix)) for tb, th, ts, ix in cands]
            scored.sort(key=lambda x: (-x[0], x[1]))
            frontier = [node for _, _, node in scored[: cfg.beam]]
            levels.append([(g, kv) for kv, g, _ in scored[: cfg.beam]])
        traces.append(levels)
    return traces


def assert_trace_matches(q, k, cfg, row, i, hq, **kw):
    """The kernel's level-by-level beams (`trace_search`) == the float64 emulation's: indices
    equal, keys within float32 rounding. Returns the number of levels compared."""
    idx, keys = (x.cpu().numpy() for x in trace_search(q, k, cfg, row, i, hq, **kw))
    compared = 0
    for forest, levels in enumerate(emulate_trace(q, k, cfg, row, i, hq)):
        for t, beam in enumerate(levels):
            got = [(int(g), float(v)) for g, v in zip(idx[forest, t], keys[forest, t]) if g >= 0]
            assert [g for g, _ in got] == [g for g, _ in beam], f"forest {forest} level {t}: {got} vs {beam}"
            np.testing.assert_allclose([v for _, v in got], [v for _, v in beam], rtol=1e-4, atol=1e-4)
            compared += 1
        assert (idx[forest, len(levels) :] == -1).all()
    return compared


def _cfg(k: np.ndarray, **kw) -> FreeSoloConfig:
    """A small FS-B config whose tau splits the cells (about the median max key norm, off every
    cell's own: float32 inputs must not move a cell across tau)."""
    cells = k[:, : k.shape[1] // 4 * 4].reshape(k.shape[0], -1, 4, *k.shape[2:])
    tau = float(np.median(np.linalg.norm(cells, axis=-1).max(axis=2))) + 1e-3
    base = dict(variant="fsb", window=16, cell=4, block=8, beam=3, top_k=3, hash_bits=6, tau=tau)
    return FreeSoloConfig(**{**base, **kw})


def _tensors(*arrays):
    return [torch.tensor(a, dtype=torch.float32, device=DEVICE) for a in arrays]


@pytest.mark.parametrize(
    "seed, T, Hq, Hkv, kw",
    [
        pytest.param(0, 47, 2, 1, dict(beam=3, leaf_order="content", radius_weight=1.0), marks=KNOWN_WRONG_ON_CUDA),
        pytest.param(1, 40, 3, 1, dict(beam=2, leaf_order="position", radius_weight=0.5, top_k=4), marks=KNOWN_WRONG_ON_CUDA),
        pytest.param(2, 41, 4, 2, dict(beam=5, leaf_order="content", radius_weight=0.0, sigma=2.0, lam=0.5),
                     marks=KNOWN_WRONG_ON_CUDA),
        (3, 33, 2, 2, dict(beam=1, leaf_order="content", radius_weight=1.0, top_k=2)),
    ],
)
def test_beams_and_selection_equal_torch_and_oracle(seed, T, Hq, Hkv, kw):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, T, Hq, 8)), rng.standard_normal((1, T, Hkv, 8))
    cfg = _cfg(k, **kw)
    qt, kt = _tensors(q, k)
    idx, found = fsb_select_cells(qt, kt, cfg, return_found=True)
    assert idx.shape == (1, T, Hq, cfg.top_k) and found.shape == (1, T, Hq, 2 * cfg.beam)
    assert (found >= 0).any(), "the beams found nothing: the test would not bite"
    torch.testing.assert_close(found.cpu(), torch_beams(qt.cpu(), kt.cpu(), cfg), rtol=0, atol=0)
    torch.testing.assert_close(idx.cpu(), torch_select(qt.cpu(), kt.cpu(), cfg), rtol=0, atol=0)
    np.testing.assert_array_equal(idx.cpu().numpy(), select_cells_fsb(q, k, cfg))


@pytest.mark.parametrize("leaf_order", ["content", "position"])
def test_exact_ties_follow_the_spec_order(leaf_order):
    """Integer keys in {-1, 0, 1}, queries in {0, 1}, no prior, no radius term: node keys are exact
    in float32 and tie massively; beams and selections equal the torch search's and the oracle's."""
    rng = np.random.default_rng(5)
    T, Hq, Hkv, D = 48, 2, 1, 4
    q = rng.integers(0, 2, (1, T, Hq, D)).astype(np.float64)
    k = rng.integers(-1, 2, (1, T, Hkv, D)).astype(np.float64)
    cfg = _cfg(k, beam=2, lam=0.0, radius_weight=0.0, leaf_order=leaf_order, top_k=2)
    qt, kt = _tensors(q, k)
    idx, found = fsb_select_cells(qt, kt, cfg, return_found=True)
    torch.testing.assert_close(found.cpu(), torch_beams(qt.cpu(), kt.cpu(), cfg), rtol=0, atol=0)
    np.testing.assert_array_equal(idx.cpu().numpy(), select_cells_fsb(q, k, cfg))


@pytest.mark.parametrize("seed, T, i, hq, kw", [(0, 47, 37, 1, dict(beam=3, radius_weight=1.0)), (2, 41, 40, 3, dict(beam=5, lam=0.5))])
def test_trace_follows_the_float64_search(seed, T, i, hq, kw):
    """`trace_search` (the debugging aid): each level's beam of one program equals a float64
    emulation of spec §6.4 on the same tables (the cases that failed on the H200: c0's query 37,
    head 1, and a beam-5 GQA case)."""
    rng = np.random.default_rng(seed)
    Hq, Hkv = (2, 1) if hq < 2 else (4, 2)
    q, k = rng.standard_normal((1, T, Hq, 8)), rng.standard_normal((1, T, Hkv, 8))
    qt, kt = _tensors(q, k)
    assert assert_trace_matches(qt, kt, _cfg(k, **kw), 0, i, hq, allow_unverified=True) >= 4


@KNOWN_WRONG_ON_CUDA
def test_row_independence_bitwise():
    """L12: row 0 beside a row of 1e3x norms == row 0 alone; the first 30 queries == the prefix alone."""
    rng = np.random.default_rng(7)
    T, Hq, Hkv, D = 40, 2, 1, 8
    q, k = rng.standard_normal((2, T, Hq, D)), rng.standard_normal((2, T, Hkv, D))
    q[1] *= 1e3
    k[1] *= 1e3
    cfg = _cfg(k[:1], beam=2)
    qt, kt = _tensors(q, k)
    both, found_both = fsb_select_cells(qt, kt, cfg, return_found=True)
    alone, found_alone = fsb_select_cells(qt[:1], kt[:1], cfg, return_found=True)
    assert torch.equal(both[:1], alone) and torch.equal(found_both[:1], found_alone)
    prefix = fsb_select_cells(qt[:1, :30], kt[:1, :30], cfg)
    assert torch.equal(prefix, alone[:, :30])


def test_refuses_bad_input():
    q, k = torch.zeros(1, 16, 2, 4, device=DEVICE), torch.zeros(1, 16, 1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="runs variant 'fsb'"):
        fsb_select_cells(q, k, FreeSoloConfig(variant="fsl"))
    with pytest.raises(ValueError, match="at most"):
        fsb_select_cells(q, k, FreeSoloConfig(variant="fsb", beam=MAX_BEAM + 1, tau=1.0))
    with pytest.raises(ValueError, match="disagree"):
        fsb_select_cells(q, k[:, :8], FreeSoloConfig(variant="fsb", tau=1.0))
    with pytest.raises(ValueError, match="not a multiple"):
        fsb_select_cells(torch.zeros(1, 16, 3, 4, device=DEVICE), torch.zeros(1, 16, 2, 4, device=DEVICE),
                         FreeSoloConfig(variant="fsb", tau=1.0))  # fmt: skip


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (paper sizes, bf16 inputs: run on the H200)")
def test_cuda_paper_size_equals_torch_search():
    """Default config (cell 32, block 128, beam 16), T = 8192, GQA 4, bf16 inputs: the beams and
    the selection equal the torch backend's (float32 search on the same tables) except at
    near-ties: at most 0.2 % of (query, head) selections differ."""
    torch.manual_seed(0)
    T, Hq, Hkv, D = 8192, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    idx = fsb_select_cells(q, k, cfg)
    ref = torch_select(q, k, cfg)
    differ = (idx != ref).any(-1).float().mean().item()
    assert differ <= 0.002, f"{differ:.4%} of the selections differ from the torch search"
    assert (idx[:, cfg.block :] >= 0).all(), "every query past the first block selects top_k cells"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the refusal is of CUDA inputs")
def test_cuda_refused_without_opt_in(monkeypatch):
    """On CUDA the kernel (known wrong there) raises unless allow_unverified=True, and so does the
    triton backend's fsb under FREESOLO_TRITON_FSB_SEARCH=triton."""
    import freesolo
    from freesolo.backends.triton.backend import FSB_SEARCH_ENV

    q, k = torch.randn(1, 64, 2, 8, device="cuda"), torch.randn(1, 64, 1, 8, device="cuda")
    cfg = FreeSoloConfig(variant="fsb", window=16, cell=4, block=8, beam=2, top_k=2, tau=1.0)
    with pytest.raises(RuntimeError, match="unverified on CUDA"):
        _fsb_select_cells(q, k, cfg)
    monkeypatch.setenv(FSB_SEARCH_ENV, "triton")
    with pytest.raises(RuntimeError, match="unverified on CUDA"):
        freesolo.select_cells(q, k, cfg, backend="triton")


@KNOWN_WRONG_ON_CUDA
def test_backend_switch(monkeypatch):
    """FREESOLO_TRITON_FSB_SEARCH=triton puts the Triton search under the triton backend's fsb: the
    same selection and output bits as the torch search here; a bad value raises."""
    import freesolo
    from freesolo.backends.triton.backend import FSB_SEARCH_ENV

    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 24, 2, 8)), rng.standard_normal((1, 24, 1, 8)), rng.standard_normal((1, 24, 1, 8))
    cfg = _cfg(k, beam=2, window=8, top_k=2)
    qt, kt, vt = _tensors(q, k, v)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(FSB_SEARCH_ENV, mode)
        runs[mode] = (freesolo.select_cells(qt, kt, cfg, backend="triton"), freesolo.freesolo_attention(qt, kt, vt, cfg, backend="triton"))
    assert (runs["torch"][0] >= 0).any()
    assert torch.equal(runs["torch"][0], runs["triton"][0]) and torch.equal(runs["torch"][1], runs["triton"][1])
    monkeypatch.setenv(FSB_SEARCH_ENV, "cuda")
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        freesolo.select_cells(qt, kt, cfg, backend="triton")
