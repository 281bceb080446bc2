"""Public functions of spec §12: validate, pick the backend, convert arrays, call, convert back."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from ._validation import InputInfo, check_cu_seqlens, check_inputs, is_torch_tensor
from .backends.registry import resolve_backend
from .config import FreeSoloConfig

__all__ = ["freesolo_attention", "select_cells", "calibrate_tau", "split_packed", "for_each_sequence"]


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


# A packed sequence that does not start on this many bytes is copied before the backend sees it,
# so that it reaches the backend as a freshly allocated tensor would (allocators align to >= 64
# bytes; BLAS and Triton kernels may pick their code path, hence their rounding, by alignment).
_ALIGN_BYTES = 64


def _aligned(x):
    """x itself if its data starts on a _ALIGN_BYTES boundary and is contiguous, else a contiguous copy."""
    if is_torch_tensor(x):
        if x.data_ptr() % _ALIGN_BYTES == 0 and x.is_contiguous():
            return x
        return x.clone(memory_format=_torch().contiguous_format)  # differentiable copy
    if x.ctypes.data % _ALIGN_BYTES == 0 and x.flags.c_contiguous:
        return x
    out = np.empty(x.nbytes + _ALIGN_BYTES, dtype=np.uint8)
    start = -out.ctypes.data % _ALIGN_BYTES
    out = out[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def _torch():
    import torch

    return torch


def split_packed(x, cu_seqlens: Sequence[int]) -> list:
    """Split packed sequences apart (spec §12, L11).

    Args:
        x: numpy array or torch tensor [1, T, ...] holding N sequences back to back along T.
        cu_seqlens: validated boundaries, N+1 ints (see `freesolo._validation.check_cu_seqlens`):
            sequence n is tokens [cu_seqlens[n], cu_seqlens[n+1]).
    Returns:
        N arrays [1, L_n, ...], L_n = cu_seqlens[n+1] - cu_seqlens[n], of x's kind, dtype and
        device: views of x, or (when a view would start off a 64-byte boundary) contiguous
        copies; torch copies are differentiable, so gradients flow back into x either way.
    """
    return [_aligned(x[:, a:b]) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def for_each_sequence(fn: Callable, cu_seqlens: Optional[Sequence[int]], *xs):
    """Run `fn` on each packed sequence alone and concatenate the results along T.

    This is the one place where packed sequences are implemented (spec §12, L11): every
    backend, the model code and future callers get the packed semantics (positions, cells,
    blocks, pools, forests and RoPE restart per sequence) by calling the B = 1 computation on
    each sequence. Because each sequence really is computed alone, the result equals running it
    alone bit for bit (L12).

    Args:
        fn: called as fn(*parts), parts [1, L_n, ...] (one per array of `xs`), and returns an
            array [1, L_n, ...] (numpy or torch).
        cu_seqlens: validated boundaries (N+1 ints, first 0, strictly increasing, last T), or None
            for no packing (then fn(*xs) is returned as is).
        xs: arrays [1, T, ...], packed along T by the same cu_seqlens.
    Returns:
        [1, T, ...]: fn's outputs concatenated along dim 1 (torch.cat for tensors, so autograd
        flows back to every input of every sequence).
    """
    if cu_seqlens is None:
        return fn(*xs)
    parts = [split_packed(x, cu_seqlens) for x in xs]
    outs = [fn(*args) for args in zip(*parts)]
    if is_torch_tensor(outs[0]):
        return _torch().cat(outs, dim=1)
    return np.concatenate(outs, axis=1)


def _config(cfg: Optional[FreeSoloConfig]) -> FreeSoloConfig:
    return FreeSoloConfig() if cfg is None else cfg


def freesolo_attention(
    q,
    k,
    v,
    cfg: Optional[FreeSoloConfig] = None,
    beta=None,
    backend: Optional[str] = None,
    cu_seqlens=None,
    check_finite: bool = True,
):
    """FreeSolo attention (spec §7).

    Args:
        q: queries [B, T, Hq, D], unrotated (numpy array or torch tensor).
        k, v: keys / values [B, T, Hkv, D], unrotated; Hq % Hkv == 0.
        cfg: FreeSoloConfig (default: FS-L with the paper's sizes).
        beta: long-range mixing coefficient [Hq] (default ones).
        backend: "numpy", "numba", "torch" or "triton" for this call (default: get_backend()).
        cu_seqlens: packed sequences (spec §12): integer vector [N+1] (numpy, torch on q's device,
            or list), 0 = cu_seqlens[0] < ... < cu_seqlens[N] = T, with B = 1. Sequence n is
            tokens [cu_seqlens[n], cu_seqlens[n+1]); each is computed alone (positions, cells,
            blocks, pools, forests and RoPE restart at its first token), bit-identical to a call
            on that sequence by itself. None: one sequence per batch row.
        check_finite: raise ValueError when q, k, v or beta hold nan / inf. On CUDA tensors the
            check costs one host sync per call (a sum per tensor, then one read on the host);
            False skips it (no host sync: what a training loop or a CUDA graph wants; non-finite
            inputs then give non-finite or meaningless outputs). Skipped under torch.compile.
    Returns:
        o [B, T, Hq, D], of the same array kind, dtype and device as q.
    """
    cfg = _config(cfg)
    info = check_inputs(q, k, v, cfg, beta, check_finite=check_finite)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, info)
    impl = resolve_backend(backend, info, cfg)
    if impl.array_kind == "numpy":
        beta64 = np.ones(info.Hq) if beta is None else _to_float64(beta)
        arrays = (_to_float64(q), _to_float64(k), _to_float64(v))
        out = for_each_sequence(lambda q_, k_, v_: impl.attention(q_, k_, v_, cfg, beta64), bounds, *arrays)
    else:
        beta_t = None if beta is None else _to_torch(beta)
        arrays = (_to_torch(q), _to_torch(k), _to_torch(v))
        out = for_each_sequence(lambda q_, k_, v_: impl.attention(q_, k_, v_, cfg, beta_t), bounds, *arrays)
    return _like_input(out, q)


def select_cells(
    q, k, cfg: Optional[FreeSoloConfig] = None, backend: Optional[str] = None, cu_seqlens=None, check_finite: bool = True
):
    """Cells read by each query: int64 [B, T, Hq, K], by descending final score, -1 padded (spec §7).

    Args:
        q: queries [B, T, Hq, D]; k: keys [B, T, Hkv, D] (numpy arrays or torch tensors).
        cu_seqlens: packed sequences, as in `freesolo_attention` (B = 1). Cell indices are then
            local to each sequence: cell c of sequence n holds its tokens [c*s, (c+1)*s), i.e. the
            packed tokens cu_seqlens[n] + [c*s, (c+1)*s).
        check_finite: as in `freesolo_attention` (False: no host sync for the finite check).
    """
    cfg = _config(cfg)
    info = check_inputs(q, k, None, cfg, check_finite=check_finite)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, info)
    impl = resolve_backend(backend, info, cfg)
    if impl.array_kind == "numpy":
        out = for_each_sequence(lambda q_, k_: impl.select_cells(q_, k_, cfg), bounds, _to_float64(q), _to_float64(k))
    else:
        out = for_each_sequence(lambda q_, k_: impl.select_cells(q_, k_, cfg), bounds, _to_torch(q), _to_torch(k))
    return _like_input(out, q)


def calibrate_tau(k, cfg: Optional[FreeSoloConfig] = None, cu_seqlens=None):
    """FS-B threshold: per kv head, the median of a_c over all complete cells of all batch rows
    (or, with cu_seqlens, of all packed sequences: cells never straddle a sequence boundary).

    Args:
        k: keys [B, T, Hkv, D]. T < cfg.cell raises ValueError.
        cu_seqlens: packed sequences, as in `freesolo_attention` (B = 1). No sequence holding a
            complete cell raises ValueError.
    Returns:
        tau [Hkv] as a float64 numpy array (pass it as FreeSoloConfig(tau=...)).
    """
    from .reference.oracle import calibrate_tau as _calibrate
    from .reference.primitives import cell_stats

    cfg = _config(cfg)
    try:
        info = check_inputs(k, k, None, cfg.replace(variant="fs"))
    except (TypeError, ValueError) as error:  # k is checked in q's place: name the argument passed
        message = str(error)
        if message.startswith("q "):
            raise type(error)("k " + message[2:]) from None
        raise
    if cu_seqlens is None:
        return _calibrate(_to_float64(k), cfg)
    bounds = check_cu_seqlens(cu_seqlens, info)
    k64 = _to_float64(k)  # [1, T, Hkv, D]
    tau = np.zeros(info.Hkv)
    for g in range(info.Hkv):
        norms = np.concatenate([cell_stats(part[0, :, g], cfg.cell)[1] for part in split_packed(k64, bounds)])
        if norms.size == 0:
            lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            raise ValueError(
                f"calibrate_tau needs a complete cell: every packed sequence is shorter than cell={cfg.cell} "
                f"(lengths {lengths[:12]}{' ...' if len(lengths) > 12 else ''})"
            )
        tau[g] = np.median(norms)
    return tau


def input_info(q, k, v=None, cfg: Optional[FreeSoloConfig] = None) -> InputInfo:
    """The validated description of a call's inputs (for tools and tests)."""
    return check_inputs(q, k, v, _config(cfg))
