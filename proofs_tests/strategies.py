"""Hypothesis strategies shared by the proofs: shapes, configs, seeds."""

from __future__ import annotations

from hypothesis import strategies as st

from freesolo import FreeSoloConfig

AWKWARD_T = (1, 31, 33, 127, 129)


@st.composite
def shapes(draw, max_t: int = 160, awkward=AWKWARD_T, dims=(2, 6, 8), groups=(1, 2, 4)):
    """(B, T, Hq, Hkv, D): awkward lengths or any T <= max_t, GQA group sizes 1, 2, 4.

    Half the branches draw T in [max_t/2, max_t]: with small_configs (blocks of <= 12 tokens)
    those lengths select cells, and top-K and the FS-L pool prune; shorter ones often read none."""
    long_t = st.integers(max(1, max_t // 2), max_t)
    T = draw(st.one_of(long_t, st.sampled_from([t for t in awkward if t <= max_t]), long_t, st.integers(1, max_t)))
    Hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from(groups))
    B = draw(st.integers(1, 2))
    D = draw(st.sampled_from(dims))
    return B, T, Hkv * group, Hkv, D


@st.composite
def small_configs(draw, variant=None):
    """Configs small enough that pruning bites (cells of 2-4 tokens, blocks of 1-3 cells)."""
    cell = draw(st.sampled_from([2, 4]))
    block = cell * draw(st.integers(1, 3))
    window = block + draw(st.integers(0, 12))
    return FreeSoloConfig(
        variant=variant or draw(st.sampled_from(["fs", "fsl"])),
        window=window,
        cell=cell,
        block=block,
        top_k=draw(st.integers(1, 4)),
        pool=draw(st.integers(1, 4)),
        recent=draw(st.integers(1, 3)),
        sigma=draw(st.sampled_from([0.5, 4.0])),
        lam=draw(st.sampled_from([0.0, 1.0, 3.0])),
    )


seeds = st.integers(0, 2**31 - 1)
