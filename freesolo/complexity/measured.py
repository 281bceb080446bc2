"""Measured cost: wall time and peak memory of `freesolo_attention` (and of `select_cells`) over T,
for any backend and device.

Memory methods (recorded in every row as "memory_method"):
- "cuda_max_memory_allocated": torch.cuda.max_memory_allocated during the call, minus the
  allocated bytes before it (the inputs are not counted).
- "tracemalloc" (CPU, host backends numpy / numba): the peak of traced allocations during the
  call minus those before it. NumPy arrays and numba's NRT arrays (temporaries included) are
  traced; the inputs are not counted.
- "peak_rss" (CPU, torch backend: torch's CPU allocator is not traced): the process's peak
  resident set (VmHWM, reset through /proc/self/clear_refs) minus the resident set before the
  call. Memory the C allocator kept from earlier calls is reused without growing the RSS, so
  this under-counts small peaks; Linux only.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..config import FreeSoloConfig

__all__ = [
    "make_inputs",
    "PeakMemory",
    "peak_memory",
    "time_call",
    "measure_point",
    "measured_sweep",
    "tau_for_keys",
]


def make_inputs(
    batch: int,
    T: int,
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    seed: int,
    kind: str = "numpy",
    device: str = "cpu",
    dtype: str | None = None,
):
    """Standard-normal q [B, T, Hq, D], k / v [B, T, Hkv, D].

    kind "numpy": float64 arrays (what the host backends compute in); kind "torch": tensors on
    `device` of `dtype` ("float32", "bfloat16", "float16"; default float32), drawn on the device.
    """
    if kind == "numpy":
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((batch, T, num_heads, dim))
        k = rng.standard_normal((batch, T, num_kv_heads, dim))
        v = rng.standard_normal((batch, T, num_kv_heads, dim))
        return q, k, v
    if kind != "torch":
        raise ValueError(f"kind={kind!r} must be 'numpy' or 'torch'")
    import torch

    torch_dtype = getattr(torch, dtype or "float32")
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, T, num_heads, dim, generator=gen, device=device, dtype=torch_dtype)
    k = torch.randn(batch, T, num_kv_heads, dim, generator=gen, device=device, dtype=torch_dtype)
    v = torch.randn(batch, T, num_kv_heads, dim, generator=gen, device=device, dtype=torch_dtype)
    return q, k, v


def tau_for_keys(k, cfg: FreeSoloConfig) -> np.ndarray:
    """calibrate_tau (median of a_c per kv head) computed vectorised: k [B, T, Hkv, D] numpy or torch -> [Hkv].

    Same definition as `freesolo.calibrate_tau`; used where its reference loop would be slow (1M tokens).
    """
    from .counted import cell_max_norms, tau_from_norms

    if hasattr(k, "detach"):
        import torch

        B, T, Hkv, D = k.shape
        C = T // cfg.cell
        if C == 0:
            raise ValueError(f"tau needs T >= cell, got T={T} < cell={cfg.cell}")
        norms = k[:, : C * cfg.cell].detach().to(torch.float32).norm(dim=-1)  # [B, C*s, Hkv]
        a = norms.reshape(B, C, cfg.cell, Hkv).amax(dim=2).permute(0, 2, 1)  # [B, Hkv, C]
        return tau_from_norms(a.double().cpu().numpy())
    return tau_from_norms(cell_max_norms(np.asarray(k), cfg.cell))


# ---- memory ---------------------------------------------------------------------------------
def _rss_kib() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in KiB."""
    with open("/proc/self/status") as f:
        status = f.read()
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return hwm, rss


def _can_reset_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _rss_kib()
        return True
    except (OSError, AttributeError):
        return False


class PeakMemory:
    """Result holder of `peak_memory`: `bytes` (peak extra bytes during the block) and `method`."""

    def __init__(self, method: str):
        self.method = method
        self.bytes: int | None = None


@contextlib.contextmanager
def peak_memory(device: str = "cpu", method: str | None = None) -> Iterator[PeakMemory]:
    """Measure the peak extra memory of the block on `device` ("cpu" or "cuda[:n]").

    method: None (CUDA: "cuda_max_memory_allocated"; CPU: "tracemalloc"), or "peak_rss" on the CPU.
    See the module doc for what each counts.
    """
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = PeakMemory("cuda_max_memory_allocated")
        yield result
        torch.cuda.synchronize(device)
        result.bytes = int(torch.cuda.max_memory_allocated(device) - before)
    elif device != "cpu":
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda[:n]'")
    elif method == "peak_rss":
        if not _can_reset_rss():
            raise RuntimeError("peak_rss needs Linux /proc/self/clear_refs; use method='tracemalloc'")
        _, before = _rss_kib()  # clear_refs was just written: VmHWM == VmRSS now
        result = PeakMemory("peak_rss")
        yield result
        hwm, _ = _rss_kib()
        result.bytes = max(0, hwm - before) * 1024
    elif method in (None, "tracemalloc"):
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = PeakMemory("tracemalloc")
        try:
            yield result
            _, peak = tracemalloc.get_traced_memory()
            result.bytes = int(peak - before)
        finally:
            if not was_tracing:
                tracemalloc.stop()
    else:
        raise ValueError(f"method={method!r} must be None, 'tracemalloc' or 'peak_rss'")


# ---- time -----------------------------------------------------------------------------------
def time_call(fn: Callable[[], object], device: str = "cpu") -> float:
    """Wall seconds of one call of fn (synchronising CUDA before and after)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_point(
    variant: str,
    backend: str,
    T: int,
    cfg: FreeSoloConfig,
    batch: int = 1,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    dim: int = 64,
    seed: int = 0,
    repeats: int = 3,
    min_total_s: float = 1.0,
    device: str = "cpu",
    dtype: str | None = None,
    selection: bool = True,
) -> dict:
    """Time and peak memory of one forward `freesolo_attention` call at length T (and, with
    `selection`, the time of `select_cells` alone).

    The first forward call is measured for memory (and timed); further calls (up to `repeats` in
    all) run while the accumulated time is below `min_total_s`. "time_s" is the best (minimum)
    of the untraced calls when there are any (tracemalloc slows Python code), else the first
    call's: other processes only ever add time, so the minimum is the robust estimate on a
    shared machine (as `timeit` does); "time_median_s" is kept too.
    FS-B gets tau from `tau_for_keys` (= calibrate_tau) on the same keys.
    """
    from ..api import freesolo_attention, select_cells

    kind = "torch" if backend in ("torch", "triton") else "numpy"
    q, k, v = make_inputs(batch, T, num_heads, num_kv_heads, dim, seed, kind, device, dtype)
    vcfg = cfg.replace(variant=variant)
    if variant == "fsb":
        vcfg = vcfg.replace(tau=tuple(tau_for_keys(k, vcfg)))

    def forward():
        return freesolo_attention(q, k, v, vcfg, backend=backend)

    def select():
        return select_cells(q, k, vcfg, backend=backend)

    method = "peak_rss" if (device == "cpu" and kind == "torch") else None
    with peak_memory(device, method) as mem:
        first = time_call(forward, device)
    times = []
    while 1 + len(times) < repeats and first + sum(times) < min_total_s:
        times.append(time_call(forward, device))
    row = {
        "variant": variant,
        "backend": backend,
        "device": device,
        "dtype": dtype or ("float64" if kind == "numpy" else "float32"),
        "T": T,
        "batch": batch,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "dim": dim,
        "time_s": float(min(times)) if times else first,
        "time_median_s": float(np.median(times)) if times else first,
        "runs": 1 + len(times),
        "peak_bytes": mem.bytes,
        "memory_method": mem.method,
        "select_time_s": None,
        "status": "ok",
    }
    if selection:
        sel = [time_call(select, device)]
        while len(sel) < repeats and sum(sel) < min_total_s:
            sel.append(time_call(select, device))
        row["select_time_s"] = float(min(sel))
    return row


def measured_sweep(
    T_list: Sequence[int],
    variants: Sequence[str],
    backend: str,
    cfg: FreeSoloConfig,
    batch: int = 1,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    dim: int = 64,
    seed: int = 0,
    repeats: int = 3,
    max_seconds_per_point: float = 30.0,
    device: str = "cpu",
    dtype: str | None = None,
    progress: bool = True,
    warmup: bool = True,
    selection: bool = True,
    budget_s: float | None = None,
) -> list[dict]:
    """Measure every (variant, T), T increasing, the variants interleaved; one row per point.

    Before the sweep each variant runs once at the smallest T (untimed: numba compiles, caches
    warm). A point is skipped (status "skipped: ...") when it is predicted, from the variant's
    last two points' slope (at least 1), to exceed `max_seconds_per_point`, or to end after
    `budget_s` seconds after the warm-ups (compilation is not counted: it happens once per
    machine with numba's cache); a variant stops at its first skip. A backend that cannot run a
    variant gives rows "error: ..." (its message).
    """
    T_list = sorted(int(T) for T in T_list)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(T_list) * len(variants), desc=f"measured ({backend})", unit="point")
    common = dict(
        batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, dim=dim, seed=seed, device=device, dtype=dtype
    )
    stopped: dict[str, str | None] = {variant: None for variant in variants}
    if warmup:
        for variant in variants:
            if bar is not None:
                bar.set_postfix_str(f"{variant} warm-up (compile)")
            try:
                measure_point(variant, backend, T_list[0], cfg, repeats=1, selection=selection, **common)
            except Exception as exc:  # noqa: BLE001 - recorded in the rows and printed by the CLI
                stopped[variant] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
    done: dict[str, list[dict]] = {variant: [] for variant in variants}
    rows = []
    start = time.perf_counter()  # the budget counts the timed points only
    for T in T_list:
        for variant in variants:
            if bar is not None:
                bar.set_postfix_str(f"{variant} T={T}")
            history = done[variant]
            if stopped[variant] is None and history:
                last = history[-1]
                slope = 1.0
                if len(history) >= 2:
                    prev = history[-2]
                    slope = max(1.0, math.log(last["time_s"] / prev["time_s"]) / math.log(last["T"] / prev["T"]))
                spent = last["time_s"] + (last["select_time_s"] or 0.0)
                predicted = spent * (T / last["T"]) ** slope
                elapsed = time.perf_counter() - start
                if predicted > max_seconds_per_point:
                    stopped[variant] = f"skipped: predicted {predicted:.1f} s > {max_seconds_per_point:g} s per point"
                elif budget_s is not None and elapsed + predicted > budget_s:
                    stopped[variant] = f"skipped: the sweep's {budget_s:g} s budget would be exceeded"
            if stopped[variant] is None:
                try:
                    row = measure_point(variant, backend, T, cfg, repeats=repeats, selection=selection, **common)
                    history.append(row)
                    rows.append(row)
                except Exception as exc:  # noqa: BLE001
                    stopped[variant] = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
            if stopped[variant] is not None:
                rows.append(
                    {
                        "variant": variant,
                        "backend": backend,
                        "device": device,
                        "T": T,
                        "status": stopped[variant],
                        "time_s": None,
                        "select_time_s": None,
                        "peak_bytes": None,
                    }
                )
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return rows
