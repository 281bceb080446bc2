"""A kernel refactor changes no bit: old vs new @triton.jit kernels of a triton module, same process.

A refactor that moves kernel code into shared `@triton.jit` helpers (s31: the backward's cell-mode
work item, the decode steps' FS-L scores / top-K rows / readout) must leave every output bit as it
was. This script loads the old file of each module (e.g. `git show REV:freesolo/backends/triton/decode.py
> .ab/decode.py`) as a sibling module, runs the cases with the current kernels, swaps every
JITFunction of the current module for the old file's (the host code stays the current one), runs
them again, and compares bit for bit:

- attention_bwd: dq / dk / dv / dbeta of the triton FS-L / FS forward + backward through the API in
  the deterministic mode, every long mode ("cell", "gather", "union"), bf16 and fp32, D 64 / 128, GQA;
- decode: FS-L / FS / FS-B fused decode steps (single and split tiles) from a chunked prefill across
  block boundaries, B 2, GQA, bf16.

    git show 5e9d696:freesolo/backends/triton/attention_bwd.py > .ab/attention_bwd.py
    git show 5e9d696:freesolo/backends/triton/decode.py > .ab/decode.py
    python benchmarks/kernel_refactor_ab.py --old attention_bwd=.ab/attention_bwd.py decode=.ab/decode.py  # GPU
    TRITON_INTERPRET=1 python benchmarks/kernel_refactor_ab.py --device cpu --old ...  # small shapes, interpreted

Exit status 1 when any output differs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

os.environ["FREESOLO_TRITON_GRAPHS"] = "0"  # the kernels under A/B launch on every call: no replay from the CUDA-graph cache
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import freesolo  # noqa: E402
from freesolo import FreeSoloCache, FreeSoloConfig  # noqa: E402
from freesolo.backends.triton.backend import deterministic  # noqa: E402
from freesolo.streaming.torch_state import DecodeTiles  # noqa: E402

__all__ = ["main"]

PACKAGE = "freesolo.backends.triton"


def load_old(name: str, path: str):
    """The file at `path` as module PACKAGE.<name>_old (its relative imports resolve in PACKAGE)."""
    spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}_old", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = PACKAGE
    sys.modules[spec.name] = module  # (dataclasses look their module up while the file runs)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def old_kernels(name: str, old):
    """Every JITFunction of PACKAGE.<name> replaced by the old module's of the same name."""
    current = importlib.import_module(f"{PACKAGE}.{name}")
    kernel_types = (JITFunction, InterpretedFunction)  # (TRITON_INTERPRET=1 decorates with the latter)
    saved = {}
    for attr, value in vars(old).items():
        if isinstance(value, kernel_types) and isinstance(getattr(current, attr, None), kernel_types):
            saved[attr] = getattr(current, attr)
            setattr(current, attr, value)
    try:
        yield sorted(saved)
    finally:
        for attr, value in saved.items():
            setattr(current, attr, value)


SMALL = dict(window=16, cell=4, block=8, pool=3, recent=2, top_k=2)  # the CPU (interpreter) cases: pruning bites


def backward_cases(device: str):
    """(label, thunk) pairs: each thunk returns the output and gradients of one forward + backward."""
    cases = []
    cuda = device == "cuda"
    dtypes = (torch.bfloat16, torch.float32) if cuda else (torch.float32,)
    heads = ((16, 16, 64), (8, 2, 128)) if cuda else ((2, 2, 16), (4, 2, 8))
    T = 4096 + 37 if cuda else 61
    for variant in ("fsl", "fs"):
        for dtype in dtypes:
            for Hq, Hkv, D in heads:
                for mode in ("cell", "gather", "union"):
                    cfg = FreeSoloConfig(variant=variant, **({} if cuda else SMALL))
                    cases.append((f"bwd {variant} {str(dtype)[6:]} Hq{Hq} Hkv{Hkv} D{D} T{T} {mode}",
                                  _backward_thunk(cfg, dtype, Hq, Hkv, D, T, mode, device)))
    return cases


def _backward_thunk(cfg, dtype, Hq, Hkv, D, T, mode, device):
    def run():
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, T, Hq, D, device=device, dtype=dtype, generator=g).requires_grad_(True)
        k = torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g).requires_grad_(True)
        v = torch.randn(1, T, Hkv, D, device=device, dtype=dtype, generator=g).requires_grad_(True)
        beta = (torch.rand(Hq, device=device, generator=g) + 0.5).requires_grad_(True)
        do = torch.randn(1, T, Hq, D, device=device, dtype=dtype, generator=g)
        previous = os.environ.get("FREESOLO_TRITON_BWD_LONG")
        os.environ["FREESOLO_TRITON_BWD_LONG"] = mode
        try:
            with deterministic(True):  # the default; the atomic mode's sums are not bitwise run to run
                o = freesolo.freesolo_attention(q, k, v, cfg, beta=beta, backend="triton", check_finite=False)
                o.backward(do)
        finally:
            if previous is None:
                os.environ.pop("FREESOLO_TRITON_BWD_LONG", None)
            else:
                os.environ["FREESOLO_TRITON_BWD_LONG"] = previous
        return [o.detach(), q.grad, k.grad, v.grad, beta.grad]

    return run


def decode_cases(device: str):
    cases = []
    for variant in ("fsl", "fs", "fsb"):
        for impl in ("single", "split"):
            if variant == "fsb" and impl == "split":
                continue  # FS-B's fused step has one form
            cases.append((f"decode {variant} {impl}", _decode_thunk(variant, impl, device)))
    return cases


def _decode_thunk(variant, impl, device):
    def run():
        cuda = device == "cuda"
        # CUDA: block boundaries at 1024 and 1152 (the pools' updates); CPU: 4 boundaries of 8-token blocks
        B, Hq, Hkv, D, T0, steps = (2, 8, 2, 64, 900, 300) if cuda else (2, 4, 2, 8, 30, 34)
        dtype = torch.bfloat16 if cuda else torch.float32
        g = torch.Generator(device=device).manual_seed(1)
        T = T0 + steps
        q = torch.randn(B, T, Hq, D, device=device, dtype=dtype, generator=g)
        k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=g)
        v = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=g)
        kw = dict(variant=variant, block=128) if cuda else dict(variant=variant, **SMALL)
        if variant == "fsb":
            kw["tau"] = float(D**0.5) * (1.4 if cuda else 1.0)
        cfg = FreeSoloConfig(**kw)
        tiles = None if variant == "fsb" else DecodeTiles(impl=impl)
        cache = FreeSoloCache(cfg, B, Hq, Hkv, D, backend="torch", dtype=dtype, device=device,
                              decode_kernel="triton", decode_tiles=tiles)
        outs = [cache.extend(q[:, :T0], k[:, :T0], v[:, :T0])]
        for i in range(T0, T):
            outs.append(cache.extend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]))
        return [torch.cat(outs, dim=1)]

    return run


CASES = {"attention_bwd": backward_cases, "decode": decode_cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", nargs="+", required=True, help="MODULE=PATH of the old file (modules: attention_bwd, decode)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (paper sizes) or cpu (TRITON_INTERPRET=1, small shapes)")
    parser.add_argument("--only", default="", help="run the cases whose label contains this text")
    args = parser.parse_args()
    failures = 0
    for item in args.old:
        name, path = item.split("=", 1)
        old = load_old(name, path)
        for label, run in CASES[name](args.device):
            if args.only not in label:
                continue
            new_out = run()
            with old_kernels(name, old) as swapped:
                old_out = run()
            same = all(torch.equal(a, b) for a, b in zip(new_out, old_out)) and len(new_out) == len(old_out)
            finite = all(bool(torch.isfinite(x).all()) for x in new_out)
            failures += not (same and finite)
            print(f"{label}: {'bitwise equal' if same else 'DIFFERENT'}{'' if finite else ' (non-finite!)'} "
                  f"({len(swapped)} kernels swapped)", flush=True)
    print(f"{failures} case(s) differ" if failures else "every case bitwise equal", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
