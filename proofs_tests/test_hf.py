"""freesolo.hf: converting and patching tiny random transformers Llama / Mistral / Qwen2 models.

With beta_init=0 and window >= T, FreeSolo is dense causal RoPE attention, so the converted
FreeSoloLM and the patched model must reproduce the original logits (each family; Llama with
attention biases and a non-default rope_theta, Qwen2 with its q/k/v biases and tied embeddings).
With beta != 0 and a window shorter than T, the patched model equals the converted FreeSoloLM.
Needs the `hf` extra (transformers, safetensors); nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from freesolo import FreeSoloConfig

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
hf = pytest.importorskip("freesolo.hf")

from .helpers import assert_close  # noqa: E402

T = 64
FS = FreeSoloConfig(cell=8, block=16, window=T, pool=4, recent=2, top_k=2)  # window >= T: dense
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
SIZES.update(num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, rope_theta=500.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def tiny(family: str, seed: int = 0):
    """A random tiny transformers causal LM (biases and norms randomised too), in eval mode."""
    config_name, model_name, extra = FAMILIES[family]
    fields = dict(SIZES, **extra)
    if "rope_theta" in fields and hasattr(getattr(transformers, config_name)(), "rope_parameters"):
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # biases and norm weights: not all zeros / ones
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


def ids_for(seed: int = 1):
    return torch.randint(0, SIZES["vocab_size"], (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convert_and_patch_reproduce_the_original_logits(family):
    model = tiny(family)
    ids = ids_for()
    with torch.no_grad():
        ref = model(ids).logits
    lm = hf.convert(model, FS, beta_init=0.0)
    assert lm.config.freesolo.rope_theta == (500.0 if family == "llama" else 10000.0)
    assert lm.config.qkv_bias == (family != "mistral") and lm.config.o_bias == (family == "llama")
    assert lm.config.tie_embeddings == (family == "qwen2")
    with torch.no_grad():
        assert_close(lm(ids), ref, 1e-5, f"{family} converted")
    hf.patch(model, FS, beta_init=0.0)
    assert all(isinstance(layer.self_attn, hf.HFFreeSoloAttention) for layer in model.model.layers)
    with torch.no_grad():
        assert_close(model(ids).logits, ref, 1e-5, f"{family} patched")
        # the comparison can fail: a window shorter than T is not dense attention any more
        short = hf.convert(tiny(family), FS.replace(window=16), beta_init=0.0)
        assert (short(ids) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["fsl", "fsb"])
def test_patched_equals_converted_with_freesolo_active(variant):
    """beta = 0.5 and window 16 < T: the patched Hugging Face model == the converted FreeSoloLM."""
    cfg = FS.replace(window=16, variant=variant, tau=(0.5, 0.7) if variant == "fsb" else None)
    ids = ids_for(2)
    lm = hf.convert(tiny("qwen2"), cfg, beta_init=0.5)
    patched = hf.patch(tiny("qwen2"), cfg, beta_init=0.5)
    with torch.no_grad():
        assert_close(patched(ids).logits, lm(ids), 1e-5, "patched vs converted")


def test_patched_model_trains():
    """A patched Llama: loss backward reaches beta and every projection; a few Adam steps lower the loss."""
    model = hf.patch(tiny("llama"), FS.replace(window=16), beta_init=0.0).train()
    ids = ids_for(3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        beta = model.model.layers[0].self_attn.beta
        assert beta.grad is not None and beta.grad.abs().sum() > 0  # beta = 0 still learns
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_convert_from_a_local_directory(tmp_path):
    model = tiny("mistral")
    model.save_pretrained(str(tmp_path))
    ids = ids_for(4)
    with torch.no_grad():
        assert_close(hf.convert(str(tmp_path), FS)(ids), model(ids).logits, 1e-5, "from directory")


def test_errors_name_the_problem():
    model = hf.patch(tiny("llama"), FS)
    with pytest.raises(ValueError, match="does not use Hugging Face's KV cache"):
        model(ids_for(), use_cache=True)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf.convert(gpt2, FS)
    llama = tiny("llama")
    llama.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf.convert(llama, FS)
    with pytest.raises(TypeError, match="expected a transformers causal LM"):
        hf.convert(42, FS)
