"""Bad input raises a clear error (type and message), and the backend registry behaves."""

from __future__ import annotations

import numpy as np
import pytest

import freesolo
from freesolo import BackendUnavailableError, FreeSoloConfig

from .helpers import SMALL, random_qkv

CFG = FreeSoloConfig(**SMALL)


def _qkv(T=20, Hq=2, Hkv=1, D=4, B=1):
    return random_qkv(0, B, T, Hq, Hkv, D)


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("variant", "fsx", "variant='fsx'"),
        ("window", 0, "window=0 must be positive"),
        ("cell", -1, "cell=-1 must be positive"),
        ("top_k", 0, "top_k=0 must be positive"),
        ("block", 30, "block=30 must be a multiple of cell=32"),
        ("window", 64, "window=64 must be >= block=128"),
        ("pool", 0, "pool=0"),
        ("recent", 0, "recent=0"),
        ("beam", 0, "beam=0"),
        ("lam", -0.5, "lam=-0.5 must be >= 0"),
        ("lam", (1.0, -1.0), "lam=(1.0, -1.0) must be >= 0"),
        ("sigma", float("nan"), "sigma=nan must be finite"),
        ("leaf_order", "random", "leaf_order='random'"),
        ("radius_weight", -1.0, "radius_weight=-1.0"),
        ("eps", 0.0, "eps=0.0 must be positive"),
        ("hash_bits", 0, "hash_bits=0"),
        ("window", 2.5, "window=2.5 must be an int"),
    ],
)
def test_config_violations_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FreeSoloConfig(**{field: value})


def test_config_is_frozen_and_hashable():
    cfg = FreeSoloConfig(sigma=[1.0, 2.0])
    assert cfg.sigma == (1.0, 2.0)
    hash(cfg)
    with pytest.raises(AttributeError):
        cfg.window = 3  # type: ignore[misc]


# ---- inputs -----------------------------------------------------------------------------------
def test_wrong_rank():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must have rank 4 \[B, T, H, D\], got shape \(20, 2, 4\)"):
        freesolo.freesolo_attention(q[0], k, v, CFG, backend="numpy")


def test_mismatched_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k shape"):
        freesolo.freesolo_attention(q, k[:, :10], v, CFG, backend="numpy")
    with pytest.raises(ValueError, match="v shape"):
        freesolo.freesolo_attention(q, k, v[..., :2], CFG, backend="numpy")


def test_heads_not_a_multiple():
    q, k, v = _qkv(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="Hq=3 must be a multiple of Hkv=2"):
        freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")


def test_odd_head_dim():
    q, k, v = _qkv(D=5)
    with pytest.raises(ValueError, match="D=5 must be even"):
        freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")


def test_empty_sequence():
    q, k, v = _qkv(T=0)
    with pytest.raises(ValueError, match="T=0"):
        freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_finite(bad, name):
    q, k, v = _qkv()
    {"q": q, "k": k, "v": v}[name][0, 3, 0, 1] = bad
    with pytest.raises(ValueError, match=f"{name} contains non-finite values"):
        freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")


def test_check_finite_false_skips_the_check_and_nothing_else():
    """check_finite=False (no host sync on CUDA) skips only the finite check: a nan reaches the
    output (its own rows), and shape errors still raise."""
    import torch

    q, k, v = (torch.from_numpy(x) for x in _qkv())
    q[0, 3, 0, 1] = float("nan")
    with pytest.raises(ValueError, match="q contains non-finite values"):
        freesolo.freesolo_attention(q, k, v, CFG, backend="torch")
    out = freesolo.freesolo_attention(q, k, v, CFG, backend="torch", check_finite=False)
    assert torch.isnan(out[0, 3, 0]).all() and torch.isfinite(out[0, :3]).all()
    with pytest.raises(ValueError, match="q contains non-finite values"):
        freesolo.select_cells(q, k, CFG, backend="torch")
    assert freesolo.select_cells(q, k, CFG, backend="torch", check_finite=False).shape[:3] == q.shape[:3]
    with pytest.raises(ValueError):
        freesolo.freesolo_attention(q[:, :, :, :3], k, v, CFG, backend="torch", check_finite=False)


def test_wrong_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be a floating dtype"):
        freesolo.freesolo_attention(q.astype(np.int32), k, v, CFG, backend="numpy")
    with pytest.raises(TypeError, match="share one dtype"):
        freesolo.freesolo_attention(q.astype(np.float32), k, v, CFG, backend="numpy")
    with pytest.raises(TypeError, match="numpy.ndarray or a torch.Tensor"):
        freesolo.freesolo_attention(q.tolist(), k, v, CFG, backend="numpy")


def test_bad_beta_and_per_head_lengths():
    q, k, v = _qkv(Hq=2)
    with pytest.raises(ValueError, match=r"beta shape \(3,\) must be \[Hq=2\]"):
        freesolo.freesolo_attention(q, k, v, CFG, beta=np.ones(3), backend="numpy")
    with pytest.raises(ValueError, match="beta contains non-finite"):
        freesolo.freesolo_attention(q, k, v, CFG, beta=np.array([1.0, np.nan]), backend="numpy")
    with pytest.raises(ValueError, match="sigma has 3 values but there are 2 query heads"):
        freesolo.freesolo_attention(q, k, v, CFG.replace(sigma=(1.0, 2.0, 3.0)), backend="numpy")


def test_fsb_without_tau_says_how_to_get_one():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="calibrate_tau"):
        freesolo.freesolo_attention(q, k, v, CFG.replace(variant="fsb"), backend="numpy")


def test_calibrate_tau_needs_a_complete_cell():
    _, k, _ = _qkv(T=3)
    with pytest.raises(ValueError, match="T=3 < cell=4"):
        freesolo.calibrate_tau(k, CFG)


def test_cfg_must_be_a_config():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="FreeSoloConfig"):
        freesolo.freesolo_attention(q, k, v, {"window": 16}, backend="numpy")


def test_numpy_dtype_is_preserved():
    q, k, v = (x.astype(np.float32) for x in _qkv())
    out = freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")
    assert out.dtype == np.float32 and out.shape == q.shape


# ---- registry -----------------------------------------------------------------------------------
def test_unknown_backend_lists_every_backend():
    with pytest.raises(BackendUnavailableError) as error:
        freesolo.set_backend("cuda-magic")
    message = str(error.value)
    for name in ("numpy", "numba", "torch", "triton"):
        assert f"  {name}:" in message


def test_use_backend_restores_previous():
    freesolo.set_backend("numpy")
    try:
        with freesolo.use_backend("numpy"):
            assert freesolo.get_backend() == "numpy"
        assert freesolo.get_backend() == "numpy"
        with pytest.raises(RuntimeError):
            with freesolo.use_backend("numpy"):
                raise RuntimeError("inside")
        assert freesolo.get_backend() == "numpy"
        # a different backend inside, so that "restored" is distinguishable from "never changed"
        other = next(name for name in freesolo.available_backends() if name != "numpy")
        with freesolo.use_backend(other):
            assert freesolo.get_backend() == other
        assert freesolo.get_backend() == "numpy"
        with pytest.raises(RuntimeError):
            with freesolo.use_backend(other):
                assert freesolo.get_backend() == other
                raise RuntimeError("inside")
        assert freesolo.get_backend() == "numpy"
    finally:
        import freesolo.backends.registry as registry

        registry._current = None


def test_env_variable_selects_backend(monkeypatch):
    import freesolo.backends.registry as registry

    monkeypatch.setattr(registry, "_current", None)
    monkeypatch.setenv("FREESOLO_BACKEND", "numpy")
    assert freesolo.get_backend() == "numpy"
    q, k, v = _qkv()
    np.testing.assert_array_equal(
        freesolo.freesolo_attention(q, k, v, CFG), freesolo.freesolo_attention(q, k, v, CFG, backend="numpy")
    )
    monkeypatch.setenv("FREESOLO_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match="unknown backend 'nope'"):
        freesolo.get_backend()


def test_available_backends_has_the_oracle():
    assert "numpy" in freesolo.available_backends()


def test_torch_inputs_on_numpy_backend_round_trip():
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    q, k, v = _qkv()
    out = freesolo.freesolo_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), CFG, backend="numpy"
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    np.testing.assert_array_equal(out.numpy(), freesolo.freesolo_attention(q, k, v, CFG, backend="numpy"))
    with pytest.raises(BackendUnavailableError, match="no autograd"):
        freesolo.freesolo_attention(
            torch.from_numpy(q).requires_grad_(), torch.from_numpy(k), torch.from_numpy(v), CFG, backend="numpy"
        )


def test_import_freesolo_needs_neither_torch_nor_triton():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import freesolo, numpy as np\n"
        "q = np.random.default_rng(0).standard_normal((1, 9, 1, 4))\n"
        "print(freesolo.freesolo_attention(q, q, q, freesolo.FreeSoloConfig(window=4, cell=2, block=4), backend='numpy').shape)\n"
        "print(freesolo.available_backends())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "(1, 9, 1, 4)" in result.stdout


# ---- torch inputs through the public API (spec §12) ------------------------------------------------
def _torch_qkv(dtype=None, **shape):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    q, k, v = (torch.from_numpy(x) for x in _qkv(**shape))
    return (q, k, v) if dtype is None else tuple(x.to(dtype) for x in (q, k, v))


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
def test_torch_dtype_and_device_are_preserved(backend, dtype_name):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    dtype = getattr(torch, dtype_name)
    q, k, v = _torch_qkv(dtype, T=30)
    out = freesolo.freesolo_attention(q, k, v, CFG, backend=backend)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == q.device
    assert out.shape == q.shape
    idx = freesolo.select_cells(q, k, CFG, backend=backend)
    assert isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.device == q.device
    assert idx.shape == (1, 30, 2, CFG.top_k)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("dtype_name", ["int32", "int64", "bool"])
def test_torch_integer_inputs_raise(backend, dtype_name):
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    dtype = getattr(torch, dtype_name)
    q, k, v = _torch_qkv()
    for name, args in (("q", (q.to(dtype), k, v)), ("k", (q, k.to(dtype), v)), ("v", (q, k, v.to(dtype)))):
        with pytest.raises(TypeError, match=f"{name} must be a floating dtype"):
            freesolo.freesolo_attention(*args, CFG, backend=backend)
    with pytest.raises(TypeError, match="floating dtype"):
        freesolo.select_cells(q.to(dtype), k.to(dtype), CFG, backend=backend)
    with pytest.raises(TypeError, match="floating dtype"):
        freesolo.calibrate_tau(k.to(dtype), CFG)
    with pytest.raises(TypeError, match="^k must be a floating dtype"):  # names the argument passed
        freesolo.calibrate_tau(k.to(dtype), CFG)


def test_calibrate_tau_errors_name_k():
    _, k, _ = _qkv()
    with pytest.raises(TypeError, match="^k must be a floating dtype"):
        freesolo.calibrate_tau(k.astype(np.int64), CFG)
    with pytest.raises(ValueError, match=r"^k must have rank 4"):
        freesolo.calibrate_tau(k[0], CFG)
    k[0, 2, 0, 1] = np.nan
    with pytest.raises(ValueError, match="^k contains non-finite values"):
        freesolo.calibrate_tau(k, CFG)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_torch_device_mismatch_raises(backend):
    """q, k, v on different devices, or beta on another device than q: a ValueError naming the
    devices, before anything is computed ("meta" stands in for a second device on CPU-only machines)."""
    pytest.importorskip("torch", reason="torch is an optional dependency")
    import torch

    q, k, v = _torch_qkv()
    with pytest.raises(ValueError, match="must be on one device"):
        freesolo.freesolo_attention(q, k.to("meta"), v, CFG, backend=backend)
    with pytest.raises(ValueError, match="must be on one device"):
        freesolo.select_cells(q.to("meta"), k, CFG, backend=backend)
    with pytest.raises(ValueError, match="beta is on meta"):
        freesolo.freesolo_attention(q, k, v, CFG, beta=torch.ones(2, device="meta"), backend=backend)


def test_beta_requiring_grad_is_not_dropped():
    """beta is learnable (spec §1, §8): a host backend (no autograd) refuses it instead of silently
    detaching it; the torch backend gives it a gradient; under no_grad the host backends run."""
    torch = pytest.importorskip("torch", reason="torch is an optional dependency")
    q, k, v = _torch_qkv(T=30)
    beta = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    for backend in ("numpy", "numba"):
        with pytest.raises(BackendUnavailableError, match="no autograd"):
            freesolo.freesolo_attention(q, k, v, CFG, beta=beta, backend=backend)
        with torch.no_grad():
            out = freesolo.freesolo_attention(q, k, v, CFG, beta=beta, backend=backend)
        ref = freesolo.freesolo_attention(q, k, v, CFG, beta=beta.detach(), backend=backend)
        assert torch.equal(out, ref)
    out = freesolo.freesolo_attention(q, k, v, CFG, beta=beta, backend="torch")
    out.sum().backward()
    assert beta.grad is not None and torch.isfinite(beta.grad).all() and beta.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", ["none", "q", "k", "v", "beta"])
def test_torch_finite_screen_names_the_tensor_and_allows_overflowing_sums(bad):
    """Torch inputs are screened by one fused sum (one host sync); a sum that overflows on finite
    values must not raise, and a real nan / inf must name its tensor."""
    torch = pytest.importorskip("torch")
    from freesolo._validation import check_inputs

    q, k, v = (torch.full((1, 40, 2, 8), 3.0e38, dtype=torch.float32) for _ in range(3))  # sums overflow to inf
    beta = torch.ones(2)
    if bad != "none":
        {"q": q, "k": k, "v": v, "beta": beta}[bad][..., 0] = float("nan")
        with pytest.raises(ValueError, match=f"^{bad} contains non-finite values"):
            check_inputs(q, k, v, FreeSoloConfig(**SMALL), beta)
    else:
        assert check_inputs(q, k, v, FreeSoloConfig(**SMALL), beta).T == 40
