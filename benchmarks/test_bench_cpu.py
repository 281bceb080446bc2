"""pytest-benchmark of the CPU backends (numpy oracle, numba): forward and selection, per variant.

Not part of CI's proofs_tests (timing is not a proof). Run:

    python -m pytest benchmarks/test_bench_cpu.py --benchmark-columns=min,median,rounds
    python -m pytest benchmarks/test_bench_cpu.py --benchmark-json=benchmarks/results/cpu_bench.json

Sizes are small: the numpy oracle loops in Python (T=256 with a reduced config), numba runs the
paper's config at T = 2k and 8k. Ids read like `numba-fsl-forward-B1-T8192-H2-D64`.
"""

from __future__ import annotations

import numpy as np
import pytest

import freesolo
from freesolo import FreeSoloConfig
from freesolo.complexity.measured import make_inputs, tau_for_keys

# reduced config for the Python-loop oracle: pruning still bites at T=256
SMALL_CONFIG = dict(window=64, cell=8, block=16, pool=8, recent=2, beam=4)

CASES = [
    # backend, T, Hq, Hkv, D, config overrides
    ("numpy", 256, 2, 1, 32, SMALL_CONFIG),
    ("numba", 2048, 2, 1, 64, {}),
    ("numba", 8192, 2, 1, 64, {}),
]


def _case_id(case):
    backend, T, Hq, Hkv, D, overrides = case
    return f"{backend}-B1-T{T}-H{Hq}-D{D}" + ("-small" if overrides else "")


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def case(request):
    backend, T, Hq, Hkv, D, overrides = request.param
    # numpy and numba are base dependencies: an unavailable backend is an error, not a skip
    assert backend in freesolo.available_backends(), freesolo.available_backends()
    q, k, v = make_inputs(1, T, Hq, Hkv, D, seed=0)
    return backend, q, k, v, FreeSoloConfig(**overrides)


def _config(cfg: FreeSoloConfig, variant: str, k) -> FreeSoloConfig:
    cfg = cfg.replace(variant=variant)
    return cfg.replace(tau=tuple(tau_for_keys(k, cfg))) if variant == "fsb" else cfg


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_forward(benchmark, case, variant):
    backend, q, k, v, cfg = case
    cfg = _config(cfg, variant, k)
    benchmark.group = f"forward {backend} T={q.shape[1]}"
    out = benchmark.pedantic(
        freesolo.freesolo_attention, args=(q, k, v, cfg), kwargs={"backend": backend}, rounds=3, warmup_rounds=1
    )
    assert out.shape == q.shape and np.isfinite(out).all()


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_select_cells(benchmark, case, variant):
    backend, q, k, v, cfg = case
    cfg = _config(cfg, variant, k)
    benchmark.group = f"select_cells {backend} T={q.shape[1]}"
    idx = benchmark.pedantic(
        freesolo.select_cells, args=(q, k, cfg), kwargs={"backend": backend}, rounds=3, warmup_rounds=1
    )
    assert idx.shape == q.shape[:3] + (cfg.top_k,)
