"""Registry entry and `torch.library` operators of the `triton` backend.

Operators (so that `torch.compile(fullgraph=True)` sees one opaque node, with fake tensors for
tracing and a registered autograd formula):

- ``freesolo::triton_forward(q, k, v, beta, cfg_json) -> (o, idx, lse_loc, lse_long, rstd)``:
  selection (FS / FS-L in Triton; FS-B by the torch backend's search) then the fused readout.
- ``freesolo::triton_backward(do, q, k, v, o, idx, beta, lse_loc, lse_long, rstd, cfg_json,
  deterministic) -> (dq, dk, dv, dbeta)``: gradients of spec §8 (none through the selection).

Eager calls (`triton_attention` outside torch.compile) run the same bodies through
`_EagerAttention`, an autograd.Function, without the operators' dispatch (host time at short T).

Shapes: q [B, T, Hq, D], k / v [B, T, Hkv, D], beta fp32 [Hq], o [B, T, Hq, D] (q's dtype),
idx int32 [B, T, Hq, K] (-1 padded; int32 since s24: half the saved bytes), lse_loc / lse_long / rstd fp32 [B, Hq, T].

Devices: CUDA tensors in float16 / bfloat16 / float32. With ``TRITON_INTERPRET=1`` (Triton's
interpreter) the backend also accepts CPU float32 tensors: that is how CI tests the kernels.

Determinism: the backward's key / value gradients of the sparse branch are summed either in a
fixed order (deterministic, the default: same bits run to run) or with fp32 atomics (faster, not
bitwise reproducible). Choose with `set_deterministic` / `deterministic(...)` or the environment
variable ``FREESOLO_DETERMINISTIC=0``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Iterator, Optional

import torch

from ...config import FreeSoloConfig
from ..base import Backend
from . import graphs

__all__ = [
    "TritonBackend",
    "config_from_json",
    "config_to_json",
    "deterministic",
    "interpreting",
    "is_deterministic",
    "on_device_of",
    "set_deterministic",
    "triton_attention",
    "triton_select_cells",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_HEAD_DIM = 256

_deterministic: Optional[bool] = None


def on_device_of(x: torch.Tensor):
    """A context in which x's CUDA device is the current one. Triton launches a kernel on the
    current device (torch ops follow their tensors), so every host entry point that launches
    kernels on caller tensors runs inside it: tensors on cuda:1 while cuda:0 is current then run on
    cuda:1. A no-op (nullcontext) for CPU tensors and when x's device is current already."""
    if x.is_cuda and x.device.index is not None and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1); imports no triton (the
    one place this is decided: the decode kernels ask here too)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_deterministic() -> bool:
    """Whether the backward sums sparse key / value gradients in a fixed order (default True)."""
    if _deterministic is not None:
        return _deterministic
    return os.environ.get("FREESOLO_DETERMINISTIC", "1") not in ("0", "false", "False")


def set_deterministic(flag: bool) -> None:
    """Deterministic backward (fixed-order sums, the default) or atomics (faster, not reproducible)."""
    global _deterministic
    if not isinstance(flag, bool):
        raise TypeError(f"deterministic must be a bool, got {flag!r}")
    _deterministic = flag


@contextlib.contextmanager
def deterministic(flag: bool = True) -> Iterator[None]:
    """Context manager: run the block with the backward's deterministic mode set to `flag`."""
    global _deterministic
    previous = _deterministic
    set_deterministic(flag)
    try:
        yield
    finally:
        _deterministic = previous


_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(FreeSoloConfig))


def _json_value(value) -> str:
    """JSON text of one config value (None, str, bool, int, finite float or a tuple of floats)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_json_value(x) for x in value) + "]"
    return repr(value)  # int or float: the config holds finite values only


_CONFIG_JSON: dict = {}


def config_to_json(cfg: FreeSoloConfig) -> str:
    """The config as a JSON string (an operator argument: custom ops take no dataclasses).
    Written without the json module so that torch.compile can trace it (a constant string).
    Eager calls reuse the string of an equal config (building it cost ~20 us of host time per
    call at short T; the config is a frozen, hashable dataclass)."""
    compiling = torch.compiler.is_compiling()
    if not compiling:
        hit = _CONFIG_JSON.get(cfg)
        if hit is not None:
            return hit
    text = "{" + ", ".join(f'"{name}": {_json_value(getattr(cfg, name))}' for name in _CONFIG_FIELDS) + "}"
    if not compiling:
        if len(_CONFIG_JSON) >= 64:
            _CONFIG_JSON.clear()
        _CONFIG_JSON[cfg] = text
    return text


@functools.lru_cache(maxsize=64)
def config_from_json(text: str) -> FreeSoloConfig:
    """The config of `config_to_json`'s string, cached (a frozen dataclass: parsing and validating
    it on every call cost host time at short T)."""
    fields = json.loads(text)
    for name in ("sigma", "lam", "tau"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    return FreeSoloConfig(**fields)


_ROPE_CACHE: dict = {}
_ROPE_SLICES: dict = {}  # (key, T) -> the [:T] views of _ROPE_CACHE[key] (two slices fewer per call)
_ROPE_CAPTURED: set = set()  # keys of _ROPE_CACHE whose current tables a CUDA-graph capture has read
_ROPE_KEPT: list = []  # replaced tables that a captured CUDA graph may still read: never freed


def rope_cos_sin(T: int, D: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [T, D/2] of half-split RoPE (angles in float64, as the torch backend), cached
    per (D, theta, device) at the largest T seen and sliced.

    CUDA graphs: a graph captured while these tables were current replays their addresses, so
    tables that a capture read are kept alive when a longer T replaces them (`_ROPE_KEPT`); freed,
    their memory would be reused and the graph would read garbage. Tables no capture read are freed."""
    from ..torch._ops import rope_tables

    key = (D, float(theta), device.type, device.index)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _ROPE_CAPTURED.add(key)
    hit = _ROPE_SLICES.get((key, T))
    if hit is not None:
        return hit
    cached = _ROPE_CACHE.get(key)
    if cached is None or cached[0].shape[0] < T:
        if cached is not None and key in _ROPE_CAPTURED:
            _ROPE_KEPT.append(cached)
            _ROPE_CAPTURED.discard(key)
        cached = rope_tables(max(T, 1), D, theta, device, torch.float32)
        _ROPE_CACHE[key] = cached
        _ROPE_SLICES.clear()  # views of the replaced tables
    hit = cached[0][:T], cached[1][:T]
    if len(_ROPE_SLICES) >= 256:
        _ROPE_SLICES.clear()
    _ROPE_SLICES[(key, T)] = hit
    return hit


FSB_SEARCH_ENV = "FREESOLO_TRITON_FSB_SEARCH"


def fsb_search_mode(device: torch.device) -> str:
    """FS-B's search on this backend for inputs on `device`, from FREESOLO_TRITON_FSB_SEARCH:
    "triton" (`fsb_search.fsb_select_cells`, one program per query and head: the default on CUDA)
    or "torch" (the torch backend's vectorized search: the default elsewhere, i.e. on the CPU under
    the Triton interpreter, where the Triton search is a per-program Python loop). The two equal
    each other bit for bit under the interpreter and on CUDA except at float32 near-ties
    (`fsb_audit.near_tie_audit`)."""
    mode = os.environ.get(FSB_SEARCH_ENV, "").strip().lower()
    if mode == "":
        return "triton" if device.type == "cuda" else "torch"
    if mode not in ("torch", "triton"):
        raise ValueError(f"{FSB_SEARCH_ENV}={mode!r} must be 'torch' or 'triton'")
    return mode


def _select(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, out_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """out_dtype [B, T, Hq, K]: FS / FS-L by the Triton kernels, FS-B by the search `fsb_search_mode` names."""
    if cfg.variant == "fsb":
        if fsb_search_mode(q.device) == "triton":
            from .fsb_search import fsb_select_cells

            return fsb_select_cells(q, k, cfg).to(out_dtype)
        from ..torch.backend import select_cells as torch_select

        return torch_select(q, k, cfg).to(out_dtype)
    from .selection import select_cells as triton_select

    return triton_select(q, k, cfg, out_dtype=out_dtype)


def _select_with_unions(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, union_rows: int):
    """(idx int32 [B, T, Hq, K], union, count): FS / FS-L's selection and the long tiles' unions from
    the scoring kernel (`selection.select_cells` with union_rows); None where `selection.fuses_unions`
    says it cannot (FS-B, or scoring tiles that are not the union tiles)."""
    from .selection import fuses_unions, select_cells

    if not fuses_unions(cfg, q.shape[3], q.dtype, union_rows):
        return None
    return select_cells(q, k, cfg, out_dtype=torch.int32, union_rows=union_rows)


_ONES: dict = {}


def _beta32(beta: Optional[torch.Tensor], Hq: int, device) -> torch.Tensor:
    """beta as fp32 [Hq]; None: a cached ones vector per (Hq, device) (no allocation + fill per call;
    the operators never write into beta). Never evicted: a CUDA graph may have captured its address
    (one small vector per head count and device)."""
    if beta is None:
        if torch.compiler.is_compiling():  # traced: a graph constant, no side effect on the cache
            return torch.ones(Hq, dtype=torch.float32, device=device)
        key = (Hq, str(device))
        ones = _ONES.get(key)
        if ones is None:
            ones = _ONES[key] = torch.ones(Hq, dtype=torch.float32, device=device)
        return ones
    return beta.to(torch.float32)


def _is_cached_ones(beta: torch.Tensor) -> bool:
    """Whether beta is one of `_beta32`'s cached ones vectors (never written, never evicted)."""
    return any(beta is ones for ones in _ONES.values())


# ---- operators -----------------------------------------------------------------------------------


def _forward_impl(q, k, v, beta, cfg_json, save_stats: bool = True):
    """The body of ``freesolo::triton_forward`` (a plain function, so that probes can time it
    without the custom-op dispatch). save_stats=False: a forward without gradients (`triton_attention`
    when nothing requires grad): the backward's statistics come back as None."""
    from .attention import forward_with_selection

    cfg = config_from_json(cfg_json)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with on_device_of(q):
        cos, sin = rope_cos_sin(q.shape[1], q.shape[3], cfg.rope_theta, q.device)
        # the selection is saved for the backward in int32 (half the bytes of int64); with window-first
        # tiles it runs on a side stream beside the window kernel (`forward_with_selection`)
        idx, (o, lse_loc, lse_long, rstd) = forward_with_selection(
            q, k, v, lambda q_, k_: _select(q_, k_, cfg, torch.int32), beta.to(torch.float32), cos, sin, cfg,
            save_stats=save_stats, select_unions=lambda q_, k_, rows: _select_with_unions(q_, k_, cfg, rows),
        )
    return o, idx, lse_loc, lse_long, rstd


@torch.library.custom_op("freesolo::triton_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, cfg_json: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, beta, cfg_json)


@_forward_op.register_fake
def _forward_fake(q, k, v, beta, cfg_json):
    cfg = config_from_json(cfg_json)
    B, T, Hq, D = q.shape
    o = torch.empty_like(q)
    idx = q.new_empty((B, T, Hq, cfg.top_k), dtype=torch.int32)
    stat = q.new_empty((B, Hq, T), dtype=torch.float32)
    return o, idx, stat, torch.empty_like(stat), torch.empty_like(stat)


def _backward_impl(do, q, k, v, o, idx, beta, lse_loc, lse_long, rstd, cfg_json, deterministic_sum, need_dbeta=True):
    """The body of ``freesolo::triton_backward`` (also called directly by the eager autograd path,
    which passes need_dbeta=False when beta needs no gradient: dbeta then comes back as None)."""
    from .attention_bwd import attention_backward

    cfg = config_from_json(cfg_json)
    with on_device_of(q):
        cos, sin = rope_cos_sin(q.shape[1], q.shape[3], cfg.rope_theta, q.device)
        return attention_backward(
            do.contiguous(), q, k, v, o, idx, beta.to(torch.float32), lse_loc, lse_long, rstd, cos, sin, cfg,
            deterministic=deterministic_sum, need_dbeta=need_dbeta,
        )


@torch.library.custom_op("freesolo::triton_backward", mutates_args=())
def _backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    idx: torch.Tensor,
    beta: torch.Tensor,
    lse_loc: torch.Tensor,
    lse_long: torch.Tensor,
    rstd: torch.Tensor,
    cfg_json: str,
    deterministic_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbeta = _backward_impl(do, q, k, v, o, idx, beta, lse_loc, lse_long, rstd, cfg_json, deterministic_sum)
    return dq, dk, dv, dbeta


@_backward_op.register_fake
def _backward_fake(do, q, k, v, o, idx, beta, lse_loc, lse_long, rstd, cfg_json, deterministic_sum):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), beta.new_empty(beta.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, beta, cfg_json = inputs
    o, idx, lse_loc, lse_long, rstd = output
    ctx.save_for_backward(q, k, v, beta, o, idx, lse_loc, lse_long, rstd)
    ctx.cfg_json = cfg_json
    ctx.deterministic_sum = is_deterministic()


def _saved(ctx) -> tuple:
    """(q, k, v, beta, o, idx, lse_loc, lse_long, rstd) of the forward: all saved by `_setup_context`,
    or (a forward replayed from a graph, `_EagerAttention`) the first five saved and the statistics
    lent by the call's `graphs.Binding` (recomputed by the eager forward if the graph's buffers were
    overwritten after a backward already ran: retain_graph)."""
    saved = ctx.saved_tensors
    binding = getattr(ctx, "binding", None)
    if binding is None:
        return saved
    q, k, v, beta, o = saved
    stats = binding.lent_tensors(lambda: _forward_impl(q, k, v, beta, ctx.cfg_json)[1:])
    return (q, k, v, beta, o, *stats)


def _grads(ctx, do, backward, *need_dbeta):
    """(dq, dk, dv, dbeta, None) from the forward's tensors (`_saved`); `backward` is the
    backward operator (traced under torch.compile) or its body `_backward_impl` (eager, which
    also takes need_dbeta: False when beta needs no gradient, dbeta then None)."""
    q, k, v, beta, o, idx, lse_loc, lse_long, rstd = _saved(ctx)
    dq, dk, dv, dbeta = backward(
        do, q, k, v, o, idx, beta, lse_loc, lse_long, rstd, ctx.cfg_json, ctx.deterministic_sum, *need_dbeta
    )
    return dq, dk, dv, None if dbeta is None else dbeta.to(beta.dtype), None


def _backward(ctx, do, _didx, _dlse_loc, _dlse_long, _drstd):
    return _grads(ctx, do, torch.ops.freesolo.triton_backward)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager twin of the operators' autograd registration: the same bodies (`_forward_impl`,
    `_backward_impl`), the same saved tensors, without the two custom-op dispatches, which cost
    about 130 us of host time per forward on the H200's host (s23 `host_overhead_probe.py`: 885
    us through the op against 756 for its body at 4k). `triton_attention` uses the operators
    while torch.compile traces (one opaque node, fake tensors) and this class otherwise.
    graphed: the forward may run from the backend's CUDA-graph cache (`graphs.eligible`); the
    backward asks `graphs.eligible` again (a capture or the sync debug mode may have started in
    between)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, cfg_json, variant, graphed):
        ctx.variant = variant
        if graphed:
            # o copied out of the graph, the statistics lent by the binding until the graph's next replay
            constant = (3,) if _is_cached_ones(beta) else ()  # beta = None: the graph reads the ones in place
            output, ctx.binding = graphs.run_forward(
                _forward_impl, (q, k, v, beta), (cfg_json, True), n_copied=1, constant=constant
            )
        else:
            output, ctx.binding = _forward_impl(q, k, v, beta, cfg_json), None
        if ctx.binding is None:
            _setup_context(ctx, (q, k, v, beta, cfg_json), output)
        else:
            ctx.save_for_backward(q, k, v, beta, output[0])
            ctx.cfg_json = cfg_json
            ctx.deterministic_sum = is_deterministic()
        return output[0]

    @staticmethod
    def backward(ctx, do):
        q = ctx.saved_tensors[0]
        if graphs.eligible(q, ctx.variant) and _capturable_backward(ctx.deterministic_sum):
            backward = _graphed_backward if ctx.binding is None else _bound_backward(ctx.binding)
        else:
            backward = _backward_impl
        grads = _grads(ctx, do, backward, ctx.needs_input_grad[3])
        if ctx.binding is not None:
            ctx.binding.spent = True  # a replay may drop the lent statistics (retain_graph: recomputed)
        return (*grads, None, None)


def _forward_call(q, k, v, beta, cfg_json, save_stats: bool, graphed: bool):
    """`_forward_impl`'s outputs, from the CUDA-graph cache when `graphed` (a forward without
    statistics copies only o out of its graph; the others come back as None, as they do eagerly;
    past `graphs.within_copy_limit` only graphs on the inputs serve it)."""
    if graphed:
        n_outputs = None if save_stats else 1
        copies = graphs.within_copy_limit(q)
        return graphs.run(_forward_impl, (q, k, v, beta), (cfg_json, save_stats), n_outputs=n_outputs, copies=copies)
    return _forward_impl(q, k, v, beta, cfg_json, save_stats=save_stats)


def _capturable_backward(deterministic_sum: bool) -> bool:
    """Whether the backward can be captured in a CUDA graph: not in the deterministic "gather" /
    "union" long modes (FREESOLO_TRITON_BWD_LONG, A/B switches of the pre-issue-11 paths), whose
    inverted selection counts readers with torch.bincount, a host sync (s33 call8)."""
    from .attention_bwd import default_long_mode

    return not deterministic_sum or default_long_mode(deterministic_sum) == "cell"


def _graphed_backward(*inputs):
    """`_backward_impl`'s signature, run through the CUDA-graph cache: its 10 tensors (do ... rstd)
    are the graph's inputs, cfg_json, deterministic_sum and need_dbeta are part of the key."""
    return graphs.run(_backward_impl, inputs[:10], inputs[10:])


def _bound_backward(binding: graphs.Binding):
    """`_graphed_backward` for a forward replayed from a graph (`graphs.run_forward`): the backward's
    graph reads q, k, v, beta, o and the statistics from the forward graph's buffers (`graphs.run_bound`:
    in place while no other call replayed the forward graph, copied back in otherwise); only do is
    copied in."""
    q, k, v, beta = binding.graph.inputs
    o, idx, lse_loc, lse_long, rstd = binding.graph.outputs
    fixed = (None, q, k, v, o, idx, beta, lse_loc, lse_long, rstd)  # `_backward_impl`'s tensor order

    def backward(*inputs):
        return graphs.run_bound(_backward_impl, inputs[:10], inputs[10:], binding, fixed)

    return backward


# ---- public functions ----------------------------------------------------------------------------


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FreeSoloConfig, beta=None) -> torch.Tensor:
    """FreeSolo attention on the Triton kernels, differentiable (spec §7, §8).

    Args:
        q: [B, T, Hq, D] unrotated queries; k, v: [B, T, Hkv, D]; same dtype and device.
        cfg: FreeSoloConfig (variant fs, fsl or fsb; fsb needs tau).
        beta: [Hq] long-range mixing coefficient or None (ones); may require grad.
    Returns:
        o [B, T, Hq, D] in q's dtype.
    """
    b = _beta32(beta, q.shape[2], q.device) if beta is None else beta
    if torch.compiler.is_compiling():
        o, _idx, _lse_loc, _lse_long, _rstd = torch.ops.freesolo.triton_forward(q, k, v, b, config_to_json(cfg))
        return o
    # short calls are host-bound: replayed from CUDA graphs when `graphs.eligible` (FREESOLO_TRITON_GRAPHS)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, b))):
        # nothing to differentiate: no autograd node, and the backward's statistics are not stored
        # (12 bytes per position and query head; the rotated keys take their room: fewer launches);
        # up to FREESOLO_TRITON_GRAPH_DIRECT_MAX query elements a graph on the inputs may serve it
        graphed = graphs.eligible(q, cfg.variant, in_place=True)
        return _forward_call(q, k, v, b, config_to_json(cfg), False, graphed)[0]
    return _EagerAttention.apply(q, k, v, b, config_to_json(cfg), cfg.variant, graphs.eligible(q, cfg.variant))


def triton_select_cells(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig) -> torch.Tensor:
    """Selected cells int64 [B, T, Hq, K] (-1 padded, descending score); q [B, T, Hq, D], k [B, T, Hkv, D]."""
    with torch.no_grad(), on_device_of(q):
        return _select(q.detach().contiguous(), k.detach().contiguous(), cfg)


class TritonBackend(Backend):
    """Fused Triton kernels: FS and FS-L entirely in Triton, FS-B with the Triton search on CUDA
    (the torch search on the CPU; FREESOLO_TRITON_FSB_SEARCH overrides: `fsb_search_mode`) +
    Triton readout."""

    name = "triton"
    array_kind = "torch"

    def unavailable_reason(self) -> Optional[str]:
        try:
            import triton  # noqa: F401
        except ImportError as error:
            return f"triton is not installed ({error}); pip install triton==3.6.0"
        try:
            from . import attention, selection  # noqa: F401
        except ImportError as error:
            return f"the Triton kernels cannot be imported ({error})"
        if not torch.cuda.is_available() and not interpreting():
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU float32 tensors, slowly)"
        return None

    def unsupported_reasons(self, info, cfg: FreeSoloConfig) -> list[str]:
        reasons = []
        if info.kind != "torch":
            reasons.append("triton runs on torch tensors, got numpy arrays (use backend='numba' or torch tensors)")
            return reasons
        if info.device.startswith("cuda"):
            if info.dtype not in tuple(str(d) for d in _DTYPES):
                reasons.append(f"triton computes float16/bfloat16/float32 on CUDA, got {info.dtype}")
        elif info.device == "cpu" and interpreting():
            if info.dtype != "torch.float32":
                reasons.append(f"triton under TRITON_INTERPRET=1 runs CPU float32 tensors only, got {info.dtype}")
        else:
            reasons.append(f"triton runs on CUDA (or CPU under TRITON_INTERPRET=1), inputs are on {info.device}")
        if info.D > MAX_HEAD_DIM:
            reasons.append(f"head dim D={info.D} exceeds the kernels' maximum {MAX_HEAD_DIM}")
        return reasons

    def attention(self, q, k, v, cfg, beta):
        return triton_attention(q, k, v, cfg, beta)

    def select_cells(self, q, k, cfg):
        return triton_select_cells(q, k, cfg)
