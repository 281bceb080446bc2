"""Input validation, in one place: every public entry point calls `check_inputs` first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .config import FreeSoloConfig

__all__ = ["InputInfo", "check_cu_seqlens", "check_inputs", "is_torch_tensor"]

_NUMPY_FLOATS = (np.float16, np.float32, np.float64)
_TORCH_FLOAT_NAMES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch when it is not loaded."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


@dataclass(frozen=True)
class InputInfo:
    """What the dispatcher needs to know about a call's inputs."""

    kind: str  # "numpy" or "torch"
    B: int
    T: int
    Hq: int
    Hkv: int
    D: int
    dtype: str  # e.g. "float32", "torch.bfloat16"
    device: str  # "cpu", "cuda:0", ...
    requires_grad: bool


def _all_finite(x) -> bool:
    """True if x has no nan / inf (exact, one element at a time)."""
    if is_torch_tensor(x):
        import torch

        return bool(torch.isfinite(x).all())
    return bool(np.isfinite(x).all())


def _first_non_finite(named: dict) -> Optional[str]:
    """The name of the first array in `named` holding a nan / inf, or None.

    Torch tensors are screened together with one host sync: the sum of a tensor is nan / inf
    whenever an element is (inf + finite = inf, inf - inf = nan, nan propagates), so finite sums
    prove finite tensors. Only a non-finite sum (a bad element, or a sum that overflowed) triggers
    the exact element-wise check. Under torch.compile the check is skipped (a host sync would break
    the graph): compiled callers get no finiteness check."""
    tensors = {name: x for name, x in named.items() if is_torch_tensor(x)}
    if tensors:
        import torch

        if torch.compiler.is_compiling():
            tensors = {}
        else:
            sums = torch.stack(
                [x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32) for x in tensors.values()]
            )
            if bool(torch.isfinite(sums).all()):
                tensors = {}
    for name, x in named.items():
        if (name in tensors or not is_torch_tensor(x)) and not _all_finite(x):
            return name
    return None


def check_inputs(q, k, v: Optional[Any], cfg: FreeSoloConfig, beta=None, check_finite: bool = True) -> InputInfo:
    """Validate q [B, T, Hq, D], k / v [B, T, Hkv, D], beta [Hq] and the per-head config fields.

    Raises TypeError (wrong array type or dtype) or ValueError (shapes, T = 0, non-finite values,
    config lengths) naming the offending argument and value. `v` may be None (selection only).
    """
    if not isinstance(cfg, FreeSoloConfig):
        raise TypeError(f"cfg must be a freesolo.FreeSoloConfig, got {type(cfg).__name__}")
    named = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    kinds = set()
    for name, x in named.items():
        if is_torch_tensor(x):
            kinds.add("torch")
        elif isinstance(x, np.ndarray):
            kinds.add("numpy")
        else:
            raise TypeError(f"{name} must be a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
    if len(kinds) > 1:
        raise TypeError("q, k, v must all be numpy arrays or all torch tensors, not a mix")
    kind = kinds.pop()
    for name, x in named.items():
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [B, T, H, D], got shape {tuple(x.shape)}")
    dtypes = {name: str(x.dtype) for name, x in named.items()}
    for name, x in named.items():
        ok = str(x.dtype) in _TORCH_FLOAT_NAMES if kind == "torch" else x.dtype in _NUMPY_FLOATS
        if not ok:
            raise TypeError(f"{name} must be a floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, k, v must share one dtype, got {dtypes}")
    if kind == "torch":
        devices = {name: str(x.device) for name, x in named.items()}
        if len(set(devices.values())) > 1:
            raise ValueError(f"q, k, v must be on one device, got {devices}")
        device = devices["q"]
        requires_grad = any(x.requires_grad for x in named.values())
    else:
        device, requires_grad = "cpu", False
    B, T, Hq, D = (int(s) for s in q.shape)
    if T == 0:
        raise ValueError("T=0: the sequence is empty")
    if B == 0 or Hq == 0 or D == 0:
        raise ValueError(f"q has an empty dimension: shape {tuple(q.shape)}")
    Bk, Tk, Hkv, Dk = (int(s) for s in k.shape)
    if (Bk, Tk, Dk) != (B, T, D):
        raise ValueError(f"k shape {tuple(k.shape)} must be [B={B}, T={T}, Hkv, D={D}] to match q {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA)")
    if v is not None and tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if D % 2 != 0:
        raise ValueError(f"head dim D={D} must be even (RoPE)")
    if beta is not None:
        if not (is_torch_tensor(beta) or isinstance(beta, np.ndarray)):
            raise TypeError(f"beta must be a numpy array or torch tensor of shape [Hq={Hq}], got {type(beta).__name__}")
        if tuple(beta.shape) != (Hq,):
            raise ValueError(f"beta shape {tuple(beta.shape)} must be [Hq={Hq}]")
        if kind == "torch" and is_torch_tensor(beta):
            if str(beta.device) != device:
                raise ValueError(f"beta is on {beta.device} but q, k, v are on {device}: move it (nothing is moved)")
            if beta.requires_grad:
                import torch

                requires_grad = requires_grad or torch.is_grad_enabled()  # beta is learnable (spec §1, §8)
    if check_finite:
        bad = _first_non_finite(named if beta is None else {**named, "beta": beta})
        if bad is not None:
            raise ValueError(f"{bad} contains non-finite values (nan or inf)")
    cfg.per_head("sigma", Hq)
    cfg.per_head("lam", Hq)
    if cfg.variant == "fsb":
        cfg.tau_array(Hkv)
    return InputInfo(kind, B, T, Hq, Hkv, D, dtypes["q"], device, requires_grad)


def _show(values, limit: int = 12) -> str:
    """A short rendering of an integer list for error messages: [0, 3, 7, ..., 90] past `limit` entries."""
    if len(values) <= limit:
        return str(list(values))
    head = ", ".join(str(x) for x in values[: limit - 2])
    return f"[{head}, ..., {values[-2]}, {values[-1]}] ({len(values)} entries)"


def check_cu_seqlens(cu_seqlens, info: InputInfo) -> tuple[int, ...]:
    """Validate packed-sequence boundaries (spec §12, flash-attn's varlen convention).

    Args:
        cu_seqlens: integer vector [N+1] (numpy array, torch tensor or python list of ints):
            cu_seqlens[0] = 0, strictly increasing (no empty sequence), cu_seqlens[N] = T.
            Sequence n is tokens [cu_seqlens[n], cu_seqlens[n+1]) of the single batch row.
        info: the validated inputs of the call (`check_inputs`): B must be 1; a torch tensor
            must be on q's device (nothing is moved).
    Returns:
        The boundaries as a tuple of N+1 python ints (a CUDA tensor is read back to the host:
        one synchronisation per call, since the split into sequences is done on the host).
    Raises:
        ValueError naming the rule that broke (dtype, rank, device, B = 1, starts at 0, strictly
        increasing, last entry T) and showing the offending values.
    """
    if is_torch_tensor(cu_seqlens):
        dtype = str(cu_seqlens.dtype)
        integer = not cu_seqlens.is_floating_point() and not cu_seqlens.is_complex() and dtype != "torch.bool"
        if not integer:
            raise ValueError(f"cu_seqlens dtype must be an integer dtype (int32 or int64), got {dtype}")
        if cu_seqlens.ndim != 1:
            raise ValueError(f"cu_seqlens rank must be 1 (a vector [N+1]), got shape {tuple(cu_seqlens.shape)}")
        if str(cu_seqlens.device) != info.device:
            raise ValueError(
                f"cu_seqlens device must be the inputs' device: cu_seqlens is on {cu_seqlens.device}, "
                f"the inputs on {info.device} (nothing is moved)"
            )
        values = [int(x) for x in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, np.ndarray):
        if cu_seqlens.dtype == np.bool_ or not np.issubdtype(cu_seqlens.dtype, np.integer):
            raise ValueError(f"cu_seqlens dtype must be an integer dtype (int32 or int64), got {cu_seqlens.dtype}")
        if cu_seqlens.ndim != 1:
            raise ValueError(f"cu_seqlens rank must be 1 (a vector [N+1]), got shape {cu_seqlens.shape}")
        values = [int(x) for x in cu_seqlens]
    elif isinstance(cu_seqlens, (list, tuple)):
        for n, x in enumerate(cu_seqlens):
            if isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0):
                raise ValueError(f"cu_seqlens rank must be 1 (a flat list of ints), entry {n} is {x!r}")
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise ValueError(
                    f"cu_seqlens dtype must be integer: entry {n} is {x!r} ({type(x).__name__}) in {cu_seqlens!r}"
                )
        values = [int(x) for x in cu_seqlens]
    else:
        raise ValueError(
            f"cu_seqlens must be an integer vector (numpy array, torch tensor or list of ints), "
            f"got {type(cu_seqlens).__name__}"
        )
    if info.B != 1:
        raise ValueError(f"cu_seqlens needs B = 1 (sequences packed along T), got B={info.B}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries [0, ..., T={info.T}], got {_show(values)}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={values[0]} in {_show(values)}")
    for n in range(len(values) - 1):
        if values[n + 1] <= values[n]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing (every sequence non-empty): "
                f"cu_seqlens[{n}]={values[n]}, cu_seqlens[{n + 1}]={values[n + 1]} "
                f"(sequence {n} has length {values[n + 1] - values[n]}) in {_show(values)}"
            )
    if values[-1] != info.T:
        raise ValueError(
            f"cu_seqlens last entry must be T={info.T} (the packed length), got cu_seqlens[{len(values) - 1}]="
            f"{values[-1]} in {_show(values)}"
        )
    return tuple(values)
