"""Hugging Face `transformers` models with FreeSolo attention: `convert` and `patch` (Llama, Mistral, Qwen2).

    import freesolo.hf
    lm = freesolo.hf.convert(hf_model_or_local_dir, FreeSoloConfig(...), beta_init=0.0)   # -> FreeSoloLM
    freesolo.hf.patch(hf_model, FreeSoloConfig(...), beta_init=0.0)                       # in place

Hugging Face applies RoPE to q and k before its attention function, while FreeSolo needs them
unrotated (RoPE only inside the local window, NoPE for the long branch), so `patch` replaces each
layer's attention *module* (same `q_proj`/`k_proj`/`v_proj`/`o_proj` weights and biases, the model's
RoPE base carried into `cfg.rope_theta`), not the attention function. With `beta_init=0` and
`cfg.window >= T` both reproduce the original model's logits (FreeSolo is then dense causal RoPE
attention). Nothing is downloaded: a directory is loaded with `local_files_only=True`.

Limits (each raises a ValueError naming it): RoPE scaling other than "default", MLP biases, an
activation other than SiLU. A patched model runs forward, loss and training without Hugging Face's
KV cache (`use_cache` is switched off; for generation convert the model and use `FreeSoloLM.generate`),
and treats every row as one unpadded sequence (its `attention_mask` / `position_ids` are not used).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from .config import FreeSoloConfig
from .models import FreeSoloLM, LMConfig
from .nn import FreeSoloAttention

__all__ = ["convert", "patch", "HFFreeSoloAttention", "FAMILIES", "lm_config_from_hf"]

FAMILIES = ("llama", "mistral", "qwen2")


def _load(model_or_dir):
    """A transformers causal LM (loaded from a local directory when given a path)."""
    if isinstance(model_or_dir, (str, bytes)) or hasattr(model_or_dir, "__fspath__"):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_or_dir, local_files_only=True)
    if not isinstance(model_or_dir, torch.nn.Module) or not hasattr(model_or_dir, "config"):
        raise TypeError(f"expected a transformers causal LM or a local directory, got {type(model_or_dir).__name__}")
    return model_or_dir


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r}: only the default RoPE is supported (no scaling)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = getattr(hf_config, "rope_theta", None) if theta is None else theta
    return 10000.0 if theta is None else float(theta)


def _layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a Llama / Mistral / Qwen2 causal LM")
    return inner, layers


def _check_family(model) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported: one of {FAMILIES}")
    act = getattr(model.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only SiLU (SwiGLU) MLPs are supported")
    _, layers = _layers(model)
    mlp = layers[0].mlp
    if any(getattr(mlp, name).bias is not None for name in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError("mlp_bias=True: MLP biases are not supported")


def lm_config_from_hf(model, cfg: Optional[FreeSoloConfig] = None, beta_init: float = 0.0, **overrides) -> LMConfig:
    """The LMConfig of a transformers Llama / Mistral / Qwen2 causal LM, FreeSolo attention `cfg.variant`."""
    _check_family(model)
    cfg = FreeSoloConfig() if cfg is None else cfg
    if not isinstance(cfg, FreeSoloConfig):
        raise TypeError(f"cfg must be a freesolo.FreeSoloConfig, got {type(cfg).__name__}")
    c = model.config
    _, layers = _layers(model)
    attn = layers[0].self_attn
    n_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    lm_head = model.get_output_embeddings()
    tied = lm_head is not None and lm_head.weight is model.get_input_embeddings().weight
    fields = dict(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        d_ff=c.intermediate_size,
        attention=cfg.variant,
        freesolo=cfg.replace(rope_theta=_rope_theta(c)),
        tie_embeddings=bool(tied),
        qkv_bias=attn.q_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        norm_eps=float(c.rms_norm_eps),
        beta_init=float(beta_init),
    )
    fields.update(overrides)
    return LMConfig(**fields)


def convert(model_or_dir, cfg: Optional[FreeSoloConfig] = None, beta_init: float = 0.0, **overrides) -> FreeSoloLM:
    """A FreeSoloLM with the weights of a transformers Llama / Mistral / Qwen2 causal LM.

    Args:
        model_or_dir: the model, or a local directory `from_pretrained` can read (no download).
        cfg: FreeSolo hyper-parameters; `variant` picks the attention; `rope_theta` is taken from the model.
        beta_init: initial beta of every head (0: the converted model starts as sliding-window attention).
        overrides: other LMConfig fields (e.g. backend="triton").
    Returns:
        FreeSoloLM in float32 on the CPU (move it with `.to(...)`).
    """
    model = _load(model_or_dir)
    config = lm_config_from_hf(model, cfg, beta_init, **overrides)
    lm = FreeSoloLM(config)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model."):
            name = name[len("model.") :]
        elif name == "lm_head.weight" and config.tie_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        state[name] = tensor.detach().to("cpu", torch.float32)
    for name, tensor in lm.state_dict().items():
        if name.endswith(".self_attn.beta"):  # FreeSolo's own parameter: beta_init
            state[name] = tensor
    lm.load_weights(state, source=f"{type(model).__name__} state dict")
    return lm


def _transformers_returns_cache() -> bool:
    """transformers < 4.48 attention modules return (output, weights, past_key_value)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) < (4, 48)


class HFFreeSoloAttention(FreeSoloAttention):
    """FreeSoloAttention with Hugging Face's attention-module calling convention:
    `forward(hidden_states, position_embeddings, attention_mask, ...) -> (output, None)`."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        for name in ("cache", "past_key_values", "past_key_value"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"a model patched with FreeSolo attention does not use Hugging Face's KV cache ({name} was given): "
                    "call it with use_cache=False, or generate with freesolo.hf.convert(model, cfg).generate(...)"
                )
        out = super().forward(hidden_states)
        return (out, None, None) if _transformers_returns_cache() else (out, None)


def patch(model, cfg: Optional[FreeSoloConfig] = None, beta_init: float = 0.0, backend: Optional[str] = "torch"):
    """Replace, in place, every attention module of a transformers Llama / Mistral / Qwen2 causal LM
    by FreeSolo attention with the same weights (q/k/v biases kept, `rope_theta` carried over).

    Args:
        model: the transformers model (modified in place and returned).
        cfg: FreeSolo hyper-parameters (its `rope_theta` is replaced by the model's).
        beta_init: initial beta of every head.
        backend: FreeSolo backend of the patched layers ("torch" on CPU, "triton" on CUDA).
    Returns:
        the model, whose forward / loss / training now run FreeSolo attention (use_cache off).
    """
    model = _load(model)
    config = lm_config_from_hf(model, cfg, beta_init)
    _, layers = _layers(model)
    for layer in layers:
        old = layer.self_attn
        ref = old.q_proj.weight
        new = HFFreeSoloAttention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            cfg=config.freesolo,
            beta_init=beta_init,
            bias=config.qkv_bias,
            o_bias=config.o_bias,
            backend=backend,
        ).to(device=ref.device, dtype=ref.dtype)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(new, name).load_state_dict(getattr(old, name).state_dict())
        new.layer_idx = getattr(old, "layer_idx", None)
        new.config = getattr(old, "config", None)
        layer.self_attn = new
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config = copy.copy(model.generation_config)
        model.generation_config.use_cache = False
    return model
