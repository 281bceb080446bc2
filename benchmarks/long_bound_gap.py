"""How far the Cauchy-Schwarz bound of the long branch's logits sits above their actual maximum, on
a trained model's q / k and on iid Gaussian q / k of the same shape.

The Triton long kernel takes, per query i and query head h, a softmax over the tokens of the
query's selected cells (NoPE, unrotated): s_t = scale * q_i . k_t, scale = 1 / sqrt(D). A fixed
per-row offset in place of the online softmax would be

    m_b = scale * ||q_i|| * max_{c selected by (i, h)} a_c,    a_c = max_{t in cell c} ||k_t||_2,

an upper bound of every logit of the row. It is numerically safe only while the gap
m_b - max_t s_t (nats) stays below about 69.3 nats (100 binades: exp(-gap) of the largest term
still representable; beyond that the fallback path runs). This script measures that gap for every
(position, head) that selects at least one cell.

The FS-L checkpoint of the extrapolation study (`results/checkpoints/ckpt_fsl`, trained at 1k
tokens, cell 16, pool 32 + 4 recent) reads an S-NIAH-1 sample; every layer's unrotated q / k are
captured at the attention call (`union_real_keys.capture_qk`) and selected again (torch backend)
with the model's config and with the library default (cell 32, pool 64 + 8 recent, block 64).
"iid" keys: torch.randn q and k of the same shapes (seeded by layer), selected the same way.
Reports per (config, layer, keys): mean, p50, p99, p99.9 and max gap, and the fractions of rows
with gap > 44 and > 69.3 nats.

s28 tried that offset in the Triton long kernel (a row far below its bound redone by the online
loop in the same kernel): on the H200 (bf16, FS-L 64k) the kernel went from 122 to 160 registers
and from 0.534 to 0.583 ms, so it was removed (results/session_2026-12-03_s28/call1). These gaps
(<= 37.8 nats on the trained keys, <= 38.8 for the local window) say the offset itself is safe for
this model: the cost was the second loop's registers, not the numerics.

`--branch local` measures the same for the local (RoPE window) kernel: per query i and head h,
s_t = scale * rope(q_i, i) . rope(k_t, t) over the window keys i - w < t <= i (w = cfg.window,
half-split RoPE, theta cfg.rope_theta), and the fixed offset

    m_b = scale * ||q_i|| * max ||k_t||  over every key of the 64-aligned key tiles the kernel
          visits for the 64-query tile holding i: keys floor(max(0, 64 j - w + 1) / 64) * 64 ..
          min(T - 1, 64 j + 63), j = floor(i / 64)

(RoPE preserves norms; the set includes keys after i on the diagonal tile). Every (position, head)
has a window, so every row counts. Same configs (window 128 for the model, 512 for the library
default), same keys (model / iid), same statistics; no cell selection runs. Each record carries
"branch" ("long" or "local"). `--check` compares the vectorized local gap with a per-row loop on a
small random case and exits. CPU only:

    python benchmarks/long_bound_gap.py --branch long --length 16384 --out benchmarks/results/long_bound_gap_16k.json
    python benchmarks/long_bound_gap.py --branch long --length 65536 --out benchmarks/results/long_bound_gap_64k.json
    python benchmarks/long_bound_gap.py --branch local --length 16384 --out benchmarks/results/local_bound_gap_16k.json
    python benchmarks/long_bound_gap.py --branch local --length 65536 --out benchmarks/results/local_bound_gap_64k.json
    python benchmarks/long_bound_gap.py --check
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import freesolo  # noqa: E402
from freesolo.backends.torch._ops import rope, rope_tables  # noqa: E402
from union_real_keys import checkpoint_layers, key_kinds, save_payload  # noqa: E402

__all__ = ["bound_gaps", "gap_stats", "local_bound_gaps", "local_bound_gaps_loop", "main"]

SAFE_NATS = 100 * math.log(2.0)  # 69.3: 100 binades
WARN_NATS = 44.0
KEY_TILE = 64  # the Triton window kernel's query / key tile


def bound_gaps(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, cell: int, chunk: int = 1024) -> torch.Tensor:
    """q [B, T, Hq, D], k [B, T, Hkv, D], idx int [B, T, Hq, K] (-1 padded) -> gap m_b - max_t s_t
    (float64, nats) of every (b, position, head) with at least one selected cell, flattened.

    s_t = q . k_t / sqrt(D) over the tokens of the selected cells; m_b = ||q|| / sqrt(D) * max a_c
    over the selected cells, a_c = max_{t in c} ||k_t||. Positions are processed `chunk` at a time."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    n_cells = -(-T // cell)
    pad = n_cells * cell - T
    k_pad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)) if pad else k  # zero keys past T
    k_cells = k_pad.reshape(B, n_cells, cell, Hkv, D).permute(0, 3, 1, 2, 4).contiguous()  # [B, Hkv, C, cell, D]
    a = k_cells.norm(dim=-1).amax(dim=-1)  # [B, Hkv, C]
    kv_of = (torch.arange(Hq) // group)[None, :, None]  # [1, Hq, 1]
    gaps = []
    for b in range(B):
        for t0 in range(0, T, chunk):
            sel = idx[b, t0 : t0 + chunk].long()  # [P, Hq, K]
            valid = sel >= 0
            rows = valid.any(dim=-1)  # [P, Hq]
            if not bool(rows.any()):
                continue
            cc = sel.clamp(min=0)
            qc = q[b, t0 : t0 + chunk]  # [P, Hq, D]
            keys = k_cells[b][kv_of, cc]  # [P, Hq, K, cell, D]
            logits = torch.einsum("phd,phkcd->phkc", qc, keys) * scale
            logits = logits.masked_fill(~valid[..., None], float("-inf"))
            s_max = logits.amax(dim=(-2, -1))  # [P, Hq]
            a_sel = a[b][kv_of, cc].masked_fill(~valid, float("-inf")).amax(dim=-1)  # [P, Hq]
            m_b = scale * qc.norm(dim=-1) * a_sel
            gaps.append((m_b.double() - s_max.double())[rows])
    return torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)


def _tile_window_bound(k: torch.Tensor, window: int, tile: int) -> torch.Tensor:
    """k [B, T, Hkv, D] -> [B, Hkv, ceil(T / tile)]: per query tile j, the max key norm over the
    key tiles floor(max(0, tile j - window + 1) / tile) .. j (keys up to min(T - 1, tile j + tile - 1))."""
    B, T, Hkv, D = k.shape
    n_tiles = -(-T // tile)
    norms = k.double().norm(dim=-1).permute(0, 2, 1)  # [B, Hkv, T]
    pad = n_tiles * tile - T
    if pad:
        norms = torch.nn.functional.pad(norms, (0, pad), value=float("-inf"))  # no key past T
    tile_max = norms.reshape(B, Hkv, n_tiles, tile).amax(dim=-1)  # [B, Hkv, NT]
    j = torch.arange(n_tiles)
    lo = (tile * j - window + 1).clamp(min=0) // tile  # first key tile of query tile j
    c = torch.arange(n_tiles)
    visit = (c[None, :] >= lo[:, None]) & (c[None, :] <= j[:, None])  # [NT_q, NT_k]
    return tile_max[:, :, None, :].masked_fill(~visit, float("-inf")).amax(dim=-1)  # [B, Hkv, NT_q]


def local_bound_gaps(q: torch.Tensor, k: torch.Tensor, window: int, theta: float, tile: int = KEY_TILE,
                     chunk: int = 1024) -> torch.Tensor:  # fmt: skip
    """q [B, T, Hq, D], k [B, T, Hkv, D] (unrotated) -> gap m_b - max_t s_t (float64, nats) of every
    (b, position, head), flattened in (b, position, head) order.

    s_t = scale * rope(q_i, i) . rope(k_t, t) over i - window < t <= i, scale = 1 / sqrt(D);
    m_b = scale * ||q_i|| * the max key norm over the key tiles the window kernel visits for the
    `tile`-query tile holding i (`_tile_window_bound`). Queries are processed `chunk` at a time."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    cos, sin = rope_tables(T, D, theta, q.device, torch.float32)
    q_rot = rope(q.float().permute(0, 2, 1, 3), cos, sin)  # [B, Hq, T, D]
    k_rot = rope(k.float().permute(0, 2, 1, 3), cos, sin).repeat_interleave(group, dim=1)  # [B, Hq, T, D]
    bound = _tile_window_bound(k, window, tile).repeat_interleave(group, dim=1)  # [B, Hq, NT]
    q_norm = q.double().norm(dim=-1).permute(0, 2, 1)  # [B, Hq, T]
    gaps = []
    for p0 in range(0, T, chunk):
        p1 = min(T, p0 + chunk)
        k0 = max(0, p0 - window + 1)
        logits = torch.einsum("bhpd,bhld->bhpl", q_rot[:, :, p0:p1], k_rot[:, :, k0:p1]) * scale
        i = torch.arange(p0, p1)[:, None]
        t = torch.arange(k0, p1)[None, :]
        in_window = (t <= i) & (t > i - window)  # [P, L]
        s_max = logits.masked_fill(~in_window, float("-inf")).amax(dim=-1).double()  # [B, Hq, P]
        m_b = scale * q_norm[:, :, p0:p1] * bound[:, :, torch.arange(p0, p1) // tile]
        gaps.append(m_b - s_max)
    return torch.cat(gaps, dim=2).permute(0, 2, 1).reshape(-1)  # (b, position, head) order


def local_bound_gaps_loop(q: torch.Tensor, k: torch.Tensor, window: int, theta: float,
                          tile: int = KEY_TILE) -> torch.Tensor:  # fmt: skip
    """Per-row reference of `local_bound_gaps` (float64, one row at a time)."""
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    scale = 1.0 / math.sqrt(D)
    cos, sin = rope_tables(T, D, theta, q.device, torch.float64)
    out = []
    for b in range(B):
        for i in range(T):
            j = i // tile
            first = (max(0, tile * j - window + 1) // tile) * tile
            last = min(T - 1, tile * j + tile - 1)
            for h in range(Hq):
                kv = h // group
                qi = rope(q[b, i, h].double()[None], cos[i : i + 1], sin[i : i + 1])[0]
                s = max(float(qi @ rope(k[b, t, kv].double()[None], cos[t : t + 1], sin[t : t + 1])[0]) * scale
                        for t in range(max(0, i - window + 1), i + 1))  # fmt: skip
                a = max(float(k[b, t, kv].double().norm()) for t in range(first, last + 1))
                out.append(scale * float(q[b, i, h].double().norm()) * a - s)
    return torch.tensor(out, dtype=torch.float64)


def check_local(T: int = 300, window: int = 32, theta: float = 10000.0) -> None:
    """Vectorized local gap against the per-row loop on random q / k (GQA, T not a tile multiple)."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for T_, w, chunk in ((T, window, 1024), (T, window, 50), (T, 100, 64), (T, 128, 77)):
        q = torch.randn(1, T_, 4, 16, generator=g) * 3
        k = torch.randn(1, T_, 2, 16, generator=g) * torch.rand(1, T_, 2, 1, generator=g) * 4
        fast = local_bound_gaps(q, k, w, theta, chunk=chunk)
        ref = local_bound_gaps_loop(q, k, w, theta)
        err = float((fast - ref).abs().max())
        worst = max(worst, err)
        print(f"check T {T_} window {w} chunk {chunk}: rows {ref.numel()} max |fast - loop| {err:.2e} nats "
              f"(gap mean {float(ref.mean()):.2f}, min {float(ref.min()):.3f})", flush=True)  # fmt: skip
        assert fast.shape == ref.shape and err < 1e-4, err
    print(f"local gap check passed (worst {worst:.2e} nats)")


def gap_stats(gaps: torch.Tensor) -> dict:
    """Summary of a 1-D tensor of gaps (nats)."""
    g = gaps.numpy()
    if g.size == 0:
        return {"rows": 0}
    p50, p99, p999 = np.percentile(g, [50, 99, 99.9])
    return {"rows": int(g.size), "gap_mean": float(g.mean()), "gap_p50": float(p50), "gap_p99": float(p99),
            "gap_p99_9": float(p999), "gap_max": float(g.max()), "gap_min": float(g.min()),
            "frac_gt_44": float((g > WARN_NATS).mean()), "frac_gt_69_3": float((g > SAFE_NATS).mean())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=os.path.join(os.path.dirname(__file__), "results", "checkpoints", "ckpt_fsl"))
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--branch", choices=("long", "local", "both"), default="both")
    ap.add_argument("--check", action="store_true", help="verify the vectorized local gap on a small case, exit")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.check:
        check_local()
        return
    if args.out is None:
        ap.error("--out is required (unless --check)")
    branches = ("long", "local") if args.branch == "both" else (args.branch,)
    start = time.perf_counter()
    model, layers = checkpoint_layers(args.ckpt, args.task, args.length)
    model_cfg = model.config.freesolo
    default_cfg = freesolo.FreeSoloConfig(variant="fsl")
    configs = {f"model config (cell {model_cfg.cell}, pool {model_cfg.pool} + {model_cfg.recent})": model_cfg,
               f"library default (cell {default_cfg.cell}, pool {default_cfg.pool} + {default_cfg.recent})": default_cfg}  # fmt: skip
    records = []
    seconds = {"capture": time.perf_counter() - start}
    for branch in branches:
        t_branch = time.perf_counter()
        for cfg_name, cfg in configs.items():
            for layer, (q, k) in enumerate(layers):
                for keys_name, (qq, kk) in key_kinds(layer, q, k):
                    rec = {"branch": branch, "config": cfg_name, "layer": layer, "keys": keys_name, "T": int(q.shape[1])}
                    if branch == "long":
                        idx = torch.as_tensor(freesolo.select_cells(qq, kk, cfg, backend="torch")).contiguous()
                        with torch.no_grad():
                            gaps = bound_gaps(qq, kk, idx, cfg.cell)
                        rec.update(cell=cfg.cell, K=cfg.top_k)
                    else:
                        with torch.no_grad():
                            gaps = local_bound_gaps(qq, kk, cfg.window, cfg.rope_theta)
                        rec.update(window=cfg.window, tile=KEY_TILE, rope_theta=cfg.rope_theta)
                    rec.update(gap_stats(gaps))
                    records.append(rec)
                    r = rec
                    tag = f"{branch:5s} {cfg_name:42s} layer {layer} {keys_name:5s}"
                    if r["rows"] == 0:
                        print(f"{tag}: no row selects a cell", flush=True)
                        continue
                    print(f"{tag}: rows {r['rows']} gap mean {r['gap_mean']:.2f} "
                          f"p50 {r['gap_p50']:.2f} p99 {r['gap_p99']:.2f} p99.9 {r['gap_p99_9']:.2f} max {r['gap_max']:.2f} "
                          f"nats; >44 {r['frac_gt_44']:.2e} >69.3 {r['frac_gt_69_3']:.2e}", flush=True)  # fmt: skip
        seconds[branch] = time.perf_counter() - t_branch
    elapsed = time.perf_counter() - start
    payload = {"ckpt": os.path.relpath(args.ckpt), "task": args.task, "length": args.length, "branches": list(branches),
               "torch": torch.__version__, "safe_nats": SAFE_NATS, "warn_nats": WARN_NATS, "seconds": elapsed,
               "seconds_by_stage": seconds, "records": records}  # fmt: skip
    save_payload(args.out, payload)
    print(f"({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
