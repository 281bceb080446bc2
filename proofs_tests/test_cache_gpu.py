"""FreeSoloCache on CUDA: L6 against the oracle, L10 for the FS-B forests grown on the GPU, FS-L decode without host synchronisation
(`torch.cuda.set_sync_debug_mode("error")`), and a decode step captured in a CUDA graph.

Skipped on machines without a CUDA device (the reason is printed). Run on the GPU with
`python -m pytest proofs_tests/test_cache_gpu.py -v`.
"""

from __future__ import annotations

import numpy as np
import pytest

import freesolo
from freesolo import FreeSoloCache, FreeSoloConfig

from .helpers import assert_close, random_qkv

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FreeSoloCache CUDA decode)"),
]

CFG = FreeSoloConfig(variant="fsl", window=32, cell=4, block=16, pool=4, recent=3, top_k=3)


def cuda(x, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda", dtype)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("chunks", [(1,), (5, 16, 1, 33)], ids=["decode", "mixed"])
def test_cuda_stream_equals_oracle(variant, chunks):
    cfg = CFG.replace(variant=variant)
    B, T, Hq, Hkv, D = 2, 150, 4, 2, 64
    q, k, v = random_qkv(0, B, T, Hq, Hkv, D)
    expected = freesolo.freesolo_attention(q, k, v, cfg, backend="numpy")
    cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch")
    outs, start, n = [], 0, 0
    while start < T:
        size = min(chunks[n % len(chunks)], T - start)
        sl = slice(start, start + size)
        outs.append(cache.extend(cuda(q[:, sl]), cuda(k[:, sl]), cuda(v[:, sl])).double().cpu().numpy())
        start, n = start + size, n + 1
    assert_close(np.concatenate(outs, 1), expected, rtol=1e-5, name=f"cuda {variant} stream")


def test_cuda_fsl_decode_has_no_host_sync():
    """Every FS-L decode step (block boundaries, T < w masks, early blocks included) with
    check_finite=False runs under sync debug mode "error": a host sync would raise."""
    B, T, Hq, Hkv, D = 2, 3 * CFG.block + CFG.window + 7, 4, 2, 64
    q, k, v = (cuda(x, torch.bfloat16) for x in random_qkv(1, B, T, Hq, Hkv, D))
    cache = FreeSoloCache(CFG, B, Hq, Hkv, D, backend="torch", dtype=torch.bfloat16, device="cuda")
    beta = torch.linspace(0.5, 1.5, Hq, device="cuda")
    outs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(T):
            outs.append(cache.extend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], beta=beta, check_finite=False))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.cat(outs, 1)
    assert torch.isfinite(out).all()
    expected = freesolo.freesolo_attention(
        *(x.double().cpu().numpy() for x in (q, k, v)), CFG, beta=beta.double().cpu().numpy(), backend="numpy"
    )
    assert_close(out.double().cpu().numpy(), expected, rtol=3e-2, name="bf16 decode")


def test_cuda_graph_decode_matches_eager():
    B, Hq, Hkv, D = 3, 4, 1, 64
    T0, steps = CFG.window + 2 * CFG.block + 5, 3 * CFG.block + 2  # steady state, crosses 3 boundaries
    q, k, v = (cuda(x) for x in random_qkv(2, B, T0 + steps, Hq, Hkv, D))
    eager = FreeSoloCache(CFG, B, Hq, Hkv, D, backend="torch")
    eager.extend(q[:, :T0], k[:, :T0], v[:, :T0])
    graphed = FreeSoloCache(CFG, B, Hq, Hkv, D, backend="torch")
    graphed.load_state_dict(eager.state_dict())
    step = graphed.decode_graph()
    outs_eager, outs_graph = [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # neither the eager step nor the replays may sync
    try:
        for t in range(T0, T0 + steps):
            outs_eager.append(eager.extend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], check_finite=False))
            outs_graph.append(step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1]).clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t, (a, b) in enumerate(zip(outs_eager, outs_graph)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"step {t}")
    assert graphed.length == eager.length == T0 + steps
    for name, x in eager.state.buffers().items():
        assert torch.equal(graphed.state.buffers()[name], x), f"state {name} differs after graph replay"


def test_cuda_graph_refuses_before_steady_state():
    cache = FreeSoloCache(CFG, 1, 2, 1, 64, backend="torch", dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="steady state"):
        cache.decode_graph()


def test_cuda_fsl_memory_constant_at_large_T():
    """L7 on the device at paper sizes: prefill 2k and 40k tokens, memory_bytes identical."""
    cfg = FreeSoloConfig(variant="fsl")
    sizes = []
    for T in (2048, 40960):
        cache = FreeSoloCache(cfg, 1, 8, 2, 64, backend="torch", dtype=torch.bfloat16, device="cuda")
        for start in range(0, T, 8192):
            n = min(8192, T - start)
            cache.prefill(
                torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16),
            )
        sizes.append(cache.memory_bytes())
        held = (cache.state.cell_ids >= 0).sum(-1)
        assert int(held.max()) <= cfg.pool + cfg.recent
    assert sizes[0] == sizes[1]


def test_cuda_prefill_equals_extend_paper_sizes():
    """Default (paper) sizes on the device: prefill (state only) then extend == extend throughout."""
    cfg = FreeSoloConfig(variant="fsl")
    B, T, cut, Hq, Hkv, D = 2, 3000, 2900, 4, 2, 64
    q, k, v = (torch.randn(B, T, h, D, device="cuda") for h in (Hq, Hkv, Hkv))
    full = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch")
    outs = [full.extend(q[:, s : s + 500], k[:, s : s + 500], v[:, s : s + 500]) for s in range(0, T, 500)]
    expected = torch.cat(outs, 1)[:, cut:]
    pre = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch")
    for s in range(0, cut, 1000):
        e = min(s + 1000, cut)
        pre.prefill(k[:, s:e], v[:, s:e])
    got = pre.extend(q[:, cut:], k[:, cut:], v[:, cut:])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(pre.state.cell_ids.sort(-1).values, full.state.cell_ids.sort(-1).values)


@pytest.mark.parametrize("leaf_order", ["content", "position"])
def test_cuda_fsb_streaming_forests_equal_batch_construction(leaf_order):
    """L10 for the GPU forests: the FS-B cache with the fused step on CUDA (its carries built by
    the Triton tree builder, the high-norm rows picked on the device) holds, after a stream of
    chunks of 1, 7 and 30 tokens, exactly the live trees of the torch backend's batch
    construction over the state's own cells (float64 on the CPU): cells, e and A equal, mu and
    rad within float32 rounding; every row's high-cell list equal to its cells with a_c > tau."""
    from freesolo.backends.torch.fsb import build_node_table

    from .test_cache import live_trees, make_cfg, split

    B, T, Hq, Hkv, D = 2, 300, 4, 2, 64
    q, k, v = random_qkv(6, B, T, Hq, Hkv, D)
    cfg = make_cfg("fsb", k, leaf_order=leaf_order)
    cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", dtype=torch.float32, device="cuda", decode_kernel="triton")
    for sl in split(T, (1, 7, 30)):
        cache.extend(cuda(q[:, sl]), cuda(k[:, sl]), cuda(v[:, sl]), check_finite=False)
    state = cache.state
    assert state.forest_all.builder == "triton"
    C = (T - 1) // cfg.block * cfg.block // cfg.cell
    kbar = state.cell_kbar[:, :, :C].double().cpu()
    a = state.cell_a[:, :, :C].double().cpu()
    codes = state.codes[:, :, :C].cpu()
    cells = torch.arange(C).expand(B, Hkv, C)
    tau = torch.as_tensor(cfg.tau_array(Hkv))
    # the high-norm test as the state makes it: a_c in float64 from the stored (float32) tokens
    k32 = cuda(k).double().cpu().permute(0, 2, 1, 3)[:, :, : C * cfg.cell].reshape(B, Hkv, C, cfg.cell, D)
    a64 = (k32 * k32).sum(-1).sqrt().amax(3)  # (B, Hkv, C)
    batch = build_node_table(kbar, a, cells, codes, C, cfg, outward=False)
    checked = 0
    for forest, rows in ((state.forest_all, None), (state.forest_high, "high")):
        for b in range(B):
            for g in range(Hkv):
                if rows is None:
                    table, n = batch, C
                    tb, tg = b, g
                else:
                    high = torch.nonzero(a64[b, g] > tau[g]).flatten()
                    n = len(high)
                    assert torch.equal(state.high_cells[b, g, :n].cpu(), high)
                    assert int(state.n_high[b, g]) == n
                    sub = (x[b : b + 1, g : g + 1][:, :, high] for x in (kbar, a, cells, codes))
                    table = build_node_table(*sub, n, cfg, outward=False)
                    tb, tg = 0, 0
                for h, size, src in live_trees(table, n):
                    dst = forest.base(h)
                    for name in ("cell", "e", "A"):
                        got = getattr(forest, name)[b, g, dst : dst + size].cpu().to(getattr(table, name).dtype)
                        assert torch.equal(got, getattr(table, name)[tb, tg, src : src + size]), (rows, b, g, h, name)
                    for name in ("mu", "rad"):
                        got = getattr(forest, name)[b, g, dst : dst + size].double().cpu()
                        want = getattr(table, name)[tb, tg, src : src + size]
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{rows} {b} {g} h={h} {name}")
                    checked += 1
    assert checked > 4 * B * Hkv
