"""The `triton` backend through the public API (spec §12, §13; lemmas L2, L8, L12).

On a CPU machine the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py when no CUDA device exists) on float32 tensors; on the H200 the same tests run on
CUDA, plus bf16 / fp16. The kernels' own tests (selection, readout, backward) live in
test_triton_selection.py, test_triton_attention.py and test_triton_backward.py; this file checks
the integrated backend: dispatch, the custom ops (fake + autograd), torch.compile, errors.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed")

import freesolo  # noqa: E402
from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.registry import BackendUnavailableError  # noqa: E402
from freesolo.reference import oracle  # noqa: E402

from .helpers import SMALL, assert_close, assert_selection_matches, off_grid_tau, random_qkv, record_jit_runs  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    "triton" not in freesolo.available_backends(),
    reason="triton backend unavailable here: " + "; ".join(freesolo.backends.registry._why_not("triton", None, None)),
)

# (variant, B, T, Hq, Hkv, D): awkward lengths, GQA groups 1, 2, 3, several blocks so pruning bites.
CASES = [
    ("fsl", 1, 1, 2, 1, 8),
    ("fsl", 2, 61, 3, 1, 16),
    ("fs", 1, 77, 4, 2, 8),
    ("fsb", 1, 70, 2, 2, 8),
    ("fsl", 1, 130, 2, 2, 32),
]


def _cfg(variant: str, k: np.ndarray) -> FreeSoloConfig:
    cfg = FreeSoloConfig(variant=variant, top_k=2, **SMALL)
    if variant == "fsb":
        cfg = cfg.replace(tau=off_grid_tau(k, cfg) if k.shape[1] >= cfg.cell else (0.0,) * k.shape[2])
    return cfg


def _oracle_output(q, k, v, idx, cfg, beta):
    """float64 output of spec §7 for a given selection idx [B, T, Hq, K]."""
    o_loc = oracle.local_attention(q, k, v, cfg)
    o_long = oracle.long_range_readout(q, k, v, idx, cfg)
    return oracle.combine(o_loc, o_long, beta, cfg.eps)


def _tensors(q, k, v, dtype=torch.float32, grad=False):
    return [torch.tensor(x, dtype=dtype, device=DEVICE).requires_grad_(grad) for x in (q, k, v)]


@pytest.mark.parametrize("variant,B,T,Hq,Hkv,D", CASES, ids=lambda x: str(x))
def test_forward_matches_oracle(variant, B, T, Hq, Hkv, D):
    q, k, v = random_qkv(11 + T, B, T, Hq, Hkv, D)
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v))  # exactly representable in fp32
    cfg = _cfg(variant, k)
    beta = np.linspace(0.5, 1.5, Hq)
    qt, kt, vt = _tensors(q, k, v)
    idx = freesolo.select_cells(qt, kt, cfg, backend="triton").cpu().numpy()
    assert idx.dtype == np.int64 and idx.shape == (B, T, Hq, cfg.top_k)
    if variant == "fsb":
        from freesolo.reference.fsb import select_cells_fsb

        from .test_torch_backend import rho_scores

        assert_selection_matches(idx, select_cells_fsb(q, k, cfg), q, k, cfg, tol=2e-5, score_fn=rho_scores)
    else:
        assert_selection_matches(idx, oracle.select_cells(q, k, cfg), q, k, cfg, tol=2e-5)
    o = freesolo.freesolo_attention(qt, kt, vt, cfg, beta=torch.tensor(beta, dtype=torch.float32, device=DEVICE), backend="triton")
    assert o.dtype == torch.float32 and o.device.type == DEVICE and tuple(o.shape) == (B, T, Hq, D)
    assert_close(o.cpu().numpy(), _oracle_output(q, k, v, idx, cfg, beta), rtol=1e-5)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_row_independence_bitwise(variant):
    """L12: a row's output and selection are the same bits alone, in a batch, and with later tokens changed."""
    B, T, Hq, Hkv, D = 3, 70, 2, 1, 8
    q, k, v = random_qkv(5, B, T, Hq, Hkv, D)
    cfg = _cfg(variant, k)
    qt, kt, vt = _tensors(q, k, v)
    full = freesolo.freesolo_attention(qt, kt, vt, cfg, backend="triton")
    alone = freesolo.freesolo_attention(qt[1:2], kt[1:2], vt[1:2], cfg, backend="triton")
    assert torch.equal(full[1:2], alone)
    cut = 37
    q2, k2, v2 = (x.clone() for x in (qt, kt, vt))
    for x in (q2, k2, v2):
        x[:, cut:] = 1e3 * torch.randn_like(x[:, cut:])
    changed = freesolo.freesolo_attention(q2, k2, v2, cfg, backend="triton")
    assert torch.equal(full[:, :cut], changed[:, :cut])
    sel = freesolo.select_cells(qt, kt, cfg, backend="triton")
    sel2 = freesolo.select_cells(q2, k2, cfg, backend="triton")
    assert torch.equal(sel[:, :cut], sel2[:, :cut])


def test_gradients_match_torch_backend_same_selection():
    """Gradients of the custom op (registered autograd) equal the torch backend's on the same selection."""
    from freesolo.backends.torch import attention as torch_attention

    B, T, Hq, Hkv, D = 1, 45, 4, 2, 8
    q, k, v = random_qkv(3, B, T, Hq, Hkv, D)
    cfg = _cfg("fsl", k)
    beta0 = torch.tensor([0.5, 1.0, 1.5, 2.0], device=DEVICE)
    qt, kt, vt = _tensors(q, k, v, grad=True)
    bt = beta0.clone().requires_grad_(True)
    o = freesolo.freesolo_attention(qt, kt, vt, cfg, beta=bt, backend="triton")
    g = torch.randn_like(o)
    o.backward(g)
    idx = freesolo.select_cells(qt.detach(), kt.detach(), cfg, backend="triton")
    q2, k2, v2 = _tensors(q, k, v, grad=True)
    b2 = beta0.clone().requires_grad_(True)
    o2 = torch_attention(q2, k2, v2, cfg, b2, idx=idx)
    o2.backward(g)
    assert_close(o.detach().cpu().numpy(), o2.detach().cpu().numpy(), 1e-5, "o")
    for name, a, b in (("dq", qt, q2), ("dk", kt, k2), ("dv", vt, v2), ("dbeta", bt, b2)):
        assert_close(a.grad.cpu().numpy(), b.grad.cpu().numpy(), 1e-5, name)


def test_deterministic_backward_is_reproducible():
    from freesolo.backends.triton.backend import deterministic

    B, T, Hq, Hkv, D = 1, 50, 2, 1, 8
    q, k, v = random_qkv(8, B, T, Hq, Hkv, D)
    cfg = _cfg("fsl", k)
    grads = []
    with deterministic(True):
        for _ in range(2):
            qt, kt, vt = _tensors(q, k, v, grad=True)
            freesolo.freesolo_attention(qt, kt, vt, cfg, backend="triton").square().sum().backward()
            grads.append([x.grad.clone() for x in (qt, kt, vt)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) of a function calling the public API: one opaque op, no graph break."""
    B, T, Hq, Hkv, D = 1, 40, 2, 1, 8
    q, k, v = random_qkv(2, B, T, Hq, Hkv, D)
    cfg = _cfg("fsl", k)

    def f(q, k, v):
        return freesolo.freesolo_attention(q * 1.0, k, v, cfg, backend="triton").sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    qt, kt, vt = _tensors(q, k, v, grad=True)
    out = compiled(qt, kt, vt)
    out.sum().backward()
    q2, k2, v2 = _tensors(q, k, v, grad=True)
    ref = f(q2, k2, v2)
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert_close(qt.grad.cpu().numpy(), q2.grad.cpu().numpy(), 1e-6, "dq")


@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_eager_path_equals_operator_path(variant):
    """Eager calls skip the custom-op dispatch (`_EagerAttention`, the same bodies): output and
    every gradient (q, k, v, beta) equal those of `torch.ops.freesolo.triton_forward` bit for bit."""
    from freesolo.backends.triton.backend import config_to_json

    B, T, Hq, Hkv, D = 1, 70, 2, 1, 8
    q, k, v = random_qkv(5, B, T, Hq, Hkv, D)
    cfg = _cfg(variant, k)
    results = []
    for path in ("operator", "eager"):
        qt, kt, vt = _tensors(q, k, v, grad=True)
        beta = torch.full((Hq,), 0.7, device=DEVICE, requires_grad=True)
        if path == "operator":
            o = torch.ops.freesolo.triton_forward(qt, kt, vt, beta, config_to_json(cfg))[0]
        else:
            o = freesolo.freesolo_attention(qt, kt, vt, cfg, beta=beta, backend="triton")
        (o * torch.linspace(-1, 1, D, device=DEVICE)).sum().backward()
        results.append([o.detach(), qt.grad, kt.grad, vt.grad, beta.grad])
    for name, a, b in zip(("o", "dq", "dk", "dv", "dbeta"), *results):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), f"{name}: eager path differs from the operator path"


def test_host_size_helpers_equal_triton():
    """`_common.next_pow2` / `cdiv` (plain Python: triton 3.6's are constexpr functions, slow on the
    host) give exactly triton.next_power_of_2 / triton.cdiv on every size a launcher uses."""
    import triton

    from freesolo.backends.triton._common import cdiv, next_pow2

    for n in range(0, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for n in (2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**40 + 3):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 32, 64, 100):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_backward_without_beta_grad_gives_the_same_gradients(variant):
    """A beta that needs no gradient skips dbeta's reduction (`need_dbeta=False`); dq, dk, dv are
    the same bits as with a beta that needs one, and beta.grad stays None."""
    B, T, Hq, Hkv, D = 1, 45, 4, 2, 8
    q, k, v = random_qkv(6, B, T, Hq, Hkv, D)
    cfg = _cfg(variant, k)
    do = torch.tensor(np.random.default_rng(7).standard_normal((B, T, Hq, D)), dtype=torch.float32, device=DEVICE)
    grads = {}
    for beta_grad in (True, False):
        qt, kt, vt = _tensors(q, k, v, grad=True)
        beta = torch.linspace(0.5, 1.5, Hq, device=DEVICE).requires_grad_(beta_grad)
        freesolo.freesolo_attention(qt, kt, vt, cfg, beta=beta, backend="triton").backward(do)
        grads[beta_grad] = (qt.grad, kt.grad, vt.grad, beta.grad)
    assert grads[True][3] is not None and torch.isfinite(grads[True][3]).all()
    assert grads[False][3] is None
    for name, x, y in zip(("dq", "dk", "dv"), grads[True][:3], grads[False][:3]):
        assert torch.equal(x, y), f"{name} depends on whether beta needs a gradient"


def test_opcheck_forward():
    """torch.library.opcheck: schema, fake tensor and autograd registration are consistent."""
    from freesolo.backends.triton.backend import config_to_json

    B, T, Hq, Hkv, D = 1, 20, 2, 1, 8
    q, k, v = random_qkv(4, B, T, Hq, Hkv, D)
    cfg = _cfg("fsl", k)
    qt, kt, vt = _tensors(q, k, v, grad=True)
    beta = torch.ones(Hq, device=DEVICE)
    torch.library.opcheck(
        torch.ops.freesolo.triton_forward.default,
        (qt, kt, vt, beta, config_to_json(cfg)),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: host syncs and CUDA-graph capture exist only there")
@pytest.mark.parametrize("window_first", [False, True])
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_training_step_has_no_host_sync_and_captures_in_a_cuda_graph(variant, window_first, monkeypatch):
    """With check_finite=False a triton forward + backward never synchronizes with the host
    (set_sync_debug_mode("error") around a whole step), so a training step can be captured in a
    CUDA graph: a replay gives the eager output and gradients bit for bit (deterministic backward).
    window_first (the default; FREESOLO_TRITON_WINDOW_FIRST=0 turns it off): the selection on a side stream, forked from and
    joined to the capturing stream."""
    from freesolo.backends.triton import attention as att

    monkeypatch.setenv(att.ENV_WINDOW_FIRST, str(int(window_first)))
    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, Hq, Hkv, D = 1, 4096, 4, 2, 64

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = randn(B, T, Hq, D).requires_grad_(), randn(B, T, Hkv, D).requires_grad_(), randn(B, T, Hkv, D).requires_grad_()
    grad = randn(B, T, Hq, D)

    def step():
        for x in (q, k, v):
            x.grad = None
        o = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        o.backward(grad)
        return o

    ref_o = step().detach().clone()
    ref_grads = [x.grad.clone() for x in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step()
    with torch.no_grad():  # a replay must write them again (same inputs, same kernels)
        o_static.zero_()
        for x in (q, k, v):
            x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_static, ref_o), "CUDA-graph replay: output differs from the eager call"
    for name, x, ref in zip("qkv", (q, k, v), ref_grads):
        assert torch.equal(x.grad, ref), f"CUDA-graph replay: d{name} differs from the eager call"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: Inductor's CUDA-graph trees exist only there")
def test_cuda_reduce_overhead_compile_runs_cuda_graphs_and_equals_eager():
    """torch.compile(mode="reduce-overhead", fullgraph=True) of a function that calls the triton
    backend (the short-T fast path the README gives) runs under Inductor's CUDA-graph trees (no
    cudagraph skip: the operators allocate, sync and stream as a capture allows) and its replays
    give the eager output and gradients bit for bit (the same kernels; deterministic backward)."""
    from torch._dynamo.utils import counters

    cfg = FreeSoloConfig(variant="fsl")
    gen = torch.Generator(device="cuda").manual_seed(9)
    B, T, Hq, Hkv, D = 1, 4096 + 17, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    do = torch.randn_like(q)

    def body(q_, k_, v_):
        return freesolo.freesolo_attention(q_, k_, v_, cfg, backend="triton", check_finite=False)

    def step(fn):
        qs, ks, vs = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = fn(qs, ks, vs)
        o.backward(do)
        return o.detach().clone(), qs.grad.clone(), ks.grad.clone(), vs.grad.clone()

    want = step(body)
    skips = counters["inductor"].get("cudagraph_skips", 0)
    compiled = torch.compile(body, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for call in range(3):  # warm-up, recording, replay
        got = step(compiled)
        torch.cuda.synchronize()
        for name, x, y in zip(("o", "dq", "dk", "dv"), want, got):
            assert torch.equal(x, y), f"reduce-overhead call {call}: {name} differs from the eager call"
    assert counters["inductor"].get("cudagraph_skips", 0) == skips, "Inductor ran the triton operators without CUDA graphs"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA-graph capture exists only there")
def test_cuda_graph_replay_after_a_longer_call_still_reads_its_rope_tables():
    """A CUDA graph of a triton forward captured at T1 reads the cached RoPE tables by address. A
    later call at a longer T2 replaces them (`backend.rope_cos_sin`); the replaced tables must stay
    alive, or their freed memory is reused and the replay reads garbage. After the longer call and
    NaN-filled allocations of the old tables' size, the replay gives the eager output bit for bit
    (and tables no capture read are freed when replaced)."""
    from freesolo.backends.triton import backend as tb

    cfg = FreeSoloConfig(variant="fsl", rope_theta=12345.0)  # a theta no other test uses: tables made here
    key = (64, 12345.0, "cuda", torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(5)
    T1, T2, Hq, Hkv, D = 2048 + 37, 4 * 2048, 4, 2, 64
    q, k, v = (torch.randn(1, T1, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    with torch.no_grad():
        want = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        captured = tb._ROPE_CACHE[key]
        assert key in tb._ROPE_CAPTURED, "the capture did not mark the tables it read"
        long = [torch.randn(1, T2, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv)]
        freesolo.freesolo_attention(*long, cfg, backend="triton", check_finite=False)
        assert tb._ROPE_CACHE[key][0].shape[0] == T2 and any(kept is captured for kept in tb._ROPE_KEPT)
        junk = [torch.full_like(captured[0], float("nan")) for _ in range(16)]  # reuse any freed block of that size
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        del junk
    assert torch.equal(out, want), "CUDA-graph replay after a longer call differs from the eager output"
    # a further replacement of tables that no capture read frees them (nothing else is kept)
    kept = len(tb._ROPE_KEPT)
    longer = [torch.randn(1, 2 * T2, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv)]
    with torch.no_grad():
        freesolo.freesolo_attention(*longer, cfg, backend="triton", check_finite=False)
    assert len(tb._ROPE_KEPT) == kept, "tables that no capture read were kept"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (streams, CUDA-graph capture)")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_selection_overlap_changes_no_bit(variant, monkeypatch):
    """`overlaps_selection`: an eager call below OVERLAP_MIN_T runs the selection on the current
    stream, from it (or FREESOLO_TRITON_OVERLAP_MIN_T) and under CUDA-graph capture on the side
    stream; outputs, statistics and gradients are the same bits either way."""
    from freesolo.backends.triton import attention as att

    assert not att.overlaps_selection(att.OVERLAP_MIN_T - 1, torch.device("cuda"))
    assert att.overlaps_selection(att.OVERLAP_MIN_T, torch.device("cuda"))
    assert not att.overlaps_selection(att.OVERLAP_MIN_T, torch.device("cpu"))
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):  # (an empty capture: only the predicate runs inside it)
        seen.append(att.overlaps_selection(16, torch.device("cuda")))
    assert seen == [True], "a CUDA-graph capture overlaps at every length"
    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda").manual_seed(2)
    B, T, Hq, Hkv, D = 2, 8192 + 77, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    do = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    runs = {}
    for min_t in ("", "0"):  # the default (no overlap at this T), then overlap from T = 0
        monkeypatch.setenv(att.ENV_OVERLAP_MIN_T, min_t)
        assert att.overlaps_selection(T, q.device) == (min_t == "0")
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = freesolo.freesolo_attention(qg, kg, vg, cfg, backend="triton", check_finite=False)
        o.backward(do)
        runs[min_t] = [o.detach(), qg.grad, kg.grad, vg.grad]
    for name, x, y in zip(("o", "dq", "dk", "dv"), runs[""], runs["0"]):
        assert torch.equal(x, y), f"{name}: the side stream changed bits"


def test_side_priority_reads_its_switch(monkeypatch):
    """`attention.side_priority`: SIDE_PRIORITY (torch's default 0) unless FREESOLO_TRITON_SIDE_PRIORITY
    names an integer; anything else is refused with the variable's name."""
    from freesolo.backends.triton import attention as att

    monkeypatch.delenv(att.ENV_SIDE_PRIORITY, raising=False)
    assert att.side_priority() == att.SIDE_PRIORITY == 0
    monkeypatch.setenv(att.ENV_SIDE_PRIORITY, "-3")
    assert att.side_priority() == -3
    monkeypatch.setenv(att.ENV_SIDE_PRIORITY, "high")
    with pytest.raises(ValueError, match=att.ENV_SIDE_PRIORITY):
        att.side_priority()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (stream priorities, CUDA-graph capture)")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_side_stream_priority_changes_no_bit(variant, monkeypatch):
    """The selection's side stream at torch's default priority and at the device's highest
    (FREESOLO_TRITON_SIDE_PRIORITY=-100, clamped by torch): a stream of that priority is used, and
    eager overlapped calls (forward + backward) and graphed short calls give the same bits."""
    from freesolo.backends.triton import attention as att
    from freesolo.backends.triton import graphs

    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda").manual_seed(5)
    B, T, Hq, Hkv, D = 1, 4096 + 33, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    do = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    monkeypatch.setenv(att.ENV_OVERLAP_MIN_T, "0")
    runs, priorities = {}, {}
    for value in ("0", "-100"):
        monkeypatch.setenv(att.ENV_SIDE_PRIORITY, value)
        graphs.clear()
        priorities[value] = att._side_stream(q.device, att.side_priority()).priority
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = freesolo.freesolo_attention(qg, kg, vg, cfg, backend="triton", check_finite=False)
        o.backward(do)
        with torch.no_grad():  # the 2nd call of a key captures its graph, the 3rd replays it
            replays = [
                freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False) for _ in range(3)
            ]
        runs[value] = [o.detach(), qg.grad, kg.grad, vg.grad, *replays]
    graphs.clear()
    assert priorities["0"] == 0
    assert priorities["-100"] < 0, f"no stream priority above the default on this device: {priorities}"
    for name, x, y in zip(("o", "dq", "dk", "dv", "eager", "captured", "replayed"), runs["0"], runs["-100"]):
        assert torch.equal(x, y), f"{name}: the side stream's priority changed bits"
    assert torch.equal(runs["0"][0], runs["0"][4]) and torch.equal(runs["0"][4], runs["0"][6])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (16-bit split kernels, streams)")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_window_first_matches_default(variant, monkeypatch):
    """The window kernel first (the default since s26: the selection on a side stream, then the long
    kernel adds its term) gives the selection and statistics of FREESOLO_TRITON_WINDOW_FIRST=0 (the
    long kernel first, one stream) bit for bit, and its output up to one bf16 rounding order
    (rms-rel <= 1e-2); repeated calls give the same bits."""
    from freesolo.backends.triton import attention as att
    from freesolo.backends.triton.backend import _forward_impl, config_to_json

    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda").manual_seed(1)
    B, T, Hq, Hkv, D = 2, 8192 + 77, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    beta = torch.tensor([1.0, 0.5, -0.25, 2.0], device="cuda")
    monkeypatch.setenv(att.ENV_WINDOW_FIRST, "0")
    ref = _forward_impl(q, k, v, beta, config_to_json(cfg))
    monkeypatch.setenv(att.ENV_WINDOW_FIRST, "1")
    assert att.default_tiles(D, torch.bfloat16, q.device).window_first
    got = _forward_impl(q, k, v, beta, config_to_json(cfg))
    again = _forward_impl(q, k, v, beta, config_to_json(cfg))
    torch.cuda.synchronize()
    for name, x, y in zip(("idx", "lse_loc", "lse_long", "rstd"), got[1:], ref[1:]):
        assert torch.equal(x, y), f"window_first: {name} differs from the default"
    err = ((got[0].float() - ref[0].float()).square().mean() / ref[0].float().square().mean()).sqrt().item()
    assert 0 < err <= 1e-2, f"window_first: o rms-rel {err:.2e} vs the default (expected one bf16 rounding order)"
    for x, y in zip(got, again):
        assert torch.equal(x, y), "window_first: two calls differ"


def test_launch_hook_knobs_are_read_as_set_only_when_they_hold_a_hook():
    """`_common._hooks_set`: triton 3.6's launch hooks are HookChain objects that are never None (s29
    call2: reading them as "set" sent every launch back through JITFunction.run); empty chains are
    unset, a chain with a hook is set, and older triton's None / callable knobs read as before."""
    import triton

    from freesolo.backends.triton import _common

    assert not _common._hooks_set(None)
    assert _common._hooks_set(print)
    chain_type = type(triton.knobs.runtime.launch_enter_hook)
    if hasattr(triton.knobs.runtime.launch_enter_hook, "calls"):
        chain = chain_type()
        assert not _common._hooks_set(chain)
        chain.add(print)
        assert _common._hooks_set(chain)
    assert not _common._hooks_set(triton.knobs.runtime.launch_enter_hook), "a launch hook is set in this process"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the fast launch path exists only for compiled kernels")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_fast_launch_equals_triton_launch(variant, monkeypatch):
    """`_common.launch` (Triton's binder + a cache of the compiled kernel + its launcher) gives the
    forward's outputs and the gradients of FREESOLO_TRITON_FAST_LAUNCH=0 (every launch through
    JITFunction.run) bit for bit, launches from its cache on the second call, and keys a
    misaligned view's specialization apart (no stale compiled kernel for another alignment)."""
    from freesolo.backends.triton import _common

    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda").manual_seed(2)
    B, T, Hq, Hkv, D = 1, 4096 + 33, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))
    do = torch.randn_like(q)

    def run():
        qs, ks, vs = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = freesolo.freesolo_attention(qs, ks, vs, cfg, backend="triton", check_finite=False)
        o.backward(do)
        torch.cuda.synchronize()
        return o.detach(), qs.grad, ks.grad, vs.grad

    monkeypatch.setenv(_common.FAST_LAUNCH_ENV, "0")
    ref = run()
    monkeypatch.setenv(_common.FAST_LAUNCH_ENV, "1")
    first = run()
    cached = len(_common._COMPILED)
    assert cached > 0, "the fast path cached no compiled kernel"
    original = _common.JITFunction.run
    hits = record_jit_runs(monkeypatch)
    second = run()
    assert hits == [], f"the second call went through JITFunction.run for {sorted(set(hits))}"
    for name, x, y, z in zip(("o", "dq", "dk", "dv"), ref, first, second):
        assert torch.equal(x, y) and torch.equal(x, z), f"fast launch: {name} differs from JITFunction.run's"
    # a view 2 bytes off 16-byte alignment: Triton specializes pointers on alignment, so must the cache
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_odd = buf[1:].view_as(q)
    q_odd.copy_(q)
    monkeypatch.setattr(_common.JITFunction, "run", original)
    got = freesolo.freesolo_attention(q_odd, k, v, cfg, backend="triton", check_finite=False)
    monkeypatch.setenv(_common.FAST_LAUNCH_ENV, "0")
    want = freesolo.freesolo_attention(q_odd, k, v, cfg, backend="triton", check_finite=False)
    assert torch.equal(got, want), "fast launch on a misaligned view differs from JITFunction.run's"
    assert len(_common._COMPILED) > cached, "the misaligned view reused the aligned inputs' compiled kernels"


def test_on_device_of_is_a_no_op_off_other_cuda_devices():
    """`on_device_of` switches the current CUDA device only for tensors on another CUDA device."""
    import contextlib

    from freesolo.backends.triton.backend import on_device_of

    assert isinstance(on_device_of(torch.zeros(1)), contextlib.nullcontext)
    if CUDA:
        assert isinstance(on_device_of(torch.zeros(1, device="cuda")), contextlib.nullcontext)


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (the H200 machine has one)")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_tensors_on_a_device_that_is_not_current(variant):
    """Triton launches on the current device: with the tensors on cuda:1 while cuda:0 is current,
    the forward, the backward and a decode step run on cuda:1 (`on_device_of`) and give the bits
    they give with cuda:1 current."""
    cfg = FreeSoloConfig(variant=variant)
    gen = torch.Generator(device="cuda:1").manual_seed(3)
    B, T, Hq, Hkv, D = 1, 2048 + 5, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda:1", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv))

    def run(current: int):
        with torch.cuda.device(current):
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            o = freesolo.freesolo_attention(*leaves, cfg, backend="triton")
            o.float().square().sum().backward()
            cache = freesolo.FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", decode_kernel="triton",
                                           device="cuda:1", dtype=torch.bfloat16)  # fmt: skip
            cache.prefill(k[:, : T - 1], v[:, : T - 1])
            step = cache.extend(q[:, T - 1 :], k[:, T - 1 :], v[:, T - 1 :])
            torch.cuda.synchronize("cuda:1")
            return [o, *(x.grad for x in leaves), step]

    for name, x, y in zip(("o", "dq", "dk", "dv", "decode"), run(0), run(1)):
        assert x.device == torch.device("cuda:1") and torch.equal(x, y), f"{variant}: {name} differs"


def test_refuses_what_it_cannot_run():
    q, k, v = random_qkv(1, 1, 8, 2, 1, 8)
    cfg = FreeSoloConfig(**SMALL)
    with pytest.raises(BackendUnavailableError, match="triton runs on torch tensors"):
        freesolo.freesolo_attention(q, k, v, cfg, backend="triton")
    q64, k64, v64 = (torch.tensor(x, device=DEVICE) for x in (q, k, v))
    with pytest.raises(BackendUnavailableError, match="float64|float32"):
        freesolo.freesolo_attention(q64, k64, v64, cfg, backend="triton")
