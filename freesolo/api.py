"""Public functions of spec §12: validate, pick the backend, convert arrays, call, convert back."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._validation import InputInfo, check_inputs, is_torch_tensor
from .backends.registry import resolve_backend
from .config import FreeSoloConfig

__all__ = ["freesolo_attention", "select_cells", "calibrate_tau"]


def _to_float64(x) -> np.ndarray:
    if is_torch_tensor(x):
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _to_torch(x):
    import torch

    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _like_input(out, like):
    """Return `out` (numpy or torch) with the array kind, dtype and device of `like`."""
    if is_torch_tensor(like):
        import torch

        out = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
        return out.to(device=like.device, dtype=like.dtype) if out.is_floating_point() else out.to(like.device)
    if is_torch_tensor(out):
        out = out.detach().cpu().numpy()
    return out.astype(like.dtype, copy=False) if np.issubdtype(out.dtype, np.floating) else out


def _config(cfg: Optional[FreeSoloConfig]) -> FreeSoloConfig:
    return FreeSoloConfig() if cfg is None else cfg


def freesolo_attention(q, k, v, cfg: Optional[FreeSoloConfig] = None, beta=None, backend: Optional[str] = None):
    """FreeSolo attention (spec §7).

    Args:
        q: queries [B, T, Hq, D], unrotated (numpy array or torch tensor).
        k, v: keys / values [B, T, Hkv, D], unrotated; Hq % Hkv == 0.
        cfg: FreeSoloConfig (default: FS-L with the paper's sizes).
        beta: long-range mixing coefficient [Hq] (default ones).
        backend: "numpy", "numba", "torch" or "triton" for this call (default: get_backend()).
    Returns:
        o [B, T, Hq, D], of the same array kind, dtype and device as q.
    """
    cfg = _config(cfg)
    info = check_inputs(q, k, v, cfg, beta)
    impl = resolve_backend(backend, info, cfg)
    if impl.array_kind == "numpy":
        beta64 = np.ones(info.Hq) if beta is None else _to_float64(beta)
        out = impl.attention(_to_float64(q), _to_float64(k), _to_float64(v), cfg, beta64)
    else:
        out = impl.attention(_to_torch(q), _to_torch(k), _to_torch(v), cfg, None if beta is None else _to_torch(beta))
    return _like_input(out, q)


def select_cells(q, k, cfg: Optional[FreeSoloConfig] = None, backend: Optional[str] = None):
    """Cells read by each query: int64 [B, T, Hq, K], by descending final score, -1 padded (spec §7).

    Args:
        q: queries [B, T, Hq, D]; k: keys [B, T, Hkv, D] (numpy arrays or torch tensors).
    """
    cfg = _config(cfg)
    info = check_inputs(q, k, None, cfg)
    impl = resolve_backend(backend, info, cfg)
    if impl.array_kind == "numpy":
        out = impl.select_cells(_to_float64(q), _to_float64(k), cfg)
    else:
        out = impl.select_cells(_to_torch(q), _to_torch(k), cfg)
    return _like_input(out, q)


def calibrate_tau(k, cfg: Optional[FreeSoloConfig] = None):
    """FS-B threshold: per kv head, the median of a_c over all complete cells of all batch rows.

    Args:
        k: keys [B, T, Hkv, D]. T < cfg.cell raises ValueError.
    Returns:
        tau [Hkv] as a float64 numpy array (pass it as FreeSoloConfig(tau=...)).
    """
    from .reference.oracle import calibrate_tau as _calibrate

    cfg = _config(cfg)
    try:
        check_inputs(k, k, None, cfg.replace(variant="fs"))
    except (TypeError, ValueError) as error:  # k is checked in q's place: name the argument passed
        message = str(error)
        if message.startswith("q "):
            raise type(error)("k " + message[2:]) from None
        raise
    return _calibrate(_to_float64(k), cfg)


def input_info(q, k, v=None, cfg: Optional[FreeSoloConfig] = None) -> InputInfo:
    """The validated description of a call's inputs (for tools and tests)."""
    return check_inputs(q, k, v, _config(cfg))
