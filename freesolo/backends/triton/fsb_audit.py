"""A float64 emulation of the FS-B search (spec §6.4-§6.5) for one query, and a near-tie audit.

Two FS-B searches on the same tables (the torch backend's `beam_search_forests`, the Triton
kernel of `fsb_search`) evaluate node keys and rerank scores in float32 in different orders, so
their selections may differ where two candidates' scores are closer than float32 rounding (spec
§13: selections differ only at near-ties). `near_tie_audit` checks that claim entry by entry: for
a (row, query, head) it replays the search in float64 on the same tables and reports the smallest
margin the search passed: at each level, the key of the last node kept in the beam minus the key of
the first node dropped; in the rerank, the smallest rho gap between consecutive cells among the
best K + 1 found (the selection's set and its order by rho). A selection difference at an entry
whose margins are all wide would be a defect, not a tie.

Both functions run on the CPU in float64 from tables built on any device; they are for tests and
benchmarks (a few entries at a time), not for production paths.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...config import FreeSoloConfig

__all__ = ["emulate_search", "near_tie_audit"]


def emulate_search(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, row: int, i: int, hq: int, forests=None):
    """Spec §6.4's level-wise beam search of query i, query head hq, batch row `row`, in float64 on
    the torch backend's tables (`build_row_forests`, float32 statistics as both searches use).

    Args:
        q: [B, T, Hq, D], k: [B, T, Hkv, D] (any float dtype and device: taken to float32 first,
            like the searches); forests: `build_row_forests(k[row] heads first, cfg, outward=True)`
            when the caller already has it (it is the costly part at long T).
    Returns a list per forest (all cells, high-norm cells) of levels, top level first; each level
    is a dict with "beam": [(index in level, key)] in beam order (key desc, index asc), "margin":
    key of the last kept node minus key of the first dropped one (inf when none is dropped), and
    "cells": at the leaf level, the cells of the beam's leaves.
    """
    from ..torch.fsb import build_row_forests, level_offset

    Hq, D = q.shape[2], q.shape[3]
    h = hq // (Hq // k.shape[2])
    if forests is None:
        forests = build_row_forests(k[row : row + 1].float().permute(0, 2, 1, 3).contiguous(), cfg, outward=True)
    tables, high_prefix = forests
    mu, rad, A, e, cell = (getattr(tables, n)[0, h].double().cpu().numpy() for n in ("mu", "rad", "A", "e", "cell"))
    base = tables.base.cpu().numpy()
    qv = q[row, i, hq].float().double().cpu().numpy()
    qn = float(np.linalg.norm(qv))
    sig, lam = cfg.per_head("sigma", Hq)[hq], cfg.per_head("lam", Hq)[hq]
    n_all = (i // cfg.block) * cfg.block // cfg.cell
    counts = [n_all, int(high_prefix[0, h, n_all])]

    def key(f):
        prior = lam * A[f] * math.erf(sig * (i - e[f]) / (2 * cfg.cell))
        return D**-0.5 * (float(mu[f] @ qv) + cfg.radius_weight * qn * rad[f]) + prior

    traces = []
    for forest, n in enumerate(counts):
        levels, frontier = [], []  # frontier: (tree base, tree height, tree start, index in level)
        for lvl in range(n.bit_length() - 1, -1, -1):
            cands = [(tb, th, ts, 2 * ix + c) for tb, th, ts, ix in frontier for c in (0, 1)]
            if (n >> lvl) & 1:
                ts = (n >> (lvl + 1)) << (lvl + 1)
                cands.append((int(base[forest, lvl]) + (ts >> lvl) * ((2 << lvl) - 1), lvl, ts, 0))
            scored = []
            for tb, th, ts, ix in cands:
                flat = tb + level_offset(th, lvl) + ix
                scored.append((key(flat), (ts >> lvl) + ix, (tb, th, ts, ix), flat))
            scored.sort(key=lambda x: (-x[0], x[1]))
            kept = scored[: cfg.beam]
            margin = kept[-1][0] - scored[cfg.beam][0] if len(scored) > cfg.beam else math.inf
            frontier = [node for _, _, node, _ in kept]
            level = {"beam": [(g, kv) for kv, g, _, _ in kept], "margin": margin}
            if lvl == 0:
                level["cells"] = [int(cell[flat]) for _, _, _, flat in kept]
            levels.append(level)
        traces.append(levels)
    return traces


def _rerank(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, row: int, i: int, hq: int, cells):
    """Spec §6.5 / §7 in float64 over the found cells: (selection, margin). selection: the top-K
    distinct cells by (rho desc, c desc), -1 padded, rho = logsumexp over the cell's tokens of
    q . k / sqrt(D); margin: the smallest rho gap between consecutive cells among the best
    min(K + 1, found), the gaps that decide the selection's set (K-th vs (K+1)-th) and its order
    (inf when fewer than two cells were found)."""
    found = sorted(set(c for c in cells if c >= 0))
    D = q.shape[3]
    h = hq // (q.shape[2] // k.shape[2])
    qv = q[row, i, hq].float().double().cpu()
    scored = []
    for c in found:
        keys = k[row, c * cfg.cell : (c + 1) * cfg.cell, h].float().double().cpu()
        scored.append((float(torch.logsumexp(keys @ qv * D**-0.5, 0)), c))
    scored.sort(key=lambda x: (-x[0], -x[1]))
    selection = [c for _, c in scored[: cfg.top_k]] + [-1] * max(0, cfg.top_k - len(scored))
    rho = [r for r, _ in scored[: cfg.top_k + 1]]
    margin = min((a - b for a, b in zip(rho, rho[1:])), default=math.inf)
    return selection, margin


def near_tie_audit(q: torch.Tensor, k: torch.Tensor, cfg: FreeSoloConfig, entries) -> list[dict]:
    """The float64 margins of the FS-B search at each entry (row, i, hq) of `entries`.

    Returns one dict per entry: row, i, hq, "beam_margin" (the smallest level margin over both
    forests), "rerank_margin" (`_rerank` over the float64 beams' cells: set and order), "margin"
    (the smaller) and "selection" (the float64 search's selection, K cells, -1 padded). A float32
    search can only disagree with another at an entry whose margin is within float32 rounding of
    the keys (~1e-5 for keys of order 1-10).
    """
    from ..torch.fsb import build_row_forests

    out, forests = [], {}
    for row, i, hq in entries:
        if row not in forests:
            forests[row] = build_row_forests(
                k[row : row + 1].float().permute(0, 2, 1, 3).contiguous(), cfg, outward=True
            )
        traces = emulate_search(q, k, cfg, row, i, hq, forests=forests[row])
        margins = [lvl["margin"] for levels in traces for lvl in levels]
        cells = [c for levels in traces if levels for c in levels[-1]["cells"]]
        beam_margin = min(margins, default=math.inf)
        selection, rerank_margin = _rerank(q, k, cfg, row, i, hq, cells)
        out.append(
            {
                "row": int(row),
                "i": int(i),
                "hq": int(hq),
                "beam_margin": beam_margin,
                "rerank_margin": rerank_margin,
                "margin": min(beam_margin, rerank_margin),
                "selection": selection,
            }
        )
    return out
