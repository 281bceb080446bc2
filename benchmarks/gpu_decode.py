"""Per-token decode latency and cache memory: FreeSoloCache (FS-L, FS) vs SDPA over a full KV cache.

Contexts 4k, 64k, 256k, 1M; batch 1 and 32; H = 16 heads (MHA), D = 64, bf16, on one GPU.
For each (B, T) in the same run:

- FS-L, torch step: a cache is brought to context T with `prefill` (state only, chunked: the
  real state, the one `extend` would leave: tested in proofs_tests/test_cache.py), then `--steps`
  one-token decode steps are timed back to back (CUDA events), eagerly
  (`extend(check_finite=False)`) and through a CUDA graph (`decode_graph()`). Memory: `memory_bytes()`.
  The eager step also runs `block + 1` times under `torch.cuda.set_sync_debug_mode("error")`
  (`fsl_sync_free` in the JSON: True, or the error a host sync raised).
- Fused Triton steps (`decode_kernel="triton"`, freesolo/backends/triton/decode.py), one entry
  per `--tiles` variant (A/B in the same run; default: `single` = the first one-program-per-
  (row, kv head) kernel, `split` = DecodeTiles(impl="split"), `split64` = window chunks of 64 on 4 warps,
  `split_tb` = split with the FS-L block boundary as one Triton launch).
  FS-L: the torch cache's state loaded into a fused cache; FS: one cache (the whole archive)
  prefilled to about T, shared by the variants (`state.decode_tiles` switched in place). Per
  variant: `block + 1` (FS-L) / 8 (FS) steps checked against the torch step on the same state
  (`{v}_{tiles}_vs_torch_rms`) under sync debug "error" (`{v}_{tiles}_sync_free`), then
  - `{v}_{tiles}_graph_us`: `decode_graph()` calls back to back (input copy + replay + host
    bookkeeping: at B = 1 this is bounded by the host, ~25 us of Python and launches),
  - `{v}_{tiles}_replay_us`: `graph.replay()` on its static inputs (no copy launch),
  - `{v}_{tiles}_dev_us`: device time per step: FS-L, 128 consecutive steps (one whole block,
    its boundary update included) captured in ONE CUDA graph and replayed (a valid stream);
    FS, 64 in-block steps in one graph that rewinds `pos` at its end (timing only),
  FS is skipped (with the reason) when the archive does not fit in free GPU memory.
- SDPA: `scaled_dot_product_attention(q [B, H, 1, D], K [B, H, T, D], V)` (1 query vs T cached
  keys, flash kernel), timed back to back (`sdpa_us`) and as 16 calls in one CUDA graph
  (`sdpa_dev_us`, device time). Memory: K and V. Skipped when the full KV cache does not fit.

Writes benchmarks/results/gpu_decode.json and gpu_decode.png (--out DIR to redirect). About a
minute on an H200 with the defaults.
    python benchmarks/gpu_decode.py            # full run (GPU)
    python benchmarks/gpu_decode.py --contexts 4096 1048576 --tiles single split   # fewer
    python benchmarks/gpu_decode.py --quick    # small CPU / GPU smoke run (triton parts: GPU only)
    python benchmarks/gpu_decode.py --no-triton  # torch step and SDPA only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

import freesolo
from freesolo import FreeSoloCache, FreeSoloConfig
from freesolo.streaming.torch_state import DecodeTiles

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info(device: str) -> dict:
    info = {"torch": torch.__version__, "freesolo": freesolo.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


class Timer:
    """Mean seconds per call of `fn` over `n` back-to-back calls (CUDA events, or perf_counter on CPU)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __call__(self, fn, n: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(n):
                fn(i)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - t0) / n


def fsl_run(cfg, B, H, D, T, dtype, device, steps, chunk, timer) -> dict:
    """Prefill an FS-L cache to T tokens, then time eager and CUDA-graph decode steps."""
    cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device)
    t0 = time.perf_counter()
    for start in range(0, T, chunk):
        n = min(chunk, T - start)
        k = torch.randn(B, n, H, D, device=device, dtype=dtype)  # (B, n, H, D)
        v = torch.randn(B, n, H, D, device=device, dtype=dtype)
        cache.prefill(k, v, check_finite=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    memory = cache.memory_bytes()
    q = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)  # decode inputs, made before timing
    k = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)
    v = torch.randn(B, 2 * steps + 8, H, D, device=device, dtype=dtype)
    out = {}

    def eager(i):
        return cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], check_finite=False)

    for i in range(2):  # warm-up, also leaves a step that is not a block boundary
        o = eager(i)
    assert torch.isfinite(o).all(), "non-finite FS-L decode output"
    out["fsl_eager_us"] = timer(lambda i: eager(2 + i), steps) * 1e6
    if device.startswith("cuda"):  # the eager FS-L step must not synchronise (block boundaries included)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(cfg.block + 1):
                eager(i)
            out["fsl_sync_free"] = True
        except RuntimeError as error:
            out["fsl_sync_free"] = f"host sync detected: {error}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if cache.length % cfg.block == 0:
        eager(0)
    if device.startswith("cuda"):
        try:
            graph = cache.decode_graph()
            base = 2 + steps

            def replay(i):
                return graph(
                    q[:, base + i : base + i + 1], k[:, base + i : base + i + 1], v[:, base + i : base + i + 1]
                )

            replay(0)
            out["fsl_graph_us"] = timer(lambda i: replay(1 + i), steps - 1) * 1e6
        except Exception as error:  # noqa: BLE001 - record why, keep the eager numbers
            out["fsl_graph_us"] = None
            out["fsl_graph_error"] = f"{type(error).__name__}: {error}"
            print(f"  CUDA graph capture failed: {out['fsl_graph_error']}")
    out.update(
        fsl_memory_bytes=memory,
        fsl_memory_after_decode=cache.memory_bytes(),
        prefill_s=prefill_s,
        fsl_T_end=cache.length,
    )
    return out, cache


def _decode_inputs(B, H, D, n, dtype, device, Hkv=None):
    """q [B, n, H, D], k / v [B, n, Hkv, D] (Hkv default H): decode inputs, made before timing."""
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, n, H, D, device=device, dtype=dtype)
    k = torch.randn(B, n, Hkv, D, device=device, dtype=dtype)
    return q, k, torch.randn(B, n, Hkv, D, device=device, dtype=dtype)


# A/B variants of the fused step (DecodeTiles): timed in the same run, same states.
TILES = {
    "default": DecodeTiles(),  # since s21: split, window chunks of 64 slots, 2 warps
    "single": DecodeTiles(impl="single", window_chunk=128, num_warps=8),  # one program per (row, kv head), before s21
    "split": DecodeTiles(impl="split", window_chunk=128, num_warps=8),  # window chunks of 128 slots, 8 warps
    "split64": DecodeTiles(impl="split", window_chunk=64, num_warps=4),
    "split256": DecodeTiles(impl="split", window_chunk=256, num_warps=8),
    "fs256": DecodeTiles(impl="split", fs_chunk=256),  # FS: 256 archive cells per scoring program (half the candidates to merge)
    "split_tb": DecodeTiles(impl="split", boundary="triton"),  # FS-L block boundary as one Triton launch
    # occupancy at B = 32 (s21): fewer warps / smaller window tiles leave room for more programs per SM
    "single_w4": DecodeTiles(impl="single", window_chunk=128, num_warps=4),
    "single64_w4": DecodeTiles(impl="single", window_chunk=64, num_warps=4),
    "single64_w2": DecodeTiles(impl="single", window_chunk=64, num_warps=2),
    "single32_w2": DecodeTiles(impl="single", window_chunk=32, num_warps=2),
    "split64_w2": DecodeTiles(impl="split", window_chunk=64, num_warps=2),
    "split128_w4": DecodeTiles(impl="split", window_chunk=128, num_warps=4),
    "split64_w1": DecodeTiles(impl="split", window_chunk=64, num_warps=1),
    "split32_w2": DecodeTiles(impl="split", window_chunk=32, num_warps=2),
    "split32_w1": DecodeTiles(impl="split", window_chunk=32, num_warps=1),
}
DEFAULT_TILES = ["default", "single", "split_tb"]


def check_against_torch_step(cache, q, k, v, n: int, prefix: str) -> dict:
    """n fused steps, each compared with the torch step on the same state (the small buffers the
    step writes are restored between the two; block boundaries are applied once, before both,
    with the torch ops both paths use). The fused steps run under sync debug "error"."""
    state = cache.state
    names = ("ring_k", "ring_v", "block_k", "block_v", "pos")
    errs, sync = [], True
    for i in range(n):
        t = cache.length
        if t > 0 and t % state.cfg.block == 0:
            state._boundary(t)  # the fused path's boundary (DecodeTiles.boundary), before both steps
        small = {name: getattr(state, name).clone() for name in names}
        step = (q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        state._fused = False
        ref = state._piece(*step, state.ones_beta).float()  # torch step
        for name, x in small.items():
            getattr(state, name).copy_(x)
        state._fused = True
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = state._piece(*step, state.ones_beta).float()  # fused step
        except RuntimeError as error:
            sync, got = f"host sync detected: {error}", None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        state.length = t + 1
        if got is None:
            break
        errs.append(float(((got - ref).pow(2).mean() / ref.pow(2).mean().clamp_min(1e-30)).sqrt()))
    return {f"{prefix}_vs_torch_rms": max(errs) if errs else None, f"{prefix}_sync_free": sync}


def graph_seconds(graph, reps: int) -> float:
    """Mean seconds per replay of a CUDA graph over `reps` back-to-back replays (CUDA events)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def device_us_per_step(cache, reps: int = 10) -> float:
    """Device time per fused step (us), host launches out of the way.

    FS-L: one whole block of steps (cfg.block, its boundary update included) captured in ONE CUDA
    graph; each replay continues the stream (the boundary falls at the same offset every block).
    FS: 64 steps inside one block (no boundary: the archive append runs eagerly in real decode)
    captured with a final `pos -= 64`, so the graph can be replayed (timing only: the ring is
    rewritten with the same tokens)."""
    state, cfg = cache.state, cache.cfg
    B, H, Hkv, D = cache.batch, cache.num_heads, cache.num_kv_heads, cache.head_dim
    fsl = cfg.variant == "fsl"
    n = cfg.block if fsl else min(64, cfg.block - 1)
    warm = _decode_inputs(B, H, D, cfg.block, state.dtype, state.device, Hkv)
    i = 0
    while not fsl and not (0 < cache.length % cfg.block <= cfg.block - n):  # FS: no boundary inside
        cache.extend(*(x[:, i : i + 1] for x in warm), check_finite=False)
        i += 1
    q, k, v = _decode_inputs(B, H, D, n, state.dtype, state.device, Hkv)
    steps = [(q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1]) for j in range(n)]
    graph = torch.cuda.CUDAGraph()
    t0 = cache.length
    with torch.no_grad(), torch.cuda.graph(graph):
        for j, step in enumerate(steps):
            if fsl and (t0 + j) % cfg.block == 0:
                state._boundary(None)  # torch ops or the Triton boundary kernel (DecodeTiles.boundary)
            state._piece(*step, state.ones_beta)
        if not fsl:
            state.pos -= n
    seconds = graph_seconds(graph, reps)
    if fsl:  # (1 + reps) blocks were consumed on the device
        state.length += n * (1 + reps)
    del graph
    return seconds / n * 1e6


def time_fused(cache, prefix: str, steps: int, timer, dtype, device) -> dict:
    """Eager, CUDA-graph call, static replay and device-only timing of the fused step of `cache`."""
    B, H, Hkv, D = cache.batch, cache.num_heads, cache.num_kv_heads, cache.head_dim
    q, k, v = _decode_inputs(B, H, D, 3 * steps + 8, dtype, device, Hkv)
    sl = [(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]) for i in range(q.shape[1])]  # sliced before timing
    out = {}

    def eager(i):
        return cache.extend(*sl[i], check_finite=False)

    for i in range(2):
        o = eager(i)
    assert torch.isfinite(o).all(), f"non-finite {prefix} fused decode output"
    n_eager = min(steps, 64)
    out[f"{prefix}_eager_us"] = timer(lambda i: eager(2 + i), n_eager) * 1e6
    graph = None
    try:
        graph = cache.decode_graph()
        base = 2 + n_eager
        graph(*sl[base])
        out[f"{prefix}_graph_us"] = timer(lambda i: graph(*sl[base + 1 + i]), steps) * 1e6
        out[f"{prefix}_replay_us"] = timer(lambda i: graph.replay(), steps) * 1e6
    except Exception as error:  # noqa: BLE001 - record why, keep the eager numbers
        out[f"{prefix}_graph_us"] = None
        out[f"{prefix}_graph_error"] = f"{type(error).__name__}: {error}"
        print(f"  {prefix} fused CUDA graph failed: {out[f'{prefix}_graph_error']}")
    del graph
    try:
        out[f"{prefix}_dev_us"] = device_us_per_step(cache)
    except Exception as error:  # noqa: BLE001
        out[f"{prefix}_dev_us"] = None
        out[f"{prefix}_dev_error"] = f"{type(error).__name__}: {error}"
        print(f"  {prefix} device timing failed: {out[f'{prefix}_dev_error']}")
    return out


def fsl_triton_run(torch_cache, cfg, steps, timer, dtype, device, tiles) -> dict:
    """The FS-L state of `torch_cache` in a fused-step cache; per tiles variant: check vs the
    torch step, time it (the variants share the cache, `state.decode_tiles` switched in place)."""
    B, H, D = torch_cache.batch, torch_cache.num_heads, torch_cache.head_dim
    cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device, decode_kernel="triton")
    cache.load_state_dict(torch_cache.state_dict())
    out, seen = {}, set()
    for name in tiles:
        fsl_shape = dataclasses.replace(TILES[name], fs_chunk=None)  # fs_chunk does not shape FS-L
        if fsl_shape in seen:
            continue
        seen.add(fsl_shape)
        cache.state.decode_tiles = TILES[name]
        q, k, v = _decode_inputs(B, H, D, cfg.block + 1, dtype, device)
        out.update(check_against_torch_step(cache, q, k, v, cfg.block + 1, f"fsl_{name}"))
        out.update(time_fused(cache, f"fsl_{name}", steps, timer, dtype, device))
    return out


def fs_triton_run(cfg, B, H, D, T, dtype, device, steps, chunk, timer, tiles) -> dict:
    """An FS cache (archive) prefilled to T - margin (the checked and timed steps of all variants
    then end at about T, inside the archive's capacity: no growth, no re-capture while timing);
    per tiles variant: check the fused step vs the torch step, time it."""
    cfg = cfg.replace(variant="fs")
    itemsize = torch.empty((), dtype=dtype).element_size()
    margin = len(tiles) * (5 * steps + 2 * cfg.block + 16) + 16  # check + eager + graph + replay + device steps
    T_pre = T - margin if T > 2 * margin else T
    end_cells = (T_pre + margin) // cfg.cell
    cap = 1 << max(0, end_cells - 1).bit_length()
    need = B * H * cap * (2 * cfg.cell * D * itemsize + 4 * D + 12)  # cell k / v, kbar, a, ids
    free, _ = torch.cuda.mem_get_info()
    if 2.1 * need > 0.9 * free:  # growth copies during prefill (old + new), state snapshots of the graph
        why = f"FS archive needs {need / 2**30:.1f} GiB (+ growth, snapshot), {free / 2**30:.1f} GiB free"
        return {"fs_skipped": why}
    cache = None
    try:
        cache = FreeSoloCache(cfg, B, H, H, D, backend="torch", dtype=dtype, device=device, decode_kernel="triton")
        t0 = time.perf_counter()
        for start in range(0, T_pre, chunk):
            n = min(chunk, T_pre - start)
            cache.prefill(
                torch.randn(B, n, H, D, device=device, dtype=dtype),
                torch.randn(B, n, H, D, device=device, dtype=dtype),
                check_finite=False,
            )
        cache.state._grow_store(end_cells)  # no-op unless the margin crosses a doubling
        torch.cuda.synchronize()
        out = {"fs_prefill_s": time.perf_counter() - t0, "fs_memory_bytes": cache.memory_bytes(), "fs_T_start": T_pre}
        seen = set()
        for name in tiles:
            fs_shape = dataclasses.replace(TILES[name], boundary="torch")  # the boundary shapes FS-L only
            if fs_shape in seen:
                continue
            seen.add(fs_shape)
            cache.state.decode_tiles = TILES[name]
            q, k, v = _decode_inputs(B, H, D, 8, dtype, device)
            out.update(check_against_torch_step(cache, q, k, v, 8, f"fs_{name}"))
            out.update(time_fused(cache, f"fs_{name}", steps, timer, dtype, device))
        out["fs_capacity_cells"] = int(cache.state.cell_ids.shape[2])
        out["fs_T_end"] = cache.length
    except torch.cuda.OutOfMemoryError as error:
        out = {"fs_skipped": f"out of memory: {str(error).splitlines()[0]}"}
    del cache
    return out


def sdpa_run(B, H, D, T, dtype, device, steps, timer) -> dict:
    """1 query vs a full KV cache of T tokens: latency (back to back, and device time from 16
    calls in one CUDA graph) and the cache's bytes (or why skipped)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = 2 * B * H * T * D * itemsize
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        if need > 0.9 * free:
            return {
                "sdpa_us": None,
                "sdpa_memory_bytes": need,
                "sdpa_skipped": f"full KV cache needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
            }
    Kc = torch.randn(B, H, T, D, device=device, dtype=dtype)  # (B, H, T, D)
    Vc = torch.randn(B, H, T, D, device=device, dtype=dtype)
    q = torch.randn(B, H, 1, D, device=device, dtype=dtype)

    def step(_):
        return F.scaled_dot_product_attention(q, Kc, Vc)

    step(0)
    n = max(10, min(steps, int(2e10 // max(need, 1))))  # fewer calls when each reads many GB
    us = timer(step, n) * 1e6
    out = {"sdpa_us": us, "sdpa_memory_bytes": need, "sdpa_steps": n}
    if device.startswith("cuda"):
        calls = 16
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                step(0)
        out["sdpa_dev_us"] = graph_seconds(graph, max(2, n // calls)) / calls * 1e6
        del graph
    return out


def plot(rows, path, title: str, tiles):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    curves = [("fsl_graph_us", "FS-L torch step (CUDA graph)", "C0")]
    palette = plt.get_cmap("tab20").colors  # one color per tile variant (C0 / C3: torch step, SDPA)
    for index, name in enumerate(tiles):
        color = palette[(2 * index + 4) % len(palette)]
        curves += [(f"fsl_{name}_dev_us", f"FS-L fused {name} (device)", color)]
        curves += [(f"fs_{name}_dev_us", f"FS fused {name} (device)", color)]
    curves += [("sdpa_dev_us", "SDPA full KV (device)", "C3")]
    for B, style in zip(sorted({r["B"] for r in rows}), ("-", "--", ":", "-.")):
        sub = [r for r in rows if r["B"] == B]
        Ts = [r["T"] for r in sub]
        for key, label, color in curves:
            pts = [(r["T"], r[key]) for r in sub if r.get(key)]
            if pts:
                marker = "s" if key.startswith("fs_") else "o"
                ax_t.plot(*zip(*pts), style, marker=marker, color=color, label=f"{label}, B={B}")
        ax_m.plot(
            Ts, [r["fsl_memory_bytes"] / 2**20 for r in sub], style, marker="o", color="C0", label=f"FS-L cache, B={B}"
        )
        ax_m.plot(
            Ts, [r["sdpa_memory_bytes"] / 2**20 for r in sub], style, marker="o", color="C3", label=f"full KV, B={B}"
        )
        fs_pts = [(r["T"], r["fs_memory_bytes"] / 2**20) for r in sub if r.get("fs_memory_bytes")]
        if fs_pts:
            ax_m.plot(*zip(*fs_pts), style, marker="o", color="C4", label=f"FS archive, B={B}")
    for ax, ylabel in ((ax_t, "decode latency per token (us)"), (ax_m, "cache memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax_t.set_title(f"per-token decode latency (1 layer, {title})", fontsize=9)
    ax_m.set_title("cache memory per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _fmt(x, spec="7.1f"):
    return "-".rjust(len(format(0.0, spec))) if x is None else format(x, spec)


def spread_line(label: str, values: list) -> str:
    mean = sum(values) / len(values)
    return (
        f"{label}: {min(values):.1f} .. {max(values):.1f} us "
        f"(spread {100 * (max(values) - min(values)) / mean:.0f} % of the mean)"
    )


def summarize(rows, batches, tiles) -> list:
    """Lines comparing the variants against the bars of issue 12 (same-run numbers)."""
    lines = []
    for name in tiles:
        for B in batches:
            for kind in ("dev", "replay", "graph"):
                vals = [r[f"fsl_{name}_{kind}_us"] for r in rows if r["B"] == B and r.get(f"fsl_{name}_{kind}_us")]
                if vals:
                    lines.append(spread_line(f"FS-L {name:>8} {kind:>6} B={B:<2}", vals))
        for r in rows:
            for kind, sdpa_key in (("dev", "sdpa_dev_us"), ("graph", "sdpa_us")):
                fs, sdpa = r.get(f"fs_{name}_{kind}_us"), r.get(sdpa_key)
                if fs and sdpa:
                    r[f"fs_{name}_{kind}_speedup_vs_sdpa"] = sdpa / fs
                    lines.append(
                        f"FS   {name:>8} {kind:>6} B={r['B']:<2} T={r['T']:>8}: {fs:7.1f} us, SDPA {sdpa:7.1f} us: "
                        f"{sdpa / fs:5.1f}x"
                    )
    lines.append("bars: FS-L B=1 <= 30 us at every context, flat within +-10 %; B=32 <= 80 us; FS >= 10x SDPA at 1M")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=128, help="decode steps per timed loop")
    p.add_argument("--chunk", type=int, default=16384, help="prefill chunk (tokens)")
    p.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, choices=sorted(TILES), help="fused-step variants (A/B)")
    p.add_argument("--no-fs", action="store_true", help="skip FS (the archive: its prefill dominates at 1M)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--name", default=None, help="results file stem (default gpu_decode / gpu_decode_quick)")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test, CPU friendly)")
    p.add_argument("--no-triton", action="store_true", help="skip the fused Triton decode (FS-L, FS)")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.heads, args.steps, args.chunk = [1024, 4096], [1, 2], 4, 16, 2048
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32
    cfg = FreeSoloConfig(variant="fsl")
    info = env_info(args.device)
    print(f"gpu_decode: {info}")
    print(f"config: {cfg}")
    print(f"tiles: { {name: TILES[name] for name in args.tiles} }")
    timer = Timer(args.device)
    triton_on = args.device.startswith("cuda") and not args.no_triton
    if triton_on:
        try:
            import triton  # noqa: F401
        except ImportError as error:
            print(f"fused Triton decode skipped: {error}")
            triton_on = False
    tiles = args.tiles if triton_on else []
    if args.device.startswith("cuda"):  # clocks up before the first timed context
        x = torch.randn(4096, 4096, device=args.device, dtype=dtype)
        t_warm = time.perf_counter()
        while time.perf_counter() - t_warm < 1.0:
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
        del x
    rows = []
    t_start = time.perf_counter()
    for B in args.batches:
        for T in args.contexts:
            row = {"B": B, "T": T, "H": args.heads, "D": args.dim, "dtype": str(dtype)}
            fsl, cache = fsl_run(cfg, B, args.heads, args.dim, T, dtype, args.device, args.steps, args.chunk, timer)
            row.update(fsl)
            if tiles:
                row.update(fsl_triton_run(cache, cfg, args.steps, timer, dtype, args.device, tiles))
                torch.cuda.empty_cache()
                if not args.no_fs:
                    row.update(
                        fs_triton_run(
                            cfg, B, args.heads, args.dim, T, dtype, args.device, args.steps, args.chunk, timer, tiles
                        )
                    )
            del cache
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            row.update(sdpa_run(B, args.heads, args.dim, T, dtype, args.device, args.steps, timer))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            rows.append(row)
            print(
                f"B={B:<2} T={T:>8} | FS-L torch graph {_fmt(row.get('fsl_graph_us'))} us | "
                f"SDPA {_fmt(row['sdpa_us'])} us, device {_fmt(row.get('sdpa_dev_us'))} us | "
                f"MiB: FS-L {row['fsl_memory_bytes'] / 2**20:.2f}, "
                f"FS {_fmt(row['fs_memory_bytes'] / 2**20 if row.get('fs_memory_bytes') else None, '.0f')}, "
                f"full KV {row['sdpa_memory_bytes'] / 2**20:.1f}  sync-free torch step: {row.get('fsl_sync_free')}"
                + (f"  (SDPA skipped: {row['sdpa_skipped']})" if row.get("sdpa_skipped") else "")
                + (f"  (FS skipped: {row['fs_skipped']})" if row.get("fs_skipped") else ""),
                flush=True,
            )
            for v in ("fsl", "fs"):
                for name in tiles:
                    pre = f"{v}_{name}"
                    if f"{pre}_eager_us" not in row:
                        continue
                    print(
                        f"    {v.upper():>4} {name:>8}: device {_fmt(row.get(f'{pre}_dev_us'))} | replay "
                        f"{_fmt(row.get(f'{pre}_replay_us'))} | graph call {_fmt(row.get(f'{pre}_graph_us'))} | "
                        f"eager {_fmt(row.get(f'{pre}_eager_us'), '6.0f')} us | vs torch rms "
                        f"{_fmt(row.get(f'{pre}_vs_torch_rms'), '.1e')} | sync-free {row.get(f'{pre}_sync_free')}",
                        flush=True,
                    )
    summary = summarize(rows, args.batches, tiles)
    print("\n".join(summary))
    for B in args.batches:
        mems = {r["fsl_memory_bytes"] for r in rows if r["B"] == B}
        print(
            f"FS-L memory at B={B} over contexts {args.contexts}: {sorted(mems)} bytes "
            f"({'constant' if len(mems) == 1 else 'NOT constant'})"
        )
    os.makedirs(args.out, exist_ok=True)
    name = args.name or ("gpu_decode_quick" if args.quick else "gpu_decode")
    result = {
        "env": info,
        "config": {k: v for k, v in vars(cfg).items()},
        "tiles": {name: vars(TILES[name]) for name in tiles},
        "device": args.device,
        "steps": args.steps,
        "rows": rows,
        "summary": summary,
        "wall_s": time.perf_counter() - t_start,
        "notes": "latency per token; FS-L / FS state reached by chunked prefill of random bf16 keys/values; "
        "SDPA = 1 query vs T cached keys; {fsl,fs}_<tiles>_* = fused Triton step variant <tiles> (DecodeTiles): "
        "_dev_us device time per step from many steps in one CUDA graph (FS-L: a whole block incl. its "
        "boundary update), _replay_us DecodeGraph.replay() back to back, _graph_us DecodeGraph(q, k, v) back "
        "to back (input copy + host), _eager_us cache.extend; sdpa_dev_us: 16 SDPA calls in one graph",
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    plot(
        rows,
        os.path.join(args.out, f"{name}.png"),
        f"H={args.heads}, D={args.dim}, {str(dtype).replace('torch.', '')}, {info.get('gpu', args.device)}",
        tiles,
    )
    print(f"wrote {os.path.join(args.out, name)}.json/.png in {result['wall_s']:.0f} s")
    return 0 if all(math.isfinite(r["fsl_eager_us"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
