"""Registers and SASS instructions per level of the Triton FS-B search kernel, compiled ahead of time
for sm_90 on any machine (no GPU: Triton's bundled ptxas and cuobjdump), issue 12.

The search is bound by instructions (s40 Nsight Compute of one launch at 64k on an H100:
`results/session_2026-12-06_s40/call3/s40b_ncu.log`: 21.1 G warp instructions, IPC 2.52, L2 throughput 3.8 %,
occupancy 18.75 % limited by 160 registers a thread), so the instruction count of one level of the beam
search (the body of its level loop) and the registers a thread predict its time. The kernel is
compiled as the prefill launches it at the paper sizes (D 64, beam 16, cell 32, block 128, top_k 4,
found beams stored, rerank off: the tile rerank's path), with the pointers and D, T specialized as
16-byte aligned, as Triton specializes them at run time.

s40 (this script, then the H100 in the same session, search alone at 1M): the s39 kernel 1046 instructions a
level, 160 registers: 753 ms; chunks of 64 / 16 / 8 / 4 dims 846 / 707 / 675 / 651 instructions at 104 / 96 /
128 / 168 registers: 540 / 480 / 627 / 1007 ms. Fewer instructions pay only while the registers (occupancy)
do not grow.

    python benchmarks/fsb_search_sass.py                       # this checkout, chunks 64 / 16 / 8 / 4
    python benchmarks/fsb_search_sass.py --root .ab/pre_s40    # another checkout's kernel (e.g. git archive of an older commit)
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

__all__ = ["main"]

POINTERS = {"q_ptr": "*fp32", "k_ptr": "*bf16", "mu_ptr": "*fp32", "rad_ptr": "*fp32", "a_ptr": "*fp32", "e_ptr": "*i64",
            "cell_ptr": "*i64", "base_ptr": "*i64", "hp_ptr": "*i64", "sigma_ptr": "*fp32", "lam_ptr": "*fp32",
            "out_ptr": "*i64", "found_ptr": "*i32", "trace_idx_ptr": "*i64", "trace_key_ptr": "*fp32"}  # fmt: skip
CONSTANTS = dict(BLOCK_D=64, CELL=32, QBLOCK=128, W=16, WP=16, K=4, KP=4, FOUND=True, TRACE=False, TRACE_LEVELS=32, RERANK=False)


def compile_search(dim_chunk: int | None):
    """The search kernel of the imported `freesolo` compiled for sm_90 at one warp: (registers a thread, SASS text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fsb_search = importlib.import_module("freesolo.backends.triton.fsb_search")
    kernel = fsb_search._fsb_search_kernel
    names = kernel.arg_names
    constants = dict(CONSTANTS)
    if "DC" in names:  # (kernels before s40 read all of D at once)
        constants["DC"] = dim_chunk or constants["BLOCK_D"]
    signature = {}
    for name in names:
        if name in POINTERS:
            signature[name] = POINTERS[name]
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name in ("scale", "radius_weight", "two_cell") else "i32"
    aligned = [n for n in names if n in POINTERS or n in ("D", "T")]
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), sass


def level_loops(sass: str):
    """The long backward branches of the SASS (the two forests' level loops): [(instructions, opcode counts)]."""
    instructions = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instructions.append((int(m.group(1), 16), m.group(2).strip()))
    at = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and address - int(m.group(1), 16) > 0x400:  # a loop of more than 64 instructions
            body = instructions[at[int(m.group(1), 16)] : i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", t).split()[0].split(".")[0] for _, t in body)
            loops.append((len(body), ops))
    return loops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."), help="checkout whose freesolo to compile")
    ap.add_argument("--dim-chunks", type=int, nargs="+", default=[64, 16, 8, 4], help="SEARCH_DIM_CHUNK values (ignored before s40)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.root))
    for chunk in args.dim_chunks:
        registers, sass = compile_search(chunk)
        loops = level_loops(sass)
        per_level = " / ".join(str(n) for n, _ in loops)
        top = ", ".join(f"{op} {count}" for op, count in loops[0][1].most_common(8)) if loops else ""
        print(f"dim chunk {chunk:>3}: {registers} registers a thread; level loops of {per_level} instructions ({top})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
