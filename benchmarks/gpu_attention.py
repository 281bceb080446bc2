"""GPU benchmark of FreeSolo (torch and triton backends) against SDPA causal, FlexAttention SWA-512
and fla's NSA.

Providers: `freesolo_fsl`, `freesolo_fs`, `freesolo_fsb` (the pure-PyTorch backend), `triton_fsl`, `triton_fs`,
`triton_fsb` (the Triton backend through the public API, `check_finite=False`: the default finite
check costs one host sync per call, and the peers check nothing), `sdpa_causal`, `flex_swa512`, and
`fla_nsa` (fla-core's `parallel_nsa`: 16 query heads on 1 kv head, compression + top-4 of 32-token
blocks, no window; it needs GQA groups of >= 16 heads, so it runs with Hkv = Hq / 16 whatever the
shape says; skipped when fla is not importable). `triton_fsl_graph` / `sdpa_causal_graph`: the same
calls (forward, or forward + backward into the inputs' .grad) captured once in a CUDA graph and
replayed: the GPU time without the per-call host work, what a training loop that captures its step
gets (peak memory: that of the eager call). The triton providers run with the backend's defaults,
so calls of at most 8192 tokens at H 16, D 64 (2^23 query elements) replay from its CUDA-graph cache (`freesolo.backends.triton.graphs`);
`triton_fsl_eager` / `triton_fs_eager`: the same calls with that cache off (FREESOLO_TRITON_GRAPHS=0).

One run times forward and forward+backward (median of `triton.testing.do_bench`; a provider slower
than 50 ms per call is timed as the median of 3 calls) and the peak memory of each provider at
T = 4k, 16k, 64k, 128k, for B = 1, bf16, shapes H16-D64 (Hq = Hkv = 16, D = 64) and GQA
(Hq = 32, Hkv = 8, D = 128). A configuration that runs out of memory is recorded as "oom"; one
that would not fit the time budget (default 330 s) is recorded as "skipped".

Usage (on the GPU machine, from the repository root):
    python benchmarks/gpu_attention.py                 # ~6 minutes on an H200
    python benchmarks/gpu_attention.py --t131k-check   # FS-L fwd+bwd at T=131072 only, peak memory
    python benchmarks/gpu_attention.py --dry-run       # tiny CPU smoke test (no timings worth reading)
Writes benchmarks/results/gpu_attention.json and gpu_attention.png (gpu_t131k_check.json for the
check; *_dryrun.* for the dry run) and prints a table and the crossover length where FS-L
becomes faster than SDPA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import freesolo
from freesolo.backends.torch import attention as fs_attention
from freesolo.backends.torch._ops import cell_stats

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = {"H16-D64": {"Hq": 16, "Hkv": 16, "D": 64}, "GQA-Hq32-Hkv8-D128": {"Hq": 32, "Hkv": 8, "D": 128}}
LENGTHS = [4096, 16384, 65536, 131072]
PROVIDERS = [
    "triton_fsl",
    "triton_fs",
    "triton_fsb",
    "freesolo_fsl",
    "sdpa_causal",
    "freesolo_fsb",
    "freesolo_fs",
    "fla_nsa",
    "flex_fsl",
    "flex_swa512",
    "triton_fsl_graph",
    "sdpa_causal_graph",
    "triton_fsl_compiled",
    "sdpa_causal_compiled",
    "triton_fsl_eager",
    "triton_fs_eager",
]
GRAPH_SUFFIX = "_graph"  # <provider>_graph: the provider's call (fwd, or fwd + backward) captured once in a CUDA graph, replayed
# <provider>_compiled: the provider's call as a function of (q, k, v) under torch.compile(mode="reduce-overhead",
# fullgraph=True): Inductor's CUDA-graph trees replay the forward (and the backward) graph, copying the inputs in
COMPILED_SUFFIX = "_compiled"
# <provider>_eager: the triton provider with the backend's CUDA-graph cache of short calls off
# (FREESOLO_TRITON_GRAPHS=0, `freesolo.backends.triton.graphs`): every call launches its kernels
EAGER_SUFFIX = "_eager"
GRAPHS_ENV = "FREESOLO_TRITON_GRAPHS"
MODES = ["fwd", "fwd+bwd"]
WINDOW = 512


# ---- providers ---------------------------------------------------------------------------------
def _tau(k: torch.Tensor, cfg) -> tuple:
    """FS-B threshold: per kv head the median of a_c over the sequence (torch, on the device)."""
    _, a = cell_stats(k.detach().float().permute(0, 2, 1, 3), cfg.cell)  # (B, Hkv, C)
    return tuple(float(x) for x in a.permute(1, 0, 2).reshape(a.shape[1], -1).median(dim=-1).values)


_FLEX = {}
FLEX_BLOCK = 128


def _swa(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def swa_block_mask(T: int, device):
    """The BlockMask of causal sliding-window-512 attention, built from block indices (O((T/128)^2)
    int32; create_block_mask would evaluate the mask on a dense T x T grid). Query block m reads
    key blocks m and m - W/128 partially and the blocks between fully."""
    from torch.nn.attention.flex_attention import BlockMask

    nq, wb = T // FLEX_BLOCK, WINDOW // FLEX_BLOCK
    m = torch.arange(nq, device=device)[:, None]

    def pack(cols):  # (nq, n) key-block ids, < 0 = none -> counts (1, 1, nq), indices (1, 1, nq, nq)
        cols = torch.where(cols >= 0, cols, torch.full_like(cols, -1))
        cols = torch.sort(cols, -1, descending=True).values[:, :nq]
        idx = torch.zeros(nq, nq, dtype=torch.int32, device=device)
        idx[:, : cols.shape[1]] = cols.clamp(min=0).int()
        return (cols >= 0).sum(-1).view(1, 1, nq).int(), idx.view(1, 1, nq, nq)

    partial_n, partial_i = pack(torch.cat([m, m - wb], -1))
    full_n, full_i = pack(m - torch.arange(1, wb, device=device)[None, :])
    return BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i, BLOCK_SIZE=FLEX_BLOCK, mask_mod=_swa)


def _flex(T: int, device: str, compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        for name in ("recompile_limit", "cache_size_limit"):  # one compile per sequence length
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    key = (T, device)
    if key not in _FLEX:
        if T % FLEX_BLOCK == 0 and WINDOW % FLEX_BLOCK == 0:
            _FLEX[key] = swa_block_mask(T, device)
        else:
            _FLEX[key] = torch.compile(create_block_mask)(_swa, None, None, T, T, device=device)
    return _FLEX["fn"], _FLEX[key]


def _selection_block_mask(idx: torch.Tensor, T: int, cell: int):
    """BlockMask of FS-L's long branch as a FlexAttention user would build it: for each 128-query
    block and query head, the union of the 128-token key blocks holding a selected cell; the
    mask_mod keeps, per query, the tokens of its own cells. idx int64 [B, T, Hq, K] (-1 padded)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, _, Hq, K = idx.shape
    nq = T // FLEX_BLOCK
    kb = torch.where(idx >= 0, idx * cell // FLEX_BLOCK, torch.full_like(idx, -1))  # key block per selection
    kb = kb.view(B, nq, FLEX_BLOCK, Hq, K).permute(0, 3, 1, 2, 4).reshape(B, Hq, nq, FLEX_BLOCK * K)
    kb = torch.sort(kb, dim=-1, descending=True).values
    dup = torch.zeros_like(kb, dtype=torch.bool)
    dup[..., 1:] = kb[..., 1:] == kb[..., :-1]
    kb = torch.sort(torch.where(dup, torch.full_like(kb, -1), kb), dim=-1, descending=True).values[..., :nq]
    counts = (kb >= 0).sum(-1).int()  # (B, Hq, nq)
    indices = torch.zeros(B, Hq, nq, nq, dtype=torch.int32, device=idx.device)
    indices[..., : kb.shape[-1]] = kb.clamp(min=0).int()
    cells = idx.permute(0, 2, 1, 3).contiguous()  # (B, Hq, T, K)

    def keep_selected(b, h, q_idx, kv_idx):
        c = kv_idx // cell
        hit = cells[b, h, q_idx, 0] == c
        for j in range(1, K):
            hit = hit | (cells[b, h, q_idx, j] == c)
        return hit

    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=keep_selected)


def flex_fsl_call(q, k, v, compiled: bool):
    """FS-L written with FlexAttention over the torch backend's selection (selection time included):
    local = flex SWA-512 on rotated q, k; long = one flex call with the selection's BlockMask."""
    from freesolo.backends.torch import select_cells as torch_select
    from freesolo.backends.torch._ops import rope, rope_tables

    cfg = freesolo.FreeSoloConfig(variant="fsl")
    B, T, Hq, D = q.shape
    gqa = Hq != k.shape[2]
    fn, swa = _flex(T, str(q.device), compiled)
    cos, sin = rope_tables(T, D, cfg.rope_theta, q.device, q.dtype)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)

    def call():
        idx = torch_select(q.detach(), k.detach(), cfg)
        o_loc = fn(rope(qt, cos, sin), rope(kt, cos, sin), vt, block_mask=swa, enable_gqa=gqa)
        o_long = fn(qt, kt, vt, block_mask=_selection_block_mask(idx, T, cfg.cell), enable_gqa=gqa)
        o_long = o_long.float()
        o_long = o_long * torch.rsqrt(o_long.square().mean(-1, keepdim=True) + cfg.eps)
        return o_loc + o_long.to(o_loc.dtype)

    return call


def _reduce_overhead_call(provider: str, q, k, v, compiled: bool):
    """The provider's call as fn(q, k, v) compiled with mode="reduce-overhead" (CUDA-graph trees)."""
    base = provider.removesuffix(COMPILED_SUFFIX)
    if base == "sdpa_causal":
        gqa = q.shape[2] != k.shape[2]

        def body(q_, k_, v_):
            qt, kt, vt = (x.transpose(1, 2) for x in (q_, k_, v_))
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    elif base.startswith("triton_"):
        cfg = freesolo.FreeSoloConfig(variant=base.split("_")[1])

        def body(q_, k_, v_):
            return freesolo.freesolo_attention(q_, k_, v_, cfg, backend="triton", check_finite=False)
    else:
        raise ValueError(f"no {COMPILED_SUFFIX} variant of {base!r}")
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per sequence length and mode
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    fn = torch.compile(body, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return lambda: fn(q, k, v)


def cudagraph_skips() -> int:
    """How many graphs Inductor ran without CUDA graphs so far in this process (its counter)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def make_call(provider: str, q, k, v, compiled: bool):
    """q [B, T, Hq, D], k / v [B, T, Hkv, D] -> a function returning the output (any layout)."""
    if provider.endswith(COMPILED_SUFFIX):
        return _reduce_overhead_call(provider, q, k, v, compiled)
    provider = provider.removesuffix(GRAPH_SUFFIX).removesuffix(EAGER_SUFFIX)
    Hq, Hkv = q.shape[2], k.shape[2]
    gqa = Hq != Hkv
    if provider.startswith("freesolo_") or provider.startswith("triton_"):
        variant = provider.split("_")[1]
        cfg = freesolo.FreeSoloConfig(variant=variant)
        if variant == "fsb":
            cfg = cfg.replace(tau=_tau(k, cfg))
        if provider.startswith("triton_"):  # check_finite=False: no host sync per call (SDPA / Flex check nothing)
            return lambda: freesolo.freesolo_attention(q, k, v, cfg, backend="triton", check_finite=False)
        return lambda: fs_attention(q, k, v, cfg)
    if provider == "flex_fsl":
        return flex_fsl_call(q, k, v, compiled)
    if provider == "fla_nsa":
        from fla.ops.nsa import parallel_nsa

        B, T, _, D = q.shape
        g = torch.ones(B, T, Hq, device=q.device, dtype=q.dtype)
        kn, vn = k[:, :, : max(1, Hq // 16)], v[:, :, : max(1, Hq // 16)]  # NSA: groups of 16 query heads
        return lambda: parallel_nsa(q, kn, vn, g_cmp=g, g_slc=g, block_counts=4, block_size=32, window_size=0)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D) views: autograd reaches q, k, v
    if provider == "sdpa_causal":
        f = torch.nn.functional.scaled_dot_product_attention
        return lambda: f(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    if provider == "flex_swa512":
        fn, mask = _flex(q.shape[1], str(q.device), compiled)
        return lambda: fn(qt, kt, vt, block_mask=mask, enable_gqa=gqa)
    raise ValueError(f"unknown provider {provider!r}")


# ---- timing ------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _once_ms(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t)


# do_bench repeats a call rep / (its estimated time) times: a budget of at least MIN_TIMED_CALLS calls keeps a call
# of 10-50 ms from being timed once or twice (s43 call2: the GQA FS forward at 64k, timed once within a 30 ms budget,
# read 49.5 ms, out of line with 34.7 ms at 128k; not re-measured).
MIN_TIMED_CALLS = 5
BENCH_TIMING = (
    f"median ms: triton.testing.do_bench (a budget of at least {MIN_TIMED_CALLS} calls) under 50 ms per call, "
    "else the median of 3 calls"
)


def bench_ms(fn, device, rep_ms: int) -> float:
    """Median milliseconds of fn (already warmed up): BENCH_TIMING."""
    first = _once_ms(fn, device)
    if device.type != "cuda" or first > 50:
        return statistics.median([first, _once_ms(fn, device), _once_ms(fn, device)])
    import triton.testing

    rep = max(rep_ms, math.ceil(MIN_TIMED_CALLS * first))
    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep, return_mode="median"))


def run_case(provider, mode, T, shape, device, dtype, compiled, rep_ms):
    """-> dict(ms, peak_gib, status); <provider>_eager runs with FREESOLO_TRITON_GRAPHS=0."""
    if not provider.endswith(EAGER_SUFFIX):
        return _run_case(provider, mode, T, shape, device, dtype, compiled, rep_ms)
    previous = os.environ.get(GRAPHS_ENV)
    os.environ[GRAPHS_ENV] = "0"
    try:
        return _run_case(provider, mode, T, shape, device, dtype, compiled, rep_ms)
    finally:
        if previous is None:
            del os.environ[GRAPHS_ENV]
        else:
            os.environ[GRAPHS_ENV] = previous


def _run_case(provider, mode, T, shape, device, dtype, compiled, rep_ms):
    B = 1
    gen = torch.Generator(device=device).manual_seed(0)
    need_grad = mode == "fwd+bwd"
    q = torch.randn(B, T, shape["Hq"], shape["D"], device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, T, shape["Hkv"], shape["D"], device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, T, shape["Hkv"], shape["D"], device=device, dtype=dtype, generator=gen)
    for x in (q, k, v):
        x.requires_grad_(need_grad)
    if provider.endswith(COMPILED_SUFFIX) and device.type != "cuda":
        return {"ms": float("nan"), "peak_gib": float("nan"), "status": "skipped (CUDA-graph trees need a GPU)"}
    skips_before = cudagraph_skips() if provider.endswith(COMPILED_SUFFIX) else 0
    call = make_call(provider, q, k, v, compiled)
    if need_grad:
        grad = None

        def fn():
            nonlocal grad
            out = call()
            if grad is None:
                grad = torch.randn_like(out)
            for x in (q, k, v):
                x.grad = None
            out.backward(grad)
    else:

        def fn():
            with torch.no_grad():
                call()

    fn()  # warm-up (compiles FlexAttention)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:
        peak = float("nan")
    if provider.endswith(GRAPH_SUFFIX):
        if device.type != "cuda":
            return {"ms": float("nan"), "peak_gib": peak, "status": "skipped (CUDA graphs need a GPU)"}
        fn = captured(fn, [q, k, v] if need_grad else [])
    ms = bench_ms(fn, device, rep_ms)
    if provider.endswith(COMPILED_SUFFIX) and cudagraph_skips() > skips_before:
        return {"ms": ms, "peak_gib": peak, "status": f"ok ({cudagraph_skips() - skips_before} cudagraph skips: ran without CUDA graphs)"}
    return {"ms": ms, "peak_gib": peak, "status": "ok"}


def captured(fn, grad_inputs):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream); returns its replay.
    grad_inputs: tensors whose .grad the captured backward writes (set to None before the capture,
    so that the graph allocates them in its pool and every replay rewrites them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for x in grad_inputs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ---- main --------------------------------------------------------------------------------------
def write_json(path, payload: dict) -> None:
    """Write a results payload to `path` (its folder created), and say so. Non-finite floats
    (an infinite margin, a NaN) are written as null: strict JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(payload), f, indent=1, allow_nan=False)
    print(f"wrote {path}")


def write_results(path: str, payload: dict, plot) -> None:
    """`write_json(path, payload)`, then `plot(payload, png)` with the PNG next to it (same stem)."""
    write_json(path, payload)
    plot(payload, os.path.splitext(path)[0] + ".png")


def plot_lines(series: dict, path: str, xlabel: str, ylabel: str, title: str) -> None:
    """A log-log line plot (x in powers of two) of {label: [(x, y), ...]} to `path`, and say so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for n, (label, pts) in enumerate(series.items()):
        pts = sorted(p for p in pts if p[1] is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, color=f"C{n}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def series_by_T(rows: list, labels: dict) -> dict:
    """{label: [(T, row[key]), ...]} for {key: label}, rows without a value for key left out
    (the input of `plot_lines` for results that hold one row per context T)."""
    return {label: [(r["T"], r[key]) for r in rows if r.get(key) is not None] for key, label in labels.items()}


def smoke_or_gpu(dry_run: bool) -> tuple:
    """(device, dtype) of a GPU benchmark: CUDA bf16, or CPU float32 for its --dry-run smoke test."""
    import torch

    return (torch.device("cpu"), torch.float32) if dry_run else (torch.device("cuda"), torch.bfloat16)


def plot_bars(values: dict, path: str, xlabel: str, title: str, mark: str = "") -> None:
    """Horizontal bars of {label: value} to `path` (the bar labelled `mark` drawn in another color)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(values)
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(labels) + 1.2))
    ax.barh(labels, [values[k] for k in labels], color=["C1" if k == mark else "C0" for k in labels])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _finite(x):
    """x with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _versions(device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
    }


def crossover(results, shape_name, mode, provider="freesolo_fsl"):
    """Smallest measured T where `provider` (FS-L) is faster than SDPA, and a log-log interpolated estimate."""

    def times(p):
        return {
            r["T"]: r["ms"]
            for r in results
            if r["shape"] == shape_name and r["mode"] == mode and r["provider"] == p and r["status"] == "ok"
        }

    fsl, sdpa = times(provider), times("sdpa_causal")
    Ts = sorted(set(fsl) & set(sdpa))
    prev = None
    for T in Ts:
        ratio = fsl[T] / sdpa[T]
        if ratio < 1:
            est = T
            if prev is not None:  # interpolate log(ratio) linearly in log(T)
                (T0, r0) = prev
                f = math.log(r0) / (math.log(r0) - math.log(ratio))
                est = round(math.exp(math.log(T0) + f * (math.log(T) - math.log(T0))))
            return {"first_measured_T": T, "estimated_T": est, "fsl_over_sdpa": {t: fsl[t] / sdpa[t] for t in Ts}}
        prev = (T, ratio)
    return {
        "first_measured_T": None,
        "estimated_T": None,
        "fsl_over_sdpa": {t: fsl[t] / sdpa[t] for t in Ts},
        "note": f"FS-L not faster than SDPA up to T={max(Ts) if Ts else None}",
    }


def _record_ms(results, shape_name, provider, mode, T, key="ms"):
    """The `key` of the record (shape, provider, mode, T) when its status is "ok", else None."""
    for r in results:
        if (r["shape"], r["provider"], r["mode"], r["T"]) == (shape_name, provider, mode, T) and r["status"] == "ok":
            return r[key]
    return None


def issue10_bars(results, shape_name="H16-D64") -> dict:
    """Issue 10's speed bars as same-run ratios of the records of one shape (None where a record is
    missing): each entry {"ratio": float, "bar": str, "met": bool}."""

    def get(provider, T, mode="fwd", key="ms"):
        return _record_ms(results, shape_name, provider, mode, T, key)

    bars = {}

    def add(name, num, den, bar, ok):
        ratio = num / den if num is not None and den else None
        bars[name] = {"ratio": ratio, "bar": bar, "met": None if ratio is None else bool(ok(ratio))}

    add("triton_fsl / flex_swa512 fwd 64k", get("triton_fsl", 65536), get("flex_swa512", 65536), "<= 3", lambda r: r <= 3)
    add("sdpa_causal / triton_fsl fwd 64k", get("sdpa_causal", 65536), get("triton_fsl", 65536), ">= 20", lambda r: r >= 20)
    add("triton_fsl / sdpa_causal fwd 4k", get("triton_fsl", 4096), get("sdpa_causal", 4096), "<= 1", lambda r: r <= 1)
    add("triton_fs / sdpa_causal fwd 64k", get("triton_fs", 65536), get("sdpa_causal", 65536), "<= 0.25", lambda r: r <= 0.25)
    for T in sorted({r["T"] for r in results if r["T"] >= 16384}):
        add(f"fla_nsa / triton_fsl fwd {T // 1024}k", get("fla_nsa", T), get("triton_fsl", T), "> 1", lambda r: r > 1)
    add("flex_fsl / triton_fsl fwd 64k", get("flex_fsl", 65536), get("triton_fsl", 65536), ">= 10", lambda r: r >= 10)
    add(
        "peak triton_fsl / sdpa_causal fwd 128k",
        get("triton_fsl", 131072, key="peak_gib"),
        get("sdpa_causal", 131072, key="peak_gib"),
        "<= 1.5",
        lambda r: r <= 1.5,
    )
    return bars


def _case(r: dict) -> tuple:
    """The case a result record times: (shape, provider, mode, T)."""
    return r["shape"], r["provider"], r["mode"], r["T"]


def merge(paths: list, supersede: list | None = None) -> dict:
    """One payload from the payloads of several runs of this script on one GPU (same versions): their
    results one after another, the crossovers and issue 10's bars recomputed. A record of a case that
    two runs both timed is refused (the merge never picks between two timings), except where a file of
    `supersede` (a re-measure, named on purpose, on the same GPU and versions) times it: its records
    replace those of `paths`, and the replaced records are kept in the payload's "superseded" list, with
    the file that replaced them. Two supersede files timing one case are refused."""
    supersede = list(supersede or [])
    every = paths + supersede
    payloads = [json.load(open(p)) for p in every]
    first = payloads[0]
    for path, other in zip(every[1:], payloads[1:]):
        for key in ("gpu", "torch", "triton"):
            if other["env"][key] != first["env"][key]:
                raise SystemExit(f"{path}: {key} {other['env'][key]!r} differs from {paths[0]}'s {first['env'][key]!r}")
    results, seen = [], set()
    for path, payload in zip(paths, payloads[: len(paths)]):
        for r in payload["results"]:
            if _case(r) in seen and r["status"] == "ok":
                raise SystemExit(f"{path}: {_case(r)} was timed by an earlier file too")
            seen.add(_case(r))
            results.append(r)
    superseded, replaced = [], set()
    for path, payload in zip(supersede, payloads[len(paths) :]):
        new = {_case(r): r for r in payload["results"]}
        if replaced & new.keys():
            raise SystemExit(f"{path}: {sorted(replaced & new.keys())[0]} was re-measured by an earlier --supersede file too")
        replaced |= new.keys()
        superseded += [dict(r, superseded_by=os.path.basename(path)) for r in results if _case(r) in new]
        results = [r for r in results if _case(r) not in new] + list(new.values())
    shapes = {}
    for payload in payloads:
        shapes.update(payload["shapes"])
    merged = dict(first)
    merged.update(
        results=results,
        shapes=shapes,
        lengths=sorted({r["T"] for r in results}),
        merged_from=[os.path.basename(p) for p in every],
        superseded=superseded,
        crossover_fsl_vs_sdpa={s: {m: crossover(results, s, m) for m in MODES} for s in shapes},
        crossover_triton_fsl_vs_sdpa={s: {m: crossover(results, s, m, "triton_fsl") for m in MODES} for s in shapes},
        issue10_bars={s: issue10_bars(results, s) for s in shapes},
        elapsed_s=sum(p.get("elapsed_s", 0.0) for p in payloads),
    )
    for payload in payloads:
        if "t131k_check" in payload:
            merged["t131k_check"] = payload["t131k_check"]
    return merged


def print_bars(bars: dict) -> None:
    for shape_name, per_bar in bars.items():
        print(f"issue 10 bars, {shape_name}:")
        for name, b in per_bar.items():
            ratio = "-" if b["ratio"] is None else f"{b['ratio']:.3f}"
            met = {True: "met", False: "missed", None: "not measured"}[b["met"]]
            print(f"  {name:>42}: {ratio:>8} (bar {b['bar']}): {met}")


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in payload["results"]))
    # a time panel per mode that was run, then the peak memory of the largest mode run
    modes = [mode for mode in MODES if any(r["mode"] == mode for r in payload["results"])] or list(MODES)
    panels = [(mode, "ms") for mode in modes] + [(modes[-1], "peak_gib")]
    fig, axes = plt.subplots(len(shapes), len(panels), figsize=(5 * len(panels), 4.2 * len(shapes)), squeeze=False)
    for row, shape_name in enumerate(shapes):
        for col, (mode, metric) in enumerate(panels):
            ax = axes[row][col]
            plotted = False
            for provider in PROVIDERS:
                pts = sorted(
                    (r["T"], r[metric])
                    for r in payload["results"]
                    if r["shape"] == shape_name
                    and r["mode"] == mode
                    and r["provider"] == provider
                    and r["status"] == "ok"
                    and r[metric] is not None
                    and math.isfinite(r[metric])
                    and r[metric] > 0
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=provider, color=f"C{PROVIDERS.index(provider)}")
                    plotted = True
            if not plotted:
                ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_ylabel("ms (median)" if metric == "ms" else "peak GiB above inputs")
            ax.set_title(f"{shape_name} {mode} {'time' if metric == 'ms' else 'memory'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{payload['env']['gpu']}, torch {payload['env']['torch']}, B=1 {payload['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def t131k_check(device, dtype) -> dict:
    """FS-L forward + backward at T = 131072 (H = 16, D = 64) through the public API; peak memory."""
    T, H, D = (131072, 16, 64) if device.type == "cuda" else (2048, 2, 16)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, T, H, D, device=device, dtype=dtype, generator=gen).requires_grad_(True) for _ in range(3)
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    t = time.perf_counter()
    o = freesolo.freesolo_attention(q, k, v, freesolo.FreeSoloConfig(variant="fsl"), backend="torch")
    o.backward(torch.ones_like(o))
    _sync(device)
    seconds = time.perf_counter() - t
    finite = all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
    out = {"T": T, "H": H, "D": D, "dtype": str(dtype), "seconds_first_call": seconds, "grads_finite": finite}
    if device.type == "cuda":
        out["peak_gib_total"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        out["inputs_gib"] = base / 2**30
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--t131k-check", action="store_true", help="only FS-L fwd+bwd at T=131072, peak memory")
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--providers", nargs="*", default=None, choices=PROVIDERS)
    ap.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES))
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new cases after this")
    ap.add_argument("--rep-ms", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--out", default=RESULTS, help="folder for the JSON and PNG (default benchmarks/results)")
    ap.add_argument("--modes", nargs="*", default=None, choices=MODES, help="default: every mode")
    ap.add_argument("--tag", default="", help="suffix of the output file names (e.g. _triton)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no run: merge these result files of one GPU into OUT/gpu_attention{TAG}.json and its plot")
    ap.add_argument("--supersede", nargs="+", default=None, metavar="JSON",
                    help="with --merge: re-measures whose records replace the merged files' records of the same cases")
    args = ap.parse_args(argv)

    if args.merge:
        payload = merge(args.merge, args.supersede)
        write_results(os.path.join(args.out, f"gpu_attention{args.tag}.json"), payload, plot)
        print_bars(payload["issue10_bars"])
        return

    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.dry_run and not args.t131k_check:
        raise SystemExit("no CUDA device: use --dry-run for the CPU smoke test")
    dtype = torch.bfloat16
    suffix = ("_dryrun" if args.dry_run else "") + args.tag
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    env = _versions(device)
    print(f"GPU: {env['gpu']} | torch {env['torch']} | triton {env['triton']} | commit {env['git_commit']}")

    if args.t131k_check:
        res = t131k_check(device, dtype)
        res["env"] = env
        path = os.path.join(out_dir, f"gpu_t131k_check{suffix}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(json.dumps(res, indent=2))
        print(f"wrote {path}")
        return

    shapes = {n: SHAPES[n] for n in (args.shapes or SHAPES)}
    lengths = args.lengths or LENGTHS
    providers = args.providers or PROVIDERS
    if args.dry_run:
        shapes = {"H2-D16": {"Hq": 2, "Hkv": 2, "D": 16}, "GQA-Hq4-Hkv2-D32": {"Hq": 4, "Hkv": 2, "D": 32}}
        lengths = args.lengths or [256, 640]
    start = time.time()
    results, last_ms = [], {}
    order = [p for p in PROVIDERS if p in providers]  # provider-major: FlexAttention (compiles) last
    for provider in order:
        for shape_name, shape in shapes.items():
            for T in lengths:
                for mode in args.modes or MODES:
                    rec = {"shape": shape_name, **shape, "T": T, "provider": provider, "mode": mode}
                    left = args.budget_s - (time.time() - start)
                    prev = last_ms.get((shape_name, provider, mode))
                    growth = (T / prev[0]) ** (2 if provider == "sdpa_causal" else 1) if prev else 1.0
                    predicted_s = 8 * prev[1] * growth / 1e3 if prev else 0.0  # ~8 calls per case
                    if left <= 0 or predicted_s > left:
                        rec.update(ms=None, peak_gib=None, status="skipped (time budget)")
                    else:
                        try:
                            rec.update(run_case(provider, mode, T, shape, device, dtype, not args.dry_run, args.rep_ms))
                            last_ms[(shape_name, provider, mode)] = (T, rec["ms"])
                        except torch.cuda.OutOfMemoryError:
                            rec.update(ms=None, peak_gib=None, status="oom")
                        except Exception as error:  # noqa: BLE001  (recorded, the run goes on)
                            rec.update(ms=None, peak_gib=None, status=f"error: {type(error).__name__}: {error}"[:300])
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    results.append(rec)
                    ms = f"{rec['ms']:10.3f}" if rec["ms"] is not None else f"{'-':>10}"
                    mem = f"{rec['peak_gib']:8.3f}" if rec.get("peak_gib") is not None else f"{'-':>8}"
                    print(
                        f"{shape_name:>20} T={T:>7} {provider:>13} {mode:>8} {ms} ms {mem} GiB  {rec['status']}",
                        flush=True,
                    )

    payload = {
        "env": env,
        "dtype": "bfloat16",
        "B": 1,
        "window": WINDOW,
        "shapes": shapes,
        "lengths": lengths,
        "freesolo_config": {
            k: getattr(freesolo.FreeSoloConfig(), k)
            for k in ("window", "cell", "top_k", "block", "pool", "recent", "beam")
        },
        "timing": BENCH_TIMING + "; peak_gib: torch.cuda.max_memory_allocated during one call minus the memory "
        "allocated before it",
        "results": results,
        "crossover_fsl_vs_sdpa": {s: {m: crossover(results, s, m) for m in MODES} for s in shapes},
        "crossover_triton_fsl_vs_sdpa": {s: {m: crossover(results, s, m, "triton_fsl") for m in MODES} for s in shapes},
        "issue10_bars": {s: issue10_bars(results, s) for s in shapes},
        "elapsed_s": time.time() - start,
    }
    if device.type == "cuda" and "H16-D64" in shapes and time.time() - start < args.budget_s + 60:
        try:
            payload["t131k_check"] = t131k_check(device, dtype)
        except torch.cuda.OutOfMemoryError:
            payload["t131k_check"] = {"status": "oom"}
    path = os.path.join(out_dir, f"gpu_attention{suffix}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    plot(payload, os.path.join(out_dir, f"gpu_attention{suffix}.png"))
    print("\ncrossover (FS-L faster than SDPA causal):")
    for s, per_mode in {**payload["crossover_fsl_vs_sdpa"], **{f"{k} triton": v for k, v in payload["crossover_triton_fsl_vs_sdpa"].items()}}.items():
        for m, c in per_mode.items():
            ratios = ", ".join(f"{t}: {r:.2f}" for t, r in c["fsl_over_sdpa"].items())
            print(
                f"  {s} {m}: first measured T = {c['first_measured_T']}, estimate ~{c['estimated_T']} "
                f"(FS-L / SDPA time: {ratios})"
            )
    print_bars(payload["issue10_bars"])
    if "t131k_check" in payload:
        print(f"T=131072 FS-L fwd+bwd check: {payload['t131k_check']}")
    print(f"wrote {path} and the .png ({payload['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
