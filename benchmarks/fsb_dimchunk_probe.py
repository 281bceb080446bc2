"""Why `test_cuda_dim_chunks_differ_at_near_ties_only` failed in s41 call4 (issue 12): at the one entry whose
float64 margin was wide, do the selections differ, or only the order of the found beams?

The test's setup (seed 2, T 16384, Hq 8, Hkv 2, D 64, bf16, paper config): the search with node rows read
16 dims at a time against all of D at once, on the forests of `fsb_search.forests_mode()`. Prints, per
differing (row, i, hq) entry: whether the selections differ, whether the found beams differ as ordered
lists and as sets, and the float64 audit's margins.
    python benchmarks/fsb_dimchunk_probe.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.triton import fsb_search  # noqa: E402
from freesolo.backends.triton.fsb_audit import near_tie_audit  # noqa: E402


def main() -> int:
    torch.manual_seed(2)
    T, Hq, Hkv, D = 16384, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    runs = {}
    for chunk in (None, 16):
        fsb_search.SEARCH_DIM_CHUNK = chunk
        runs[chunk] = fsb_search.fsb_select_cells(q, k, cfg, return_found=True)
    (ref, ref_found), (idx, found) = runs[None], runs[16]
    sel = (idx != ref).any(-1)
    ordered = (found != ref_found).any(-1)
    as_sets = (found.sort(-1).values != ref_found.sort(-1).values).any(-1)
    print(f"forests {fsb_search.forests_mode()}: selections differ at {int(sel.sum())}, found beams (ordered) at "
          f"{int(ordered.sum())}, found beams (sets) at {int(as_sets.sum())} of {sel.numel()} entries")
    entries = [tuple(int(x) for x in e) for e in (sel | ordered).nonzero()[:64].tolist()]
    for r, e in zip(near_tie_audit(q, k, cfg, entries), entries):
        print(f"  {e}: selection differs {bool(sel[e])}, beams ordered {bool(ordered[e])}, sets {bool(as_sets[e])}, "
              f"beam margin {r['beam_margin']:.3g}, rerank margin {r['rerank_margin']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
