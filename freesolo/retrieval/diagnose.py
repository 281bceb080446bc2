"""Why did a FreeSolo model miss a needle? Per layer and head, at the query that predicts the first answer token.

For one sample and the position `p = answer_start - 1`:
- `local`: the needle (first answered) lies inside the local window of `p` (the long branch is not needed);
- `available`: some needle cell is complete and available to `p`'s query block (spec §3);
- `in_candidates` [layer][kv head]: a needle cell is in the candidate set (FS: every available cell; FS-L:
  recent + high-norm pool, spec §5; FS-B: the selection is all we see, so None);
- `selected` [layer][query head]: a needle cell is among the top-K read (`freesolo.select_cells`);
- `mass` [layer][query head]: the long branch's softmax mass on the needle's tokens (0 when not selected);
- `norm_pct` [layer][kv head]: percentile of the needle cell's max key norm a_c among the available cells
  (FS-L's pool keeps the top-P by a_c: a needle needs a high percentile to survive long contexts).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["diagnose_sample", "summarize"]


def _fsl_candidates(a: np.ndarray, n_avail: int, pool: int, recent: int) -> set:
    """FS-L candidate cells of one kv head: a [C] max key norms, cells [0, n_avail) available (spec §5)."""
    r0 = max(0, n_avail - recent)
    older = np.arange(r0)
    order = sorted(older.tolist(), key=lambda c: (-a[c], -c))[:pool]  # larger a first, then more recent
    return set(order) | set(range(r0, n_avail))


def diagnose_sample(model, sample, device) -> dict:
    """Diagnosis of `sample` under `model` (a FreeSoloLM with FreeSolo attention). Plain JSON-able dict."""
    import torch

    from freesolo import select_cells
    from freesolo.nn import FreeSoloAttention

    layers = [layer for layer in model.layers if isinstance(layer.self_attn, FreeSoloAttention)]
    if not layers:
        raise ValueError(f"attention={model.config.attention!r}: diagnosis needs FreeSolo attention layers")
    captured = {}

    def hook(i):
        def pre(module, args, kwargs):
            captured[i] = args[0].detach()

        return pre

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    p = sample.answer_start - 1
    tokens = torch.as_tensor(sample.tokens[None, : p + 1], device=device)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    cfg0 = layers[0].self_attn.cfg
    s, Bq = cfg0.cell, cfg0.block
    a_tok, b_tok = sample.evidence[0]
    n_avail = (p // Bq) * Bq // s
    needle_cells = [c for c in range(a_tok // s, (b_tok - 1) // s + 1) if c < n_avail]
    out = {
        "p": int(p),
        "local": bool(p - a_tok < cfg0.window),
        "available": bool(needle_cells),
        "in_candidates": [],
        "selected": [],
        "mass": [],
        "norm_pct": [],
    }
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        cfg = attn.cfg
        with torch.no_grad():
            q, k, _ = attn.qkv(captured[i].float())  # (1, p+1, H, D), unrotated
            q, k = q.float(), k.float()
            idx = select_cells(q, k, cfg)[0, p]  # (Hq, K)
        Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
        C = (p + 1) // s
        kc = k[0, : C * s].view(C, s, Hkv, D)
        a = kc.norm(dim=-1).amax(dim=1).cpu().numpy()  # (C, Hkv): max key norm per cell
        sel, mass = [], []
        for h in range(Hq):
            g = h // (Hq // Hkv)
            cells = [int(c) for c in idx[h].tolist() if c >= 0]
            hit = any(c in needle_cells for c in cells)
            sel.append(bool(hit))
            if not hit:
                mass.append(0.0)
                continue
            toks = torch.cat([torch.arange(c * s, (c + 1) * s, device=k.device) for c in cells])
            logits = (k[0, toks, g] @ q[0, p, h]) / math.sqrt(D)
            w = torch.softmax(logits, dim=0)
            in_needle = (toks >= a_tok) & (toks < b_tok)
            mass.append(float(w[in_needle].sum()))
        cand, pct = [], []
        for g in range(Hkv):
            if not needle_cells:
                cand.append(False)
                pct.append(None)
                continue
            av = a[:n_avail, g]
            best = max(av[c] for c in needle_cells)
            pct.append(float((av < best).mean()))
            if cfg.variant == "fs":
                cand.append(True)
            elif cfg.variant == "fsl":
                pool = _fsl_candidates(av, n_avail, cfg.pool, cfg.recent)
                cand.append(any(c in pool for c in needle_cells))
            else:
                cand.append(None)
        out["in_candidates"].append(cand)
        out["selected"].append(sel)
        out["mass"].append(mass)
        out["norm_pct"].append(pct)
    return out


def summarize(diag: list) -> dict:
    """Aggregate diagnoses (each with `correct`): for failed and correct samples, the fraction whose needle
    was available, in some head's candidates, selected by some head, the mean best mass, and per layer the
    median needle-norm percentile."""

    def agg(items):
        if not items:
            return None
        avail = [d for d in items if d["available"]]
        out = {
            "n": len(items),
            "local": float(np.mean([d["local"] for d in items])),
            "available": len(avail) / len(items),
        }
        if avail:
            known = [d for d in avail if all(x is not None for row in d["in_candidates"] for x in row)]
            out["in_candidates_any"] = float(np.mean([any(x for row in d["in_candidates"] for x in row) for d in known])) if known else None
            out["selected_any"] = float(np.mean([any(x for row in d["selected"] for x in row) for d in avail]))
            out["best_mass"] = float(np.mean([max(max(row) for row in d["mass"]) for d in avail]))
            n_layers = len(avail[0]["norm_pct"])
            out["norm_pct_by_layer"] = [
                float(np.median([max(x for x in d["norm_pct"][i] if x is not None) for d in avail])) for i in range(n_layers)
            ]
            out["selected_by_layer"] = [float(np.mean([any(d["selected"][i]) for d in avail])) for i in range(n_layers)]
        return out

    return {"failed": agg([d for d in diag if not d["correct"]]), "correct": agg([d for d in diag if d["correct"]])}
