"""One training step of a small LLaMA-style stack: FreeSolo FS-L (Triton) against the same model
with SDPA causal attention and with FlexAttention sliding-window-512 attention.

Model (freesolo.models.FreeSoloLM): 4 layers, d_model 1024, 16 query heads, 4 kv heads (GQA 4),
head dim 64, SwiGLU, vocab 8192 (small, so attention and not the lm_head dominates), bf16 weights,
AdamW. A step = forward + next-token loss + backward + optimizer step on B = 1 sequence of T tokens.
Timed with triton.testing.do_bench (median); peak memory = torch.cuda.max_memory_allocated during
one step. Providers: `freesolo_fsl_triton`, `sdpa_causal` (attention="dense"), `flex_swa512`
(attention="window" with its SDPA call replaced by compiled FlexAttention over the SWA-512 BlockMask).
`<provider>_compiled`: the same model with its loss (forward; the backward through AOTAutograd) under
`torch.compile(mode="reduce-overhead")`: Inductor fuses the elementwise ops and replays the step's forward and
backward graphs as CUDA graphs (what removes the per-launch host time of short sequences); the AdamW step stays eager.

Usage (GPU): python benchmarks/train_step.py [--lengths 4096 16384 65536] [--out DIR]
Writes train_step.json and train_step.png (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import freesolo  # noqa: E402
from freesolo.models import FreeSoloLM, LMConfig  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PROVIDERS = [
    "freesolo_fsl_triton",
    "sdpa_causal",
    "flex_swa512",
    "freesolo_fsl_triton_compiled",
    "sdpa_causal_compiled",
    "flex_swa512_compiled",
]
COMPILED_SUFFIX = "_compiled"
MODEL = dict(vocab_size=8192, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4)


def build(provider: str, T: int, device) -> FreeSoloLM:
    provider = provider.removesuffix(COMPILED_SUFFIX)
    if provider == "freesolo_fsl_triton":
        cfg = LMConfig(**MODEL, attention="fsl", backend="triton")
    elif provider == "sdpa_causal":
        cfg = LMConfig(**MODEL, attention="dense")
    elif provider == "flex_swa512":
        cfg = LMConfig(**MODEL, attention="window", freesolo=freesolo.FreeSoloConfig(window=512))
    else:
        raise ValueError(provider)
    model = FreeSoloLM(cfg).to(device=device, dtype=torch.bfloat16)
    if provider == "freesolo_fsl_triton":
        for layer in model.layers:  # a training loop's setting: no finite check, so no host sync per layer
            layer.self_attn.check_finite = False
    if provider == "flex_swa512":
        from gpu_attention import _flex

        fn, mask = _flex(T, str(device), True)

        def flex_sdpa(q, k, v, _mask):  # q [B, n, Hq, D] rotated, k / v [B, n, Hkv, D]
            qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
            return fn(qh, kh, vh, block_mask=mask, enable_gqa=True).transpose(1, 2)

        for layer in model.layers:
            layer.self_attn._sdpa = flex_sdpa
            layer.self_attn._mask = lambda qpos, kpos: None  # no dense [T, T] mask: the BlockMask holds it
    return model


def run(provider: str, T: int, device) -> dict:
    import triton.testing

    model = build(provider, T, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, MODEL["vocab_size"], (1, T), device=device)
    compiled = provider.endswith(COMPILED_SUFFIX)
    if compiled:
        for name in ("recompile_limit", "cache_size_limit"):  # one compile per model instance and length
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
    loss_fn = torch.compile(model.loss, mode="reduce-overhead") if compiled else model.loss

    def step():
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the previous step's graph outputs are dead
        opt.zero_grad(set_to_none=True)
        loss_fn(ids).backward()
        opt.step()

    for _ in range(3 if compiled else 1):  # compiled: warm-up, CUDA-graph recording, first replay
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = float(triton.testing.do_bench(step, warmup=2, rep=300, return_mode="median"))
    del model, opt
    torch.cuda.empty_cache()
    return {"ms": ms, "tokens_per_s": T / ms * 1e3, "peak_gib": peak, "status": "ok"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--providers", nargs="*", default=PROVIDERS, choices=PROVIDERS)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit or None,
    }
    print(env, flush=True)
    results = []
    for T in args.lengths:
        for provider in args.providers:
            rec = {"provider": provider, "T": T, "B": 1, **MODEL}
            try:
                rec.update(run(provider, T, device))
            except torch.cuda.OutOfMemoryError:
                rec.update(ms=None, tokens_per_s=None, peak_gib=None, status="oom")
            except Exception as error:  # noqa: BLE001  (recorded, the run goes on)
                rec.update(ms=None, tokens_per_s=None, peak_gib=None, status=f"error: {type(error).__name__}: {error}"[:300])
            torch.cuda.empty_cache()
            results.append(rec)
            ms = f"{rec['ms']:9.2f} ms" if rec["ms"] else "        -"
            tps = f"{rec['tokens_per_s']:12,.0f} tok/s" if rec["tokens_per_s"] else ""
            print(f"T={T:>6} {provider:>20} {ms} {tps} peak {rec['peak_gib']} GiB {rec['status']}", flush=True)
    payload = {"env": env, "dtype": "bfloat16", "model": MODEL, "timing": "do_bench median of one AdamW step", "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
        json.dump(payload, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, provider in enumerate(args.providers):
        pts = [(r["T"], r["tokens_per_s"], r["peak_gib"]) for r in results if r["provider"] == provider and r["ms"]]
        if pts:
            Ts, tps, mem = zip(*pts)
            axes[0].plot(Ts, tps, marker="o", label=provider, color=f"C{i}")
            axes[1].plot(Ts, mem, marker="o", label=provider, color=f"C{i}")
    for ax, label in zip(axes, ("tokens / s (one AdamW step)", "peak GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"train step, 4 layers d1024 H16 GQA4 D64, {env['gpu']}, torch {env['torch']}, bf16")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "train_step.png"), dpi=110)
    print("wrote", os.path.join(args.out, "train_step.json"))


if __name__ == "__main__":
    main()
