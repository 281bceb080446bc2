"""L12 row independence, bitwise (spec §11): on a given backend and device, the forward output
and the selection of query i in batch row b are a function of row b's tokens <= i alone.

For every backend (numpy oracle, numba, torch CPU float64 / float32, torch CUDA, triton when it
is available) and every variant (fs, fsl, fsb), one Hypothesis example compares, bit for bit
(integer views of the floats, so even a -0.0 / +0.0 or a NaN payload would count):

- row b of a batch of 3 with row b alone (B = 1): the other rows have huge norms (1e3x), many
  ties, or are copies of row b with other later tokens;
- the full length T with a prefix T' < T (T' on either side of a block boundary, so the number
  of blocks, the FS width, the forests and the padded buffers change);
- the full length with the tokens from T' on replaced (huge norms or ties).

Inputs are built to provoke shape- and data-dependent arithmetic: small configs (cells of 4-8
tokens, blocks of 8-16, windows of 16-32, pools of 2-4, 1-2 recent cells) so that pruning bites
and blocks select different unions; quantized values and repeated cells (ties everywhere); rows
whose norms are 1000 times the others. FS-B's tau is calibrated on row b's own keys
(`freesolo.calibrate_tau`), a per-config constant shared by all the calls of an example.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig

try:  # torch is optional for the numpy / numba cases
    import torch
except ImportError:  # pragma: no cover
    torch = None

_AVAILABLE = freesolo.available_backends()
_HAS_CUDA = torch is not None and torch.cuda.is_available()
_NO_CUDA = "no CUDA device: the torch CUDA L12 test runs on the GPU machine"
# The default profile's example count, scaled down for the slow backends (the float64 oracle
# loops over queries in Python; triton on the CPU runs under its interpreter).
_N = settings().max_examples


# ---- strategies ------------------------------------------------------------------------------


@st.composite
def l12_problems(draw, max_t: int = 72):
    """(cfg, Hq, Hkv, D, T, T_prefix, seed, kinds): small configs, T past block 2, a prefix T'
    next to a block boundary (or anywhere), and the kinds of data of the target row, the other
    rows and the replaced later tokens."""
    cell = draw(st.sampled_from([4, 8]))
    block = draw(st.sampled_from([8, 16]))
    window = draw(st.sampled_from([w for w in (16, 24, 32) if w >= block]))
    cfg = FreeSoloConfig(
        variant=draw(st.sampled_from(["fs", "fsl", "fsb"])),
        window=window,
        cell=cell,
        block=block,
        top_k=draw(st.integers(1, 3)),
        pool=draw(st.integers(2, 4)),
        recent=draw(st.integers(1, 2)),
        beam=draw(st.integers(1, 3)),
        sigma=draw(st.sampled_from([0.5, 4.0])),
        lam=draw(st.sampled_from([0.0, 1.0, 3.0])),
        leaf_order=draw(st.sampled_from(["content", "position"])),
        hash_bits=draw(st.sampled_from([3, 16])),
        radius_weight=draw(st.sampled_from([0.0, 1.0])),
    )
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([4, 6, 16]))
    T = draw(st.integers(min(max_t, 2 * block + 1), max_t))
    edges = {t for j in range(1, T // block + 1) for t in (j * block - 1, j * block, j * block + 1)}
    edges = sorted(edges & set(range(1, T)))  # prefixes that end on either side of a block boundary
    T_prefix = draw(st.one_of(st.sampled_from(edges), st.integers(1, T - 1)))
    kinds = {
        "target": draw(st.sampled_from(["normal", "ties"])),
        "others": draw(st.sampled_from(["huge", "ties", "huge_ties", "same_prefix"])),
        "later": draw(st.sampled_from(["huge", "ties", "normal"])),
        "row": draw(st.integers(0, 2)),  # where the target row sits in the batch of 3
    }
    return cfg, Hq, Hkv, D, T, T_prefix, draw(st.integers(0, 2**31 - 1)), kinds


def _rows(rng, kind: str, B: int, T: int, Hq: int, Hkv: int, D: int, cell: int):
    """float64 q [B, T, Hq, D], k / v [B, T, Hkv, D] of one kind of data:
    normal; huge (1e3x the norms); ties (values on a coarse grid, and most cells copies of a few
    cells, so scores, a_c, rho and node keys tie); huge_ties (both)."""
    q = rng.standard_normal((B, T, Hq, D))
    k = rng.standard_normal((B, T, Hkv, D))
    v = rng.standard_normal((B, T, Hkv, D))
    if "ties" in kind:
        q, k, v = (np.round(x * 2) / 2 for x in (q, k, v))
        C = T // cell
        if C > 1:  # repeated cells: cell c takes the tokens of one of the first two cells
            src = rng.integers(0, 2, size=C)
            for c in range(2, C):
                k[:, c * cell : (c + 1) * cell] = k[:, src[c] * cell : (src[c] + 1) * cell]
                v[:, c * cell : (c + 1) * cell] = v[:, src[c] * cell : (src[c] + 1) * cell]
    if "huge" in kind:
        q, k = q * 1e3, k * 1e3
    return q, k, v


# ---- running a backend and comparing bits ----------------------------------------------------


def _convert(x: np.ndarray, target: str):
    """float64 numpy -> the backend's input: "numpy" or "<device>-<torch dtype>"."""
    if target == "numpy":
        return np.ascontiguousarray(x)
    device, dtype = target.split("-")
    return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=getattr(torch, dtype))


def _bits(x) -> np.ndarray:
    """The raw bits of an output (an integer view of the same shape) or an integer selection."""
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.is_floating_point():
            assert bool(torch.isfinite(x.float()).all()), "the backend returned a non-finite output"
            x = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
        return x.numpy()
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
        assert np.isfinite(x).all(), "the backend returned a non-finite output"
        x = x.view({4: np.int32, 8: np.int64}[x.itemsize])
    return x


def _run(backend: str, target: str, q, k, v, cfg: FreeSoloConfig):
    """(output bits [B, T, Hq, D], selection [B, T, Hq, K]) of the backend on float64 inputs."""
    qx, kx, vx = (_convert(x, target) for x in (q, k, v))
    o = freesolo.freesolo_attention(qx, kx, vx, cfg, backend=backend)
    idx = freesolo.select_cells(qx, kx, cfg, backend=backend)
    return _bits(o), _bits(idx)


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    where = np.argwhere(a != b)
    return f"{len(where)} entries differ, first at [b, i, h, d/k] = {where[0].tolist()}" if len(where) else ""


def _assert_same(what: str, got, want, T: int) -> None:
    """got / want: (output bits, selection) restricted to the first T positions."""
    for name, x, y in (("output", got[0], want[0]), ("selection", got[1], want[1])):
        x, y = x[:, :T], y[:, :T]
        assert x.shape == y.shape, f"{what}: {name} shapes {x.shape} vs {y.shape}"
        assert np.array_equal(x, y), f"L12 broken ({what}): {name} bits differ: {_first_difference(x, y)}"


def check_row_independence(backend: str, target: str, problem) -> None:
    """The three comparisons of the module docstring for one example."""
    cfg, Hq, Hkv, D, T, Tp, seed, kinds = problem
    rng = np.random.default_rng(seed)
    s = cfg.cell
    q, k, v = _rows(rng, kinds["target"], 1, T, Hq, Hkv, D, s)  # the target row, [1, T, H, D]
    if cfg.variant == "fsb":
        tau = freesolo.calibrate_tau(k, cfg) if T >= s else (float(np.sqrt(D)),) * Hkv
        cfg = cfg.replace(tau=tuple(float(x) for x in np.atleast_1d(tau)))
    alone = _run(backend, target, q, k, v, cfg)

    # 1. the row in a batch of 3 (at position kinds["row"]) vs alone
    if kinds["others"] == "same_prefix":  # same tokens before Tp, huge ones after
        oq, ok_, ov = (np.repeat(x, 2, axis=0) for x in (q, k, v))
        lq, lk, lv = _rows(rng, "huge", 2, T - Tp, Hq, Hkv, D, s)
        oq[:, Tp:], ok_[:, Tp:], ov[:, Tp:] = lq, lk, lv
    else:
        oq, ok_, ov = _rows(rng, kinds["others"], 2, T, Hq, Hkv, D, s)
    r = kinds["row"]
    batch = [np.concatenate([o[:r], x, o[r:]]) for x, o in ((q, oq), (k, ok_), (v, ov))]
    out_b, idx_b = _run(backend, target, *batch, cfg)
    what = f"row {r} of a batch of 3 vs alone, others {kinds['others']}"
    _assert_same(what, (out_b[r : r + 1], idx_b[r : r + 1]), alone, T)

    # 2. a prefix T' < T vs the full row
    _assert_same(f"prefix T'={Tp} vs T={T}", _run(backend, target, q[:, :Tp], k[:, :Tp], v[:, :Tp], cfg), alone, Tp)

    # 3. the tokens from T' on replaced
    lq, lk, lv = _rows(rng, kinds["later"], 1, T - Tp, Hq, Hkv, D, s)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[:, Tp:], k2[:, Tp:], v2[:, Tp:] = lq, lk, lv
    _assert_same(f"tokens >= {Tp} replaced ({kinds['later']})", _run(backend, target, q2, k2, v2, cfg), alone, Tp)


# ---- the property, per backend ---------------------------------------------------------------


@settings(max_examples=max(3, _N // 3))
@given(l12_problems(max_t=40))
def test_l12_numpy_oracle(problem):
    check_row_independence("numpy", "numpy", problem)


@pytest.mark.skipif("numba" not in _AVAILABLE, reason="numba backend not available on this machine")
@settings(max_examples=max(4, _N // 2))
@given(l12_problems())
def test_l12_numba(problem):
    check_row_independence("numba", "numpy", problem)


def _issue9_example(variant: str, D: int, T: int, Tp: int):
    """A problem of the kind that broke the torch backend before the fix (found by the dev
    profile): one kv head, small D, two rows of 1e3x norms next to a normal row."""
    cfg = FreeSoloConfig(
        variant=variant, window=16, cell=4, block=8, top_k=2, pool=2, recent=1, beam=1, sigma=0.5, lam=0.0
    )
    return cfg, 1, 1, D, T, Tp, 0, {"target": "normal", "others": "huge", "later": "huge", "row": 0}


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@settings(max_examples=max(_N, 20))
@given(problem=l12_problems())
@example(problem=_issue9_example("fs", 4, 22, 7))
@example(problem=_issue9_example("fsb", 6, 41, 17))
@example(problem=_issue9_example("fsl", 6, 41, 16))
def test_l12_torch_cpu(dtype, problem):
    check_row_independence("torch", f"cpu-{dtype}", problem)


@pytest.mark.skipif(not _HAS_CUDA, reason=_NO_CUDA)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@given(problem=l12_problems(max_t=160))
def test_l12_torch_cuda(dtype, problem):
    check_row_independence("torch", f"cuda-{dtype}", problem)


def _triton_targets():
    if "triton" not in _AVAILABLE:
        return [pytest.param(None, marks=pytest.mark.skip(reason="triton backend not available on this machine"))]
    if _HAS_CUDA:
        return ["cuda-float32", "cuda-bfloat16"]
    return ["cpu-float32"]  # TRITON_INTERPRET=1


@pytest.mark.parametrize("target", _triton_targets())
@settings(max_examples=max(4, _N // 3) if _HAS_CUDA else max(2, _N // 4))  # each config compiles kernels
@given(problem=l12_problems(max_t=160 if _HAS_CUDA else 40))
def test_l12_triton(target, problem):
    check_row_independence("triton", target, problem)


# ---- the case of issue 9, fixed (examples a derandomized search might not draw) ---------------


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_l12_torch_batch_of_three_huge_rows(variant, dtype):
    """Issue 9: the torch FS and FS-B outputs of row 0 changed in their last bits when two rows of
    1e3x norms joined it (B = 1 vs B = 3): the union readout was padded to the widest union of
    all rows, so the matmul widths, and with them the rounding, followed the other rows."""
    cfg = FreeSoloConfig(variant=variant, window=16, cell=4, block=8, pool=2, recent=1, beam=2, top_k=2, tau=(2.0, 2.0))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 100, 4, 6))
    k, v = rng.standard_normal((3, 100, 2, 6)), rng.standard_normal((3, 100, 2, 6))
    q[1:] *= 1e3
    k[1:] *= 1e3
    target = f"cpu-{dtype}"
    out_b, idx_b = _run("torch", target, q, k, v, cfg)
    alone = _run("torch", target, q[:1], k[:1], v[:1], cfg)
    _assert_same("row 0 of a batch of 3 vs alone", (out_b[:1], idx_b[:1]), alone, 100)


# ---- the readout's reduction order (issue 9, remaining L12 risk) ------------------------------
# Within a chunk the torch readout reads the long branch from a buffer of cells shared by the
# chunk's queries. Query i's output must not depend on where ITS cells sit in that buffer when
# the buffer's content follows the other queries' selections (later queries of the same block
# included): the matmul's reduction order over the keys would follow them. The random problems
# above use tiny heads; these use the real sizes (D = 64, K*s = 128) where the union layout runs.

_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _HAS_CUDA, reason=_NO_CUDA))]


def _hand_selection(rng, T: int, Hq: int, cfg: FreeSoloConfig, fill: str) -> np.ndarray:
    """int64 [1, T, Hq, K]: per query up to K distinct available cells in random order (not by cell
    id: the selection order is the score's), -1 padded, drawn from a few cells per block and head
    so that a block's union is narrow and follows the draw. fill "few": 1-2 cells per query from
    2-4 cells per block; "wide": K cells from 6-12; "none": no cell."""
    K, s, Bq = cfg.top_k, cfg.cell, cfg.block
    idx = np.full((1, T, Hq, K), -1, np.int64)
    if fill == "none":
        return idx
    for j in range(-(-T // Bq)):
        n = j * Bq // s  # cells available to block j
        if n == 0:
            continue
        for h in range(Hq):
            lo, hi = (2, 4) if fill == "few" else (6, 12)
            fav = rng.choice(n, size=min(n, int(rng.integers(lo, hi + 1))), replace=False)
            for i in range(j * Bq, min(T, (j + 1) * Bq)):
                m = min(len(fav), K if fill == "wide" else int(rng.integers(1, 3)))
                idx[0, i, h, :m] = rng.choice(fav, size=m, replace=False)
    return idx


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("long_path", ["auto", "union", "gather", "wide"])
def test_l12_torch_readout_later_selections(device, dtype, long_path):
    """The torch readout (the backend's internal `attention` with a given selection) called with
    two selections that agree for queries <= i and differ after i (other widths and cell orders
    of the chunk's cell buffer), later tokens changed too: no bit of o[:i+1] may change."""
    from freesolo.backends.torch.backend import attention as torch_attention

    cfg = FreeSoloConfig(variant="fs")  # w 512, s 32, K 4, Bq 128: the long branch reads unions
    T, Hq, Hkv, D = 1024, 2, 2, 64
    rng = np.random.default_rng(9)
    dt = getattr(torch, dtype)
    q, k, v = _rows(rng, "normal", 1, T, Hq, Hkv, D, cfg.cell)
    idx = _hand_selection(rng, T, Hq, cfg, "few")
    want = None
    for cut, fill in ((300, "wide"), (700, "few"), (767, "wide"), (1000, "none")):
        idx2 = idx.copy()
        idx2[:, cut + 1 :] = _hand_selection(rng, T, Hq, cfg, fill)[:, cut + 1 :]
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        q2[:, cut + 1 :], k2[:, cut + 1 :], v2[:, cut + 1 :] = _rows(rng, "huge", 1, T - cut - 1, Hq, Hkv, D, 1)
        outs = []
        for xs, ix in (((q, k, v), idx), ((q2, k2, v2), idx2)):
            qx, kx, vx = (torch.from_numpy(x).to(device=device, dtype=dt) for x in xs)
            o = torch_attention(qx, kx, vx, cfg, idx=torch.from_numpy(ix).to(device), long_path=long_path)
            outs.append(_bits(o))
        if want is None:
            want = outs[0]
        assert np.array_equal(outs[0], want), "the same inputs gave other bits (not reproducible)"
        got = outs[1][:, : cut + 1]
        assert np.array_equal(got, want[:, : cut + 1]), (
            f"L12 broken: selections / tokens after {cut} changed o[:{cut + 1}]: {_first_difference(got, want[:, : cut + 1])}"
        )


_CUDA_MARK = pytest.mark.skipif(not _HAS_CUDA, reason=_NO_CUDA)
_TARGETS = [("cpu", "float64"), ("cpu", "float32")] + [
    pytest.param("cuda", t, marks=_CUDA_MARK) for t in ("float64", "float32", "bfloat16")
]


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize(("device", "dtype"), _TARGETS)
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_l12_torch_later_tokens_change_later_selections(device, dtype, variant):
    """End to end at the real sizes (default config, D = 64): later queries random again and later
    keys of 1e3x norms, so the later queries of query i's own block select other cells (and the
    later blocks the huge ones); outputs and selections of queries <= i keep every bit."""
    cfg = FreeSoloConfig(variant=variant, pool=8, recent=4)  # P + W < the available cells: pruning bites
    T, Hq, Hkv, D = 1536, 2, 1, 64
    rng = np.random.default_rng(12)
    q, k, v = _rows(rng, "normal", 1, T, Hq, Hkv, D, cfg.cell)
    if variant == "fsb":
        cfg = cfg.replace(tau=tuple(float(x) for x in np.atleast_1d(freesolo.calibrate_tau(k, cfg))))
    target = f"{device}-{dtype}"
    want = _run("torch", target, q, k, v, cfg)
    for cut in (700, 1300):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        lq, lk, lv = _rows(rng, "huge", 1, T - cut - 1, Hq, Hkv, D, cfg.cell)
        q2[:, cut + 1 :], k2[:, cut + 1 :], v2[:, cut + 1 :] = lq / 1e3, lk, lv
        got = _run("torch", target, q2, k2, v2, cfg)
        assert not np.array_equal(got[1][:, cut + 128 :], want[1][:, cut + 128 :]), "later selections unchanged"
        _assert_same(f"tokens after {cut} replaced", got, want, cut + 1)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("mode", ["auto", "wide", "gather"])
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_l12_torch_readout_modes_chunks_of_blocks(variant, mode, monkeypatch):
    """Every readout mode picked by FREESOLO_TORCH_READOUT, in chunks of 4 blocks as on CUDA (the
    CPU default is one block: shared slices over several blocks, FS-L's candidate buffers per
    block and the gathers of a multi-block chunk are read only here): later tokens replaced
    (so the later queries of i's block and chunk select other cells) leave o[:i+1] and the
    selection of i bitwise unchanged, and a row in a batch of two keeps the bits it has alone."""
    from freesolo.backends.torch.attention import READOUT_ENV
    from freesolo.backends.torch.backend import attention as torch_attention
    from freesolo.backends.torch.backend import select_cells as torch_select

    monkeypatch.setenv(READOUT_ENV, mode)
    cfg = FreeSoloConfig(variant=variant, pool=8, recent=4)  # P + W = 12 cells: 3 blocks of cells
    T, Hq, Hkv, D, ct = 1536, 2, 1, 64, 512
    rng = np.random.default_rng(21)
    q, k, v = _rows(rng, "normal", 1, T, Hq, Hkv, D, cfg.cell)
    if variant == "fsb":
        cfg = cfg.replace(tau=tuple(float(x) for x in np.atleast_1d(freesolo.calibrate_tau(k, cfg))))

    def run(*xs):
        qx, kx, vx = (torch.from_numpy(x).float() for x in xs)
        o = torch_attention(qx, kx, vx, cfg, chunk_tokens=ct)
        return _bits(o), _bits(torch_select(qx, kx, cfg, chunk_tokens=ct))

    want = run(q, k, v)
    for cut in (300, 700, 1300):  # in the first chunk (shared slices), the second, the third
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        lq, lk, lv = _rows(rng, "huge", 1, T - cut - 1, Hq, Hkv, D, cfg.cell)
        q2[:, cut + 1 :], k2[:, cut + 1 :], v2[:, cut + 1 :] = lq / 1e3, lk, lv
        got = run(q2, k2, v2)
        assert not np.array_equal(got[1][:, cut + 1 :], want[1][:, cut + 1 :]), "later selections unchanged"
        _assert_same(f"{mode}: tokens after {cut} replaced", got, want, cut + 1)
    oq, ok_, ov = _rows(rng, "huge", 1, T, Hq, Hkv, D, cfg.cell)
    batch = run(*(np.concatenate([x, o]) for x, o in ((q, oq), (k, ok_), (v, ov))))
    _assert_same(f"{mode}: row 0 of a batch of 2", (batch[0][:1], batch[1][:1]), want, T)
