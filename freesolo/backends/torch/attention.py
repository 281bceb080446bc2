"""FreeSolo readout of the torch backend with a chunked, recomputing autograd (spec §2, §7, §8).

Per chunk of `nb` query blocks (queries [i0, i1)):
- local branch: each block reads the `nwin = ceil((w-1)/Bq) + 1` key blocks ending with its own
  (nwin*Bq >= Bq + w - 1 keys, masked to i - w < t <= i); logits [B, Hkv, G, nb, Bq, nwin*Bq],
  never T x T; windows are stacked block slices (their backward is a sum of slices);
- long branch, two equivalent layouts (same token sets, same softmax):
  "union": per (block, kv head) the union of the cells its queries selected, padded to the
  chunk's fixed bound U (`union_width`: min(G*Bq*K, cells available to the chunk's last block,
  and P + W for FS-L)), gathered once as [B, Hkv, nb, U*s, D] and read by matmuls with a
  per-query mask; "gather": the tokens of each query's own cells, [B, Hkv, G, L, K*s, D];
  "auto" picks union per chunk when its bound U is small enough that it moves less memory
  (FS-L: always);
- o = o_loc + beta * rmsnorm(o_long).
Row independence (spec L12): `attention` in backend.py calls the readout one batch row at a time,
on a row padded to whole chunks; every width above (chunk, window, U, path) is a function of the
config, the head shapes and the chunk's position, never of B, T or the selected data, so the
ops that compute query i have the same shapes whatever the other rows and later tokens are.
RoPE is applied per chunk (to the chunk's queries and key span, tables computed per chunk from
the positions), inputs stay in their own dtype
and each chunk is cast to the compute dtype on entry. Forward keeps only the inputs; backward
recomputes one chunk at a time under autograd and scatters the chunk's gradients into full-size
buffers (dk, dv accumulate in the compute dtype), so peak memory is O(T) plus one chunk.
Selection indices are constants (no gradient).
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig
from ._ops import rope, rope_tables, take_rows

__all__ = [
    "FreeSoloReadout",
    "block_unions",
    "choose_long_path",
    "chunk_forward",
    "readout_bytes_per_query",
    "union_width",
]


def block_unions(idx: torch.Tensor, block: int) -> torch.Tensor:
    """idx [B, Hkv, G, T, K] -> cells [B, Hkv, nblocks, G*block*K]: the union of the cells selected
    in each query block by any of its queries and query heads, decreasing, -1 padded. The width is
    the fixed bound G*block*K (a width that depended on the data would change the shapes that
    read other rows' blocks); a chunk reads the first `union_width` entries."""
    B, Hkv, G, T, K = idx.shape
    nblocks = -(-T // block)
    x = torch.nn.functional.pad(idx, (0, 0, 0, nblocks * block - T), value=-1)
    x = x.reshape(B, Hkv, G, nblocks, block * K).transpose(2, 3).reshape(B, Hkv, nblocks, G * block * K)
    x = torch.sort(x, dim=-1, descending=True).values
    dup = torch.zeros_like(x, dtype=torch.bool)
    dup[..., 1:] = x[..., 1:] == x[..., :-1]
    return torch.sort(torch.where(dup, torch.full_like(x, -1), x), dim=-1, descending=True).values


def union_width(cfg: FreeSoloConfig, G: int, j1: int, pool_bound: bool) -> int:
    """Fixed width U of the union buffer of a chunk whose last block is j1 - 1: a bound of every
    block's union that depends on the config and the chunk's position only (L12): at most
    G*Bq*K selected cells, all available to the last block (c < (j1-1)*Bq/s), and, with
    `pool_bound` (FS-L selection), inside the block's candidate set (<= P + W). U >= 1."""
    U = min(G * cfg.block * cfg.top_k, (j1 - 1) * cfg.block // cfg.cell)
    if pool_bound:
        U = min(U, cfg.pool + cfg.recent)
    return max(1, U)


def choose_long_path(U: int, cfg: FreeSoloConfig, D: int) -> str:
    """ "union" when its per-query tensors (~5 U*s) are no larger than the gather's (~4 K*s*(D+2)).
    U is a chunk's fixed bound (`union_width`), so the choice never depends on the data."""
    return "union" if 5 * U <= 4 * cfg.top_k * (D + 2) else "gather"


def readout_bytes_per_query(
    Hq: int, D: int, cfg: FreeSoloConfig, itemsize: int, G: int, pool_bound: bool, long_path: str = "auto"
) -> int:
    """Transient bytes per query position of one row's readout chunk, backward recomputation
    included, for the largest layout a chunk may take (a function of the config, the head shapes
    and `long_path` only, so the chunk size never depends on B, T or the data)."""
    local = 6 * window_blocks(cfg) * cfg.block  # logits, mask, probabilities and their gradients
    U = G * cfg.block * cfg.top_k  # the largest union_width
    if pool_bound:
        U = min(U, cfg.pool + cfg.recent)
    gather = 4 * cfg.top_k * cfg.cell * (D + 2)  # gathered k, v, their gradients, logits
    if long_path == "gather" or (long_path == "auto" and choose_long_path(U, cfg, D) == "gather"):
        if long_path == "gather":
            return Hq * itemsize * (local + gather)
        U = max(1, 4 * cfg.top_k * (D + 2) // 5)  # "auto": the widest union a chunk still reads as union
        return Hq * itemsize * (local + max(gather, 6 * U * cfg.cell + U * cfg.top_k))
    return Hq * itemsize * (local + 6 * U * cfg.cell + U * cfg.top_k)  # union: logits, probabilities, grads, mask


def window_blocks(cfg: FreeSoloConfig) -> int:
    """Key blocks read by a query block's local window: ceil((w - 1) / Bq) + 1."""
    return -(-(cfg.window - 1) // cfg.block) + 1


def _local_mask(j0: int, nb: int, cfg: FreeSoloConfig, device) -> torch.Tensor:
    """[nb, Bq, nwin*Bq] bool: query row r of block j sees window key u (token (j-nwin+1)*Bq + u)."""
    Bq, w = cfg.block, cfg.window
    nwin = window_blocks(cfg)
    r = torch.arange(Bq, device=device)[:, None]
    u = torch.arange(nwin * Bq, device=device)[None, :]
    off = (nwin - 1) * Bq  # u - off - r = t - i
    band = (u <= off + r) & (u > off + r - w)  # i - w < t <= i
    token = (torch.arange(j0, j0 + nb, device=device) - nwin + 1)[:, None] * Bq + u  # (nb, nwin*Bq)
    return band[None] & (token >= 0)[:, None, :]


def _masked_softmax_readout(lg, mask, values_eq, values):
    """Unnormalized softmax over the masked entries of lg (rows with none give 0) and its
    denominator; multiplied with `values` by einsum `values_eq` unless that is None.
    With lg [..., U, s] the max / sum run over both last dims (the rows are [..., U*s])."""
    lg = lg.masked_fill(~mask, float("-inf"))
    dims = (-1,) if values_eq is not None else (-2, -1)
    mx = lg.detach().amax(dim=dims, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # rows with no cell: 0
    e = torch.exp(lg - mx)  # masked entries: exp(-inf) = 0
    den = e.sum(dim=-1, keepdim=True)
    if values_eq is None:
        return e, den
    return torch.einsum(values_eq, e, values), den


def chunk_forward(
    q,
    k_span,
    v_span,
    k_long,
    v_long,
    long_mask,
    beta,
    rope_q,
    rope_k,
    j0: int,
    pad_front: int,
    cfg: FreeSoloConfig,
    path: str,
):
    """One chunk of the readout; differentiable in q, k_span, v_span, k_long, v_long, beta.

    Args:
        q: [B, Hkv, G, L, D] unrotated queries of positions [j0*Bq, j0*Bq + L) (any float dtype).
        k_span, v_span: [B, Hkv, S, D] unrotated keys / values of tokens [max(0, (j0-nwin+1)*Bq), ...),
            S <= L + (nwin-1)*Bq (missing tokens are padded with zeros and masked out).
        rope_q, rope_k: (cos, sin) [L, D/2] / [S, D/2] of those positions, in the compute dtype.
        k_long, v_long: "gather": [B, Hkv, G, L, K*s, D]; "union": [B, Hkv, nb, U*s, D] (unrotated).
        long_mask: "gather": [B, Hkv, G, L, K*s] bool; "union": [B, Hkv, G, nb, Bq, K] int64, the
            union slot of each of the query's K selected cells in selection order (U: none).
        beta: [Hkv, G]. pad_front: zero keys before kr_span (the window starts before token 0).
    Returns:
        o [B, Hkv, G, L, D] in the compute dtype.
    """
    B, Hkv, G, L, D = q.shape
    cdt = rope_q[0].dtype
    q, k_span, v_span, k_long, v_long = (x.to(cdt) for x in (q, k_span, v_span, k_long, v_long))
    qr, kr_span = rope(q, *rope_q), rope(k_span, *rope_k)
    Bq = cfg.block
    nb = -(-L // Bq)
    scale = D**-0.5
    pad_q = nb * Bq - L
    # ---- local branch: banded windows per block
    qb = torch.nn.functional.pad(qr, (0, 0, 0, pad_q)) if pad_q else qr
    qb = qb.reshape(B, Hkv, G, nb, Bq, D)  # (B, Hkv, G, nb, Bq, D)
    nwin = window_blocks(cfg)
    pad_back = (nb + nwin - 1) * Bq - pad_front - kr_span.shape[2]

    def windows(x):  # [B, Hkv, S, D] -> [B, Hkv, nb, nwin*Bq, D]
        xb = torch.nn.functional.pad(x, (0, 0, pad_front, pad_back)).reshape(B, Hkv, nb + nwin - 1, Bq, D)
        return torch.stack([xb[:, :, o : o + nb] for o in range(nwin)], dim=3).reshape(B, Hkv, nb, nwin * Bq, D)

    kw, vw = windows(kr_span), windows(v_span)
    logits = torch.einsum("bhgnqd,bhnkd->bhgnqk", qb, kw) * scale  # (B, Hkv, G, nb, Bq, nwin*Bq)
    logits = logits.masked_fill(~_local_mask(j0, nb, cfg, q.device), float("-inf"))
    o_loc = torch.einsum("bhgnqk,bhnkd->bhgnqd", torch.softmax(logits, dim=-1), vw)
    o_loc = o_loc.reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
    # ---- long branch: NoPE softmax over the selected tokens
    if path == "union":
        # logits of the block's union by one matmul; each query then reads its own K cells'
        # logits (its selection order: a fixed layout), softmaxes them and scatters the weights
        # back into the union's columns for the value matmul: the wide [Bq, U*s] tensors are
        # written twice and read twice (no mask / exp / max passes over them)
        s = cfg.cell
        qu = torch.nn.functional.pad(q, (0, 0, 0, pad_q)) if pad_q else q
        qu = qu.reshape(B, Hkv, G, nb, Bq, D)
        lg = torch.einsum("bhgnqd,bhnud->bhgnqu", qu * scale, k_long)  # (B, Hkv, G, nb, Bq, U*s)
        slot = long_mask  # (B, Hkv, G, nb, Bq, K): the union slot of each selected cell, U = none
        U = k_long.shape[-2] // s
        K = slot.shape[-1]
        col = (slot[..., None] * s + torch.arange(s, device=q.device)).reshape(B, Hkv, G, nb, Bq, K * s)
        col = col.clamp(max=U * s - 1)  # slot U (no cell): any column, its weight is 0 (masked below)
        lk = torch.gather(lg, -1, col)  # (B, Hkv, G, nb, Bq, K*s): the query's own logits
        ok = (slot < U)[..., None].expand(B, Hkv, G, nb, Bq, K, s).reshape(B, Hkv, G, nb, Bq, K * s)
        lk = lk.masked_fill(~ok, float("-inf"))
        mx = lk.detach().amax(dim=-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # rows with no cell: 0
        e = torch.exp(lk - mx)  # masked entries: +0
        den = e.sum(dim=-1, keepdim=True)  # (B, Hkv, G, nb, Bq, 1), in the query's own order
        # weights back into the union's columns; a masked entry adds +0 (exact, so the order of
        # the additions into a column, atomic on CUDA, never changes a bit)
        if torch.is_grad_enabled():
            p = torch.zeros_like(lg).scatter_add(-1, col, e)
        else:
            p = lg.zero_().scatter_add_(-1, col, e)  # forward: reuse the logits' storage
        num = torch.einsum("bhgnqu,bhnud->bhgnqd", p, v_long)
        num = num.reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
        den = den.reshape(B, Hkv, G, nb * Bq, 1)[:, :, :, :L]
    else:
        lg = torch.einsum("bhgld,bhglnd->bhgln", q, k_long) * scale  # (B, Hkv, G, L, K*s)
        num, den = _masked_softmax_readout(lg, long_mask, "bhgln,bhglnd->bhgld", v_long)
    o_long = num / torch.where(den > 0, den, torch.ones_like(den))
    rms = torch.rsqrt((o_long * o_long).mean(dim=-1, keepdim=True) + cfg.eps)
    return o_loc + beta.view(1, Hkv, G, 1, 1) * (o_long * rms)


class _Chunk:
    """Index bookkeeping of one chunk: query range, key span, long-branch layout, token indices,
    mask and RoPE tables (every shape a function of the config and the chunk's position)."""

    def __init__(self, j0, j1, T, cfg, idx, unions, long_path, pool_bound, D, cdt):
        Bq, s = cfg.block, cfg.cell
        dev = idx.device
        G = idx.shape[2]
        self.U = union_width(cfg, G, j1, pool_bound)
        path = choose_long_path(self.U, cfg, D) if long_path == "auto" else long_path
        self.path = path
        self.j0 = j0
        self.i0, self.i1 = j0 * Bq, min(T, j1 * Bq)
        start = self.i0 - (window_blocks(cfg) - 1) * Bq
        self.lo, self.hi = max(0, start), min(T, j1 * Bq)
        self.pad_front = self.lo - start
        theta = cfg.rope_theta
        self.cos_k, self.sin_k = rope_tables(self.hi - self.lo, D, theta, dev, cdt, start=self.lo)  # [S, D/2]
        # the key span ends with the chunk's queries (hi == i1): their table is its tail
        self.cos_q, self.sin_q = self.cos_k[self.i0 - self.lo :], self.sin_k[self.i0 - self.lo :]  # [L, D/2]
        cells = idx[:, :, :, self.i0 : self.i1]  # (B, Hkv, G, L, K)
        B, Hkv, G, L, K = cells.shape
        ar = torch.arange(s, device=dev)
        if path == "union":
            nb = j1 - j0
            uc = unions[:, :, j0:j1, : self.U]  # (B, Hkv, nb, U): the fixed bound, -1 padded
            U = self.U
            self.tok = (uc.clamp(min=0)[..., None] * s + ar).clamp(max=T - 1).reshape(B, Hkv, nb, U * s)
            sel = torch.nn.functional.pad(cells, (0, 0, 0, nb * Bq - L), value=-1).reshape(B, Hkv, G, nb, Bq, K, 1)
            hit = (sel == uc[:, :, None, :, None, None, :]) & (sel >= 0)  # (B, Hkv, G, nb, Bq, K, U)
            slot = (hit * torch.arange(U, device=dev)).sum(dim=-1)  # the union slot of each selected cell
            self.mask = torch.where(hit.any(dim=-1), slot, torch.full_like(slot, U))  # U: no cell
            self.bi = torch.arange(B, device=dev).view(B, 1, 1, 1)
            self.hi_ = torch.arange(Hkv, device=dev).view(1, Hkv, 1, 1)
        else:
            tok = cells.clamp(min=0)[..., None] * s + ar  # (B, Hkv, G, L, K, s)
            self.tok = tok.clamp(max=T - 1).reshape(B, Hkv, G, L, K * s)  # -1 pads read a masked token
            self.mask = (cells >= 0)[..., None].expand(B, Hkv, G, L, K, s).reshape(B, Hkv, G, L, K * s)
            self.bi = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
            self.hi_ = torch.arange(Hkv, device=dev).view(1, Hkv, 1, 1, 1)

    def rope_q(self):
        """cos / sin of the chunk's query positions [L, D/2]."""
        return self.cos_q, self.sin_q

    def rope_k(self):
        """cos / sin of the chunk's key span [S, D/2]."""
        return self.cos_k, self.sin_k

    def gather(self, x):
        """x [B, Hkv, T, D] -> the long branch's tokens (union or per-query layout)."""
        return take_rows(x, self.tok)

    def scatter_add(self, dst, src):
        """dst [B, Hkv, T, D] (contiguous) += src (layout of `gather`) at the same tokens."""
        B, Hkv, T, D = dst.shape
        rows = ((self.bi * Hkv + self.hi_) * T + self.tok).reshape(-1)  # flat (b, h, t) row of each token
        dst.view(B * Hkv * T, D).index_add_(0, rows, src.reshape(-1, D))

    def leaves(self, q, k, v, beta):
        """The chunk's slices of every differentiable input, in chunk_forward's order."""
        return (
            q[:, :, :, self.i0 : self.i1],
            k[:, :, self.lo : self.hi],
            v[:, :, self.lo : self.hi],
            self.gather(k),
            self.gather(v),
            beta,
        )


class FreeSoloReadout(torch.autograd.Function):
    """o = local(rope(q), rope(k), v) + beta * rmsnorm(long(q, k, v; idx)), chunked, recomputed in backward.

    forward(q, k, v, beta, idx, unions, cfg, nblocks_per_chunk, long_path, pool_bound):
        q: [B, Hkv, G, T, D] unrotated queries; k, v: [B, Hkv, T, D] (the inputs' dtype);
        beta [Hkv, G] in the compute dtype (its dtype);
        idx: int64 [B, Hkv, G, T, K] selected cells (-1 padded); unions: block_unions(idx)
        (read by the chunks whose layout is "union"); long_path: "auto", "union" or "gather";
        pool_bound: the selection is FS-L's (union_width may use P + W).
        Row independence needs B = 1 and T a whole number of chunks (backend.attention does it).
        Returns o [B, Hkv, G, T, D] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, idx, unions, cfg, nblocks_per_chunk, long_path, pool_bound):
        B, Hkv, G, T, D = q.shape
        nblocks = -(-T // cfg.block)
        cdt = beta.dtype
        out = q.new_empty(B, Hkv, G, T, D)
        with torch.no_grad():
            for j0 in range(0, nblocks, nblocks_per_chunk):
                j1 = min(nblocks, j0 + nblocks_per_chunk)
                c = _Chunk(j0, j1, T, cfg, idx, unions, long_path, pool_bound, D, cdt)
                x = c.leaves(q, k, v, beta)
                out[:, :, :, c.i0 : c.i1] = chunk_forward(
                    *x[:5], c.mask, x[5], c.rope_q(), c.rope_k(), j0, c.pad_front, cfg, c.path
                )
        ctx.save_for_backward(q, k, v, beta, idx, unions)
        ctx.cfg, ctx.nblocks_per_chunk, ctx.long_path, ctx.pool_bound = cfg, nblocks_per_chunk, long_path, pool_bound
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, beta, idx, unions = ctx.saved_tensors
        cfg = ctx.cfg
        cdt = beta.dtype
        D = q.shape[-1]
        T = q.shape[3]
        nblocks = -(-T // cfg.block)
        dq = torch.empty_like(q)  # every query belongs to exactly one chunk
        dk, dv = torch.zeros_like(k, dtype=cdt), torch.zeros_like(v, dtype=cdt)  # accumulated over chunks
        dbeta = torch.zeros_like(beta)
        for j0 in range(0, nblocks, ctx.nblocks_per_chunk):
            j1 = min(nblocks, j0 + ctx.nblocks_per_chunk)
            c = _Chunk(j0, j1, T, cfg, idx, unions, ctx.long_path, ctx.pool_bound, D, cdt)
            x = [t.detach().to(cdt).requires_grad_(True) for t in c.leaves(q, k, v, beta)]
            with torch.enable_grad():
                o = chunk_forward(*x[:5], c.mask, x[5], c.rope_q(), c.rope_k(), j0, c.pad_front, cfg, c.path)
                g = torch.autograd.grad(o, x, dout[:, :, :, c.i0 : c.i1].to(cdt))
            dq[:, :, :, c.i0 : c.i1] = g[0]
            dk[:, :, c.lo : c.hi] += g[1]
            dv[:, :, c.lo : c.hi] += g[2]
            c.scatter_add(dk, g[3])
            c.scatter_add(dv, g[4])
            dbeta += g[5]
        return dq, dk.to(k.dtype), dv.to(v.dtype), dbeta, None, None, None, None, None, None
