"""The triton backend's CUDA-graph cache of short eager calls (`freesolo.backends.triton.graphs`).

On the CPU: the cache's policy (the first call of a key eager, the second captures, later ones
replay; LRU eviction; turned off after too many evictions; capture errors raised, not hidden),
the FREESOLO_TRITON_GRAPHS parsing, the key's parts, and that CPU tensors are never graphed.
On the H200: a replay gives the eager kernels' bits (forward without grad, forward + backward of
two layers in flight at once, fs and fsl), new input values after the capture are read, and the
cache steps aside under a caller's capture, the sync debug mode and above its size limit.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed")

import freesolo  # noqa: E402
from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton import graphs  # noqa: E402

CUDA = torch.cuda.is_available()


class _Stand:
    """A stand-in for `graphs._Graph`: records its captures; a replay returns body's outputs."""

    built: list = []

    def __init__(self, body, tensors, args, fixed=None):
        self.body, self.args = body, args
        _Stand.built.append(args)

    def __call__(self, tensors, n_outputs=None, prepare=None):
        outs = tuple(self.body(*tensors, *self.args))
        return outs if n_outputs is None else outs[:n_outputs] + (None,) * (len(outs) - n_outputs)


def _body(x, scale):
    return (x * scale, None)


def test_cache_runs_the_first_call_eagerly_captures_the_second_and_replays_after():
    _Stand.built = []
    cache = graphs.GraphCache(capture=_Stand)
    x = torch.arange(4.0)
    out, graph = cache.call("a", _body, (x,), (2.0,))
    assert graph is None, "an eager call named a graph"
    assert cache.stats == {"graphs": 0, "captures": 0, "replays": 0, "evictions": 0, "refreshes": 0, "disabled": False}
    assert torch.equal(out[0], x * 2) and out[1] is None
    for replays in (1, 2, 3):
        out, graph = cache.call("a", _body, (x + replays,), (2.0,))
        assert isinstance(graph, _Stand)
        assert torch.equal(out[0], (x + replays) * 2), "a replay did not read the call's inputs"
        assert cache.stats["captures"] == 1 and cache.stats["replays"] == replays
    assert _Stand.built == [(2.0,)]


def test_cache_evicts_the_least_recently_used_graph_and_turns_off_after_too_many_evictions():
    cache = graphs.GraphCache(capture=_Stand, max_entries=2, max_evictions=3)
    x = torch.ones(2)
    for key in ("a", "b"):
        cache.call(key, _body, (x,), (1.0,))
        cache.call(key, _body, (x,), (1.0,))
    cache.call("a", _body, (x,), (1.0,))  # a is now the most recent: c evicts b
    for _ in range(2):
        cache.call("c", _body, (x,), (1.0,))
    assert cache.stats["graphs"] == 2 and cache.stats["evictions"] == 1
    assert set(cache._graphs) == {"a", "c"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for key in ("d", "e"):  # two more evictions: the third turns the cache off
            for _ in range(2):
                cache.call(key, _body, (x,), (1.0,))
    assert cache.disabled and cache.stats["graphs"] == 0 and cache.stats["disabled"]
    assert any("CUDA-graph cache" in str(w.message) for w in caught), "turning itself off was not warned"
    replays = cache.replays
    for _ in range(3):
        assert torch.equal(cache.call("f", _body, (x,), (3.0,))[0][0], x * 3)
    assert cache.replays == replays and cache.stats["graphs"] == 0, "a disabled cache captured or replayed"


def test_cache_raises_a_capture_error_naming_the_switch():
    def broken(body, tensors, args):
        raise RuntimeError("operation not permitted when stream is capturing")

    cache = graphs.GraphCache(capture=broken)
    x = torch.ones(2)
    cache.call("a", _body, (x,), (1.0,))
    with pytest.raises(RuntimeError, match=graphs.GRAPHS_ENV):
        cache.call("a", _body, (x,), (1.0,))


class _Emulated(graphs._Graph):
    """`graphs._Graph` with its CUDA graph emulated on the CPU: the capture runs body once on the
    static inputs (its results become the static outputs), a replay runs it again on them and writes
    the results into the static outputs, so copies in / out, fixed buffers and bindings are the real
    code's (one stream: no stream ordering)."""

    def _capture(self, body, args):
        inputs = self.inputs  # what a CUDA graph would read: the static buffers, or the caller's memory (`on_inputs`)
        self._run = lambda: body(*inputs, *args)
        return self._run()

    def _replay(self):
        for static, new in zip(self.outputs, self._run()):
            if static is not None:
                static.copy_(new)

    def enter_stream(self):
        pass


def _fwd_body(x, w, tag):
    return (x * w, x.sum(dim=-1))


def _bwd_body(g, x, w, y, s, tag):
    return (g * w + y * s[:, None] - x,)


def test_a_bound_backward_reads_its_forwards_buffers_in_place_and_refreshes_them_when_stale(monkeypatch):
    """`run_forward` / `run_bound` on emulated graphs: the forward copies out its first output and lends
    the second (the graph's own buffer while its binding is current, a copy after a later replay, a
    recomputation once its backward ran); a bound graph reads the forward graph's buffers (no copies of
    its own), copies in only the fresh tensor (g) while the binding is current and first copies the
    saved tensors back after later forwards (`refreshes`); every result equals the direct computation,
    calls in flight in any order (forwards, backwards in reverse and forward order, repeated ones)."""
    cache = graphs.GraphCache(capture=_Emulated)
    monkeypatch.setattr(graphs, "CACHE", cache)
    w = torch.tensor([1.5, -2.0, 0.25])
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    gs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + i)) for i in range(6)]
    recomputed = []

    def forward(i):
        (y, s), binding = graphs.run_forward(_fwd_body, (xs[i], w), ("t",), n_copied=1)
        assert (s is None) == (binding is not None), "a bound forward copied its lent output out"
        return y, s, binding

    def backward(i, y, s, binding):
        if binding is not None:
            def recompute():
                recomputed.append(i)
                return _fwd_body(xs[i], w, "t")[1:]

            (s,) = binding.lent_tensors(recompute)
        tensors = (gs[i], xs[i], w, y, s)
        if binding is None:
            return _bwd_body(*tensors, "t")[0]
        fixed = (None, binding.graph.inputs[0], binding.graph.inputs[1], *binding.graph.outputs)
        got = graphs.run_bound(_bwd_body, tensors, ("t",), binding, fixed)[0]
        binding.spent = True
        return got

    def want(i):
        y, s = _fwd_body(xs[i], w, "t")
        return y, _bwd_body(gs[i], xs[i], w, y, s, "t")[0]

    first = forward(0)
    assert first[2] is None, "the first (eager) call of a key got a binding"
    calls = {i: forward(i) for i in (1, 2, 3)}  # the second call captures: bindings 1, 2, 3 to one graph
    graph = calls[1][2].graph
    assert all(c[2].graph is graph for c in calls.values()) and calls[3][2].current() and not calls[1][2].current()
    assert calls[3][2].lent[0] is graph.outputs[1] and calls[1][2].lent[0] is not graph.outputs[1]
    for i, (y, _, _) in calls.items():
        assert torch.equal(y, want(i)[0])
    assert torch.equal(backward(0, *first), want(0)[1])
    refreshes = []
    for i in (3, 2, 1, 1):  # reverse order (3 is current), then 1 twice (current after its refresh)
        assert torch.equal(backward(i, *calls[i]), want(i)[1]), f"backward of call {i}"
        refreshes.append(cache.refreshes)
    # the bound key's first call runs eagerly, the second captures (binding 2: stale, refreshed), ...
    assert refreshes == [0, 1, 2, 2], refreshes
    bound = [g for g in cache._graphs.values() if g is not graph]
    assert len(bound) == 1 and bound[0].inputs[1] is graph.inputs[0] and bound[0].inputs[3] is graph.outputs[0]
    assert bound[0]._copied_in == (0,), "a bound graph copies in more than its fresh tensor"
    assert calls[1][2].current(), "a refresh did not make its binding current"
    later = forward(4)  # binding 1 was spent: the replay drops its lent output, a backward recomputes it
    assert not calls[1][2].current() and calls[1][2].lent is None and later[2].current()
    assert torch.equal(backward(1, *calls[1]), want(1)[1]) and cache.refreshes == 3 and recomputed == [1]
    assert torch.equal(backward(4, *later), want(4)[1]) and cache.refreshes == 4 and recomputed == [1]
    assert torch.equal(later[0], want(4)[0]), "a copied-out output changed under later replays"


def test_a_constant_input_is_read_in_place_and_keyed_by_its_identity(monkeypatch):
    """`run_forward(..., constant=...)`: the graph reads that tensor itself (no static copy, no copy in);
    the same call with another tensor of that shape and dtype gets a graph of its own."""
    cache = graphs.GraphCache(capture=_Emulated)
    monkeypatch.setattr(graphs, "CACHE", cache)
    x, w = torch.randn(4, 3), torch.tensor([1.5, -2.0, 0.25])
    for _ in range(3):
        (y, _), binding = graphs.run_forward(_fwd_body, (x, w), ("t",), 1, constant=(1,))
    (graph,) = cache._graphs.values()
    assert graph.inputs[1] is w and graph._copied_in == (0,) and binding.graph is graph
    assert torch.equal(y, x * w)
    other = w * 2
    for _ in range(3):
        (y, _), _ = graphs.run_forward(_fwd_body, (x, other), ("t",), 1)
    assert cache.captures == 2 and torch.equal(y, x * other), "a copied input shared the constant's graph"


def test_direct_graphs_read_repeated_addresses_in_place_and_others_are_copied(monkeypatch):
    """`call_direct` on emulated graphs: eager, then the copying graph; the third call at the addresses
    of the second captures a graph on the caller's tensors, later calls there replay it without copies
    (an in-place change of the inputs is read); inputs elsewhere take the copying graph, and a second
    call at the new addresses captures a graph of their own. Every output equals the direct computation."""
    cache = graphs.GraphCache(capture=_Emulated)
    w = torch.tensor([1.0, -2.0, 3.0])
    x = torch.arange(6.0).reshape(2, 3)

    def check(x):
        out, graph = cache.call_direct("k", _fwd_body, (x, w), ("t",))
        assert torch.equal(out[0], x * w) and torch.equal(out[1], x.sum(dim=-1))
        return graph

    assert check(x) is None
    copying = check(x)
    assert copying is not None and cache.stats["captures"] == 1
    assert cache.direct_stats["captures"] == 0, "the copying graph's capture call captured a direct graph too"
    direct = check(x)
    assert direct is not copying and direct.inputs == () and direct._copied_in == ()
    assert cache.direct_stats == {"graphs": 1, "captures": 1, "replays": 1, "evictions": 0, "disabled": False}
    x.mul_(-1.5)  # the graph reads the memory, not a copy taken at its capture
    assert check(x) is direct
    y = x.clone() + 1
    assert check(y) is copying, "inputs at other addresses did not take the copying graph"
    assert check(y) not in (copying, direct) and cache.direct_stats["graphs"] == 2
    assert check(x) is direct
    strided = torch.as_strided(x, (2, 3), (1, 2))  # x's memory and shape, other strides: not the captured layout
    assert strided.data_ptr() == x.data_ptr()
    assert check(strided) is copying
    assert cache.direct_stats["replays"] == 4 and cache.stats["replays"] == 3, (cache.stats, cache.direct_stats)
    cache.clear()
    assert cache.direct_stats == {"graphs": 0, "captures": 0, "replays": 0, "evictions": 0, "disabled": False}


def test_calls_past_the_copy_limit_take_only_graphs_on_their_inputs(monkeypatch):
    """`call_direct(copies=False)` (a forward past FREESOLO_TRITON_GRAPHS, s49): no copying graph ever;
    the first call eager, the second at the same addresses captures a graph on them, later ones there
    replay it (an in-place change is read); a call elsewhere runs eagerly, and its second call at its
    own addresses captures a graph of their own. Every output equals the direct computation."""
    cache = graphs.GraphCache(capture=_Emulated)
    w = torch.tensor([1.0, -2.0, 3.0])
    x = torch.arange(6.0).reshape(2, 3)

    def check(x):
        out, graph = cache.call_direct("k", _fwd_body, (x, w), ("t",), copies=False)
        assert torch.equal(out[0], x * w) and torch.equal(out[1], x.sum(dim=-1))
        return graph

    assert check(x) is None
    direct = check(x)
    assert direct is not None and direct.inputs == () and direct._copied_in == ()
    assert cache.stats["captures"] == 0 and cache.direct_stats["captures"] == 1
    x.mul_(-1.5)
    assert check(x) is direct
    y = x.clone() + 1
    assert check(y) is None, "a call at other addresses was not run eagerly"
    assert check(y) not in (None, direct) and cache.direct_stats["graphs"] == 2
    assert check(x) is direct
    assert cache.stats == {"graphs": 0, "captures": 0, "replays": 0, "evictions": 0, "refreshes": 0, "disabled": False}
    assert cache.direct_stats["replays"] == 4, cache.direct_stats


def test_run_keeps_calls_past_the_copy_limit_off_copying_graphs(monkeypatch):
    """`run(copies=False)` (queries past `max_elements()`): graphs on its inputs only, and with
    FREESOLO_TRITON_GRAPH_DIRECT=0 every call eager; `direct_max_elements` parses its switch."""
    cache = graphs.GraphCache(capture=_Emulated)
    monkeypatch.setattr(graphs, "CACHE", cache)
    w, x = torch.tensor([1.0, 3.0]), torch.ones(2, 2)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "3")  # x holds 4 elements
    monkeypatch.setenv(graphs.DIRECT_ENV, "0")
    assert not graphs.within_copy_limit(x)
    for _ in range(3):
        assert torch.equal(graphs.run(_fwd_body, (x, w), ("t",), copies=False)[0], x * w)
    assert cache.stats["captures"] == 0 and cache.direct_stats["captures"] == 0
    monkeypatch.setenv(graphs.DIRECT_ENV, "1")
    for _ in range(3):
        assert torch.equal(graphs.run(_fwd_body, (x, w), ("t",), copies=False)[0], x * w)
    # (the capturing call counts as a replay)
    assert cache.stats["captures"] == 0 and cache.direct_stats["captures"] == 1 and cache.direct_stats["replays"] == 2
    monkeypatch.setenv(graphs.GRAPHS_ENV, "4")  # within the copy limit, direct graphs off: the copying graph
    monkeypatch.setenv(graphs.DIRECT_ENV, "0")
    assert graphs.within_copy_limit(x)
    for _ in range(3):
        assert torch.equal(graphs.run(_fwd_body, (x, w), ("t",), copies=True)[0], x * w)
    assert cache.stats["captures"] == 1
    monkeypatch.delenv(graphs.DIRECT_MAX_ENV, raising=False)
    assert graphs.direct_max_elements() == graphs.DEFAULT_DIRECT_MAX_ELEMENTS == 1 << 24  # s50 (graphs.py)
    for text, value in (("", graphs.DEFAULT_DIRECT_MAX_ELEMENTS), ("0", 0), ("16777216", 1 << 24)):
        monkeypatch.setenv(graphs.DIRECT_MAX_ENV, text)
        assert graphs.direct_max_elements() == value
    for text in ("-1", "many"):
        monkeypatch.setenv(graphs.DIRECT_MAX_ENV, text)
        with pytest.raises(ValueError, match=graphs.DIRECT_MAX_ENV):
            graphs.direct_max_elements()


def test_direct_graphs_evict_and_turn_off_when_addresses_keep_changing(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_DIRECT_ENTRIES", 2)
    monkeypatch.setattr(graphs, "MAX_DIRECT_EVICTIONS", 3)
    cache = graphs.GraphCache(capture=_Emulated)
    w = torch.tensor([2.0, 0.5])
    xs = [torch.full((3, 2), float(i)) for i in range(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            for _ in range(3):
                out, _graph = cache.call_direct("k", _fwd_body, (x, w), ("t",))
                assert torch.equal(out[0], x * w)
    stats = cache.direct_stats
    assert stats["disabled"] and stats["evictions"] == 3 and stats["graphs"] == 0, stats
    assert any(graphs.DIRECT_ENV in str(item.message) for item in caught), "turning direct graphs off was not warned"
    assert not cache.disabled, "the copying graphs were turned off with the direct ones"
    replays = cache.replays
    for _ in range(3):
        out, graph = cache.call_direct("k", _fwd_body, (xs[0], w), ("t",))
        assert torch.equal(out[0], xs[0] * w) and graph is not None
    assert cache.replays == replays + 3 and cache.direct_stats["captures"] == stats["captures"]


def test_run_takes_the_direct_graphs_only_when_switched_on(monkeypatch):
    cache = graphs.GraphCache(capture=_Emulated)
    monkeypatch.setattr(graphs, "CACHE", cache)
    w, x = torch.tensor([1.0, 3.0]), torch.ones(2, 2)
    monkeypatch.setenv(graphs.DIRECT_ENV, "0")
    for _ in range(4):
        assert torch.equal(graphs.run(_fwd_body, (x, w), ("t",))[0], x * w)
    assert cache.direct_stats["captures"] == 0 and cache.stats["replays"] == 3
    monkeypatch.setenv(graphs.DIRECT_ENV, "1")
    for _ in range(3):
        assert torch.equal(graphs.run(_fwd_body, (x, w), ("t",))[0], x * w)
    assert cache.direct_stats["captures"] == 1 and cache.direct_stats["replays"] == 2, cache.direct_stats
    monkeypatch.delenv(graphs.DIRECT_ENV)
    assert graphs.direct_inputs(), "the direct graphs are not the default"
    for bad in ("2", "yes", "-1"):
        monkeypatch.setenv(graphs.DIRECT_ENV, bad)
        with pytest.raises(ValueError, match=graphs.DIRECT_ENV):
            graphs.direct_inputs()


def test_max_elements_parses_the_switch(monkeypatch):
    monkeypatch.delenv(graphs.GRAPHS_ENV, raising=False)
    assert graphs.max_elements() == graphs.DEFAULT_MAX_ELEMENTS == 8192 * 16 * 64
    for text, value in (("", graphs.DEFAULT_MAX_ELEMENTS), ("0", 0), ("4096", 4096)):
        monkeypatch.setenv(graphs.GRAPHS_ENV, text)
        assert graphs.max_elements() == value
    for text in ("-1", "yes", "1.5"):
        monkeypatch.setenv(graphs.GRAPHS_ENV, text)
        with pytest.raises(ValueError, match=graphs.GRAPHS_ENV):
            graphs.max_elements()


def test_cache_key_holds_shapes_dtypes_args_the_kernel_switches_and_inference_mode(monkeypatch):
    x, y = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)
    base = graphs.cache_key(_body, (x, None), ("cfg", True))
    assert base == graphs.cache_key(_body, (torch.zeros(2, 3), None), ("cfg", True)), "values must not change the key"
    assert base != graphs.cache_key(_body, (torch.ones(3, 2), None), ("cfg", True))
    assert base != graphs.cache_key(_body, (y, None), ("cfg", True))
    assert base != graphs.cache_key(_body, (x, None), ("cfg", False))
    with torch.inference_mode():
        assert graphs.cache_key(_body, (x, None), ("cfg", True)) != base, "inference mode is not part of the key"
    for name in graphs.KNOB_ENVS:
        monkeypatch.setenv(name, "7")
        assert graphs.cache_key(_body, (x, None), ("cfg", True)) != base, f"{name} is not part of the key"
        monkeypatch.delenv(name)


def test_knob_list_names_every_triton_switch_of_the_kernels():
    """Every FREESOLO_TRITON_* variable the forward / backward code reads is part of the key (or is
    the cache's own switch, or FS-B's search / rerank / forests switches: the cache never graphs FS-B)."""
    from freesolo.backends.triton import _common, attention, attention_bwd, selection

    read = {
        attention.ENV_LONG_BLOCK, attention.ENV_MAXNREG, attention.ENV_LONG_INTO_OUT, attention.ENV_WINDOW_FIRST,
        attention.ENV_SORTED_LONG, attention.ENV_OVERLAP_MIN_T, selection.ENV_FSL_TAIL, attention_bwd.LONG_MODE_ENV,
        _common.FAST_LAUNCH_ENV, attention.ENV_LONG_TMA, attention.ENV_SIDE_PRIORITY,
        selection.ENV_FSL_DIRECT_MAX_CELLS, attention.ENV_SORTED_LONG_MIN_T, attention.ENV_FUSED_UNIONS,
        attention.ENV_LONG_MAXNREG,
        attention.ENV_WINDOW_TILES,
    }
    assert read == set(graphs.KNOB_ENVS)
    import pathlib
    import re

    root = pathlib.Path(graphs.__file__).parent
    named = set()
    for path in root.glob("*.py"):
        named |= set(re.findall(r'"(FREESOLO_TRITON_[A-Z_]+)"', path.read_text()))
    fsb_prefill = {"FREESOLO_TRITON_FSB_SEARCH", "FREESOLO_TRITON_FSB_RERANK", "FREESOLO_TRITON_FSB_FORESTS"}
    assert named - set(graphs.KNOB_ENVS) == {graphs.GRAPHS_ENV, graphs.DIRECT_ENV, graphs.DIRECT_MAX_ENV} | fsb_prefill, named


def test_the_deterministic_gather_and_union_backwards_are_not_captured(monkeypatch):
    """Their inverted selection counts readers with torch.bincount (a host sync): the cache leaves
    those backwards eager (the default "cell" mode and the atomic modes are captured)."""
    from freesolo.backends.triton import attention_bwd
    from freesolo.backends.triton.backend import _capturable_backward

    for mode, deterministic, capturable in (
        ("", True, True), ("cell", True, True), ("gather", True, False), ("union", True, False),
        ("legacy", True, False), ("gather", False, True), ("union", False, True), ("legacy", False, True),
    ):
        monkeypatch.setenv(attention_bwd.LONG_MODE_ENV, mode)
        assert _capturable_backward(deterministic) == capturable, (mode, deterministic)


def test_cpu_tensors_are_never_graphed(monkeypatch):
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    assert not graphs.eligible(torch.ones(1, 8, 2, 4), "fsl")


# ---- CUDA ------------------------------------------------------------------------------------------


def _inputs(seed, B, T, Hq, Hkv, D, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (Hq, Hkv, Hkv)]
    return [x.requires_grad_(grad) for x in xs]


@pytest.fixture
def graphs_on(monkeypatch):
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    monkeypatch.setenv(graphs.DIRECT_ENV, "0")  # the copying graphs (their counts); the direct ones' tests set 1
    graphs.clear()
    yield graphs.CACHE
    graphs.clear()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_graphed_forward_equals_eager(variant, graphs_on, monkeypatch):
    """Forward without grad: calls replayed from the cache give the eager kernels' bits, for inputs
    other than the captured ones too."""
    cfg = FreeSoloConfig(variant=variant)
    cases = [_inputs(seed, 1, 4096 + 17, 4, 2, 64) for seed in range(3)]
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    with torch.no_grad():
        want = [freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False) for xs in cases]
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    with torch.no_grad():
        for round_ in range(3):
            for i, xs in enumerate(cases):
                got = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
                assert torch.equal(got, want[i]), f"round {round_}, input {i}: the graphed forward differs from eager"
    assert graphs_on.stats["captures"] == 1 and graphs_on.stats["replays"] == 8, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_graphed_training_of_two_layers_equals_eager(variant, graphs_on, monkeypatch):
    """Two layers of one shape in flight at once (both forwards, then one backward): outputs and
    gradients (q, k, v, beta) from the cache equal the eager ones bit for bit, step after step (the
    replays' outputs are the caller's own tensors, the saved ones of layer 1 survive layer 2)."""
    cfg = FreeSoloConfig(variant=variant)
    layers = [_inputs(seed, 2, 2048 + 5, 4, 2, 64) for seed in (11, 12)]
    betas = [torch.full((4,), 0.5 + i, device="cuda") for i in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(13)
    grads = [torch.randn(2, 2048 + 5, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]

    def step():
        leaves = [[x.clone().requires_grad_(True) for x in xs] for xs in layers]
        bs = [b.clone().requires_grad_(True) for b in betas]
        outs = [freesolo.freesolo_attention(*xs, cfg, beta=b, backend="triton", check_finite=False) for xs, b in zip(leaves, bs)]
        loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads))
        loss.backward()
        flat = [o.detach() for o in outs] + [x.grad for xs in leaves for x in xs] + [b.grad for b in bs]
        return flat

    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    want = step()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    for n in range(4):
        got = step()
        for i, (x, y) in enumerate(zip(want, got)):
            assert torch.equal(x, y), f"step {n}: tensor {i} (outputs, dq/dk/dv per layer, dbeta) differs from eager"
    # forward: the first call eager, the second captures (layer 2 of step 0); backward likewise, bound to
    # the forward's graph from step 1 on (autograd runs layer 2's backward first: its binding is current,
    # layer 1's is stale and refreshed once per step)
    assert graphs_on.stats["captures"] == 2, graphs_on.stats
    assert graphs_on.stats["replays"] == (2 * 4 - 1) + 2 * 3, graphs_on.stats
    assert graphs_on.stats["refreshes"] == 3, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
def test_cuda_graph_cache_steps_aside(graphs_on, monkeypatch):
    """No graph under sync debug mode "error" (and no error), none inside a caller's capture (whose
    replay gives the eager bits), none above the size limit (FREESOLO_TRITON_GRAPHS query elements)."""
    cfg = FreeSoloConfig(variant="fsl")
    xs = _inputs(21, 1, 1024 + 3, 4, 2, 64)
    with torch.no_grad():
        monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
        want = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
        monkeypatch.setenv(graphs.GRAPHS_ENV, "")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(torch.equal(out, want) for out in outs)
        assert graphs_on.stats["captures"] == 0, graphs_on.stats
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
        assert graphs_on.stats["captures"] == 0, "the cache captured inside the caller's capture"
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        monkeypatch.setenv(graphs.GRAPHS_ENV, str(xs[0].numel() - 1))
        monkeypatch.setenv(graphs.DIRECT_MAX_ENV, "0")
        monkeypatch.setenv(graphs.DIRECT_ENV, "1")
        for _ in range(3):
            assert torch.equal(freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False), want)
        assert graphs_on.stats["captures"] == 0, "a call above FREESOLO_TRITON_GRAPHS query elements was graphed"
        assert graphs_on.direct_stats["captures"] == 0, "a call above both limits was graphed on its inputs"
        monkeypatch.setenv(graphs.DIRECT_MAX_ENV, "")
        monkeypatch.setenv(graphs.DIRECT_ENV, "0")
        monkeypatch.setenv(graphs.GRAPHS_ENV, str(xs[0].numel()))
        assert graphs.eligible(xs[0], "fsl") and not graphs.eligible(xs[0], "fsb")
        monkeypatch.setenv(graphs.GRAPHS_ENV, "")
        for _ in range(3):
            assert torch.equal(freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False), want)
        assert graphs_on.stats["captures"] == 1 and graphs_on.stats["replays"] == 2, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
def test_cuda_graphs_of_inference_mode_and_no_grad_calls_are_kept_apart(graphs_on, monkeypatch):
    """A graph captured under torch.inference_mode holds inference tensors; the same call under
    torch.no_grad gets a graph of its own (the key holds the mode) and both give the eager bits."""
    cfg = FreeSoloConfig(variant="fsl")
    xs = _inputs(31, 1, 2048 + 9, 4, 2, 64)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    with torch.no_grad():
        want = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    for _ in range(3):
        with torch.inference_mode():
            got = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
        assert torch.equal(got, want)
        with torch.no_grad():
            got = freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)
        assert torch.equal(got, want)
    assert graphs_on.stats["captures"] == 2 and graphs_on.stats["replays"] == 4, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
def test_cuda_gather_backward_stays_eager_under_the_cache(graphs_on, monkeypatch):
    """FREESOLO_TRITON_BWD_LONG=gather (deterministic): its backward cannot be captured (a host
    sync); with the cache on, forwards replay, backwards run eagerly, gradients equal the eager ones."""
    from freesolo.backends.triton import attention_bwd

    monkeypatch.setenv(attention_bwd.LONG_MODE_ENV, "gather")
    cfg = FreeSoloConfig(variant="fsl")
    xs = _inputs(41, 1, 1024 + 7, 4, 2, 64)
    do = torch.randn(1, 1024 + 7, 4, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(42))

    def step():
        leaves = [x.clone().requires_grad_(True) for x in xs]
        o = freesolo.freesolo_attention(*leaves, cfg, backend="triton", check_finite=False)
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]

    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    want = step()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(step(), want))
    assert graphs_on.stats["captures"] == 1 and graphs_on.stats["replays"] == 2, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
def test_cuda_bound_backward_reads_the_forward_graph_in_place_and_refreshes_a_stale_one(graphs_on, monkeypatch):
    """One layer trained step after step: the backward's graph reads the forward graph's buffers (q, k,
    v, beta, o, statistics: no copies of its own, no refresh) and its gradients equal the eager ones bit
    for bit; with another forward of the shape between two backwards of one call (retain_graph) the
    second refreshes the buffers and gives the same gradients again."""
    cfg = FreeSoloConfig(variant="fsl")
    xs = _inputs(51, 1, 4096 + 11, 4, 2, 64)
    beta = torch.full((4,), 0.75, device="cuda")
    do = torch.randn(1, 4096 + 11, 4, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(52))

    def forward():
        leaves = [x.clone().requires_grad_(True) for x in xs] + [beta.clone().requires_grad_(True)]
        return leaves, freesolo.freesolo_attention(*leaves[:3], cfg, beta=leaves[3], backend="triton", check_finite=False)

    def step():
        leaves, o = forward()
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    want = step()
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    for n in range(5):
        got = step()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {n} differs from eager"
    stats = graphs_on.stats
    assert stats["captures"] == 2 and stats["replays"] == 4 + 3 and stats["refreshes"] == 0, stats
    fwd, bwd = list(graphs_on._graphs.values())
    assert bwd.inputs[1] is fwd.inputs[0] and bwd.inputs[4] is fwd.outputs[0] and bwd._copied_in == (0,)
    leaves, o = forward()
    first = torch.autograd.grad(o, leaves, do, retain_graph=True)
    _, o_other = forward()  # replays the forward graph with this call's inputs: the first binding goes stale
    second = torch.autograd.grad(o, leaves, do)
    assert graphs_on.stats["refreshes"] == 1, graphs_on.stats
    assert all(torch.equal(a, b) for a, b in zip(first, want[1:])) and all(torch.equal(a, b) for a, b in zip(second, want[1:]))
    assert torch.equal(o_other.detach(), want[0])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
def test_cuda_replays_of_one_graph_on_two_streams_are_ordered(graphs_on, monkeypatch):
    """Calls of one key issued back to back on two side streams (no sync in between) share the graph's
    buffers: the second waits for the first's use of them (`_Graph.enter_stream`), so both give the
    eager bits, forward alone and forward + backward (each call's backward on its own stream)."""
    cfg = FreeSoloConfig(variant="fsl")
    cases = [_inputs(61 + i, 1, 4096 + 3, 4, 2, 64) for i in range(2)]
    do = torch.randn(1, 4096 + 3, 4, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(63))

    def train(xs):
        leaves = [x.clone().requires_grad_(True) for x in xs]
        o = freesolo.freesolo_attention(*leaves, cfg, backend="triton", check_finite=False)
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    def infer(xs):
        with torch.no_grad():
            return [freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False)]

    for run in (infer, train):
        monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
        want = [run(xs) for xs in cases]
        monkeypatch.setenv(graphs.GRAPHS_ENV, "")
        streams = [torch.cuda.Stream() for _ in cases]
        for round_ in range(4):  # the first two calls of the key run eagerly / capture, then replays
            torch.cuda.synchronize()
            got = []
            for stream, xs in zip(streams, cases):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    got.append(run(xs))
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(got, want)):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{run.__name__}, round {round_}, stream {i}"
    assert graphs_on.stats["replays"] > 0, graphs_on.stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_direct_graphs_read_the_callers_inputs_and_equal_eager(variant, graphs_on, monkeypatch):
    """FREESOLO_TRITON_GRAPH_DIRECT=1, forward without grad: the same tensors passed again and again
    are read in place by a graph of their own (no copies in), new values written into them are read,
    tensors elsewhere take the copying graph; inputs freed and reallocated at the captured addresses
    (the allocator's reuse) are read as well; every output has the eager kernels' bits."""
    cfg = FreeSoloConfig(variant=variant)
    cases = [_inputs(seed, 1, 4096 + 5, 4, 2, 64) for seed in (61, 62)]
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    with torch.no_grad():
        want = [freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False) for xs in cases]
    monkeypatch.setenv(graphs.GRAPHS_ENV, "")
    monkeypatch.setenv(graphs.DIRECT_ENV, "1")
    first, second = cases
    held = [x.clone() for x in first]
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(freesolo.freesolo_attention(*first, cfg, backend="triton", check_finite=False), want[0])
        assert graphs_on.direct_stats["captures"] == 1 and graphs_on.direct_stats["replays"] == 2, graphs_on.direct_stats
        for x, y in zip(first, second):
            x.copy_(y)  # the captured memory now holds the second case's values
        assert torch.equal(freesolo.freesolo_attention(*first, cfg, backend="triton", check_finite=False), want[1])
        for x, h in zip(first, held):
            x.copy_(h)
        assert torch.equal(freesolo.freesolo_attention(*held, cfg, backend="triton", check_finite=False), want[0])
        assert graphs_on.direct_stats["replays"] == 3, "inputs at other addresses replayed the direct graph"
        # the allocator's reuse: free the inputs, allocate the same shapes again, fill them with case 2
        pointers = [x.data_ptr() for x in first]
        del first, cases, x, y, h  # (the loop names hold tensors too)
        again = [torch.empty_like(y) for y in second]
        if [x.data_ptr() for x in again] == pointers:
            for x, y in zip(again, second):
                x.copy_(y)
            assert torch.equal(freesolo.freesolo_attention(*again, cfg, backend="triton", check_finite=False), want[1])
            assert graphs_on.direct_stats["replays"] == 4, graphs_on.direct_stats
    assert graphs_on.direct_stats["captures"] == 1, graphs_on.direct_stats


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: CUDA graphs exist only there")
@pytest.mark.parametrize("variant", ["fsl", "fs"])
def test_cuda_forwards_past_the_copy_limit_replay_graphs_on_their_inputs(variant, graphs_on, monkeypatch):
    """Past FREESOLO_TRITON_GRAPHS and within FREESOLO_TRITON_GRAPH_DIRECT_MAX (s49): a forward without
    gradients repeated on the same tensors is replayed from a graph on them (no copying graph), new
    values written into them are read, tensors elsewhere run eagerly; a forward + backward is never
    graphed there; every output and gradient has the eager kernels' bits."""
    cfg = FreeSoloConfig(variant=variant)
    xs = _inputs(71, 1, 2048 + 7, 4, 2, 64)
    other = _inputs(72, 1, 2048 + 7, 4, 2, 64)
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    with torch.no_grad():
        want = [freesolo.freesolo_attention(*x, cfg, backend="triton", check_finite=False) for x in (xs, other)]
    grad_in = [x.detach().clone().requires_grad_(True) for x in xs]
    freesolo.freesolo_attention(*grad_in, cfg, backend="triton", check_finite=False).float().square().sum().backward()
    want_grads = [x.grad.clone() for x in grad_in]
    monkeypatch.setenv(graphs.GRAPHS_ENV, str(xs[0].numel() - 1))
    monkeypatch.setenv(graphs.DIRECT_MAX_ENV, str(xs[0].numel()))
    monkeypatch.setenv(graphs.DIRECT_ENV, "1")
    assert graphs.eligible(xs[0], variant, in_place=True) and not graphs.eligible(xs[0], variant)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False), want[0])
        # call 1 eager, call 2 captures and replays (the capturing call counts as a replay), calls 3, 4 replay
        assert graphs_on.direct_stats["captures"] == 1 and graphs_on.direct_stats["replays"] == 3, graphs_on.direct_stats
        assert graphs_on.stats["captures"] == 0, graphs_on.stats
        held = [x.clone() for x in xs]
        for x, y in zip(xs, other):
            x.copy_(y)
        assert torch.equal(freesolo.freesolo_attention(*xs, cfg, backend="triton", check_finite=False), want[1])
        assert torch.equal(freesolo.freesolo_attention(*held, cfg, backend="triton", check_finite=False), want[0])
        assert graphs_on.direct_stats["replays"] == 4 and graphs_on.stats["captures"] == 0, graphs_on.direct_stats
    for _ in range(3):
        for x in grad_in:
            x.grad = None
        freesolo.freesolo_attention(*grad_in, cfg, backend="triton", check_finite=False).float().square().sum().backward()
        assert all(torch.equal(x.grad, g) for x, g in zip(grad_in, want_grads))
    assert graphs_on.stats["captures"] == 0 and graphs_on.direct_stats["captures"] == 1, "a training call was graphed"
