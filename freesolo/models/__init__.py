"""Models built on FreeSolo attention: `FreeSoloLM` (a small LLaMA-style decoder) and its `LMConfig`.

    from freesolo import FreeSoloConfig
    from freesolo.models import FreeSoloLM, LMConfig
    model = FreeSoloLM(LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                attention="fsl", freesolo=FreeSoloConfig(cell=8, block=16, window=32)))
    logits = model(input_ids)            # [B, T] -> [B, T, V]

This package imports torch.
"""

from .config import ATTENTIONS, FREESOLO_ATTENTIONS, LMConfig
from .lm import DecoderLayer, FreeSoloLM, SwiGLU, calibrate_tau

__all__ = ["LMConfig", "FreeSoloLM", "DecoderLayer", "SwiGLU", "calibrate_tau", "ATTENTIONS", "FREESOLO_ATTENTIONS"]
