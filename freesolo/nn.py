"""Attention layers for models: `FreeSoloAttention` and the two baselines (`SDPAAttention`: dense causal
RoPE attention, or sliding-window RoPE attention = FreeSolo's local branch alone), with their caches.

    attn = FreeSoloAttention(hidden_size=64, num_heads=4, num_kv_heads=2, cfg=FreeSoloConfig(...))
    y = attn(x)                              # x [B, T, hidden] -> [B, T, hidden]
    cache = attn.new_cache(batch=B)          # FreeSoloCache: decode / chunked prefill
    y_new = attn(x_new, cache=cache)         # x_new [B, n, hidden], any n >= 1

FreeSolo needs q and k *unrotated* (RoPE only inside the local window, NoPE for the long branch),
so the module owns its projections and calls `freesolo.freesolo_attention` with raw q, k, v; the
backend applies RoPE (base `cfg.rope_theta`) in the local branch. The projections are named as in
Hugging Face's Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`), so checkpoints map one to one.

Caches. A cache argument is either one cache for the whole batch (every row at the same length)
or a list with one batch-1 cache per row: rows may then stand at different lengths (generation
from prompts of different lengths), and each row's outputs equal its own sequence's.

This module imports torch (it is not imported by `import freesolo`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .api import freesolo_attention
from .backends.registry import get_backend
from .cache import FreeSoloCache
from .config import FreeSoloConfig

__all__ = [
    "RMSNorm",
    "FreeSoloAttention",
    "SDPAAttention",
    "KVCache",
    "rope_cos_sin",
    "apply_rope",
    "positions_from_cu_seqlens",
]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32 (as Llama's)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [..., n, D/2] of half-split RoPE (spec §2) at integer `positions` [..., n];
    angles computed in float64 (as the torch backend's), then cast to `dtype`."""
    half = head_dim // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=positions.device) / head_dim)
    angle = positions.to(torch.float64)[..., None] * inv_freq  # (..., n, D/2)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split ("rotate_half") RoPE. x [B, n, H, D]; cos / sin [B or 1, n, D/2] -> [B, n, H, D]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, n, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: (position in its sequence [T], sequence id [T]) for cu_seqlens [N+1]."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()} must start at 0, increase strictly and end at T={T}")
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # (T,)
    pos = torch.arange(T) - cu[:-1][seq]
    return pos, seq


# ---- torch.compile: FreeSolo attention as one opaque custom op -------------------------------
# Under torch.compile (compile_mode "auto") the module calls these ops instead of
# `freesolo_attention` for every backend except triton (whose kernels are already custom ops with
# fake tensors): the torch backend cannot be traced (its autograd.Function's backward calls
# torch.autograd.grad; its Python loops over query blocks would unroll), the host backends are
# NumPy. `torch.compile(model, fullgraph=True)` thus traces the model without graph breaks on any
# backend. Backward recomputes the forward with autograd inside `attention_opaque_bwd` (one more
# forward per backward).


def _cfg_json(cfg: FreeSoloConfig) -> str:
    return json.dumps(asdict(cfg))


def _cfg_from_json(text: str) -> FreeSoloConfig:
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}
    return FreeSoloConfig(**fields)


@torch.library.custom_op("freesolo::attention_opaque", mutates_args=())
def attention_opaque(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, cfg_json: str, backend: str
) -> torch.Tensor:
    """freesolo_attention(q, k, v, cfg, beta, backend) as a custom op: q [B, T, Hq, D] -> [B, T, Hq, D]."""
    with torch.no_grad():
        o = freesolo_attention(q, k, v, _cfg_from_json(cfg_json), beta=beta, backend=backend or None)
    return o.contiguous()


@attention_opaque.register_fake
def _attention_opaque_fake(q, k, v, beta, cfg_json, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("freesolo::attention_opaque_bwd", mutates_args=())
def attention_opaque_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    grad: torch.Tensor,
    cfg_json: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dbeta) of attention_opaque, by recomputing its forward with autograd."""
    # a custom op's body runs with autograd excluded from dispatch: include it again for the recompute
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        inputs = [x.detach().requires_grad_(True) for x in (q, k, v, beta)]
        o = freesolo_attention(*inputs[:3], _cfg_from_json(cfg_json), beta=inputs[3], backend=backend or None)
        grads = torch.autograd.grad(o, inputs, grad)
    return tuple(g.contiguous() for g in grads)


@attention_opaque_bwd.register_fake
def _attention_opaque_bwd_fake(q, k, v, beta, grad, cfg_json, backend):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, beta))


def _opaque_setup(ctx, inputs, output):
    q, k, v, beta, cfg_json, backend = inputs
    ctx.save_for_backward(q, k, v, beta)
    ctx.cfg_json, ctx.backend = cfg_json, backend


def _opaque_backward(ctx, grad):
    q, k, v, beta = ctx.saved_tensors
    dq, dk, dv, dbeta = attention_opaque_bwd(q, k, v, beta, grad.contiguous(), ctx.cfg_json, ctx.backend)
    return dq, dk, dv, dbeta, None, None


attention_opaque.register_autograd(_opaque_backward, setup_context=_opaque_setup)


def _sizes(hidden_size, num_heads, num_kv_heads, head_dim) -> tuple[int, int, int, int]:
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive int")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}: pass head_dim")
        head_dim = hidden_size // num_heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim={head_dim!r} must be a positive even int (RoPE)")
    return hidden_size, num_heads, num_kv_heads, head_dim


def _is_decode_graph(cache) -> bool:
    from .streaming.torch_state import DecodeGraph

    return isinstance(cache, DecodeGraph)


def _check_x(x: torch.Tensor, hidden_size: int) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != hidden_size:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [B, T, hidden_size={hidden_size}], got {shape}")
    if x.shape[1] == 0:
        raise ValueError("x has T=0 tokens")


def _row_caches(cache, B: int, kind: type) -> list:
    """A list of batch-1 caches (one per row), checked against B and the cache type."""
    rows = list(cache)
    if len(rows) != B:
        raise ValueError(f"cache is a list of {len(rows)} per-row caches but x has B={B} rows")
    for r in rows:
        if not isinstance(r, kind):
            raise TypeError(f"per-row caches must be {kind.__name__}, got {type(r).__name__}")
    return rows


class _Projections(nn.Module):
    """q / k / v / o projections shared by every attention kind (Llama names)."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, bias: bool, o_bias: bool):
        super().__init__()
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = _sizes(
            hidden_size, num_heads, num_kv_heads, head_dim
        )
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(hidden_size, Hq * D, bias=bias)
        self.k_proj = nn.Linear(hidden_size, Hkv * D, bias=bias)
        self.v_proj = nn.Linear(hidden_size, Hkv * D, bias=bias)
        self.o_proj = nn.Linear(Hq * D, hidden_size, bias=o_bias)

    def qkv(self, x: torch.Tensor):
        """x [B, T, hidden] -> q [B, T, Hq, D], k / v [B, T, Hkv, D] (unrotated)."""
        _check_x(x, self.hidden_size)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, Hq, D] -> [B, T, hidden]."""
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))


class FreeSoloAttention(_Projections):
    """FreeSolo attention layer: projections, GQA, learnable per-head `beta` (spec §1, §7).

    Args:
        hidden_size: model width.
        num_heads, num_kv_heads: Hq and Hkv (Hq % Hkv == 0; default Hkv = Hq).
        head_dim: D (even; default hidden_size // num_heads).
        cfg: FreeSoloConfig (variant, window, cell, ..., rope_theta of the local branch). FS-B's
            `tau` [Hkv] may be in cfg or set later with `set_tau` (see `freesolo.models.calibrate_tau`).
        beta_init: initial value of `beta` [Hq]. 0 makes the layer a pure sliding-window RoPE layer
            at start (continued pretraining of a converted model).
        bias: biases on q / k / v projections (Qwen2 has them); o_bias: bias on o_proj.
        backend: backend of every call ("torch", "triton", "numba", "numpy"; None = `freesolo.get_backend()`).
        check_finite: the parallel op's finite check of q, k, v (`freesolo_attention`): one host
            sync per call on CUDA; False for training loops that must not sync (the attribute can
            be changed later).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        cfg: Optional[FreeSoloConfig] = None,
        beta_init: float = 1.0,
        bias: bool = False,
        o_bias: bool = False,
        backend: Optional[str] = None,
        check_finite: bool = True,
    ):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, bias, o_bias)
        cfg = FreeSoloConfig() if cfg is None else cfg
        if not isinstance(cfg, FreeSoloConfig):
            raise TypeError(f"cfg must be a freesolo.FreeSoloConfig, got {type(cfg).__name__}")
        cfg.per_head("sigma", self.num_heads)
        cfg.per_head("lam", self.num_heads)
        if cfg.tau is not None:
            cfg = cfg.replace(tau=tuple(cfg.tau_array(self.num_kv_heads)))
        if not math.isfinite(float(beta_init)):
            raise ValueError(f"beta_init={beta_init!r} must be finite")
        self.cfg = cfg
        self.backend = backend
        self.check_finite = bool(check_finite)
        self.compile_mode = "auto"  # under torch.compile: "auto", "opaque" (attention_opaque) or "direct"
        self.beta = nn.Parameter(torch.full((self.num_heads,), float(beta_init)))

    @property
    def cfg(self) -> FreeSoloConfig:
        """The layer's FreeSoloConfig (FS-B: with this layer's tau)."""
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: FreeSoloConfig) -> None:
        if not isinstance(cfg, FreeSoloConfig):
            raise TypeError(f"cfg must be a freesolo.FreeSoloConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._cfg_json = _cfg_json(cfg)  # the compiled path passes the config as a string

    # ---- FS-B threshold -------------------------------------------------------------------
    @property
    def tau(self) -> Optional[tuple]:
        """FS-B high-norm threshold per kv head (a tuple of Hkv floats) or None."""
        return self.cfg.tau

    def set_tau(self, tau) -> None:
        """Set FS-B's threshold [Hkv] (a sequence, numpy array or tensor); stored in `cfg`."""
        tau = FreeSoloConfig(tau=tau).tau
        self.cfg = self.cfg.replace(tau=tuple(self.cfg.replace(tau=tau).tau_array(self.num_kv_heads)))

    def _check_ready(self) -> None:
        if self.cfg.variant == "fsb" and self.cfg.tau is None:
            raise ValueError(
                "FreeSoloAttention(variant='fsb') has no tau: calibrate it with "
                "freesolo.models.calibrate_tau(model, sequences) or attn.set_tau(freesolo.calibrate_tau(k, cfg))"
            )

    def cache_backend(self) -> str:
        """Backend of the streaming cache: the layer's, except "triton" whose cache runs torch ops."""
        backend = self.backend if self.backend is not None else get_backend()
        return "torch" if backend == "triton" else backend

    def new_cache(
        self, batch: int, dtype=None, device=None, check_finite: bool = True, decode_kernel: Optional[str] = None
    ) -> FreeSoloCache:
        """A FreeSoloCache for this layer (dtype / device: the torch cache's storage; default: the
        weights'; check_finite=False: no host sync per call; decode_kernel: the cache's one-token
        step, default "auto" (the fused Triton step on CUDA) for a triton layer of FS / FS-L, else "torch")."""
        self._check_ready()
        backend = self.cache_backend()
        kwargs = {}
        if backend == "torch":
            dtype = self.q_proj.weight.dtype if dtype is None else dtype
            device = self.q_proj.weight.device if device is None else device
            if decode_kernel is None:
                decode_kernel = "auto" if self.backend == "triton" else "torch"
            if decode_kernel != "torch":
                kwargs["decode_kernel"] = decode_kernel
        elif decode_kernel not in (None, "torch"):
            raise ValueError(f"decode_kernel={decode_kernel!r} needs the torch cache, not backend={backend!r}")
        return FreeSoloCache(
            self.cfg,
            batch=batch,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            backend=backend,
            dtype=dtype if backend == "torch" else None,
            device=device if backend == "torch" else None,
            check_finite=check_finite,
            **kwargs,
        )

    def attend(self, q, k, v, cu_seqlens=None, cache=None) -> torch.Tensor:
        """The attention alone on projected q [B, T, Hq, D], k / v [B, T, Hkv, D] -> o [B, T, Hq, D]."""
        self._check_ready()
        if cache is None:
            if torch.compiler.is_compiling() and self._compile_opaque():
                if cu_seqlens is not None:
                    raise ValueError("cu_seqlens is not supported under torch.compile with the opaque op")
                return attention_opaque(q, k, v, self.beta, self._cfg_json, self.backend or "")
            kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
            beta = self.beta.view(-1) if torch.compiler.is_compiling() else self.beta  # a Tensor, not a Parameter
            return freesolo_attention(
                q, k, v, self.cfg, beta=beta, backend=self.backend, check_finite=self.check_finite, **kwargs
            )
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens and cache cannot be combined: a cache streams one sequence per row")
        beta = self.beta.detach()
        if _is_decode_graph(cache):  # cache.decode_graph(beta): the one-token step in CUDA graphs
            if q.shape[1] != 1:
                raise ValueError(f"a DecodeGraph takes one token per call, got T={q.shape[1]}")
            return cache(q, k, v).clone()
        if isinstance(cache, FreeSoloCache):
            return self._extend(cache, q, k, v, beta)
        rows = _row_caches(cache, q.shape[0], FreeSoloCache)
        return torch.cat([self._extend(c, q[b : b + 1], k[b : b + 1], v[b : b + 1], beta) for b, c in enumerate(rows)])

    def _extend(self, cache: FreeSoloCache, q, k, v, beta) -> torch.Tensor:
        """Stream a chunk through the cache. A first chunk of several tokens (a prompt) runs the
        parallel op and `cache.prefill` (the state `extend` would leave; outputs equal by L6)."""
        if cache.length == 0 and q.shape[1] > 1:
            o = freesolo_attention(q, k, v, self.cfg, beta=beta, backend=self.backend, check_finite=self.check_finite)
            cache.prefill(k, v)
            return o
        return cache.extend(q, k, v, beta=beta)

    def _compile_opaque(self) -> bool:
        """Under torch.compile: call FreeSolo through `attention_opaque`? "auto": yes, except for the
        triton backend, whose kernels are custom ops with fake tensors (compile-native)."""
        if self.compile_mode == "auto":
            return (self.backend if self.backend is not None else get_backend()) != "triton"
        if self.compile_mode not in ("opaque", "direct"):
            raise ValueError(f"compile_mode={self.compile_mode!r} must be 'auto', 'opaque' or 'direct'")
        return self.compile_mode == "opaque"

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Union[FreeSoloCache, Sequence[FreeSoloCache], None] = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden].

        Args:
            cu_seqlens: packed sequences (B = 1), int [N+1] (spec §12).
            cache: a FreeSoloCache of batch B, or a list of B batch-1 caches (rows at different
                lengths), or `cache.decode_graph(beta)` (CUDA, one token per call); the call then
                consumes x as the next tokens (inference only: no grad).
        """
        q, k, v = self.qkv(x)
        return self.out(self.attend(q, k, v, cu_seqlens=cu_seqlens, cache=cache))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, variant={self.cfg.variant!r}, backend={self.backend!r}"
        )


_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch >= 2.5


def _cached_sdpa_backends():
    """SDPA backends for cached steps (a key length that changes every call): cuDNN left out. On the
    H200 (torch 2.11) cuDNN attention builds an execution plan for every new key length: 13.4 ms of
    host time per call, 45 ms per token for a 4-layer dense model at 64k
    (`benchmarks/profile_dense_decode.py`), against ~20 us of GPU time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class KVCache:
    """KV cache of one baseline layer: keys (rotated at their position) and values [B, L, Hkv, D].

    With `window`, only the last `window` tokens are kept (memory bounded, like FreeSolo's ring).
    All rows share one length; rows at different lengths use a list of batch-1 caches.
    """

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self._k: Optional[torch.Tensor] = None  # (B, capacity, Hkv, D); dense: grown by doubling
        self._v: Optional[torch.Tensor] = None
        self._held = 0  # tokens held in the buffers
        self.length = 0  # tokens consumed

    @property
    def k(self) -> Optional[torch.Tensor]:
        """Held keys [B, L, Hkv, D] (rotated), L = length (dense) or min(length, window)."""
        return None if self._k is None else self._k[:, : self._held]

    @property
    def v(self) -> Optional[torch.Tensor]:
        return None if self._v is None else self._v[:, : self._held]

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Add k (rotated) / v [B, n, Hkv, D]; return the keys / values the chunk's queries read."""
        n = k.shape[1]
        if self._k is not None and self._k.shape[0] != k.shape[0]:
            raise ValueError(f"the KV cache holds B={self._k.shape[0]} rows, the chunk has {k.shape[0]}")
        if self.window is not None:  # bounded: the last `window` tokens before the chunk, then the chunk
            keys = k if self._k is None else torch.cat([self.k, k], dim=1)
            values = v if self._v is None else torch.cat([self.v, v], dim=1)
            keep = min(keys.shape[1], self.window)
            self._k, self._v = keys[:, -keep:].detach().clone(), values[:, -keep:].detach().clone()
            self._held = keep
        else:
            need = self._held + n
            if self._k is None or need > self._k.shape[1]:
                cap = max(need, 2 * (0 if self._k is None else self._k.shape[1]), 16)
                new_k = k.new_empty((k.shape[0], cap) + tuple(k.shape[2:]))
                new_v = v.new_empty((v.shape[0], cap) + tuple(v.shape[2:]))
                if self._k is not None:
                    new_k[:, : self._held] = self.k
                    new_v[:, : self._held] = self.v
                self._k, self._v = new_k, new_v
            self._k[:, self._held : need] = k.detach()
            self._v[:, self._held : need] = v.detach()
            self._held = need
            keys, values = self.k, self.v
        self.length += n
        return keys, values

    def held_bytes(self) -> int:
        """Bytes of the keys / values held (the allocated capacity may be up to twice this)."""
        if self._k is None:
            return 0
        return 2 * self.k.numel() * self.k.element_size()

    def memory_bytes(self) -> int:
        """Bytes of the key / value buffers (allocated capacity)."""
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    def state_dict(self) -> dict:
        return {"window": self.window, "length": self.length, "k": self.k, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.length = state["window"], state["length"]
        self._k, self._v = state["k"], state["v"]
        self._held = 0 if self._k is None else self._k.shape[1]


class SDPAAttention(_Projections):
    """Baseline attention with the same projections: dense causal RoPE attention (`window=None`) or
    sliding-window RoPE attention (keys i-window < t <= i: FreeSolo's local branch alone), through
    `torch.nn.functional.scaled_dot_product_attention`.

    Args: as FreeSoloAttention's, plus `window` (None = dense) and `rope_theta`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        window: Optional[int] = None,
        rope_theta: float = 10000.0,
        bias: bool = False,
        o_bias: bool = False,
    ):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, bias, o_bias)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"window={window!r} must be a positive int or None (dense)")
        if not (isinstance(rope_theta, (int, float)) and math.isfinite(rope_theta) and rope_theta > 0):
            raise ValueError(f"rope_theta={rope_theta!r} must be a positive float")
        self.window = window
        self.rope_theta = float(rope_theta)

    def new_cache(self, batch: int = 1, dtype=None, device=None) -> KVCache:
        """An empty KVCache (batch, dtype and device follow the first chunk)."""
        return KVCache(self.window)

    def _sdpa(self, q, k, v, mask):
        """q [B, n, Hq, D] (rotated), k / v [B, L, Hkv, D] -> [B, n, Hq, D]. mask: bool [n, L], None
        (causal) or "all" (every key visible: one decode query)."""
        qh = q.transpose(1, 2)  # (B, Hq, n, D)
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, L, D)
        kwargs = dict(is_causal=True) if mask is None else dict(attn_mask=None if isinstance(mask, str) else mask)
        if self.num_heads != self.num_kv_heads:
            if _SDPA_GQA:
                kwargs["enable_gqa"] = True  # no copy of the cache per query head
            else:
                G = self.num_heads // self.num_kv_heads
                kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)  # (B, Hq, L, D)
        return F.scaled_dot_product_attention(qh, kh, vh, **kwargs).transpose(1, 2)  # (B, n, Hq, D)

    def _mask(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """bool [n, L]: key t visible from query i (t <= i, and i - window < t with a window)."""
        mask = kpos[None, :] <= qpos[:, None]
        if self.window is not None:
            mask = mask & (kpos[None, :] > qpos[:, None] - self.window)
        return mask

    def attend(self, q, k, v, cu_seqlens=None, cache=None) -> torch.Tensor:
        """Projected q [B, T, Hq, D], k / v [B, T, Hkv, D] (unrotated) -> o [B, T, Hq, D]."""
        B, T = q.shape[:2]
        dev = q.device
        if cache is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens and cache cannot be combined: a cache streams one sequence per row")
            if isinstance(cache, KVCache):
                return self._extend(cache, q, k, v)
            rows = _row_caches(cache, B, KVCache)
            return torch.cat([self._extend(c, q[b : b + 1], k[b : b + 1], v[b : b + 1]) for b, c in enumerate(rows)])
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens needs B=1 (sequences packed along T), got B={B}")
            pos, seq = positions_from_cu_seqlens(cu_seqlens, T)
            pos, seq = pos.to(dev), seq.to(dev)
            mask = self._mask(pos, pos) & (seq[None, :] == seq[:, None])
        else:
            pos = torch.arange(T, device=dev)
            mask = None if self.window is None or self.window >= T else self._mask(pos, pos)
        cos, sin = rope_cos_sin(pos[None], self.head_dim, self.rope_theta, q.dtype)
        return self._sdpa(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask)

    def _extend(self, cache: KVCache, q, k, v) -> torch.Tensor:
        n, t0 = q.shape[1], cache.length
        pos = torch.arange(t0, t0 + n, device=q.device)
        cos, sin = rope_cos_sin(pos[None], self.head_dim, self.rope_theta, q.dtype)
        keys, values = cache.append(apply_rope(k, cos, sin), v)  # (B, L, Hkv, D)
        L = keys.shape[1]
        if L == n and (self.window is None or self.window >= n):
            mask = None  # a first chunk: plain causal
        elif n == 1 and (self.window is None or self.window >= L):
            mask = "all"  # one query sees every held key
        else:
            mask = self._mask(pos, torch.arange(t0 + n - L, t0 + n, device=q.device))
        with _cached_sdpa_backends():
            return self._sdpa(apply_rope(q, cos, sin), keys, values, mask)

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; `cu_seqlens` / `cache` as FreeSoloAttention's."""
        q, k, v = self.qkv(x)
        return self.out(self.attend(q, k, v, cu_seqlens=cu_seqlens, cache=cache))

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, window={self.window}, rope_theta={self.rope_theta}"
        )
