"""The one place that touches `freesolo.models`: build, load, re-target and save a model.

Attention kinds: "dense" (causal RoPE, SDPA), "window" (the local RoPE branch alone), "fs",
"fsl", "fsb" (FreeSolo variants; FS-B needs tau, calibrated here on training-like sequences).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import numpy as np

__all__ = ["ATTENTIONS", "pick_device", "pick_backend", "build_model", "load_model", "retarget", "save_model", "count_params"]

ATTENTIONS = ("dense", "window", "fs", "fsl", "fsb")
FREESOLO_KINDS = ("fs", "fsl", "fsb")


def pick_device(name: str = "auto"):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_backend(name: str, device) -> str:
    """`auto`: the fastest registered backend for `device` ("triton" on CUDA when usable, else "torch")."""
    if name != "auto":
        return name
    import freesolo

    if device.type == "cuda" and "triton" in freesolo.available_backends():
        return "triton"
    return "torch"


@contextmanager
def backend_scope(name: str):
    import freesolo

    with freesolo.use_backend(name):
        yield


def _fs_config(attention: str, fs_kwargs: dict):
    from freesolo import FreeSoloConfig

    variant = attention if attention in FREESOLO_KINDS else "fs"
    kw = dict(fs_kwargs)
    if variant != "fsb":
        kw.pop("tau", None)
    return FreeSoloConfig(variant=variant, **kw)


def build_model(
    attention: str, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, fs_kwargs: dict
):
    """A fresh `FreeSoloLM` with attention kind `attention` and FreeSolo fields `fs_kwargs`."""
    from freesolo.models import FreeSoloLM, LMConfig

    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTIONS}")
    cfg = LMConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        attention=attention,
        freesolo=_fs_config(attention, fs_kwargs),
        backend=None,  # the backend is chosen per run (`backend_scope`), not stored in the checkpoint
    )
    return FreeSoloLM(cfg)


def load_model(folder: str):
    from freesolo.models import FreeSoloLM

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder!r} does not exist")
    model = FreeSoloLM.from_pretrained(folder, backend=None)
    return model.float()


def retarget(model, attention: str, tau=None, **fs_overrides):
    """The same weights with another attention kind (FS -> FS-L continued training, FS -> FS-B at inference).

    Returns a new model (the weights are copied); `tau` [Hkv] is needed for "fsb" only.
    """
    from freesolo.models import FreeSoloLM

    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTIONS}")
    cfg = model.config
    fs = cfg.freesolo
    fields = {"variant": attention if attention in FREESOLO_KINDS else fs.variant, **fs_overrides}
    if attention == "fsb":
        fields["tau"] = tau if tau is None else tuple(float(x) for x in np.asarray(tau).ravel())
    elif fs.tau is not None:
        fields["tau"] = None
    new = FreeSoloLM(cfg.replace(attention=attention, freesolo=fs.replace(**fields)))
    new.load_weights(model.state_dict(), source=f"retarget {cfg.attention} -> {attention}")
    return new.to(next(model.parameters()).device)


def calibrate_fsb(model, tokens, device):
    """FS-B model from an FS/FS-L model: tau per layer and kv head from `tokens` int64 [n, T] (training-like).

    Uses the model's own `calibrate_tau` (freesolo.models, per layer); returns the FS-B model.
    """
    import torch

    fsb = retarget(model, "fsb", tau=None)
    with torch.no_grad():
        fsb.calibrate_tau(torch.as_tensor(tokens, device=device))
    return fsb


def save_model(model, folder: str, dtype: str = "bfloat16") -> int:
    """`save_pretrained` with the weights cast to `dtype` (checkpoints stay small); returns bytes on disk."""
    import copy

    import torch

    clone = copy.deepcopy(model).to(getattr(torch, dtype))
    clone.save_pretrained(folder)
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
