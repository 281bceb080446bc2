"""L11, packed sequences (spec §11, §12): `cu_seqlens` in freesolo_attention, select_cells and
calibrate_tau.

- the packed call == each sequence run alone, bit for bit (outputs and selections; L12 makes the
  bitwise promise), every variant, on numpy, numba, torch (CPU float64 / float32, CUDA skipped
  without a GPU) and triton (interpreted on the CPU, CUDA on a GPU);
- gradients (torch float64): packed backward == per-sequence backward (q, k, v and beta);
- select_cells returns cell indices local to each sequence;
- calibrate_tau over packed sequences is the median of a_c over every complete cell of every
  sequence (cells never straddle a boundary);
- every rule of cu_seqlens broken on purpose -> ValueError naming the rule.

Lengths come from the spec's awkward set {1, 31, 33, 129, 700} and small random ones, packed in
random orders, with one sequence's norms sometimes scaled up 1000x, so a sequence that leaked
into its neighbour's pool, top-K or forest would show. The 700-token sequence runs on numba and
torch only (the oracle loops over queries in Python).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import freesolo
from freesolo import FreeSoloConfig

from .helpers import assert_close

AWKWARD = (1, 31, 33, 129)
LONG = 700
VARIANTS = ("fs", "fsl", "fsb")


def _examples(n: int) -> int:
    """n examples under the ci profile (12 by default), proportionally more under dev."""
    return max(2, settings.default.max_examples * n // 12)


# ---- strategies ------------------------------------------------------------------------------


@st.composite
def packings(draw, lengths=AWKWARD, small_max: int = 12, max_seqs: int = 4, long: bool = False):
    """Sequence lengths in a random order: the spec's awkward lengths (700 at most once, if
    `long`), small random ones, or lengths next to a cell / block boundary of the config."""
    pool = st.one_of(st.sampled_from(lengths), st.integers(1, small_max))
    seqs = draw(st.lists(pool, min_size=1, max_size=max_seqs))
    if long and draw(st.booleans()):
        seqs.append(LONG)
    return tuple(draw(st.permutations(seqs)))


@st.composite
def packed_problems(draw, variant: str, lengths=AWKWARD, small_max: int = 12, max_seqs: int = 4, long=False):
    """(lengths, cfg, Hq, Hkv, D, seed, loud): a small config whose pruning bites (cells of 2-4
    tokens, blocks of 1-3 cells), GQA heads, and the index of a sequence scaled 1000x (or -1)."""
    seqs = draw(packings(lengths, small_max, max_seqs, long))
    cell = draw(st.sampled_from([2, 4]))
    block = cell * draw(st.integers(1, 3))
    cfg = FreeSoloConfig(
        variant=variant,
        window=block + draw(st.integers(0, 8)),
        cell=cell,
        block=block,
        top_k=draw(st.integers(1, 4)),
        pool=draw(st.integers(1, 3)),
        recent=draw(st.integers(1, 2)),
        beam=draw(st.integers(1, 3)),
        hash_bits=draw(st.sampled_from([3, 16])),
        leaf_order=draw(st.sampled_from(["content", "position"])),
        sigma=draw(st.sampled_from([0.5, 4.0])),
        lam=draw(st.sampled_from([0.0, 1.0])),
    )
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([2, 4]))
    loud = draw(st.integers(-1, len(seqs) - 1))
    return seqs, cfg, Hq, Hkv, D, draw(st.integers(0, 2**31 - 1)), loud


# ---- inputs and the per-sequence reference -----------------------------------------------------


def packed_inputs(seqs, Hq: int, Hkv: int, D: int, seed: int, loud: int = -1):
    """float64 q [1, T, Hq, D], k / v [1, T, Hkv, D] (T = sum(seqs)) and cu_seqlens int64 [N+1];
    sequence `loud` (if >= 0) has its q and k scaled by 1000."""
    cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int64)
    T = int(cu[-1])
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, T, Hq, D))
    k = rng.standard_normal((1, T, Hkv, D))
    v = rng.standard_normal((1, T, Hkv, D))
    if loud >= 0:
        q[:, cu[loud] : cu[loud + 1]] *= 1000.0
        k[:, cu[loud] : cu[loud + 1]] *= 1000.0
    return q, k, v, cu


def _fsb_tau(cfg: FreeSoloConfig, k, cu) -> FreeSoloConfig:
    """FS-B's tau from cfg as usual: calibrated over the packed sequences (1.0 if no cell exists)."""
    if cfg.variant != "fsb":
        return cfg
    try:
        tau = freesolo.calibrate_tau(k, cfg, cu_seqlens=cu)
    except ValueError:  # no sequence holds a complete cell
        tau = np.ones(k.shape[2])
    return cfg.replace(tau=tuple(float(t) for t in tau))


def _fresh(x):
    """A fresh copy (the user's own array for a sequence run alone)."""
    return x.clone() if isinstance(x, torch.Tensor) else np.array(x, copy=True)


def each_alone(fn, cu, *xs):
    """fn run on fresh copies of each sequence [1, L_n, ...] alone, concatenated along T."""
    outs = [fn(*(_fresh(x[:, a:b]) for x in xs)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat(outs, dim=1) if isinstance(outs[0], torch.Tensor) else np.concatenate(outs, axis=1)


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().float().numpy() if x.dtype == torch.bfloat16 else x.detach().cpu().numpy()


def assert_bitwise(actual, expected, name: str) -> None:
    """Exact equality (NaN anywhere fails), reporting the first differing element."""
    a, e = _numpy(actual) if isinstance(actual, torch.Tensor) else actual, expected
    e = _numpy(e) if isinstance(e, torch.Tensor) else e
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    if a.dtype.kind == "f":
        assert np.isfinite(a).all(), f"{name}: non-finite values"
    same = a == e
    if not same.all():
        where = tuple(int(i) for i in np.argwhere(~same)[0])
        raise AssertionError(
            f"{name}: {int((~same).sum())} / {a.size} elements differ from the sequences run alone; "
            f"first at {where}: packed {a[where]!r}, alone {e[where]!r}"
        )


def check_packed_equals_alone(problem, backend: str, to_array) -> None:
    """L11 for one problem: forward output and selection, packed vs each sequence alone, bitwise.

    `to_array` turns a float64 numpy array into the backend's input (numpy or a torch tensor)."""
    seqs, cfg, Hq, Hkv, D, seed, loud = problem
    q, k, v, cu = packed_inputs(seqs, Hq, Hkv, D, seed, loud)
    cfg = _fsb_tau(cfg, k, cu)
    q, k, v = to_array(q), to_array(k), to_array(v)
    cu_arg = torch.as_tensor(cu, device=q.device) if isinstance(q, torch.Tensor) else cu

    o = freesolo.freesolo_attention(q, k, v, cfg, backend=backend, cu_seqlens=cu_arg)
    o_alone = each_alone(lambda q_, k_, v_: freesolo.freesolo_attention(q_, k_, v_, cfg, backend=backend), cu, q, k, v)
    assert_bitwise(o, o_alone, f"{backend} {cfg.variant} output, lengths {seqs}")

    idx = freesolo.select_cells(q, k, cfg, backend=backend, cu_seqlens=cu_arg)
    idx_alone = each_alone(lambda q_, k_: freesolo.select_cells(q_, k_, cfg, backend=backend), cu, q, k)
    assert_bitwise(idx, idx_alone, f"{backend} {cfg.variant} selection, lengths {seqs}")
    check_local_cells(_numpy(idx) if isinstance(idx, torch.Tensor) else idx, cu, cfg)


def check_local_cells(idx: np.ndarray, cu: np.ndarray, cfg: FreeSoloConfig) -> None:
    """select_cells with cu_seqlens: indices are cells of the query's own sequence, counted from
    its first token, and available to it: -1 <= c < n_j = (i_local // Bq) * Bq / s."""
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        local = np.arange(b - a)
        n_j = (local // cfg.block) * cfg.block // cfg.cell  # [L]
        part = idx[0, a:b]  # [L, Hq, K]
        assert (part >= -1).all() and (part < n_j[:, None, None]).all(), (
            f"sequence [{a}, {b}): a cell index is not local to the sequence or not available"
        )


def _cpu(dtype):
    return lambda x: torch.tensor(x, dtype=dtype)


def _cuda(dtype):
    return lambda x: torch.tensor(x, dtype=dtype, device="cuda")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (runs on the H200)")

# A problem with the 700-token sequence among the spec's lengths, run on every fast backend.
LONG_EXAMPLE = ((31, LONG, 1, 33), FreeSoloConfig(window=16, cell=4, block=8, top_k=3, pool=3, recent=2, beam=2))


def _long_example(variant: str):
    seqs, cfg = LONG_EXAMPLE
    return (seqs, cfg.replace(variant=variant), 2, 1, 4, 7, 3)


# ---- L11: forward and selection, bitwise --------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(4))
@given(data=st.data())
def test_packed_equals_alone_numpy_oracle(variant, data):
    problem = data.draw(packed_problems(variant, lengths=AWKWARD, max_seqs=3))
    check_packed_equals_alone(problem, "numpy", np.asarray)


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(4))
@given(data=st.data())
def test_packed_equals_alone_numba(variant, data):
    problem = data.draw(packed_problems(variant, long=True))
    check_packed_equals_alone(problem, "numba", np.asarray)


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_equals_alone_long_sequence(variant):
    """The 700-token sequence between the spec's other lengths, numba and torch (float64, float32)."""
    problem = _long_example(variant)
    check_packed_equals_alone(problem, "numba", np.asarray)
    check_packed_equals_alone(problem, "torch", _cpu(torch.float64))
    check_packed_equals_alone(problem, "torch", _cpu(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(3))
@given(data=st.data())
def test_packed_equals_alone_torch_cpu(variant, dtype, data):
    problem = data.draw(packed_problems(variant))
    check_packed_equals_alone(problem, "torch", _cpu(dtype))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(6))
@given(data=st.data())
def test_packed_equals_alone_torch_cuda(variant, dtype, data):
    problem = data.draw(packed_problems(variant, long=True))
    check_packed_equals_alone(problem, "torch", _cuda(dtype))


@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_equals_alone_long_sequence_cuda(variant):
    check_packed_equals_alone(_long_example(variant), "torch", _cuda(torch.float32))


def _triton_ready() -> str:
    """'' when the triton backend can run here, else why not (the test is skipped with it)."""
    if "triton" not in freesolo.available_backends():
        return "triton backend unavailable (no CUDA device and TRITON_INTERPRET unset, or no triton)"
    try:
        for module in ("attention", "selection"):
            importlib.import_module(f"freesolo.backends.triton.{module}")
    except ImportError as error:
        return f"triton kernels not importable yet: {error}"
    return ""


TRITON_SKIP = _triton_ready()


@pytest.mark.skipif(bool(TRITON_SKIP), reason=TRITON_SKIP or "ready")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_packed_equals_alone_triton_cuda runs instead")
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_equals_alone_triton_interpreted(variant):
    """Triton's CPU interpreter (float32) is slow: one fixed short packing per variant, with a
    one-token sequence, then a loud one past block 2 and off the block grid."""
    cfg = FreeSoloConfig(variant=variant, window=8, cell=2, block=4, top_k=2, pool=2, recent=1, beam=2)
    check_packed_equals_alone(((1, 11), cfg, 2, 1, 4, 11, 1), "triton", _cpu(torch.float32))


@pytest.mark.skipif(bool(TRITON_SKIP), reason=TRITON_SKIP or "ready")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the CUDA tests cover the 16-bit split default")
def test_packed_equals_alone_triton_interpreted_sorted_long_tiles(monkeypatch):
    """The split long kernel with its tiles sorted by selection (the 16-bit GPU default from
    SORTED_LONG_MIN_T, forced here on CPU float32 at any length): each sequence of the packed
    batch still equals itself alone, bitwise."""
    from freesolo.backends.triton import attention as att

    monkeypatch.setenv(att.ENV_LONG_BLOCK, "16")
    monkeypatch.setattr(att, "SORTED_LONG_MIN_T", 0)
    assert att.default_tiles(4, torch.float32, torch.device("cpu")).sorted_long
    cfg = FreeSoloConfig(variant="fsl", window=8, cell=2, block=4, top_k=2, pool=2, recent=1)
    check_packed_equals_alone(((1, 11), cfg, 2, 1, 4, 11, 1), "triton", _cpu(torch.float32))


@pytest.mark.skipif(bool(TRITON_SKIP), reason=TRITON_SKIP or "ready")
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(6))
@given(data=st.data())
def test_packed_equals_alone_triton_cuda(variant, data):
    check_packed_equals_alone(data.draw(packed_problems(variant, long=True)), "triton", _cuda(torch.float32))


def test_packing_changes_the_result():
    """The packed call is not the unpacked call: without cu_seqlens the second sequence's queries
    see the first sequence (window, cells, RoPE positions); with it they do not. (So a
    cu_seqlens that was ignored fails the tests above only through this one.)"""
    q, k, v, cu = packed_inputs((33, 40), 2, 1, 4, seed=3)
    cfg = FreeSoloConfig(variant="fsl", window=16, cell=4, block=8, top_k=2, pool=2, recent=1)
    packed = freesolo.freesolo_attention(q, k, v, cfg, backend="numpy", cu_seqlens=cu)
    whole = freesolo.freesolo_attention(q, k, v, cfg, backend="numpy")
    assert np.array_equal(packed[:, :33], whole[:, :33]), "the first sequence sees nothing else either way"
    assert not np.allclose(packed[:, 33:], whole[:, 33:]), "cu_seqlens changed nothing in the second sequence"
    assert np.array_equal(freesolo.freesolo_attention(q, k, v, cfg, backend="numpy", cu_seqlens=[0, 73]), whole)


# ---- L11: gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=_examples(3))
@given(data=st.data())
def test_packed_gradients_equal_alone(variant, data):
    """torch float64: d(sum(o * g))/d(q, k, v, beta) packed == each sequence's own backward
    (beta's gradient is the sum over sequences)."""
    seqs, cfg, Hq, Hkv, D, seed, loud = data.draw(packed_problems(variant, max_seqs=3))
    q, k, v, cu = packed_inputs(seqs, Hq, Hkv, D, seed, loud)
    cfg = _fsb_tau(cfg, k, cu)
    rng = np.random.default_rng(seed + 1)
    g = torch.tensor(rng.standard_normal(q.shape))
    beta0 = torch.tensor(rng.uniform(0.5, 1.5, Hq))

    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)] + [beta0.clone().requires_grad_()]
    o = freesolo.freesolo_attention(*leaves[:3], cfg, beta=leaves[3], backend="torch", cu_seqlens=cu)
    (o * g).sum().backward()
    packed = [x.grad for x in leaves]

    alone = [torch.full_like(x.grad, float("nan")) for x in leaves[:3]] + [torch.zeros(Hq, dtype=torch.float64)]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        parts = [torch.tensor(x[:, a:b], requires_grad=True) for x in (q, k, v)] + [beta0.clone().requires_grad_()]
        o_n = freesolo.freesolo_attention(*parts[:3], cfg, beta=parts[3], backend="torch")
        (o_n * g[:, a:b]).sum().backward()
        for x, part in zip(alone[:3], parts[:3]):
            x[:, a:b] = part.grad
        alone[3] += parts[3].grad
    for name, p, e in zip(("dq", "dk", "dv", "dbeta"), packed, alone):
        assert_close(p.numpy(), e.numpy(), rtol=1e-12, name=f"{variant} {name}, lengths {seqs}")


# ---- calibrate_tau over packed sequences --------------------------------------------------------


@settings(max_examples=_examples(6))
@given(seqs=packings(small_max=12, max_seqs=5), cell=st.sampled_from([2, 4, 32]), seed=st.integers(0, 2**31 - 1))
def test_calibrate_tau_packed_is_median_over_sequences(seqs, cell, seed):
    """tau[g] = median of a_c = max_{t in c} ||k_t|| over every complete cell of every sequence,
    written here from spec §3 (cells restart at each sequence's first token)."""
    cfg = FreeSoloConfig(cell=cell, block=cell, window=cell)
    q, k, v, cu = packed_inputs(seqs, 2, 2, 4, seed)
    norms = [[] for _ in range(2)]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for c in range((b - a) // cell):
            keys = k[0, a + c * cell : a + (c + 1) * cell]  # [cell, Hkv, D]
            for g in range(2):
                norms[g].append(np.sqrt((keys[:, g] ** 2).sum(-1)).max())
    if not norms[0]:
        with pytest.raises(ValueError, match="complete cell"):
            freesolo.calibrate_tau(k, cfg, cu_seqlens=cu)
        return
    tau = freesolo.calibrate_tau(k, cfg, cu_seqlens=cu)
    assert_close(tau, np.array([np.median(n) for n in norms]), rtol=1e-13, name=f"tau, lengths {seqs}")
    torch_tau = freesolo.calibrate_tau(torch.tensor(k, dtype=torch.float32), cfg, cu_seqlens=torch.tensor(cu))
    assert_close(torch_tau, tau, rtol=1e-6, name="tau from float32 torch keys")


def test_calibrate_tau_cells_do_not_straddle_boundaries():
    """lengths (3, 5), cell 4: the packed sequences hold one cell (tokens 3..6); unpacked, the
    cell [0, 4) would hold token 2, whose key is huge."""
    cfg = FreeSoloConfig(cell=4, block=4, window=4)
    k = np.ones((1, 8, 1, 2))
    k[0, 2] = 100.0
    assert freesolo.calibrate_tau(k, cfg)[0] > 70.0  # unpacked: median of (141.4, 1.41) = their mean
    assert freesolo.calibrate_tau(k, cfg, cu_seqlens=[0, 3, 8])[0] == pytest.approx(np.sqrt(2.0), rel=1e-15)
    with pytest.raises(ValueError, match="complete cell"):
        freesolo.calibrate_tau(k, cfg, cu_seqlens=[0, 3, 6, 8])  # lengths 3, 3, 2: no cell anywhere


# ---- bad cu_seqlens -----------------------------------------------------------------------------

T_BAD = 12
BAD = [
    ([1, 5, T_BAD], r"start at 0.*cu_seqlens\[0\]=1"),
    ([0, 7, 5, T_BAD], r"strictly increasing.*cu_seqlens\[1\]=7, cu_seqlens\[2\]=5"),
    ([0, 5, 5, T_BAD], r"strictly increasing.*sequence 1 has length 0"),
    ([0, 5, T_BAD - 1], rf"last entry must be T={T_BAD}.*={T_BAD - 1}"),
    ([0, 5, T_BAD + 3], rf"last entry must be T={T_BAD}.*={T_BAD + 3}"),
    ([0], r"at least 2 entries"),
    (np.array([0.0, 5.0, T_BAD]), r"dtype must be an integer.*float64"),
    ([0, 5.0, T_BAD], r"dtype must be integer: entry 1 is 5.0"),
    ([0, True, T_BAD], r"dtype must be integer: entry 1 is True"),
    (np.array([0, 1, T_BAD]) > 0, r"dtype must be an integer.*bool"),
    (torch.tensor([0.0, 5.0, T_BAD]), r"dtype must be an integer.*torch.float32"),
    (np.array([[0, 5, T_BAD]]), r"rank must be 1.*\(1, 3\)"),
    (torch.tensor([[0, 5, T_BAD]]), r"rank must be 1.*\(1, 3\)"),
    ([[0, 5], [T_BAD]], r"rank must be 1"),
    (torch.tensor([0, 5, T_BAD], device="meta"), r"device must be the inputs' device.*meta.*cpu"),
    ("0,5,12", r"must be an integer vector.*str"),
]


@pytest.mark.parametrize("fn", ["freesolo_attention", "select_cells", "calibrate_tau"])
@pytest.mark.parametrize("bad, rule", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_cu_seqlens_raise_naming_the_rule(fn, bad, rule):
    q, k, v, _ = packed_inputs((T_BAD,), 2, 1, 4, seed=0)
    q, k, v = (torch.tensor(x) for x in (q, k, v)) if isinstance(bad, torch.Tensor) else (q, k, v)
    call = {
        "freesolo_attention": lambda cu: freesolo.freesolo_attention(q, k, v, backend="numpy", cu_seqlens=cu),
        "select_cells": lambda cu: freesolo.select_cells(q, k, backend="numpy", cu_seqlens=cu),
        "calibrate_tau": lambda cu: freesolo.calibrate_tau(k, FreeSoloConfig(cell=4, block=4, window=4), cu_seqlens=cu),
    }[fn]
    with pytest.raises(ValueError, match=rule):
        call(bad)


@pytest.mark.parametrize("fn", ["freesolo_attention", "select_cells", "calibrate_tau"])
def test_cu_seqlens_needs_a_single_batch_row(fn):
    q, k, v, _ = packed_inputs((6,), 2, 1, 4, seed=0)
    q, k, v = (np.concatenate([x, x]) for x in (q, k, v))  # B = 2
    cfg = FreeSoloConfig(cell=2, block=2, window=2)
    call = {
        "freesolo_attention": lambda: freesolo.freesolo_attention(q, k, v, cfg, backend="numpy", cu_seqlens=[0, 2, 6]),
        "select_cells": lambda: freesolo.select_cells(q, k, cfg, backend="numpy", cu_seqlens=[0, 2, 6]),
        "calibrate_tau": lambda: freesolo.calibrate_tau(k, cfg, cu_seqlens=[0, 2, 6]),
    }[fn]
    with pytest.raises(ValueError, match=r"B = 1.*B=2"):
        call()


@needs_cuda
def test_cu_seqlens_on_another_device_raises():
    q, k, v, cu = packed_inputs((5, 7), 2, 1, 4, seed=0)
    with pytest.raises(ValueError, match=r"device must be the inputs' device.*cuda.*cpu"):
        cu_cuda = torch.tensor(cu, device="cuda")
        freesolo.select_cells(torch.tensor(q), torch.tensor(k), backend="torch", cu_seqlens=cu_cuda)


@pytest.mark.parametrize(
    "cu",
    [
        [0, 5, 12],
        (0, 5, 12),
        np.array([0, 5, 12], np.int32),
        np.array([0, 5, 12]),
        torch.tensor([0, 5, 12], dtype=torch.int32),
        torch.tensor([0, 5, 12]),
        [np.int64(0), np.int32(5), 12],
    ],
    ids=["list", "tuple", "np-int32", "np-int64", "torch-int32", "torch-int64", "numpy-scalars"],
)
def test_accepted_cu_seqlens_forms(cu):
    """Lists / tuples of ints, numpy and torch int32 / int64 vectors all mean the same packing."""
    q, k, v, _ = packed_inputs((5, 7), 2, 1, 4, seed=1)
    cfg = FreeSoloConfig(variant="fs", window=4, cell=2, block=4)
    ref = freesolo.freesolo_attention(q, k, v, cfg, backend="numpy", cu_seqlens=[0, 5, 12])
    assert_bitwise(freesolo.freesolo_attention(q, k, v, cfg, backend="numpy", cu_seqlens=cu), ref, "output")
