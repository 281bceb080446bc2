"""FreeSoloCache with rows at different positions (spec §9, last bullet): prompts of different
lengths, chunked prefill with per-row lengths, rows that stop early. Each row's outputs must equal
its own sequence's parallel outputs (L6 per row), and bit for bit those of a batch-1 cache fed
that row alone with the same chunking (L12).

API under test: `extend(q, k, v, lengths=[...])` / `prefill(k, v, lengths=[...])`, row b taking
the first lengths[b] tokens of the right-padded chunk; `cache.lengths`; state round trip.
"""

from __future__ import annotations

import numpy as np
import pytest

import freesolo
from freesolo import FreeSoloCache, FreeSoloConfig

from .helpers import SMALL, assert_close, off_grid_tau, random_qkv

torch = pytest.importorskip("torch")

B, HQ, HKV, D = 3, 4, 2, 6
PROMPTS = (5, 19, 11)  # prompt lengths: row 0 shorter than a block, row 1 past the window
FINAL = (30, 26, 21)  # tokens each row ends with (rows stop at different steps)


def make_cfg(variant: str, k) -> FreeSoloConfig:
    cfg = FreeSoloConfig(variant=variant, **SMALL)
    return cfg.replace(tau=off_grid_tau(k, cfg)) if variant == "fsb" else cfg


def schedule(prefill_chunk: int):
    """(lengths per row, starts per row) of each call: the prompts in chunks of `prefill_chunk`
    (right-padded), then one-token steps until each row has FINAL[b] tokens (0 once it stopped)."""
    calls, pos = [], [0] * B
    while any(p < n for p, n in zip(pos, PROMPTS)):
        lengths = [min(prefill_chunk, n - p) for p, n in zip(pos, PROMPTS)]
        calls.append((lengths, list(pos)))
        pos = [p + n for p, n in zip(pos, lengths)]
    while any(p < n for p, n in zip(pos, FINAL)):
        lengths = [1 if p < n else 0 for p, n in zip(pos, FINAL)]
        calls.append((lengths, list(pos)))
        pos = [p + n for p, n in zip(pos, lengths)]
    return calls


def run_ragged(cache, q, k, v, beta, calls, to=None, use_prefill=False):
    """Feed the calls (padded chunks); returns each row's outputs [FINAL[b], Hq, D] float64 (NaN
    where the row's output was not produced: prefilled tokens)."""
    outs = [np.full((FINAL[b], HQ, D), np.nan) for b in range(B)]
    for i, (lengths, starts) in enumerate(calls):
        n = max(lengths)
        chunk = [np.zeros((B, n) + x.shape[2:]) for x in (q, k, v)]
        for b in range(B):
            for x, c in zip((q, k, v), chunk):
                c[b, : lengths[b]] = x[b, starts[b] : starts[b] + lengths[b]]
        if to is not None:
            chunk = [torch.from_numpy(c).to(to) for c in chunk]
        if use_prefill and i == 0:
            cache.prefill(chunk[1], chunk[2], lengths=lengths)
            continue
        b_arg = None if beta is None else (beta if to is None else torch.from_numpy(beta))
        out = cache.extend(*chunk, beta=b_arg, lengths=lengths)
        out = out.double().numpy() if hasattr(out, "detach") else np.asarray(out)
        for b in range(B):
            outs[b][starts[b] : starts[b] + lengths[b]] = out[b, : lengths[b]]
            assert not np.any(out[b, lengths[b] :]), "padded outputs must be zeros"
    return outs


def per_row_reference(q, k, v, cfg, beta):
    return [
        freesolo.freesolo_attention(q[b : b + 1, : FINAL[b]], k[b : b + 1, : FINAL[b]], v[b : b + 1, : FINAL[b]],
                                    cfg, beta=beta, backend="numpy")[0]
        for b in range(B)
    ]  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
@pytest.mark.parametrize("prefill_chunk", [4, 7], ids=["pchunk4", "pchunk7"])
def test_rows_at_different_lengths_equal_their_own_parallel_output(variant, backend, prefill_chunk):
    """L6 per row: padded chunked prompts of different lengths, then decode where rows stop at
    different steps; every produced output == the parallel op on that row's sequence alone."""
    q, k, v = random_qkv(21, B, max(FINAL), HQ, HKV, D)
    cfg = make_cfg(variant, k)
    beta = np.linspace(0.5, 1.5, HQ)
    to = torch.float64 if backend == "torch" else None
    cache = FreeSoloCache(cfg, B, HQ, HKV, D, backend=backend)
    outs = run_ragged(cache, q, k, v, beta, schedule(prefill_chunk), to=to)
    assert cache.lengths == list(FINAL) and cache.ragged
    rtol = 1e-10 if backend == "torch" else 1e-12
    for b, ref in enumerate(per_row_reference(q, k, v, cfg, beta)):
        assert_close(outs[b], ref, rtol=rtol, name=f"{variant} row {b}")


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_ragged_prefill_then_decode(variant):
    """prefill(lengths=...) of uneven prompts, then decode: the decoded outputs == parallel per row."""
    q, k, v = random_qkv(22, B, max(FINAL), HQ, HKV, D)
    cfg = make_cfg(variant, k)
    cache = FreeSoloCache(cfg, B, HQ, HKV, D, backend="torch")
    calls = schedule(prefill_chunk=max(PROMPTS))  # one padded prompt chunk, then decode
    outs = run_ragged(cache, q, k, v, None, calls, to=torch.float64, use_prefill=True)
    for b, ref in enumerate(per_row_reference(q, k, v, cfg, None)):
        assert np.isnan(outs[b][: PROMPTS[b]]).all()
        assert_close(outs[b][PROMPTS[b] :], ref[PROMPTS[b] :], rtol=1e-10, name=f"{variant} row {b}")


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_ragged_row_bitwise_equals_batch1_cache(variant):
    """L12: row b of the ragged batch == a batch-1 cache fed row b alone, same chunks, bit for bit
    (float32), after the cache was first fed in lockstep (the split of a batched state)."""
    q, k, v = (torch.from_numpy(x).float() for x in random_qkv(23, B, max(FINAL), HQ, HKV, D))
    cfg = make_cfg(variant, None)
    cache = FreeSoloCache(cfg, B, HQ, HKV, D, backend="torch")
    cache.extend(q[:, :9], k[:, :9], v[:, :9])  # lockstep first
    alone = [FreeSoloCache(cfg, 1, HQ, HKV, D, backend="torch") for _ in range(B)]
    for b in range(B):
        alone[b].extend(q[b : b + 1, :9], k[b : b + 1, :9], v[b : b + 1, :9])
    pos = [9] * B
    for step_lengths in ([3, 0, 5], [1, 1, 0], [2, 4, 1], [0, 1, 1], [1, 1, 1]):
        n = max(step_lengths)
        chunk = [torch.zeros((B, n) + x.shape[2:]) for x in (q, k, v)]
        for b, n_b in enumerate(step_lengths):
            for x, c in zip((q, k, v), chunk):
                c[b, :n_b] = x[b, pos[b] : pos[b] + n_b]
        out = cache.extend(*chunk, lengths=step_lengths)
        for b, n_b in enumerate(step_lengths):
            if n_b:
                ref = alone[b].extend(*(x[b : b + 1, pos[b] : pos[b] + n_b] for x in (q, k, v)))
                assert torch.equal(out[b : b + 1, :n_b], ref), f"row {b} at {pos[b]}"
            pos[b] += n_b
    assert cache.lengths == pos


def test_ragged_state_round_trip_and_errors():
    """state_dict of a ragged cache restores bit-identical continuations; bad lengths are refused."""
    q, k, v = (torch.from_numpy(x).float() for x in random_qkv(24, B, 20, HQ, HKV, D))
    cfg = make_cfg("fsl", None)
    a = FreeSoloCache(cfg, B, HQ, HKV, D, backend="torch")
    a.extend(q[:, :6], k[:, :6], v[:, :6], lengths=[6, 2, 4])
    with pytest.raises(ValueError, match="different positions"):
        _ = a.length
    b = FreeSoloCache(cfg, B, HQ, HKV, D, backend="torch")
    b.load_state_dict(a.state_dict())
    assert b.lengths == [6, 2, 4] and b.ragged
    step = (q[:, 10:11], k[:, 10:11], v[:, 10:11])
    assert torch.equal(a.extend(*step, lengths=[1, 1, 1]), b.extend(*step, lengths=[1, 1, 1]))
    assert torch.equal(a.extend(*step), b.extend(*step))  # no lengths on a ragged cache: every row moves
    assert a.lengths == [8, 4, 6]
    for bad, match in (([1, 1], "2 entries, the cache has batch=3"), ([2, 0, 0], r"lengths\[0\]=2"), ([-1, 0, 0], "must be an int")):
        with pytest.raises(ValueError, match=match):
            a.extend(*step, lengths=bad)
    with pytest.raises(ValueError, match="fused step"):  # ragged graphs need the fused FS-L step
        a.decode_graph()
    fsb = FreeSoloCache(make_cfg("fsb", k.numpy()), B, HQ, HKV, D, backend="torch")
    fsb.extend(q[:, :3], k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="from the start"):
        fsb.extend(q[:, :3], k[:, :3], v[:, :3], lengths=[3, 1, 0])
    lock = FreeSoloCache(cfg, B, HQ, HKV, D, backend="torch")
    lock.extend(q[:, :4], k[:, :4], v[:, :4], lengths=[4, 4, 4])  # all full: stays batched
    assert not lock.ragged and lock.length == 4
