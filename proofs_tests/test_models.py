"""freesolo.nn / freesolo.models: the attention module against the functional op, cached generation
against the uncached forward (every attention kind, prompts of different lengths in one batch),
save / load, FS-B calibration per layer, causality of the whole model (L2), packed sequences,
torch.compile, and clear errors for bad configs, checkpoints and shapes.

Tiny sizes: d_model 32, 2 layers, 4 query / 2 kv heads (D = 8), T <= 100, cell 8, block 16,
window 32, pool 4, recent 2: prompts cross block boundaries and the window, so cells are selected.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import freesolo
from freesolo import FreeSoloConfig
from freesolo.models import ATTENTIONS, FreeSoloLM, LMConfig
from freesolo.nn import FreeSoloAttention, SDPAAttention

from .helpers import assert_close

FS = FreeSoloConfig(cell=8, block=16, window=32, pool=4, recent=2, top_k=2, beam=2)
VOCAB = 61
PROMPT_LENGTHS = (21, 50, 37)  # crosses blocks (16), the window (32) and cell boundaries; rows differ
NEW = 10



def make_lm(attention: str, seed: int = 0, device: str = "cpu", **fields) -> FreeSoloLM:
    """A tiny FreeSoloLM on `device`; FS-B is calibrated on random sequences (so it can run)."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg = LMConfig(**sizes, attention=attention, freesolo=FS, **fields)
    model = FreeSoloLM(cfg).to(device).eval()
    with torch.no_grad():  # a random model whose beta is not 1 everywhere and whose norms are not all ones
        for name, p in model.named_parameters():
            if name.endswith("beta") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if attention == "fsb":
        ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(seed + 1))
        model.calibrate_tau(ids.to(device))
    return model


def prompts(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENGTHS]


def left_padded(rows: list, pad: int = 0):
    """input_ids / attention_mask [B, T] with the rows right-aligned."""
    T = max(r.numel() for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), T), dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, T - r.numel() :] = r
        mask[b, T - r.numel() :] = 1
    return ids, mask


# ---- the module --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_module_equals_functional_op(variant):
    """FreeSoloAttention(x) == o_proj(freesolo_attention(q_proj(x), k_proj(x), v_proj(x), cfg, beta)),
    and gradients reach beta and every projection."""
    torch.manual_seed(1)
    B, T, hidden = 2, 70, 48
    cfg = FS.replace(variant=variant)
    attn = FreeSoloAttention(
        hidden, num_heads=6, num_kv_heads=2, head_dim=8, cfg=cfg, beta_init=0.7, bias=True, backend="torch"
    )
    x = torch.randn(B, T, hidden)
    if variant == "fsb":
        with pytest.raises(ValueError, match="no tau"):
            attn(x)
        attn.set_tau(freesolo.calibrate_tau(attn.k_proj(x).detach().view(B, T, 2, 8), cfg))
        assert attn.tau is not None and len(attn.tau) == 2
    y = attn(x)
    q = attn.q_proj(x).view(B, T, 6, 8)
    k = attn.k_proj(x).view(B, T, 2, 8)
    v = attn.v_proj(x).view(B, T, 2, 8)
    o = freesolo.freesolo_attention(q, k, v, attn.cfg, beta=attn.beta, backend="torch")
    ref = attn.o_proj(o.reshape(B, T, 48))
    assert y.shape == (B, T, hidden)
    assert_close(y.detach(), ref.detach(), 1e-6, "module vs functional op")
    y.square().mean().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    # the module is not the local branch alone: beta = 0 changes the output
    with torch.no_grad():
        attn.beta.zero_()
        assert (attn(x) - y).abs().max() > 1e-4


@torch.no_grad()
def test_baseline_modules_match_dense_reference():
    """SDPAAttention: dense = softmax over t <= i with RoPE; window = keys i-w < t <= i (an explicit loop)."""
    torch.manual_seed(2)
    B, T, hidden, w = 1, 40, 32, 8
    for window in (None, w):
        attn = SDPAAttention(hidden, num_heads=4, num_kv_heads=2, window=window, rope_theta=100.0)
        x = torch.randn(B, T, hidden, dtype=torch.float64)
        attn = attn.double()
        q, k, v = attn.qkv(x)
        pos = torch.arange(T, dtype=torch.float64)
        inv = 100.0 ** (-2.0 * torch.arange(4, dtype=torch.float64) / 8)
        ang = pos[:, None] * inv  # (T, 4)
        rot = lambda z: torch.view_as_real(  # noqa: E731 (complex rotation: an independent RoPE)
            torch.complex(z[..., :4], z[..., 4:]) * torch.polar(torch.ones_like(ang), ang)[None, :, None]
        )
        qr = rot(q).permute(0, 1, 2, 4, 3).reshape(B, T, 4, 8)
        kr = rot(k).permute(0, 1, 2, 4, 3).reshape(B, T, 2, 8)
        out = torch.empty(B, T, 4, 8, dtype=torch.float64).fill_(float("nan"))
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)
            for h in range(4):
                s = (kr[0, lo : i + 1, h // 2] @ qr[0, i, h]) / 8**0.5
                out[0, i, h] = torch.softmax(s, 0) @ v[0, lo : i + 1, h // 2]
        assert_close(attn.attend(q, k, v), out, 1e-12, f"window={window}")


# ---- cached generation == uncached forward -------------------------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generate_equals_uncached_forward(attention):
    """Greedy generation from a left-padded batch of prompts of different lengths: each row's tokens
    are the argmax of the uncached forward on that row's own sequence, and the logits agree."""
    model = make_lm(attention)
    rows = prompts()
    ids, mask = left_padded(rows, pad=3)
    seqs, logits = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, return_logits=True)
    T = ids.shape[1]
    assert seqs.shape == (len(rows), T + NEW) and torch.equal(seqs[:, :T], ids)
    assert logits.shape == (len(rows), NEW, VOCAB)
    for b, r in enumerate(rows):
        full = torch.cat([r, seqs[b, T:]])
        with torch.no_grad():
            ref = model(full[None])[0, r.numel() - 1 : r.numel() - 1 + NEW]  # (NEW, V)
        assert torch.equal(ref.argmax(-1), seqs[b, T:]), f"row {b}: cached tokens differ from the uncached argmax"
        assert_close(logits[b], ref, 1e-5, f"{attention} row {b} logits")


def test_generate_padding_sides_and_chunked_prefill():
    """Right padding, a list of prompts and chunked prefill give the same new tokens as left padding."""
    model = make_lm("fsl")
    rows = prompts(3)[:2]
    ids, mask = left_padded(rows)
    left = model.generate(ids, attention_mask=mask, max_new_tokens=6)[:, ids.shape[1] :]
    right_ids = torch.zeros_like(ids)
    right_mask = torch.zeros_like(mask)
    for b, r in enumerate(rows):
        right_ids[b, : r.numel()], right_mask[b, : r.numel()] = r, 1
    right = model.generate(right_ids, attention_mask=right_mask, max_new_tokens=6, pad_token_id=7)
    listed = model.generate([r.tolist() for r in rows], max_new_tokens=6, prefill_chunk=5)
    for b, r in enumerate(rows):
        n = r.numel()
        assert torch.equal(right[b, :n], r) and torch.equal(right[b, n : n + 6], left[b])
        assert (right[b, n + 6 :] == 7).all()
        assert torch.equal(listed[b, n : n + 6], left[b])


def test_generate_sampling_and_eos():
    """Sampling is reproducible with a generator, top_k=1 is greedy, tokens stay in the top-k set,
    and a row that emits eos is padded afterwards."""
    model = make_lm("window")  # the sampling logic does not depend on the attention kind
    rows = prompts(4)[:2]
    greedy = model.generate([r.tolist() for r in rows], max_new_tokens=5)
    lists = [r.tolist() for r in rows]
    seeded = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    one = model.generate(lists, max_new_tokens=5, do_sample=True, top_k=1, generator=seeded(0))
    assert torch.equal(one, greedy)
    runs = [
        model.generate(lists, max_new_tokens=5, do_sample=True, top_k=5, temperature=2.0, return_logits=True,
                       generator=seeded(9))
        for _ in range(2)
    ]
    assert torch.equal(runs[0][0], runs[1][0])
    seqs, logits = runs[0]
    for b, r in enumerate(rows):
        new = seqs[b, r.numel() : r.numel() + 5]
        top5 = logits[b].topk(5, dim=-1).indices
        assert (top5 == new[:, None]).any(-1).all(), "a sampled token is outside the top-k set"
    n0 = rows[0].numel()
    eos = int(greedy[0, n0 + 1])  # row 0 emits it at its second new token (or at its first)
    at = int((greedy[0, n0:] == eos).nonzero()[0])
    out = model.generate([r.tolist() for r in rows], max_new_tokens=5, eos_token_id=eos, pad_token_id=VOCAB - 1)
    assert torch.equal(out[0, : n0 + at + 1], greedy[0, : n0 + at + 1])
    assert (out[0, n0 + at + 1 : n0 + 5] == VOCAB - 1).all()


def test_batched_cache_chunks_and_memory():
    """One cache for B = 2 rows fed in chunks of 50 == the uncached forward; FS-L's cache memory stops
    growing with T (L7 at model level), the dense KV cache keeps growing."""
    sizes = {}
    for attention in ("fsl", "dense"):
        model = make_lm(attention)
        cache = model.new_cache(2)
        ids = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(5))
        mem, chunks = [], []
        with torch.no_grad():
            for start in range(0, 200, 50):
                chunks.append(model(ids[:, start : start + 50], cache=cache))
                mem.append(model.cache_memory_bytes(cache))
            assert_close(torch.cat(chunks, dim=1), model(ids), 1e-5, f"{attention} chunked cache")
        sizes[attention] = mem
    assert sizes["fsl"][-1] == sizes["fsl"][-2] == sizes["fsl"][-3], sizes  # T >= w + (P+W)*s + Bq = 96
    held = [2 * 2 * 2 * t * 2 * 8 * 4 for t in (50, 100, 150, 200)]  # layers * (k, v) * B * T * Hkv * D * fp32
    assert all(m >= h for m, h in zip(sizes["dense"], held)) and sizes["dense"][-1] > sizes["dense"][0], sizes


def test_backend_agnostic_numpy_equals_torch():
    """The same float64 model on the numpy oracle (host cache) and on the torch backend: equal logits
    and equal greedy tokens (the layer only passes `backend=` through)."""
    models = {b: make_lm("fsl", backend=b).double() for b in ("numpy", "torch")}
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = {b: m(ids) for b, m in models.items()}
    assert_close(out["numpy"], out["torch"], 1e-10, "numpy vs torch logits")
    gen = {b: m.generate([ids[0, :35].tolist()], max_new_tokens=3) for b, m in models.items()}
    assert torch.equal(gen["numpy"], gen["torch"])
    assert models["numpy"].new_cache(1)[0].backend == "numpy"


def test_decode_graph_as_layer_cache(monkeypatch):
    """`cache.decode_graph(beta)` stands for a layer's cache: with each CUDA graph replaced by a direct
    call of the function it would capture (CPU), decoding through the graphs gives the eager cache's
    logits, across block boundaries."""
    from freesolo.streaming import torch_state

    class FakeGraph:
        def __init__(self, fn):
            self.fn, self.out = fn, None

        def replay(self):
            self.out.copy_(self.fn())

    def fake_capture(self, fn, share_with):
        graph = FakeGraph(fn)
        snapshot = self.state.state_dict()
        graph.out = fn().clone()
        self.state.load_state_dict(snapshot)
        return graph, graph.out

    monkeypatch.setattr(torch_state.DecodeGraph, "_check", staticmethod(lambda state: None))
    monkeypatch.setattr(torch_state.DecodeGraph, "_warmup", lambda self, fns: [fn() for fn in fns])
    monkeypatch.setattr(torch_state.DecodeGraph, "_capture", fake_capture)
    model = make_lm("fsl")
    ids = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(13))
    eager, graphed = model.new_cache(1), model.new_cache(1)
    with torch.no_grad():
        model(ids[:, :50], cache=eager)
        model(ids[:, :50], cache=graphed)
        graphs = [c.decode_graph(layer.self_attn.beta.detach()) for c, layer in zip(graphed, model.layers)]
        for t in range(50, 90):  # crosses the block boundaries at 64 and 80
            a = model(ids[:, t : t + 1], cache=eager)
            b = model(ids[:, t : t + 1], cache=graphs)
            assert torch.equal(a, b), f"t={t}"
        with pytest.raises(ValueError, match="one token per call"):
            model(ids[:, :2], cache=graphs)


# ---- save / load --------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,tied", [("fsb", True), ("fsl", False), ("window", True)])
def test_save_load_round_trip_bit_identical(tmp_path, attention, tied):
    model = make_lm(attention, tie_embeddings=tied, qkv_bias=True)
    ids = torch.randint(0, VOCAB, (2, 60), generator=torch.Generator().manual_seed(6))
    model.save_pretrained(str(tmp_path))
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["config"]["attention"] == attention and meta["config"]["freesolo"]["cell"] == FS.cell
    loaded = FreeSoloLM.from_pretrained(str(tmp_path))
    assert loaded.config == model.config
    if attention == "fsb":
        for a, b in zip(model.layers, loaded.layers):
            assert a.self_attn.tau == b.self_attn.tau  # float64, exact
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_checkpoint_continued_with_another_attention(tmp_path):
    """A dense checkpoint loaded as FS-L keeps every weight and starts with beta = beta_init = 0: its
    logits equal the window baseline's; FS weights load as FS-B (tau then calibrated)."""
    dense = make_lm("dense")
    dense.save_pretrained(str(tmp_path / "dense"))
    fsl = FreeSoloLM.from_pretrained(str(tmp_path / "dense"), attention="fsl", beta_init=0.0)
    window = FreeSoloLM.from_pretrained(str(tmp_path / "dense"), attention="window")
    assert all(float(layer.self_attn.beta.detach().abs().max()) == 0.0 for layer in fsl.layers)
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert_close(fsl(ids), window(ids), 1e-5, "FS-L with beta 0 vs window")
    make_lm("fs").save_pretrained(str(tmp_path / "fs"))
    fsb = FreeSoloLM.from_pretrained(str(tmp_path / "fs"), attention="fsb")
    assert fsb.layers[0].self_attn.cfg.variant == "fsb" and fsb.layers[0].self_attn.tau is None


def test_mismatched_checkpoints_give_clear_errors(tmp_path):
    model = make_lm("fsl")
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"shape mismatch.*mlp\.gate_proj\.weight"):
        FreeSoloLM.from_pretrained(str(tmp_path), d_ff=64)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head.weight'\]|missing \['lm_head.weight'\]"):
        FreeSoloLM.from_pretrained(str(tmp_path), tie_embeddings=False)
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.self_attn.beta', 'layers.1.self_attn.beta'\]"):
        FreeSoloLM.from_pretrained(str(tmp_path), attention="dense")
    with pytest.raises(FileNotFoundError, match="not a FreeSoloLM.save_pretrained directory"):
        FreeSoloLM.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(json.dumps({"format": "something/else", "config": {}}))
    with pytest.raises(ValueError, match="format"):
        FreeSoloLM.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown LMConfig fields \['colour'\]"):
        LMConfig.from_dict({**model.config.to_dict(), "colour": "red"})


# ---- FS-B calibration ---------------------------------------------------------------------------


def _median_cell_norm(k: torch.Tensor, cell: int) -> np.ndarray:
    """Independent statement: per kv head, the median over complete cells of max_t ||k_t||."""
    k = k.detach().double()
    C = k.shape[1] // cell
    a = k[:, : C * cell].reshape(k.shape[0], C, cell, k.shape[2], k.shape[3]).norm(dim=-1).amax(dim=2)  # (B, C, Hkv)
    return a.reshape(-1, k.shape[2])


def test_calibrate_tau_per_layer_and_kv_head():
    """Layer l's tau [Hkv] is the median a_c of the keys layer l sees, with layers < l calibrated."""
    model = make_lm("fsb")
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (45, 30, 7)]
    taus = model.calibrate_tau([s.tolist() for s in seqs])
    assert len(taus) == 2 and all(t.shape == (2,) for t in taus)
    hs = [model.embed_tokens(s[None]) for s in seqs]
    with torch.no_grad():
        for layer, tau in zip(model.layers, taus):
            a = torch.cat([_median_cell_norm(layer.self_attn.qkv(layer.input_layernorm(h))[1], FS.cell) for h in hs])
            assert a.shape[0] == 45 // 8 + 30 // 8  # the 7-token sequence has no complete cell
            np.testing.assert_allclose(tau, np.median(a.numpy(), axis=0), rtol=1e-6)
            assert layer.self_attn.tau == tuple(tau)
            hs = [layer(h) for h in hs]
    with pytest.raises(ValueError, match="complete cell"):
        model.calibrate_tau([[1, 2, 3]])
    with pytest.raises(ValueError, match="attention='dense'"):
        make_lm("dense").calibrate_tau(seqs)


# ---- causality (L2 at model level) and packed sequences -----------------------------------------


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_model_causality(attention):
    """Changing tokens after position i leaves the logits of positions <= i unchanged (bitwise for
    FreeSolo: spec L12; within float tolerance for the SDPA baselines, which promise no bits)."""
    model = make_lm(attention)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, VOCAB, (2, 80), generator=g)
    cut = 45
    other = ids.clone()
    other[:, cut + 1 :] = torch.randint(0, VOCAB, (2, 80 - cut - 1), generator=g)
    with torch.no_grad():
        a, b = model(ids), model(other)
    if attention in ("fs", "fsl", "fsb"):
        assert torch.equal(a[:, : cut + 1], b[:, : cut + 1])
    else:
        assert_close(a[:, : cut + 1], b[:, : cut + 1], 1e-6, "prefix logits")
    assert (a[:, cut + 1 :] - b[:, cut + 1 :]).abs().max() > 1e-3  # the change is visible after the cut


@pytest.mark.parametrize("attention", ["fsl", "dense", "window"])  # every FreeSolo variant: L11 in the op's tests
def test_packed_sequences_equal_separate_runs(attention):
    """forward(input_ids [1, sum T_n], cu_seqlens) == each sequence run alone (positions restart)."""
    model = make_lm(attention)
    rows = prompts(9)
    packed = torch.cat(rows)[None]
    cu = torch.tensor([0] + np.cumsum([r.numel() for r in rows]).tolist())
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu)
        for n, r in enumerate(rows):
            assert_close(out[0, cu[n] : cu[n + 1]], model(r[None])[0], 1e-5, f"sequence {n}")
    loss = model.loss(packed, cu_seqlens=cu)
    expected = torch.cat(
        [torch.nn.functional.cross_entropy(model(r[None])[0, :-1], r[1:], reduction="none") for r in rows]
    ).mean()
    assert abs(loss.item() - expected.item()) < 1e-5


# ---- torch.compile --------------------------------------------------------------------------------


def _compile_matches_eager(model, ids):
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if not ids.is_cuda else "inductor")
    out = compiled(ids)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(ids)
    ref.float().square().mean().backward()
    tol = 1e-4 if ids.is_cuda else 1e-5  # inductor reorders float32 reductions on the GPU
    assert_close(out.detach().float().cpu(), ref.detach().float().cpu(), tol, "compiled forward")
    for n, p in model.named_parameters():
        assert_close(grads[n].float().cpu(), p.grad.float().cpu(), tol * 10, f"compiled grad {n}")


@pytest.mark.parametrize("attention", ["fsl"])
def test_torch_compile_fullgraph_forward_backward(attention):
    """torch.compile(model, fullgraph=True): one graph for forward and backward, equal to eager.

    The torch backend itself cannot be traced (next test), so under torch.compile the module calls
    FreeSolo attention through the opaque custom op `freesolo::attention_opaque` (backward: a second
    op that recomputes the forward with autograd). On the CPU the graph runs with backend="aot_eager"
    (tracing and autograd without C++ code generation, to keep the test fast)."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attention=attention, freesolo=FS)
    model = FreeSoloLM(cfg)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(10))
    torch._dynamo.reset()
    _compile_matches_eager(model, ids)


@pytest.mark.xfail(
    strict=True,
    raises=torch._dynamo.exc.Unsupported,
    reason="tracing INTO the torch backend fails: the backward of its autograd.Function (FreeSoloReadout) "
    "recomputes each chunk with torch.autograd.grad, which Dynamo does not trace (and its Python loops over "
    "query blocks would unroll, T/block copies). compile_mode='auto' therefore calls the torch backend "
    "through the opaque op; only the triton backend (custom ops with fake tensors) is traced directly",
)
def test_torch_backend_cannot_be_traced_directly():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, attention="fsl", freesolo=FS)
    model = FreeSoloLM(cfg)
    model.layers[0].self_attn.compile_mode = "direct"
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(10))
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend="aot_eager")(ids).square().mean().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor on the GPU (triton and torch backends); no CUDA device here")
@pytest.mark.parametrize("backend,attention", [("triton", "fsl"), ("triton", "fs"), ("torch", "fsl")])
def test_torch_compile_cuda(backend, attention):
    """On the GPU: torch.compile(fullgraph=True, inductor), forward and backward equal to eager; the
    triton backend traced directly (its custom ops), the torch backend through the opaque op."""
    if backend not in freesolo.available_backends():
        pytest.fail(f"the {backend} backend is not available on this CUDA machine")
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg = LMConfig(**sizes, attention=attention, freesolo=FS, backend=backend)
    model = FreeSoloLM(cfg).cuda()
    ids = torch.randint(0, VOCAB, (2, 256), device="cuda")
    torch._dynamo.reset()
    _compile_matches_eager(model, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the triton backend and its fused decode step run on CUDA")
@pytest.mark.parametrize("attention", ["fsl", "fs", "fsb"])
def test_generate_triton_cuda(attention):
    """On the GPU, backend='triton' (prefill: the parallel op; decode: the cache's fused Triton step,
    FS-B: the Triton decode search): greedy tokens equal the uncached forward's argmax, logits
    within float32 tolerance."""
    if "triton" not in freesolo.available_backends():
        pytest.fail("the triton backend is not available on this CUDA machine")
    model = make_lm(attention, backend="triton", device="cuda")  # FS-B calibrates on the GPU (triton)
    rows = [r.cuda() for r in prompts()]
    seqs, logits = model.generate([r.tolist() for r in rows], max_new_tokens=NEW, return_logits=True)
    for b, r in enumerate(rows):
        n = r.numel()
        with torch.no_grad():
            ref = model(seqs[b, : n + NEW][None])[0, n - 1 : n - 1 + NEW]
        assert torch.equal(ref.argmax(-1), seqs[b, n : n + NEW]), f"row {b}"
        assert_close(logits[b].cpu(), ref.cpu(), 1e-4, f"{attention} triton row {b}")


# ---- errors -------------------------------------------------------------------------------------


def test_bad_configs_and_inputs_name_the_problem():
    bad = [
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads=3"),
        (dict(attention="flash"), "attention='flash'"),
        (dict(d_model=30, n_heads=4), "d_model=30"),
        (dict(head_dim=7), "head_dim=7"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(tie_embeddings=1), "tie_embeddings=1"),
    ]
    for change, message in bad:
        fields = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
        fields.update(change)
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            LMConfig(**fields)
    with pytest.raises(TypeError, match="freesolo must be a FreeSoloConfig"):
        LMConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, freesolo="fsl")
    fs_model = LMConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, attention="fs", freesolo=FS)
    assert fs_model.freesolo.variant == "fs"  # the attention kind sets the variant
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        FreeSoloAttention(32, 4, 3, cfg=FS)
    attn = FreeSoloAttention(32, 4, 2, cfg=FS, backend="torch")
    with pytest.raises(ValueError, match=r"hidden_size=32\], got \(2, 5, 31\)"):
        attn(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="2 per-row caches but x has B=3"):
        attn(torch.randn(3, 1, 32), cache=[attn.new_cache(1), attn.new_cache(1)])
    model = make_lm("fsl")
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor \[B, T\]"):
        model(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="padding between real tokens"):
        model.generate(torch.ones(1, 4, dtype=torch.int64), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="mixes left- and right-padded"):
        model.generate(torch.ones(2, 3, dtype=torch.int64), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=61\\)"):
        model.generate([[1, 2, VOCAB]])
