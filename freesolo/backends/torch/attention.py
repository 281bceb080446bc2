"""FreeSolo readout of the torch backend with a chunked, recomputing autograd (spec §2, §7, §8).

Per chunk of `nb` query blocks (queries [i0, i1)):
- local branch: the keys [i0 - w + 1, i0 + nb*Bq) of the chunk, unfolded into one banded window
  of Bq + w - 1 keys per block; logits [B, Hkv, G, nb, Bq, Bq + w - 1], never T x T;
- long branch: the tokens of the selected cells gathered into [B, Hkv, G, L, K*s, D];
- o = o_loc + beta * rmsnorm(o_long).
Forward keeps only the inputs; backward recomputes one chunk at a time under autograd and
scatters the chunk's gradients into full-size buffers, so peak memory is O(T) plus one chunk.
Selection indices are constants (no gradient).
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig

__all__ = ["FreeSoloReadout", "chunk_forward", "readout_bytes_per_query"]


def readout_bytes_per_query(B: int, Hq: int, D: int, cfg: FreeSoloConfig, itemsize: int) -> int:
    """Transient bytes per query position of one readout chunk, backward recomputation included."""
    local = 6 * (cfg.block + cfg.window)  # logits, mask, probabilities and their gradients
    long = 4 * cfg.top_k * cfg.cell * (D + 2)  # gathered k, v, their gradients, logits
    return B * Hq * itemsize * (local + long)


def _local_mask(j0: int, nb: int, cfg: FreeSoloConfig, device) -> torch.Tensor:
    """[nb, Bq, Bq + w - 1] bool: query row r of block j sees window key u (token j*Bq - w + 1 + u)."""
    Bq, w = cfg.block, cfg.window
    r = torch.arange(Bq, device=device)[:, None]
    u = torch.arange(Bq + w - 1, device=device)[None, :]
    band = (u >= r) & (u <= r + w - 1)  # i - w < t <= i
    first = (torch.arange(j0, j0 + nb, device=device) * Bq - w + 1)[:, None] + u  # (nb, Bq+w-1) token of key u
    return band[None] & (first >= 0)[:, None, :]


def chunk_forward(qr, q, kr_span, v_span, k_sel, v_sel, sel_valid, beta, j0: int, pad_front: int, cfg: FreeSoloConfig):
    """One chunk of the readout; differentiable in qr, q, kr_span, v_span, k_sel, v_sel, beta.

    Args:
        qr, q: [B, Hkv, G, L, D] rotated / unrotated queries of positions [j0*Bq, j0*Bq + L).
        kr_span, v_span: [B, Hkv, S, D] rotated keys / values of tokens [max(0, j0*Bq - w + 1), ...),
            S <= L + w - 1 (the chunk pads zeros for missing tokens: they are masked out).
        k_sel, v_sel: [B, Hkv, G, L, K*s, D] unrotated keys / values of the selected cells' tokens.
        sel_valid: [B, Hkv, G, L, K*s] bool (False for -1 padding).
        beta: [Hkv, G]. pad_front: zero keys before kr_span (the window start is before token 0).
    Returns:
        o [B, Hkv, G, L, D] in the compute dtype.
    """
    B, Hkv, G, L, D = q.shape
    Bq, w = cfg.block, cfg.window
    nb = -(-L // Bq)
    scale = D**-0.5
    # ---- local branch: banded windows per block
    pad_q = nb * Bq - L
    qb = torch.nn.functional.pad(qr, (0, 0, 0, pad_q)) if pad_q else qr
    qb = qb.reshape(B, Hkv, G, nb, Bq, D)  # (B, Hkv, G, nb, Bq, D)
    pad_back = nb * Bq + w - 1 - pad_front - kr_span.shape[2]
    kp = torch.nn.functional.pad(kr_span, (0, 0, pad_front, pad_back))  # (B, Hkv, nb*Bq + w - 1, D)
    vp = torch.nn.functional.pad(v_span, (0, 0, pad_front, pad_back))
    kw = kp.unfold(2, Bq + w - 1, Bq).transpose(-1, -2)  # (B, Hkv, nb, Bq+w-1, D)
    vw = vp.unfold(2, Bq + w - 1, Bq).transpose(-1, -2)
    logits = torch.einsum("bhgnqd,bhnkd->bhgnqk", qb, kw) * scale  # (B, Hkv, G, nb, Bq, Bq+w-1)
    logits = logits.masked_fill(~_local_mask(j0, nb, cfg, q.device), float("-inf"))
    p = torch.softmax(logits, dim=-1)
    o_loc = torch.einsum("bhgnqk,bhnkd->bhgnqd", p, vw).reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
    # ---- long branch: NoPE softmax over the selected tokens
    lg = torch.einsum("bhgld,bhglnd->bhgln", q, k_sel) * scale  # (B, Hkv, G, L, K*s)
    lg = lg.masked_fill(~sel_valid, float("-inf"))
    mx = lg.detach().amax(dim=-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # rows with no cell: 0
    e = torch.exp(lg - mx)  # masked entries: exp(-inf) = 0
    den = e.sum(dim=-1, keepdim=True)
    o_long = torch.einsum("bhgln,bhglnd->bhgld", e, v_sel) / torch.where(den > 0, den, torch.ones_like(den))
    rms = torch.rsqrt((o_long * o_long).mean(dim=-1, keepdim=True) + cfg.eps)
    return o_loc + beta.view(1, Hkv, G, 1, 1) * (o_long * rms)


class _Chunk:
    """Index bookkeeping of one chunk: query range, key span, gather indices."""

    def __init__(self, j0, j1, T, cfg, idx, s):
        Bq, w = cfg.block, cfg.window
        self.j0 = j0
        self.i0, self.i1 = j0 * Bq, min(T, j1 * Bq)
        start = self.i0 - w + 1
        self.lo, self.hi = max(0, start), min(T, j1 * Bq)
        self.pad_front = self.lo - start
        cells = idx[:, :, :, self.i0 : self.i1]  # (B, Hkv, G, L, K)
        B, Hkv, G, L, K = cells.shape
        tok = cells.clamp(min=0)[..., None] * s + torch.arange(s, device=idx.device)  # (B, Hkv, G, L, K, s)
        tok = tok.clamp(max=idx.shape[3] - 1)  # -1 pads read a masked, in-range token
        self.tok = tok.reshape(B, Hkv, G, L, K * s)
        self.valid = (cells >= 0)[..., None].expand(B, Hkv, G, L, K, s).reshape(B, Hkv, G, L, K * s)
        self.bi = torch.arange(B, device=idx.device).view(B, 1, 1, 1, 1)
        self.hi_ = torch.arange(Hkv, device=idx.device).view(1, Hkv, 1, 1, 1)

    def gather(self, x):
        """x [B, Hkv, T, D] -> [B, Hkv, G, L, K*s, D] tokens of the selected cells."""
        return x[self.bi, self.hi_, self.tok]

    def scatter_add(self, dst, src):
        """dst [B, Hkv, T, D] += src [B, Hkv, G, L, K*s, D] at the selected tokens."""
        bi, hi, tok = torch.broadcast_tensors(self.bi, self.hi_, self.tok)
        dst.index_put_((bi, hi, tok), src, accumulate=True)


class FreeSoloReadout(torch.autograd.Function):
    """o = local(qr, kr, v) + beta * rmsnorm(long(q, k, v; idx)), chunked, recomputed in backward.

    forward(qr, kr, q, k, v, beta, idx, cfg, nblocks_per_chunk):
        qr, q: [B, Hkv, G, T, D] rotated / unrotated queries (compute dtype);
        kr, k, v: [B, Hkv, T, D] rotated keys, keys, values; beta [Hkv, G];
        idx: int64 [B, Hkv, G, T, K] selected cells (-1 padded). Returns o [B, Hkv, G, T, D].
    """

    @staticmethod
    def forward(ctx, qr, kr, q, k, v, beta, idx, cfg, nblocks_per_chunk):
        B, Hkv, G, T, D = q.shape
        nblocks = -(-T // cfg.block)
        out = q.new_empty(B, Hkv, G, T, D)
        with torch.no_grad():
            for j0 in range(0, nblocks, nblocks_per_chunk):
                c = _Chunk(j0, min(nblocks, j0 + nblocks_per_chunk), T, cfg, idx, cfg.cell)
                out[:, :, :, c.i0 : c.i1] = chunk_forward(
                    qr[:, :, :, c.i0 : c.i1], q[:, :, :, c.i0 : c.i1], kr[:, :, c.lo : c.hi], v[:, :, c.lo : c.hi],
                    c.gather(k), c.gather(v), c.valid, beta, j0, c.pad_front, cfg,
                )
        ctx.save_for_backward(qr, kr, q, k, v, beta, idx)
        ctx.cfg, ctx.nblocks_per_chunk = cfg, nblocks_per_chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        qr, kr, q, k, v, beta, idx = ctx.saved_tensors
        cfg = ctx.cfg
        B, Hkv, G, T, D = q.shape
        nblocks = -(-T // cfg.block)
        dqr, dq = torch.zeros_like(qr), torch.zeros_like(q)
        dkr, dk, dv = torch.zeros_like(kr), torch.zeros_like(k), torch.zeros_like(v)
        dbeta = torch.zeros_like(beta)
        for j0 in range(0, nblocks, ctx.nblocks_per_chunk):
            c = _Chunk(j0, min(nblocks, j0 + ctx.nblocks_per_chunk), T, cfg, idx, cfg.cell)
            leaves = [
                x.detach().requires_grad_(True)
                for x in (
                    qr[:, :, :, c.i0 : c.i1], q[:, :, :, c.i0 : c.i1], kr[:, :, c.lo : c.hi], v[:, :, c.lo : c.hi],
                    c.gather(k), c.gather(v), beta,
                )
            ]
            with torch.enable_grad():
                o = chunk_forward(*leaves[:6], c.valid, leaves[6], j0, c.pad_front, cfg)
                g = torch.autograd.grad(o, leaves, dout[:, :, :, c.i0 : c.i1])
            dqr[:, :, :, c.i0 : c.i1] += g[0]
            dq[:, :, :, c.i0 : c.i1] += g[1]
            dkr[:, :, c.lo : c.hi] += g[2]
            dv[:, :, c.lo : c.hi] += g[3]
            c.scatter_add(dk, g[4])
            c.scatter_add(dv, g[5])
            dbeta += g[6]
        return dqr, dkr, dq, dk, dv, dbeta, None, None, None
