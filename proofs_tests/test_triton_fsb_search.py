"""The Triton FS-B search (`freesolo.backends.triton.fsb_search`, spec §6.4-§6.5, §7; L12).

- the beams (each forest's found cells, in beam order) equal the torch backend's level-wise search
  on the same tables, and the selection equals the torch backend's float32 selection and the
  float64 oracle's (random inputs, both leaf orders, radius weights 0 / 0.5 / 1, beams 1-5, GQA);
- exact arithmetic (integer keys, no prior, no radius term): keys tie everywhere, and the beams
  and selections still equal the torch search's and the oracle's (the tie rules);
- L12 bitwise: a row alone == the row beside a row of 1e3x norms; a prefix == the same queries of
  the full sequence;
- bad input raises.
- L9: the kernel's beams hold min(beam, n >> l) nodes per level, so the keys it scores are the
  reference's data-independent count;
- decode: the Triton decode search (`decode_select_cells`) == the torch search's decode, bitwise;
- the float64 emulation (`fsb_audit`): the kernel's per-level trace follows it; its margins are 0
  at exact ties and wide on random keys; on CUDA at paper sizes, every selection that differs
  from the torch search sits at a float32 near-tie (a margin within float32 rounding).
On a CPU machine the kernel runs under the interpreter (TRITON_INTERPRET=1) on tiny shapes (a
program per query and head: slow); the CUDA tests (paper sizes, bf16 inputs) skip without a GPU.
The small cases are those on which the kernel's first form failed on the H200 (session 19).
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
from freesolo.backends.triton.fsb_audit import emulate_search, near_tie_audit  # noqa: E402
from freesolo.backends.triton.fsb_search import MAX_BEAM, fsb_select_cells, trace_search  # noqa: E402
from freesolo.reference.fsb import select_cells_fsb  # noqa: E402

from .helpers import triton_kernel_tests  # noqa: E402

CUDA, INTERPRETED, DEVICE, pytestmark = triton_kernel_tests()


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
    """Per forest, per level (top first): the float64 emulation's beam [(index in level, key)]
    (`fsb_audit.emulate_search`), the reference of `trace_search`."""
    return [[level["beam"] for level in levels] for levels in emulate_search(q, k, cfg, row, i, hq)]


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
    "seed, T, Hq, Hkv, dim_chunk, kw",
    [
        (0, 47, 2, 1, 4, dict(beam=3, leaf_order="content", radius_weight=1.0)),
        (1, 40, 3, 1, None, dict(beam=2, leaf_order="position", radius_weight=0.5, top_k=4)),
        (2, 41, 4, 2, 2, dict(beam=5, leaf_order="content", radius_weight=0.0, sigma=2.0, lam=0.5)),
        (3, 33, 2, 2, 8, dict(beam=1, leaf_order="content", radius_weight=1.0, top_k=2)),
    ],
)
def test_beams_and_selection_equal_torch_and_oracle(monkeypatch, seed, T, Hq, Hkv, dim_chunk, kw):
    """dim_chunk: the search's node rows (D 8) in steps of 4 / 2 dims (`_node_keys`' per-lane sums)
    or all at once (8, None)."""
    from freesolo.backends.triton import fsb_search

    monkeypatch.setattr(fsb_search, "SEARCH_DIM_CHUNK", dim_chunk)
    assert fsb_search.search_dim_chunk(8) == (dim_chunk or 8)
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
    assert assert_trace_matches(qt, kt, _cfg(k, **kw), 0, i, hq) >= 4


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


def test_audit_margins_zero_at_ties_wide_elsewhere():
    """`near_tie_audit`: integer keys tie exactly (margin 0 at some level); random keys leave wide
    margins at random entries (so a difference there would be flagged as a defect, not a tie), and
    its float64 selection there is the oracle's."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 2, (1, 48, 2, 4)).astype(np.float64)
    k = rng.integers(-1, 2, (1, 48, 1, 4)).astype(np.float64)
    cfg = _cfg(k, beam=2, lam=0.0, radius_weight=0.0, top_k=2)
    qt, kt = (torch.tensor(x, dtype=torch.float32) for x in (q, k))
    tied = near_tie_audit(qt, kt, cfg, [(0, i, h) for i in range(40, 48) for h in range(2)])
    assert min(r["margin"] for r in tied) == 0.0
    q, k = rng.standard_normal((1, 300, 2, 8)), rng.standard_normal((1, 300, 1, 8))
    cfg = _cfg(k, beam=2, top_k=2)
    qt, kt = (torch.tensor(x, dtype=torch.float32) for x in (q, k))
    entries = [(0, i, h) for i in (250, 271, 299) for h in range(2)]
    wide = near_tie_audit(qt, kt, cfg, entries)
    margins = [r["margin"] for r in wide]
    assert all(np.isfinite(m) for m in margins), "every audited entry must pass a real beam boundary"
    assert np.median(margins) > 1e-3, margins
    oracle = select_cells_fsb(q, k, cfg)  # the emulation's float64 selection is the oracle's
    assert [r["selection"] for r in wide] == [oracle[0, i, h].tolist() for _, i, h in entries]


CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (paper sizes, bf16 inputs: run on the H200)")


@CUDA_ONLY
def test_cuda_paper_size_equals_torch_search_but_near_ties():
    """Default config (cell 32, block 128, beam 16), T = 16384, GQA 4, bf16 inputs: the selection
    equals the torch backend's (float32 search on the same tables) except at float32 near-ties:
    every differing (query, head) has a float64 margin (`near_tie_audit`) below 1e-3."""
    torch.manual_seed(0)
    T, Hq, Hkv, D = 16384, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    idx = fsb_select_cells(q, k, cfg)
    ref = torch_select(q, k, cfg)
    assert (idx[:, cfg.block :] >= 0).all(), "every query past the first block selects top_k cells"
    differ = (idx != ref).any(-1)  # (1, T, Hq)
    assert differ.float().mean().item() <= 0.002, f"{differ.float().mean().item():.4%} of the selections differ"
    entries = [tuple(int(x) for x in e) for e in differ.nonzero()[:64].tolist()]
    audit = near_tie_audit(q, k, cfg, entries)
    wide = [r for r in audit if r["margin"] > 1e-3]
    assert not wide, f"selections differ from the torch search at entries with wide float64 margins: {wide[:4]}"


def _row_beside_loud_row(seed: int, T: int, Hq: int, Hkv: int, **kw):
    """Two rows of random q / k (D 8), the second at 1e3x norms, and a config fit to the first:
    (q, k, cfg, qt, kt) as float64 arrays and float32 tensors on DEVICE."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, T, Hq, 8)), rng.standard_normal((2, T, Hkv, 8))
    q[1] *= 1e3
    k[1] *= 1e3
    cfg = _cfg(k[:1], **kw)
    return (q, k, cfg, *_tensors(q, k))


def _assert_first_row_exact(q, k, cfg, qt, kt):
    """Row 0 alone: beams == the torch search's, selection == the torch search's and the float64
    oracle's; L12 bitwise: row 0 beside the loud row == row 0 alone. Returns row 0's (idx, found)."""
    idx, found = fsb_select_cells(qt[:1], kt[:1], cfg, return_found=True)
    torch.testing.assert_close(found.cpu(), torch_beams(qt[:1].cpu(), kt[:1].cpu(), cfg), rtol=0, atol=0)
    torch.testing.assert_close(idx.cpu(), torch_select(qt[:1].cpu(), kt[:1].cpu(), cfg), rtol=0, atol=0)
    np.testing.assert_array_equal(idx.cpu().numpy(), select_cells_fsb(q[:1], k[:1], cfg))
    both, found_both = fsb_select_cells(qt, kt, cfg, return_found=True)
    assert torch.equal(both[:1], idx) and torch.equal(found_both[:1], found)
    return idx, found


@pytest.mark.parametrize(
    "seed, T, Hq, Hkv, rows, cells, kw",
    [
        (0, 47, 2, 1, 8, 2, dict(beam=3, top_k=3)),  # 6 tiles of 8 queries, the last partial; 2 cells a step
        (2, 41, 4, 2, 16, 4, dict(beam=5, top_k=4, sigma=2.0, lam=0.5)),  # GQA, top_k 4, 4 cells a step
    ],
)
def test_tile_rerank_equals_torch_and_oracle(monkeypatch, seed, T, Hq, Hkv, rows, cells, kw):
    """FREESOLO_TRITON_FSB_RERANK=tile (`_fsb_rerank_tile_kernel`: a tile of queries scores the union
    of its found cells, a query keeps its own): the selection equals the torch search's and the
    float64 oracle's; the beams are those of the per-query rerank path; L12 bitwise (a row beside a
    row of 1e3x norms == the row alone). Cells of 4 keys (padded to the dot's 16 columns)."""
    from freesolo.backends.triton import fsb_search

    monkeypatch.setenv(fsb_search.RERANK_ENV, "tile")
    monkeypatch.setattr(fsb_search, "RERANK_TILE_ROWS", rows)
    monkeypatch.setattr(fsb_search, "RERANK_TILE_CELLS", cells)
    q, k, cfg, qt, kt = _row_beside_loud_row(seed, T, Hq, Hkv, **kw)
    idx, _ = _assert_first_row_exact(q, k, cfg, qt, kt)
    assert (idx >= 0).sum() > 3 * T, "too few selections: the rerank would not bite"


def test_search_dim_chunk_setting(monkeypatch):
    """search_dim_chunk: SEARCH_DIM_CHUNK capped at the padded head dim; unset: the whole of it."""
    from freesolo.backends.triton import fsb_search

    assert fsb_search.search_dim_chunk(64) == fsb_search.SEARCH_DIM_CHUNK == 16
    assert fsb_search.search_dim_chunk(8) == 8
    monkeypatch.setattr(fsb_search, "SEARCH_DIM_CHUNK", None)
    assert fsb_search.search_dim_chunk(128) == 128


@CUDA_ONLY
def test_cuda_dim_chunks_differ_at_near_ties_only(monkeypatch):
    """Paper config, T = 16384, GQA 4, bf16: the search reading node rows 16 dims at a time (the
    default: per-lane sums) equals the one reading all of D at once (sums across lanes) except at
    float32 near-ties (float64 margin below 1e-3)."""
    from freesolo.backends.triton import fsb_search

    torch.manual_seed(2)
    T, Hq, Hkv, D = 16384, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    monkeypatch.setattr(fsb_search, "SEARCH_DIM_CHUNK", None)
    ref, ref_found = fsb_select_cells(q, k, cfg, return_found=True)
    monkeypatch.setattr(fsb_search, "SEARCH_DIM_CHUNK", 16)
    idx, found = fsb_select_cells(q, k, cfg, return_found=True)
    assert (idx[:, cfg.block :] >= 0).all(), "every query past the first block selects top_k cells"
    # the beams as sets: their order (key desc) is not part of the selection (the rerank sorts by rho), and
    # two kept nodes of nearly equal keys may swap places without any near-tie at the kept / dropped boundary
    # that `near_tie_audit` measures (s41 call4: one such swap at (0, 14351, 6), margin 1.2e-3)
    differ = (idx != ref).any(-1) | (found.sort(-1).values != ref_found.sort(-1).values).any(-1)
    assert differ.float().mean().item() <= 0.002, f"{differ.float().mean().item():.4%} of the beams or selections differ"
    entries = [tuple(int(x) for x in e) for e in differ.nonzero()[:64].tolist()]
    wide = [r for r in near_tie_audit(q, k, cfg, entries) if r["margin"] > 1e-3]
    assert not wide, f"the chunked search differs at entries with wide float64 margins: {wide[:4]}"


def test_rerank_mode_refuses_unknown(monkeypatch):
    from freesolo.backends.triton import fsb_search

    monkeypatch.setenv(fsb_search.RERANK_ENV, "tiles")
    with pytest.raises(ValueError, match="must be 'tile' or 'query'"):
        fsb_search.rerank_mode()
    monkeypatch.delenv(fsb_search.RERANK_ENV)
    assert fsb_search.rerank_mode() == fsb_search.RERANK_DEFAULT


@CUDA_ONLY
def test_cuda_tile_rerank_differs_at_near_ties_only(monkeypatch):
    """Paper config, T = 16384, GQA 4, bf16: the tile rerank's selection equals the per-query
    rerank's except at float32 near-ties (float64 margin below 1e-3 at every differing entry)."""
    from freesolo.backends.triton import fsb_search

    torch.manual_seed(1)
    T, Hq, Hkv, D = 16384, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    monkeypatch.setenv(fsb_search.RERANK_ENV, "query")
    ref = fsb_select_cells(q, k, cfg)
    monkeypatch.setenv(fsb_search.RERANK_ENV, "tile")
    idx = fsb_select_cells(q, k, cfg)
    assert (idx[:, cfg.block :] >= 0).all(), "every query past the first block selects top_k cells"
    differ = (idx != ref).any(-1)
    assert differ.float().mean().item() <= 0.002, f"{differ.float().mean().item():.4%} of the selections differ"
    entries = [tuple(int(x) for x in e) for e in differ.nonzero()[:64].tolist()]
    wide = [r for r in near_tie_audit(q, k, cfg, entries) if r["margin"] > 1e-3]
    assert not wide, f"the tile rerank differs at entries with wide float64 margins: {wide[:4]}"


def test_default_search_by_device(monkeypatch):
    """The triton backend's FS-B search: the Triton kernel on CUDA, the torch search on the CPU,
    FREESOLO_TRITON_FSB_SEARCH overriding either."""
    from freesolo.backends.triton.backend import FSB_SEARCH_ENV, fsb_search_mode

    monkeypatch.delenv(FSB_SEARCH_ENV, raising=False)
    assert fsb_search_mode(torch.device("cuda")) == "triton"
    assert fsb_search_mode(torch.device("cpu")) == "torch"
    monkeypatch.setenv(FSB_SEARCH_ENV, "torch")
    assert fsb_search_mode(torch.device("cuda")) == "torch"


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


@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 2)])
def test_decode_search_equals_torch_search(Hq, Hkv):
    """FS-B decode (spec §9) with the fused Triton step (decode_kernel="triton": the search and
    rerank of `decode_select_cells`, then the fused window + readout kernel) against the torch
    step, from a chunked prefill through several block boundaries (forests growing, high-norm
    counts differing between rows): before every step inside a block the Triton search's cells
    == the torch search's (`_search`) on the same state, exactly; outputs within float32
    rounding (the window and the readout sum in another order); a float64 state is refused."""
    from freesolo import FreeSoloCache
    from freesolo.backends.triton.fsb_search import decode_select_cells

    rng = np.random.default_rng(11)
    B, D, T0 = 2, 8, 30
    T = 44  # block boundaries at 32 and 40 (the interpreter's search costs ~1 s a step)
    G = Hq // Hkv
    q, k, v = (rng.standard_normal((B, T, h, D)) for h in (Hq, Hkv, Hkv))
    k[1] *= 1.5  # the rows' high-norm forests grow at different rates
    cfg = _cfg(k, beam=3, top_k=2, window=8)
    qt, kt, vt = _tensors(q, k, v)
    outs, searched = {}, 0
    for kernel in ("torch", "triton"):
        cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", dtype=torch.float32, device=DEVICE, decode_kernel=kernel)
        state = cache._state
        assert state._fused == (kernel == "triton")
        steps = [cache.extend(qt[:, :T0], kt[:, :T0], vt[:, :T0])]
        for i in range(T0, T):
            if kernel == "triton" and i % cfg.block:  # inside a block: the forests are the step's
                qg = qt[:, i].reshape(B, Hkv, G, D)
                n_avail = (i // cfg.block) * cfg.block // cfg.cell
                expected = state._search(qg, state.pos.view(1), n_avail).view(B, Hkv, G, cfg.top_k)
                assert torch.equal(decode_select_cells(state, qg), expected), f"step {i}"
                searched += int((expected >= 0).sum())
            steps.append(cache.extend(qt[:, i : i + 1], kt[:, i : i + 1], vt[:, i : i + 1]))
        outs[kernel] = torch.cat(steps, dim=1)
    assert searched > 0, "no cell was selected: the comparison would not bite"
    assert torch.isfinite(outs["torch"]).all()
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fused decode runs float32"):
        FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", dtype=torch.float64, device=DEVICE, decode_kernel="triton")
    with pytest.raises(ValueError, match=r"must be \[B="):
        decode_select_cells(cache.state, torch.zeros(B, Hkv, D, device=DEVICE))


@pytest.mark.parametrize("seed, i, hq", [(0, 46, 1), (4, 39, 0)])
def test_L9_node_keys_of_the_kernel(seed, i, hq):
    """L9 for the Triton search: its trace holds min(beam, n >> l) nodes at level l of a forest over
    n elements, so the keys it scores below the top level, sum_l (2 |beam at l + 1| + bit_l(n)),
    are the data-independent fsb_node_keys_count(n, beam) (the reference's counted cost)."""
    from freesolo.reference.fsb import fsb_node_keys_count

    rng = np.random.default_rng(seed)
    T, Hq, Hkv, D = 47, 2, 1, 8
    q, k = rng.standard_normal((1, T, Hq, D)), rng.standard_normal((1, T, Hkv, D))
    cfg = _cfg(k, beam=2)
    qt, kt = _tensors(q, k)
    idx, keys = (x.cpu().numpy() for x in trace_search(qt, kt, cfg, 0, i, hq))
    n_all = (i // cfg.block) * cfg.block // cfg.cell
    _, high_prefix = build_row_forests(kt.cpu().permute(0, 2, 1, 3).contiguous(), cfg, outward=True)
    counts = [n_all, int(high_prefix[0, hq // (Hq // Hkv), n_all])]
    assert counts[0] > 2 * cfg.beam and counts[1] > cfg.beam, counts  # the beam prunes: the test bites
    for forest, n in enumerate(counts):
        top = n.bit_length() - 1
        sizes = [int((idx[forest, t] >= 0).sum()) for t in range(top + 1)]  # level top - t
        assert sizes == [min(cfg.beam, n >> (top - t)) for t in range(top + 1)]
        assert (idx[forest, top + 1 :] == -1).all()
        scored = sum(2 * sizes[t - 1] + (n >> (top - t) & 1) for t in range(1, top + 1))
        assert scored == fsb_node_keys_count(n, cfg.beam)


_AOT_SEARCH = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freesolo.backends.triton import fsb_search as fs

def compile_sm90(kernel, pointers, constants, floats=("scale", "radius_weight", "two_cell")):
    names = kernel.arg_names
    if names.index("D") not in kernel.constexprs:  # D a runtime int: its value is not compiled in
        constants = {k: v for k, v in constants.items() if k != "D"}
    signature = {n: pointers.get(n) or ("constexpr" if n in constants else "fp32" if n in floats else "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "maxnreg": 72})

table = {"mu_ptr": "*fp32", "rad_ptr": "*fp32", "a_ptr": "*fp32", "e_ptr": "*i64", "cell_ptr": "*i64"}
prefill = {"q_ptr": "*fp32", "k_ptr": "*bf16", **table, "base_ptr": "*i64", "hp_ptr": "*i64", "sigma_ptr": "*fp32",
           "lam_ptr": "*fp32", "out_ptr": "*i64", "found_ptr": "*i32", "trace_idx_ptr": "*i64", "trace_key_ptr": "*fp32"}
decode = {"q_ptr": "*bf16", "pos_ptr": "*i64", "n_high_ptr": "*i64", "sigma_ptr": "*fp32", "lam_ptr": "*fp32",
          "found_ptr": "*i64"}
for forest in ("a", "h"):
    decode.update({f"{name[:-4]}_{forest}_ptr": kind for name, kind in table.items()}, **{f"base_{forest}_ptr": "*i64"})
for D, block_d in ((64, 64), (48, 64)):
    for ones in ({}, {"G": 1}):  # Triton makes an int argument equal to 1 a constexpr (MHA: G = 1)
        base = dict(D=D, BLOCK_D=block_d, CELL=32, QBLOCK=128, W=16, WP=16, **ones)
        for trace in (False, True):
            compile_sm90(fs._fsb_search_kernel, prefill, dict(base, DC=16, K=4, KP=4, FOUND=True, TRACE=trace,
                                                              TRACE_LEVELS=fs.TRACE_LEVELS, RERANK=not trace))
        compile_sm90(fs._fsb_decode_search_kernel, decode, dict(base, **({"Hkv": 1} if ones else {})))
print("compiled")
"""


def test_search_kernels_compile_for_sm90():
    """The prefill and decode search kernels compile ahead of time for sm_90 (Triton's own ptxas, no
    TRITON_INTERPRET) as they launch: D equal to BLOCK_D or below it (compiled in where the kernel
    takes it as a constexpr), MHA's G = 1 (and Hkv = 1) specialized, traced and not, the launch's
    register cap. The interpreter accepts code the compiler may refuse (s41 call3)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _AOT_SEARCH], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
