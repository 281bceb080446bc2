"""Issue 10, deliverable 4 at real lengths (CUDA only): the Triton forward through the public API at
T = 128k in bf16 / fp16 / fp32 (GQA), and one FS-L forward at T = 2^20 (H 16, D 64), each against the
torch backend (its own selection, and its output on the Triton selection) and against the float64
selection of spec §3-§5 on sampled rows.

The selections may differ only at near-ties (spec §13): where the Triton and the torch selections
differ, the float64 scores of the two sets are within a gap. The outputs are compared as RMS-relative
errors against the torch backend computing in float64 (float32 at 2^20: 4 GiB per input there) on the
same inputs and the same selection.

On a CPU machine these tests skip: the interpreter would take hours at these lengths (the interpreted
kernels are tested on small shapes in test_triton_attention.py / test_triton_selection.py). On the
device: `gpu_session_run.sh` step s51_long.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

import freesolo  # noqa: E402
from freesolo import FreeSoloConfig  # noqa: E402

from .helpers import TorchCellScores, assert_close, assert_rows_select_reference, assert_selection_matches  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU: forwards at T = 128k and 2^20 (the device runs them, step s51_long)"
)

# RMS-relative error of the Triton output against the torch backend on the same inputs and selection:
# fp32 at fp32 rounding; fp16 / bf16 a few ulps of their mantissa (the tensor-core dots read
# probabilities rounded to q's dtype, and the output is rounded once more).
OUTPUT_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# float64 score gap allowed where two selections differ (the scores are computed in fp32 from bf16 /
# fp16 / fp32 inputs; spec §13's near-tie rule), and the largest share of (query, head) rows that
# may differ at all
SCORE_GAP = 2e-4
MAX_DIFFERING_ROWS = 1e-3


def _inputs(T: int, Hq: int, Hkv: int, D: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, D, device="cuda", generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    beta = torch.linspace(-1.0, 1.5, Hq, device="cuda")
    return q, k, v, beta


def _sample_rows(T: int, Hq: int, cfg: FreeSoloConfig, n: int, seed: int) -> list:
    """(0, i, h) rows: the first and the last query block, positions around the first cells and a
    seeded uniform sample of the rest."""
    g = torch.Generator().manual_seed(seed)
    fixed = [0, cfg.block - 1, cfg.block, 2 * cfg.block + 5, T // 2, T - cfg.block, T - 2, T - 1]
    spread = torch.randint(0, T, (n - len(fixed),), generator=g).tolist()
    heads = torch.randint(0, Hq, (n,), generator=g).tolist()
    return [(0, i, h) for i, h in zip(fixed + spread, heads)]


def _check_selections(idx_triton, idx_torch, q, k, cfg: FreeSoloConfig, scores: TorchCellScores) -> int:
    """Where the Triton and the torch selections differ, the sets are near-ties (float64 score gap
    <= SCORE_GAP, `assert_selection_matches`), and they differ in at most MAX_DIFFERING_ROWS of the
    (query, head) rows. Returns the number of differing rows."""
    a, b = idx_triton.cpu().numpy(), idx_torch.cpu().numpy()
    n = assert_selection_matches(a, b, q, k, cfg, SCORE_GAP, score_fn=scores)
    assert n <= MAX_DIFFERING_ROWS * a[..., 0].size, f"{n} of {a[..., 0].size} rows select other cells"
    return n


def _forward_matches(T: int, Hq: int, Hkv: int, D: int, dtype, variant: str, ref_dtype, seed: int) -> None:
    from freesolo.backends.torch import attention as torch_attention
    from freesolo.backends.torch import select_cells as torch_select
    from freesolo.backends.triton.selection import select_cells as triton_select

    cfg = FreeSoloConfig(variant=variant)
    q, k, v, beta = _inputs(T, Hq, Hkv, D, dtype, seed)
    o = freesolo.freesolo_attention(q, k, v, cfg, beta, backend="triton")
    assert o.shape == q.shape and o.dtype == dtype and bool(torch.isfinite(o).all())
    idx = triton_select(q, k, cfg)
    # the reference output below reads this selection: a row where the API's forward selected other
    # cells would show up in the output comparison
    scores = TorchCellScores(q, k, cfg)
    assert_rows_select_reference(idx, q, k, cfg, _sample_rows(T, Hq, cfg, 48, seed), SCORE_GAP, scores)
    _check_selections(idx, torch_select(q.float(), k.float(), cfg), q, k, cfg, scores)
    ref = torch_attention(q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), cfg, beta.to(ref_dtype), idx=idx)
    assert_close(o.double().cpu().numpy(), ref.double().cpu().numpy(), OUTPUT_RTOL[dtype], f"{variant} {dtype} o")


@needs_cuda
@pytest.mark.parametrize(
    "variant, dtype",
    [("fsl", torch.bfloat16), ("fsl", torch.float16), ("fsl", torch.float32), ("fs", torch.bfloat16)],
    ids=["fsl-bf16", "fsl-fp16", "fsl-fp32", "fs-bf16"],
)
def test_cuda_forward_at_128k_matches_torch_backend(variant, dtype):
    """T = 131072, B 1, Hq 8, Hkv 2 (GQA 4), D 64, the paper's sizes: the API's output against the torch
    backend in float64 on the same inputs and selection; the selection against the torch backend's
    (near-ties only) and the float64 reference on 48 sampled rows."""
    _forward_matches(131072, 8, 2, 64, dtype, variant, torch.float64, seed=10)


@needs_cuda
def test_cuda_fsl_forward_at_1m_matches_torch_backend():
    """T = 2^20, B 1, H 16, D 64, bf16, FS-L at the paper's sizes: the API's output against the torch
    backend (float32 compute on the bf16 inputs) on the same selection; the selection against the
    torch backend's (near-ties only) and the float64 reference on 48 sampled rows."""
    _forward_matches(2**20, 16, 16, 64, torch.bfloat16, "fsl", torch.float32, seed=11)
