"""Shared pieces of the Triton kernels: host-side size helpers and `@triton.jit` device helpers.

RoPE convention (spec §2): half-split ("rotate_half") over all D dims. A kernel keeps a head
vector as its two halves, x_lo = x[:D/2] and x_hi = x[D/2:], each padded to HALF_P lanes
(a power of two >= 16, masked loads give zeros in the padding), so that

    rope(x) = [x_lo * cos - x_hi * sin,  x_hi * cos + x_lo * sin]
    rope(q) . rope(k) = rope(q)_lo . rope(k)_lo + rope(q)_hi . rope(k)_hi   (two tl.dot of width HALF_P)

with cos / sin the fp32 tables of `freesolo.backends.torch._ops.rope_tables` ([T, D/2]).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = [
    "MAX_HEAD_DIM",
    "NEG_BIG",
    "FAST_LAUNCH_ENV",
    "cdiv",
    "check_head_dim",
    "launch",
    "load_halves",
    "load_rope",
    "next_pow2",
    "padded_dims",
    "rope_halves",
    "rope_rotate",
    "same_device",
    "store_union",
]


def same_device(a, b) -> bool:
    """True when torch devices `a` and `b` are one device: `cuda` (no index) is the current CUDA
    device, so `cuda` and `cuda:0` agree while device 0 is current."""
    import torch

    def resolved(device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    return a == b or resolved(a) == resolved(b)


MAX_HEAD_DIM = 256
# Finite start of a running max: exp2(NEG_BIG - NEG_BIG) = 1 and exp2(-inf - NEG_BIG) = 0, so a
# fully masked step leaves (m, l, acc) bit-identical (never exp(-inf - -inf) = NaN).
NEG_BIG = tl.constexpr(-1.0e30)


def _interpreter_numpy2_compat() -> None:
    """Make dynamic loop bounds work under TRITON_INTERPRET=1 with NumPy >= 2.4.

    triton 3.6's interpreter converts a scalar tensor to a Python int with `int(handle.data)`,
    but its scalars are 1-element 1-D arrays, which NumPy 2.4 no longer converts
    (`range(lo, hi)` with a tensor bound raises "only 0-dimensional arrays can be converted").
    This re-registers `__index__` through `.item()`; compiled (GPU) kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of another triton version
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_freesolo_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._freesolo_compat = True
    interpreter._patch_lang_tensor = patched


_interpreter_numpy2_compat()


def _interpreter_row_independent_dot() -> None:
    """Make tl.dot under TRITON_INTERPRET=1 compute each output element by the same arithmetic
    whatever the other rows of the operands hold (spec L12, as the GPU's MMA does).

    triton 3.6's interpreter runs tl.dot as np.matmul, i.e. the CPU's BLAS sgemm, whose micro-kernels
    may accumulate a row differently by its position in the tile (main block vs edge rows; seen on
    OpenBLAS 0.3.31's Haswell kernels: a sorted long tile's rows differed from consecutive tiles' by
    one ulp). This re-registers it as fp32 products summed over k in increasing order, one
    elementwise add per k (`np.add.reduce` over the leading k axis), plus the accumulator: a function
    of the output element's own row and column alone. Compiled (GPU) kernels are unaffected.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - layout of another triton version
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_freesolo_rows", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and b.dtype.is_floating()) or a.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_dtype = d.data.dtype
        lhs = np.moveaxis(a.data.astype(acc_dtype), -1, 0)[..., :, None]  # [K, ..., M, 1]
        rhs = np.moveaxis(b.data.astype(acc_dtype), -2, 0)[..., None, :]  # [K, ..., 1, N]
        out = np.add.reduce(lhs * rhs, axis=0) + d.data
        return interpreter.TensorHandle(out.astype(acc_dtype, copy=False), d.dtype.scalar)

    create_dot._freesolo_rows = True
    builder.create_dot = create_dot


_interpreter_row_independent_dot()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1; 0 for n = 0), as `triton.next_power_of_2`: host code
    uses this one because triton 3.6's is a constexpr function whose call from plain Python costs
    about 5 us (argument unwrapping), and a forward made ~20 such calls (s23 host profile)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0 (`triton.cdiv` without its constexpr-function call cost)."""
    return -(-a // b)



# ---- kernel launches -----------------------------------------------------------------------------

FAST_LAUNCH_ENV = "FREESOLO_TRITON_FAST_LAUNCH"  # 0: every launch through JITFunction.run (A/B of `launch`)
_COMPILED: dict = {}  # (id(kernel), device, specialization, options) -> (kernel, the CompiledKernel JITFunction.run picked, `_direct_launcher`)
# The fast path reads triton 3.6's JITFunction internals (device_caches' binder, CompiledKernel.run's
# arguments); other versions launch through JITFunction.run (the project pins triton==3.6.0).
FAST_LAUNCH_TRITON = tuple(triton.__version__.split(".")[:2]) == ("3", "6")


def _hooks_set(hook) -> bool:
    """Whether a launch hook knob holds a hook: triton 3.6's are HookChain objects (never None),
    set when their `calls` list is not empty; older versions hold None or a callable."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _direct_launcher(compiled):
    """The C launch function of a compiled kernel when its Python wrapper (triton 3.6
    `CudaLauncher.__call__`) would add nothing: no global or profile scratch buffer to allocate
    per launch. None otherwise (launch through the wrapper)."""
    run = compiled.run
    sizes = (getattr(run, "global_scratch_size", None), getattr(run, "profile_scratch_size", None))
    if sizes != (0, 0) or not hasattr(run, "launch") or not hasattr(run, "launch_pdl"):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` with less host work per launch on CUDA.

    triton 3.6's `JITFunction.run` costs 20-50 us of host time per launch on the H200's host
    (s29 `benchmarks/launch_host_probe.py`, against ~12 us for the compiled kernel's launcher
    alone), and a short forward + backward is host bound. This keeps its exact choice of compiled
    kernel: Triton's own binder computes the arguments' specialization (dtypes, 16-byte alignment,
    integer divisibility), which with the options (num_warps, ... and the debug / instrumentation
    knobs, as `run` adds them) keys a cache of the CompiledKernel that `run` returned the first
    time; a hit calls that kernel's launcher on the current stream, the same launch `run` makes
    (without its empty enter / exit hook chains and their launch metadata), and, when the kernel
    needs no scratch buffer, the launcher's C function directly (`_direct_launcher`: the arguments
    the Python wrapper would pass). The cache is keyed by the kernel's id (JITFunction hashes in
    Python) and checks the entry's kernel is that object.
    A miss (first launch of a specialization: compilation) goes through `run`, and so does every
    launch under the interpreter (TRITON_INTERPRET=1), with a callable grid, pre-run hooks or
    launch hooks set (e.g. a profiler's), with a triton other than 3.6 (`FAST_LAUNCH_TRITON`), or
    with FREESOLO_TRITON_FAST_LAUNCH=0.
    grid: a tuple of 1 to 3 ints.
    """
    if (
        not FAST_LAUNCH_TRITON
        or not isinstance(kernel, JITFunction)
        or kernel.pre_run_hooks
        or callable(grid)
        or _hooks_set(triton.knobs.runtime.launch_enter_hook)
        or _hooks_set(triton.knobs.runtime.launch_exit_hook)
        or os.environ.get(FAST_LAUNCH_ENV, "1") == "0"
    ):
        kernel[grid](*args, **kwargs)
        return
    import torch

    torch_c = torch._C
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
    kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    device = torch_c._cuda_getDevice()  # torch.cuda.current_device() without its lazy-init check (CUDA tensors: initialized)
    binder = kernel.device_caches[device][4]
    bound_args, specialization, options = binder(*args, **kwargs)
    try:
        key = (id(kernel), device, tuple(specialization), tuple(options.items()))
        entry = _COMPILED.get(key)
    except TypeError:  # an unhashable specialization value: Triton's own path
        key = entry = None
    if entry is None or entry[0] is not kernel:
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if key is not None and compiled is not None and not hasattr(compiled, "result"):
            _COMPILED[key] = (kernel, compiled, _direct_launcher(compiled))
        return
    _, compiled, direct = entry
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    stream = torch_c._cuda_getCurrentRawStream(device)
    if direct is not None:
        c_launch, cooperative, pdl = direct
        c_launch(g0, g1, g2, stream, compiled.function, cooperative, pdl, None, None,
                 compiled.packed_metadata, None, None, None, *bound_args.values())  # fmt: skip
        return
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound_args.values())


def check_head_dim(D: int) -> None:
    """ValueError unless D is even and 2 <= D <= MAX_HEAD_DIM (RoPE needs two halves)."""
    if D % 2 != 0 or D < 2 or D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} must be even and in [2, {MAX_HEAD_DIM}] for the triton kernels")


def padded_dims(D: int) -> tuple[int, int]:
    """(D_P, HALF_P): D and D/2 rounded up to powers of two, at least 16 (tl.dot's minimum width)."""
    check_head_dim(D)
    return max(16, next_pow2(D)), max(16, next_pow2(D // 2))


@triton.jit
def store_union(x, out, count_ptr, U_MAX, ok):
    """Writes the distinct values of x (int32 [U_P], U_P a power of two; INT32_MAX = absent) ascending
    into out[0:n], -1 into out[n:U_MAX], n into *count_ptr (stores masked by the scalar `ok`): sorted
    (bitonic, tl.sort), deduplicated (first of each run, tl.gather of the left neighbour), compacted
    by a prefix sum. The tile unions of the long branch (`attention._tile_union_kernel`, and the
    scoring kernel's fused form, `selection._score_topk_kernel` with UNION_OUT)."""
    big = 2147483647
    x = tl.sort(x, 0)
    e = tl.arange(0, x.shape[0])
    prev = tl.gather(x, tl.maximum(e - 1, 0), 0)
    first = (x != big) & ((e == 0) | (x != prev))
    pos = tl.cumsum(first.to(tl.int32), 0) - 1
    n = tl.sum(first.to(tl.int32), 0)
    tl.store(out + pos, x, mask=first & (pos < U_MAX) & ok)  # pos < U_MAX holds: a guard, never a clip
    tl.store(out + e, tl.full(x.shape, -1, tl.int32), mask=(e >= n) & (e < U_MAX) & ok)
    tl.store(count_ptr, n, mask=ok)


@triton.jit
def load_halves(ptrs_lo, row_mask, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Rows of a [*, D] tensor as halves. ptrs_lo [R, HALF_P] points at x[r, d] (d < HALF_P);
    returns (x_lo, x_hi) [R, HALF_P], zeros where d >= HALF or the row is masked."""
    d = tl.arange(0, HALF_P)
    mask = row_mask[:, None] & (d[None, :] < HALF)
    x_lo = tl.load(ptrs_lo, mask=mask, other=0.0)
    x_hi = tl.load(ptrs_lo + HALF, mask=mask, other=0.0)
    return x_lo, x_hi


@triton.jit
def load_rope(cos_ptr, sin_ptr, pos, row_mask, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """cos, sin [R, HALF_P] fp32 at int64 positions pos [R] from tables [T, HALF] (zeros where masked)."""
    d = tl.arange(0, HALF_P)
    offs = pos[:, None] * HALF + d[None, :]
    mask = row_mask[:, None] & (d[None, :] < HALF)
    return tl.load(cos_ptr + offs, mask=mask, other=0.0), tl.load(sin_ptr + offs, mask=mask, other=0.0)


@triton.jit
def rope_halves(x_lo, x_hi, cos, sin):
    """Half-split RoPE of (x_lo, x_hi) in fp32: (x_lo*cos - x_hi*sin, x_hi*cos + x_lo*sin)."""
    x_lo = x_lo.to(tl.float32)
    x_hi = x_hi.to(tl.float32)
    return x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin


@triton.jit
def _rope_rows_kernel(
    X,  # rows of a [B, T, H, D] tensor, contiguous inside a batch row (batch stride X_BATCH elements)
    OUT,  # [R, D] contiguous [B, T, H, D], X's dtype
    COS,  # fp32 [T, HALF] (the table rows of positions 0..T-1 of X)
    SIN,  # fp32 [T, HALF]
    R,
    T,
    H,
    X_BATCH,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < R
    pos = (r // H) % T
    x_row = (r // (T * H)) * X_BATCH + (r % (T * H)) * (2 * HALF)  # int64 element offset of row r in X
    x_lo, x_hi = load_halves(X + x_row[:, None] + tl.arange(0, HALF_P)[None, :], row_ok, HALF, HALF_P)
    c, s = load_rope(COS, SIN, pos, row_ok, HALF, HALF_P)
    y_lo, y_hi = rope_halves(x_lo, x_hi, c, s)
    d = tl.arange(0, HALF_P)
    mask = row_ok[:, None] & (d[None, :] < HALF)
    ptrs = OUT + r[:, None] * (2 * HALF) + d[None, :]
    tl.store(ptrs, y_lo.to(OUT.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, y_hi.to(OUT.dtype.element_ty), mask=mask)


def rope_rotate(x, cos, sin, out=None):
    """Half-split RoPE of x [B, T, H, D] at positions 0..T-1 -> [B, T, H, D] in x's dtype
    (rotation in fp32, one rounding to x's dtype: the same values as rotating inside a kernel).

    Args:
        x: [B, T, H, D], contiguous inside each batch row (a time slice x[:, t0:t1] of a contiguous
            tensor qualifies: its rows keep the full tensor's batch stride).
        cos, sin: fp32 [T, D/2] (`freesolo.backends.torch._ops.rope_tables`; rows t0:t1 of the
            tables for such a slice, i.e. the positions of x's rows).
        out: optional contiguous [B, T, H, D] buffer of x's dtype (a view of a larger buffer is fine);
            default a new tensor.
    """
    import torch

    B, T, H, D = x.shape
    check_head_dim(D)
    if x.stride()[1:] != (H * D, D, 1):
        raise ValueError(f"x must be contiguous inside each batch row, got strides {x.stride()}")
    if out is None:
        out = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (B, T, H, D) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{B}, {T}, {H}, {D}], got {out.dtype} {tuple(out.shape)}")
    R = B * T * H
    if R == 0:
        return out
    half_p = padded_dims(D)[1]
    block_r = max(8, 2048 // half_p)  # rows per program: 4 fp32 tiles [block_r, HALF_P] in registers
    launch(_rope_rows_kernel, (cdiv(R, block_r),),
        x, out, cos, sin, R, T, H, x.stride(0) if B > 1 else T * H * D, HALF=D // 2, HALF_P=half_p, BLOCK_R=block_r
    )
    return out
