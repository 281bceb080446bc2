"""Whether two checkouts' Triton FS-B prefill selections are the same bits (issue 12 A/B of a search-kernel change).

Each checkout runs `fsb_select_cells(q, k, cfg, return_found=True)` in its own process on the same random
bf16 q, k (B 1, H 16 MHA, D 64, the default FS-B config, tau 8 * 1.4 as in s41) and saves the selection and
the found beams; then the two are compared bit for bit and the files are deleted (at 256k they are 1.2 GB).

    python benchmarks/fsb_same_selections.py --roots .ab/pre_s42 . --T 262144
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import freesolo
from freesolo import FreeSoloConfig
from freesolo.backends.triton.fsb_search import fsb_select_cells
T = int(sys.argv[3])
torch.manual_seed(0)
q = torch.randn(1, T, 16, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, T, 16, 64, device="cuda", dtype=torch.bfloat16)
idx, found = fsb_select_cells(q, k, FreeSoloConfig(variant="fsb", tau=8.0 * 1.4), return_found=True)
torch.save((idx.cpu(), found.cpu()), sys.argv[2])
print(freesolo.__file__)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roots", nargs=2, required=True, help="two checkouts (folders holding freesolo/)")
    ap.add_argument("--T", type=int, default=262144)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        saved = []
        for n, root in enumerate(args.roots):
            path = os.path.join(tmp, f"sel{n}.pt")
            subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(root), path, str(args.T)], check=True)
            saved.append(torch.load(path))
        (idx_a, found_a), (idx_b, found_b) = saved
    print(
        f"T={args.T}: selections bitwise equal: {torch.equal(idx_a, idx_b)} | found beams bitwise equal: "
        f"{torch.equal(found_a, found_b)} | selected entries: {int((idx_a >= 0).sum())} | differing selection entries: "
        f"{int((idx_a != idx_b).sum())}"
    )
    return 0 if torch.equal(idx_a, idx_b) and torch.equal(found_a, found_b) else 1


if __name__ == "__main__":
    raise SystemExit(main())
