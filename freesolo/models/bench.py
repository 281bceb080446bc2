"""Model-level measurements (run on the GPU; tiny settings run on the CPU for a smoke test).

    python -m freesolo.models.bench generate --T 65536 --new 256 --out lm_generate.json
        B = 1 generation after a T-token prompt: FS-L (FreeSoloCache) against the same model with
        dense attention (SDPA + KV cache): prefill time, decode tokens/s, cache memory.
    python -m freesolo.models.bench convert-train --backend triton --steps 30 --out convert_train.json
        a tiny random transformers Llama converted with freesolo.hf.convert, trained for a few steps
        under torch.compile(fullgraph=True): the loss and step time per step.

Both print the JSON they write (GPU name, torch / triton / transformers versions included).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from ..config import FreeSoloConfig
from .config import LMConfig
from .lm import FreeSoloLM

__all__ = ["bench_generate", "convert_train", "main"]


def _env(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_generate(
    T: int,
    new: int,
    attentions=("fsl", "dense"),
    d_model: int = 512,
    n_layers: int = 4,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    vocab: int = 1024,
    backend: str = "torch",
    dtype: str = "bfloat16",
    freesolo: FreeSoloConfig = None,
    warmup: int = 8,
    decode_kernel: str = None,
    cuda_graph: bool = False,
) -> dict:
    """B = 1: prefill T tokens, then decode `new` tokens one at a time (greedy), per attention kind."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, dtype)
    fs = FreeSoloConfig() if freesolo is None else freesolo
    records = []
    for attention in attentions:
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       attention=attention, freesolo=fs, backend=backend)
        model = FreeSoloLM(cfg).to(device=device, dtype=dt).eval()
        ids = torch.randint(0, vocab, (1, T), device=device, generator=torch.Generator(device).manual_seed(1))
        cache = model.new_cache(1, check_finite=False, decode_kernel=decode_kernel)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            _sync(device)
            t0 = time.perf_counter()
            logits = model(ids, cache=cache)[:, -1]
            _sync(device)
            prefill_s = time.perf_counter() - t0
            tok = logits.argmax(-1, keepdim=True)
            for _ in range(warmup):
                tok = model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(new):
                tok = model(tok, cache=cache)[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            decode_s = time.perf_counter() - t0
            graph_s = None
            if cuda_graph and attention in ("fsl", "fs") and device.type == "cuda":
                # the attention step of every layer captured in CUDA graphs (the rest of the model eager)
                graphs = [c.decode_graph(layer.self_attn.beta.detach()) for c, layer in zip(cache, model.layers)]
                for _ in range(warmup):
                    tok = model(tok, cache=graphs)[:, -1].argmax(-1, keepdim=True)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(new):
                    tok = model(tok, cache=graphs)[:, -1].argmax(-1, keepdim=True)
                _sync(device)
                graph_s = time.perf_counter() - t0
        record = {
            "attention": attention,
            "T_prompt": T,
            "new_tokens": new,
            "prefill_s": prefill_s,
            "decode_tokens_per_s": new / decode_s,
            "decode_ms_per_token": 1e3 * decode_s / new,
            "decode_graph_tokens_per_s": None if graph_s is None else new / graph_s,
            "fused_decode_step": getattr(getattr(cache[0], "state", None), "_fused", None),
            "cache_bytes": model.cache_memory_bytes(cache),  # allocated (KV cache: capacity, grown by doubling)
            "kv_held_bytes": sum(c.held_bytes() for c in cache if hasattr(c, "held_bytes")) or None,
            "context_at_end": T + warmup + new,
            "params": model.num_parameters(),
        }
        if device.type == "cuda":
            record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        records.append(record)
        print(json.dumps(record), flush=True)
        del model, cache
    return {
        "env": _env(device),
        "model": dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab=vocab,
                      dtype=dtype, backend=backend),
        "freesolo": {k: v for k, v in fs.__dict__.items()},
        "records": records,
    }


def convert_train(
    steps: int, backend: str, T: int = 1024, batch: int = 4, compile: bool = True, lr: float = 3e-3
) -> dict:
    """Convert a tiny random Llama (no download) and train it on a copy task under torch.compile."""
    import transformers

    from ..hf import convert

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    hf_model = transformers.LlamaForCausalLM(hf_cfg)
    cfg = FreeSoloConfig(variant="fsl", window=min(512, T), cell=32, block=128, top_k=4, pool=16, recent=4)
    model = convert(hf_model, cfg, beta_init=0.0, backend=backend).to(device).train()
    step_fn = torch.compile(model, fullgraph=True) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator(device).manual_seed(0)
    log = []
    for step in range(steps):
        half = torch.randint(2, 256, (batch, T // 2), device=device, generator=g)
        ids = torch.cat([half, half], dim=1)  # the second half repeats the first: learnable only past the window
        _sync(device)
        t0 = time.perf_counter()
        logits = step_fn(ids)  # float32 weights and activations
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        _sync(device)
        beta = torch.cat([layer.self_attn.beta.detach().float() for layer in model.layers])
        elapsed = time.perf_counter() - t0
        entry = {"step": step, "loss": loss.item(), "step_s": elapsed, "beta_abs_mean": beta.abs().mean().item()}
        log.append(entry)
        print(json.dumps(entry), flush=True)
    return {"env": _env(device), "backend": backend, "compiled": compile, "T": T, "batch": batch, "log": log}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m freesolo.models.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="B=1 generation: FS-L vs dense tokens/s and cache memory")
    gen.add_argument("--T", type=int, default=65536)
    gen.add_argument("--new", type=int, default=256)
    gen.add_argument("--attention", nargs="+", default=["fsl", "dense"])
    gen.add_argument("--d-model", type=int, default=512)
    gen.add_argument("--layers", type=int, default=4)
    gen.add_argument("--backend", default="torch")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--small", action="store_true", help="CPU smoke test sizes (cell 8, block 16, window 32)")
    gen.add_argument("--decode-kernel", default=None, help="FreeSoloCache step: torch | triton | auto")
    gen.add_argument("--cuda-graph", action="store_true", help="also time FS / FS-L decode with cache.decode_graph")
    gen.add_argument("--out", default=None)
    tr = sub.add_parser("convert-train", help="converted tiny Llama, a few compiled training steps")
    tr.add_argument("--steps", type=int, default=30)
    tr.add_argument("--backend", default="triton")
    tr.add_argument("--T", type=int, default=1024)
    tr.add_argument("--batch", type=int, default=4)
    tr.add_argument("--no-compile", action="store_true")
    tr.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        fs = FreeSoloConfig(cell=8, block=16, window=32, pool=4, recent=2) if args.small else None
        result = bench_generate(args.T, args.new, tuple(args.attention), d_model=args.d_model, n_layers=args.layers,
                                backend=args.backend, dtype=args.dtype, freesolo=fs,
                                decode_kernel=args.decode_kernel, cuda_graph=args.cuda_graph)
    else:
        result = convert_train(args.steps, args.backend, T=args.T, batch=args.batch, compile=not args.no_compile)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
