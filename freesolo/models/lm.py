"""`FreeSoloLM`: a small LLaMA-style decoder with FreeSolo (fs / fsl / fsb) or baseline (dense / window)
attention, cached generation, safetensors save / load and per-layer FS-B calibration.

    cfg = LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="fsl",
                   freesolo=FreeSoloConfig(cell=8, block=16, window=32, pool=4, recent=2))
    model = FreeSoloLM(cfg)
    logits = model(input_ids)                      # [B, T] -> [B, T, V]
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=20)
    model.save_pretrained("ckpt"); FreeSoloLM.from_pretrained("ckpt")

Parameter names follow Hugging Face's Llama (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...,
`mlp.gate_proj`, `input_layernorm`, `post_attention_layernorm`, `norm`, `lm_head`).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import FreeSoloConfig
from ..nn import FreeSoloAttention, RMSNorm, SDPAAttention
from .config import FREESOLO_ATTENTIONS, LMConfig

__all__ = ["FreeSoloLM", "SwiGLU", "DecoderLayer", "calibrate_tau"]

_FORMAT = "freesolo.FreeSoloLM/1"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_TAU_SUFFIX = ".self_attn.tau"


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): [..., d_model] -> [..., d_model]."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_attention(cfg: LMConfig) -> nn.Module:
    """The attention layer of `cfg.attention` (FreeSoloAttention or SDPAAttention)."""
    fs = cfg.freesolo
    common = dict(hidden_size=cfg.d_model, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim)
    if cfg.attention in FREESOLO_ATTENTIONS:
        return FreeSoloAttention(
            **common, cfg=fs, beta_init=cfg.beta_init, bias=cfg.qkv_bias, o_bias=cfg.o_bias, backend=cfg.backend
        )
    window = fs.window if cfg.attention == "window" else None
    return SDPAAttention(**common, window=window, rope_theta=fs.rope_theta, bias=cfg.qkv_bias, o_bias=cfg.o_bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = make_attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, cu_seqlens=None, cache=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cu_seqlens=cu_seqlens, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class FreeSoloLM(nn.Module):
    """Decoder-only LM: embedding, `n_layers` DecoderLayers, final RMSNorm, (tied) lm_head."""

    def __init__(self, config: LMConfig):
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be a freesolo.models.LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) linear / embedding weights, zero biases, unit norms, beta = beta_init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.config.init_std)
            elif isinstance(module, FreeSoloAttention):
                nn.init.constant_(module.beta, self.config.beta_init)

    # ---- forward --------------------------------------------------------------------------
    def _check_ids(self, input_ids) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [B, T], got {shape}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has T=0 tokens")
        return input_ids

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: h [B, T, d_model] -> logits [B, T, V]."""
        h = self.norm(h)
        return h @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, cache=None) -> torch.Tensor:
        """input_ids [B, T] (int) -> logits [B, T, vocab_size].

        Args:
            cu_seqlens: packed sequences (B = 1), int [N+1]: positions restart at each sequence.
            cache: list of per-layer caches (`new_cache`): input_ids are then the next tokens.
        """
        self._check_ids(input_ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layer entries, the model has {len(self.layers)} layers")
        h = self.embed_tokens(input_ids)  # (B, T, d_model)
        for i, layer in enumerate(self.layers):
            h = layer(h, cu_seqlens=cu_seqlens, cache=None if cache is None else cache[i])
        return self.logits_of(h)

    def loss(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross entropy over input_ids [B, T] (with cu_seqlens: within each sequence)."""
        logits = self(input_ids, cu_seqlens=cu_seqlens)
        targets = input_ids[:, 1:].clone()
        if cu_seqlens is not None:
            starts = torch.as_tensor(cu_seqlens, device=input_ids.device)[1:-1]
            targets[:, starts - 1] = -100  # the last token of a sequence does not predict the next one's first
        flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()  # (B * (T-1), V)
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)

    # ---- caches and generation ------------------------------------------------------------
    def new_cache(
        self, batch: int = 1, dtype=None, device=None, check_finite: bool = True, decode_kernel: Optional[str] = None
    ) -> list:
        """One cache per layer for `batch` rows at the same length (FreeSoloCache or KVCache);
        check_finite=False skips FreeSoloCache's per-call finite check (a host sync on CUDA);
        decode_kernel: see FreeSoloAttention.new_cache."""
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attn, FreeSoloAttention):
                kw = dict(dtype=dtype, device=device, check_finite=check_finite, decode_kernel=decode_kernel)
                out.append(attn.new_cache(batch, **kw))
            else:
                out.append(attn.new_cache(batch))
        return out

    def cache_memory_bytes(self, cache: list) -> int:
        """Bytes held by a cache from `new_cache` (or by per-row lists of them)."""
        total = 0
        for entry in cache:
            for c in entry if isinstance(entry, (list, tuple)) else [entry]:
                total += c.memory_bytes()
        return total

    @torch.no_grad()
    def generate(
        self,
        input_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
        attention_mask: Optional[torch.Tensor] = None,
        max_new_tokens: int = 16,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        eos_token_id: Optional[int] = None,
        pad_token_id: int = 0,
        prefill_chunk: Optional[int] = None,
        return_logits: bool = False,
    ):
        """Greedy or sampled continuation of a batch of prompts of different lengths.

        Each row is streamed through its own caches (FreeSoloCache for FreeSolo attention, a KV
        cache for the baselines): its tokens and logits equal those of its prompt run alone.

        Args:
            input_ids: int [B, T] padded prompts (with `attention_mask`), or a list of B token lists.
            attention_mask: [B, T] of 0 / 1, each row's ones contiguous: left padding (zeros first)
                or right padding (zeros last); None = every token is real.
            max_new_tokens: tokens generated per row.
            do_sample, temperature, top_k, top_p, generator: sampling (greedy argmax otherwise).
            eos_token_id: a row that emits it is finished; its later tokens are `pad_token_id`.
            prefill_chunk: prompt tokens per cache call (None: the whole prompt at once).
            return_logits: also return the logits each new token was chosen from.
        Returns:
            sequences int64 [B, T + max_new_tokens]: with left padding (or a full batch), the input
            followed by the new tokens; with right padding or a list, each row's prompt, its new
            tokens, then `pad_token_id`. With `return_logits`: (sequences, logits [B, max_new_tokens, V]).
        """
        prompts, side = _split_prompts(input_ids, attention_mask, self.embed_tokens.weight.device)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative int")
        if do_sample and not (temperature > 0):
            raise ValueError(f"temperature={temperature} must be > 0 when sampling")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk <= 0):
            raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive int or None")
        B, V = len(prompts), self.config.vocab_size
        for b, p in enumerate(prompts):
            if int(p.min()) < 0 or int(p.max()) >= V:
                raise ValueError(f"prompt {b} has token ids outside [0, vocab_size={V})")
        # one batch-1 cache per row and layer: rows stand at different lengths
        rows = [self.new_cache(1, check_finite=False) for _ in range(B)]  # rows[b][layer]
        last = []
        for b, p in enumerate(prompts):
            chunk = p.numel() if prefill_chunk is None else prefill_chunk
            for start in range(0, p.numel(), chunk):
                logits = self(p[None, start : start + chunk], cache=rows[b])  # (1, n, V)
            last.append(logits[:, -1])
        logits = torch.cat(last)  # (B, V)
        per_layer = [[rows[b][i] for b in range(B)] for i in range(len(self.layers))]  # cache[layer][row]
        device = logits.device
        new = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.int64, device=device)
        out_logits = torch.full((B, max_new_tokens, V), float("nan"), dtype=logits.dtype, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            out_logits[:, step] = logits
            tok = _pick(logits, do_sample, temperature, top_k, top_p, generator)
            tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
            new[:, step] = tok
            if eos_token_id is not None:
                finished |= tok == eos_token_id
                if bool(finished.all()):
                    break
            if step + 1 < max_new_tokens:
                logits = self(tok[:, None], cache=per_layer)[:, -1]  # (B, V)
        sequences = _assemble(prompts, side, input_ids, new, pad_token_id)
        return (sequences, out_logits) if return_logits else sequences

    # ---- FS-B calibration -----------------------------------------------------------------
    def calibrate_tau(self, sequences) -> list:
        """See `freesolo.models.calibrate_tau`."""
        return calibrate_tau(self, sequences)

    # ---- save / load ----------------------------------------------------------------------
    def save_pretrained(self, path: str) -> None:
        """Write `config.json` (LMConfig) and `model.safetensors` (weights; FS-B tau per layer, float64)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if isinstance(attn, FreeSoloAttention) and attn.tau is not None:
                tensors[f"layers.{i}{_TAU_SUFFIX}"] = torch.tensor(attn.tau, dtype=torch.float64)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump({"format": _FORMAT, "config": self.config.to_dict()}, f, indent=2)
        save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt", "freesolo": _FORMAT})

    @classmethod
    def from_pretrained(cls, path: str, device=None, dtype=None, **overrides) -> "FreeSoloLM":
        """Load a `save_pretrained` directory. `overrides`: LMConfig fields to change (e.g. backend="triton",
        or attention="fsb" on FS weights); a change that alters a weight's shape raises a ValueError
        naming the tensor. A dense / window checkpoint loaded with FreeSolo attention gets beta = beta_init."""
        from safetensors.torch import load_file

        config_path = os.path.join(path, CONFIG_NAME)
        weights_path = os.path.join(path, WEIGHTS_NAME)
        for p in (config_path, weights_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p} not found: not a FreeSoloLM.save_pretrained directory")
        with open(config_path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"{config_path}: format={found!r}, expected {_FORMAT!r}")
        saved = LMConfig.from_dict(meta["config"])
        config = saved.replace(**overrides) if overrides else saved
        model = cls(config)
        tensors = load_file(weights_path)
        taus = {k: tensors.pop(k) for k in [k for k in tensors if k.endswith(_TAU_SUFFIX)]}
        if saved.attention not in FREESOLO_ATTENTIONS and config.attention in FREESOLO_ATTENTIONS:
            # a dense / window checkpoint continued as FreeSolo: beta starts at beta_init
            for name, tensor in model.state_dict().items():
                if name.endswith(".self_attn.beta"):
                    tensors.setdefault(name, tensor)
        model.load_weights(tensors, source=weights_path)
        for key, tau in taus.items():
            i = int(key.split(".")[1])
            if i >= len(model.layers) or not isinstance(model.layers[i].self_attn, FreeSoloAttention):
                raise ValueError(f"{weights_path}: {key} has no FreeSolo attention layer to go to")
            model.layers[i].self_attn.set_tau(tau.numpy())
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        return model

    def load_weights(self, tensors: dict, source: str = "checkpoint") -> None:
        """load_state_dict(strict) with one error listing missing, unexpected and mis-shaped tensors."""
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        shapes = [
            f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
            for k in sorted(set(own) & set(tensors))
            if tuple(tensors[k].shape) != tuple(own[k].shape)
        ]
        if missing or unexpected or shapes:
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if unexpected:
                parts.append(f"unexpected {unexpected}")
            if shapes:
                parts.append("shape mismatch " + "; ".join(shapes))
            raise ValueError(f"{source} does not match the model config: " + ", ".join(parts))
        self.load_state_dict(tensors, strict=True)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---- helpers ------------------------------------------------------------------------------


def _split_prompts(input_ids, attention_mask, device) -> tuple[list, str]:
    """Prompts as a list of 1-D int64 tensors, and the padding side ("left" or "right")."""
    if not isinstance(input_ids, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a padded input_ids tensor, not with a list of prompts")
        prompts = [torch.as_tensor(list(p), dtype=torch.int64, device=device) for p in input_ids]
        if not prompts or any(p.ndim != 1 or p.numel() == 0 for p in prompts):
            raise ValueError("input_ids as a list must hold at least one non-empty list of token ids per row")
        return prompts, "right"
    if input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.dtype.is_floating_point:
        shape, dtype = tuple(input_ids.shape), input_ids.dtype
        raise ValueError(f"input_ids must be an integer tensor [B, T] with T >= 1, got {shape} {dtype}")
    ids = input_ids.to(device=device, dtype=torch.int64)
    if attention_mask is None:
        return list(ids), "left"
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        shapes = tuple(attention_mask.shape), tuple(input_ids.shape)
        raise ValueError(f"attention_mask shape {shapes[0]} != input_ids shape {shapes[1]}")
    mask = attention_mask.to(device="cpu", dtype=torch.int64)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")
    prompts, sides = [], set()
    for b in range(mask.shape[0]):
        real = torch.nonzero(mask[b]).flatten()
        if real.numel() == 0:
            raise ValueError(f"attention_mask row {b} has no real token")
        first, last = int(real[0]), int(real[-1])
        if last - first + 1 != real.numel():
            raise ValueError(f"attention_mask row {b} has padding between real tokens: pad on one side only")
        if first > 0:
            sides.add("left")
        if last < mask.shape[1] - 1:
            sides.add("right")
        prompts.append(ids[b, first : last + 1])
    if len(sides) > 1:
        raise ValueError("attention_mask mixes left- and right-padded rows: use one padding side")
    return prompts, sides.pop() if sides else "left"


def _assemble(prompts, side, input_ids, new, pad_token_id) -> torch.Tensor:
    """Prompts and new tokens [B, N] as one int64 tensor (see generate's Returns)."""
    B, N = new.shape
    if side == "left" and isinstance(input_ids, torch.Tensor):
        return torch.cat([input_ids.to(new.device, torch.int64), new], dim=1)
    T = max(p.numel() for p in prompts)
    out = torch.full((B, T + N), pad_token_id, dtype=torch.int64, device=new.device)
    for b, p in enumerate(prompts):
        out[b, : p.numel()] = p
        out[b, p.numel() : p.numel() + N] = new[b]
    return out


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k, top_p, generator) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax, or a sample after temperature / top-k / top-p."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(int(top_k), scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) > top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def calibrate_tau(model: FreeSoloLM, sequences) -> list:
    """Calibrate FS-B's tau of every layer (spec §12): per layer and kv head, the median of the cells'
    max key norm over the sample sequences. Layers are calibrated in order, each on the keys its
    input produces with the layers before it already calibrated; the taus are set on the model.

    Args:
        model: a FreeSoloLM with FreeSolo attention (any variant; tau is used by FS-B).
        sequences: int [B, T] or a list of 1-D token sequences (each with at least one complete cell).
    Returns:
        a list of n_layers float64 numpy arrays [Hkv].
    """
    from ..api import calibrate_tau as _calibrate

    if model.config.attention not in FREESOLO_ATTENTIONS:
        raise ValueError(f"calibrate_tau needs FreeSolo attention, the model has attention={model.config.attention!r}")
    device = model.embed_tokens.weight.device
    if isinstance(sequences, torch.Tensor):
        seqs = list(model._check_ids(sequences).to(device))
    else:
        seqs = [torch.as_tensor(list(s), dtype=torch.int64, device=device) for s in sequences]
    if not seqs:
        raise ValueError("sequences is empty")
    s = model.config.freesolo.cell
    if max(x.numel() for x in seqs) < s:
        raise ValueError(f"no sequence has a complete cell (cell={s} tokens): give longer sequences")
    hs = [model.embed_tokens(x[None]) for x in seqs]  # each (1, T_b, d_model)
    taus = []
    for layer in model.layers:
        attn = layer.self_attn
        ks = []
        for h in hs:
            _, k, _ = attn.qkv(layer.input_layernorm(h))  # (1, T_b, Hkv, D), unrotated
            ks.append(k[:, : (k.shape[1] // s) * s])  # complete cells only: their union is the cells of the concat
        tau = _calibrate(torch.cat(ks, dim=1), attn.cfg.replace(variant="fs", tau=None))
        attn.set_tau(tau)
        taus.append(np.asarray(tau, dtype=np.float64))
        hs = [layer(h) for h in hs]
    return taus
