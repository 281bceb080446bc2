"""Debug the Triton FS-B search on CUDA (issue 12: its first form was wrong there, see the history
in freesolo/backends/triton/fsb_search.py; the rewrite passes every case below on the H200).

Runs the small cases of proofs_tests/test_triton_fsb_search.py (c0-c3 and the L12 "row" case),
each in its own subprocess (a CUDA fault poisons its process) at num_warps 4, 2, 1, with
TRITON_DEBUG=1 (the kernel's device assertions on) and CUDA_LAUNCH_BLOCKING=1, and prints for each
how many (query, head) beams differ from the torch search (CPU and CUDA), the first differing
beams, the first level where one program's beam (`trace_search`) leaves a float64 emulation of
the search, and the assertion lines; then c0 and "row" again without the assertions.

    python benchmarks/fsb_search_debug.py > debug.txt 2>&1      # repository root, ~1 min on an H200
    python benchmarks/fsb_search_debug.py c0 4                   # one case, one num_warps
"""

import os
import subprocess
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "proofs_tests"))

__all__ = ["CASES", "one"]
CASES = {
    "c0": (0, 47, 2, 1, dict(beam=3, leaf_order="content", radius_weight=1.0)),
    "c1": (1, 40, 3, 1, dict(beam=2, leaf_order="position", radius_weight=0.5, top_k=4)),
    "c2": (2, 41, 4, 2, dict(beam=5, leaf_order="content", radius_weight=0.0, sigma=2.0, lam=0.5)),
    "c3": (3, 33, 2, 2, dict(beam=1, leaf_order="content", radius_weight=1.0, top_k=2)),
    "row": None,
}


def one(name, nw):
    """Run case `name` at num_warps `nw` and print how its beams compare with the torch search."""
    import numpy as np
    import test_triton_fsb_search as tt
    import torch

    from freesolo.backends.triton.fsb_search import fsb_select_cells

    if name == "row":
        rng = np.random.default_rng(7)
        T, Hq, Hkv, D = 40, 2, 1, 8
        q, k = rng.standard_normal((2, T, Hq, D)), rng.standard_normal((2, T, Hkv, D))
        q[1] *= 1e3
        k[1] *= 1e3
        cfg = tt._cfg(k[:1], beam=2)
    else:
        seed, T, Hq, Hkv, kw = CASES[name]
        rng = np.random.default_rng(seed)
        q, k = rng.standard_normal((1, T, Hq, 8)), rng.standard_normal((1, T, Hkv, 8))
        cfg = tt._cfg(k, **kw)
    qt, kt = tt._tensors(q, k)
    idx, found = fsb_select_cells(qt, kt, cfg, return_found=True, num_warps=nw)
    torch.cuda.synchronize()
    ref_cpu = tt.torch_beams(qt.cpu(), kt.cpu(), cfg)
    ref_gpu = tt.torch_beams(qt, kt, cfg).cpu()
    f = found.cpu()
    bad = (f != ref_cpu).any(-1)
    print(
        f"{name} nw={nw}: beams differ from torch CPU at {int(bad.sum())} of {bad.numel()}; from torch CUDA at {int((f != ref_gpu).any(-1).sum())}; torch CUDA vs CPU {int((ref_gpu != ref_cpu).any(-1).sum())}"
    )
    for b, t, h in bad.nonzero().tolist()[:4]:
        print("   ", (b, t, h), "triton", f[b, t, h].tolist(), "torch", ref_cpu[b, t, h].tolist())
    # the first differing program (else c0's query 37, head 1), level by level against float64
    b, t, h = (bad.nonzero().tolist() or [[0, min(37, qt.shape[1] - 1), min(1, qt.shape[2] - 1)]])[0]
    try:
        levels = tt.assert_trace_matches(qt, kt, cfg, b, t, h, num_warps=nw)
        print(f"    trace of {(b, t, h)}: {levels} levels equal to the float64 emulation")
    except AssertionError as error:
        print(f"    trace of {(b, t, h)} diverges: {str(error).splitlines()[0][:400]}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1], int(sys.argv[2]))
        raise SystemExit(0)
    env = dict(os.environ, TRITON_DEBUG="1", CUDA_LAUNCH_BLOCKING="1")
    for name in CASES:
        for nw in (4, 2, 1):
            r = subprocess.run([sys.executable, __file__, name, str(nw)], env=env, capture_output=True, text=True)
            print(r.stdout.strip())
            if r.returncode:
                print(
                    "  rc",
                    r.returncode,
                    "\n  "
                    + "\n  ".join(r.stderr.strip().splitlines()[-3:])
                    + "\n  asserts: "
                    + " | ".join(
                        sorted(
                            set(
                                l.strip()[:200]
                                for l in (r.stdout + r.stderr).splitlines()
                                if "FS-B search" in l or "Assertion" in l
                            )
                        )[:6]
                    ),
                )
    # without debug (asserts off) for comparison
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for name in ("c0", "row"):
        r = subprocess.run([sys.executable, __file__, name, "4"], env=env, capture_output=True, text=True)
        print("nodebug", r.stdout.strip())
        if r.returncode:
            print("  rc", r.returncode, "\n  " + "\n  ".join(r.stderr.strip().splitlines()[-6:]))
