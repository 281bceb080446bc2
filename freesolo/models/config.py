"""`LMConfig`: the configuration of `FreeSoloLM`, a frozen dataclass validated once (JSON round trip)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

from ..config import FreeSoloConfig

__all__ = ["LMConfig", "ATTENTIONS", "FREESOLO_ATTENTIONS"]

FREESOLO_ATTENTIONS = ("fs", "fsl", "fsb")
ATTENTIONS = FREESOLO_ATTENTIONS + ("dense", "window")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


@dataclass(frozen=True)
class LMConfig:
    """A small LLaMA-style decoder (RMSNorm, SwiGLU MLP, RoPE) whose attention is chosen per model.

    `attention`: "fs" / "fsl" / "fsb" (FreeSolo; `freesolo.variant` is set to it), "dense" (causal
    RoPE attention over all previous tokens, SDPA) or "window" (sliding-window RoPE attention with
    `freesolo.window`: FreeSolo's local branch alone). Every kind reads RoPE's base from
    `freesolo.rope_theta`, so the baselines match the FreeSolo model they are compared with.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None  # GQA: kv heads (default n_heads)
    attention: str = "fsl"  # "fs" | "fsl" | "fsb" | "dense" | "window"
    freesolo: FreeSoloConfig = None  # default FreeSoloConfig(); the baselines read window, rope_theta
    head_dim: Optional[int] = None  # default d_model // n_heads
    d_ff: Optional[int] = None  # SwiGLU hidden size (default: 8/3 d_model rounded up to a multiple of 16)
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # biases on q / k / v projections (Qwen2)
    o_bias: bool = False  # bias on the output projection (Llama with attention_bias=True)
    norm_eps: float = 1e-6  # RMSNorm epsilon of the model's norms
    beta_init: float = 1.0  # FreeSolo: initial beta of every head (0: starts as a sliding-window model)
    init_std: float = 0.02  # normal init of linear and embedding weights
    backend: Optional[str] = "torch"  # FreeSolo backend of every layer (None: freesolo.get_backend())

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            _positive(name, getattr(self, name))
        n_kv = self.n_heads if self.n_kv_heads is None else _positive("n_kv_heads", self.n_kv_heads)
        if self.n_heads % n_kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={n_kv}")
        object.__setattr__(self, "n_kv_heads", n_kv)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}: set head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if _positive("head_dim", self.head_dim) % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", -(-(8 * self.d_model // 3) // 16) * 16)
        _positive("d_ff", self.d_ff)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTIONS}")
        cfg = self.freesolo
        if cfg is None:
            cfg = FreeSoloConfig()
        elif isinstance(cfg, dict):
            cfg = FreeSoloConfig(**cfg)
        elif not isinstance(cfg, FreeSoloConfig):
            raise TypeError(f"freesolo must be a FreeSoloConfig, got {type(cfg).__name__}")
        if self.attention in FREESOLO_ATTENTIONS and cfg.variant != self.attention:
            cfg = cfg.replace(variant=self.attention)
        object.__setattr__(self, "freesolo", cfg)
        for name in ("tie_embeddings", "qkv_bias", "o_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        for name in ("norm_eps", "beta_init", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"{name}={value!r} must be a float")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be positive")
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"backend={self.backend!r} must be a backend name or None")

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the FreeSolo config nested; tuples as lists)."""
        out = asdict(self)
        out["freesolo"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.freesolo).items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "LMConfig":
        """Inverse of `to_dict`; unknown keys raise a ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LMConfig fields {unknown}")
        data = dict(data)
        fs = data.get("freesolo")
        if isinstance(fs, dict):
            fs_known = {f.name for f in fields(FreeSoloConfig)}
            bad = sorted(set(fs) - fs_known)
            if bad:
                raise ValueError(f"unknown FreeSoloConfig fields {bad} in freesolo")
            fs = {k: tuple(v) if isinstance(v, list) else v for k, v in fs.items()}
            data["freesolo"] = FreeSoloConfig(**fs)
        return cls(**data)

    def replace(self, **changes) -> "LMConfig":
        from dataclasses import replace

        return replace(self, **changes)
