"""FreeSolo readout of the torch backend with a chunked, recomputing autograd (spec §2, §7, §8).

Per chunk of `nb` query blocks (queries [i0, i1)):
- local branch: each block reads the `nwin = ceil((w-1)/Bq) + 1` key blocks ending with its own
  (nwin*Bq >= Bq + w - 1 keys, masked to i - w < t <= i); logits [B, Hkv, G, nb, Bq, nwin*Bq],
  never T x T; windows are stacked block slices (their backward is a sum of slices);
- long branch, two equivalent layouts (same token sets, same softmax):
  "union": a buffer of cells per block whose content and order are a function of the cells
  available to the block alone, never of the queries' selections: FS-L's candidate set C_j
  (decreasing, -1 padded to U = min(P + W, cells available to the chunk's last block)) when the
  readout is given it, else every cell available to the chunk's last block in cell order
  (U = (j1 - 1) * Bq / s, a contiguous slice of k shared by the chunk's blocks; also FS-L's
  layout while those cells are no more than P + W). One matmul gives the logits of the buffer;
  each query reads its own K*s logits (its selection order), softmaxes them and scatters the
  weights into the buffer's columns for the value matmul;
  "gather": the tokens of each query's own cells, [B, Hkv, G, L, K*s, D];
  "auto" picks union per chunk when its width U is small enough that it moves less memory
  (FS-L with candidates: always);
- o = o_loc + beta * rmsnorm(o_long).
Row independence (spec L12): `attention` in backend.py calls the readout one batch row at a time,
on a row padded to whole chunks; every width above (chunk, window, U, path) is a function of the
config, the head shapes and the chunk's position, never of B, T or the selected data, so the
ops that compute query i have the same shapes whatever the other rows and later tokens are.
The position of each of query i's keys inside those ops (hence the order in which a matmul
reduces them) is a function of the chunk's position, the cells available to i's block and i's
own selection alone: a union of the block's selected cells would move i's cells with the
selections of the block's later queries (a reduction order that follows later tokens). Entries
of the buffer's other cells and of masked keys weigh exactly +0 for query i; they can flip only
the sign of an exact zero, so the output is canonicalized (x + 0.0 turns -0.0 into +0.0 and
leaves every other value alone).
RoPE is applied per chunk (to the chunk's queries and key span, tables computed per chunk from
the positions), inputs stay in their own dtype and each chunk is cast to the compute dtype on
entry. Forward keeps only the inputs; backward recomputes one chunk at a time under autograd and
scatters the chunk's gradients into full-size buffers (dk, dv accumulate in the compute dtype),
so peak memory is O(T) plus one chunk.
Selection indices are constants (no gradient).
"""

from __future__ import annotations

import torch

from ...config import FreeSoloConfig
from ._ops import rope, rope_tables, take_rows

__all__ = [
    "FreeSoloReadout",
    "choose_long_path",
    "chunk_forward",
    "readout_bytes_per_query",
    "union_width",
]


def union_width(cfg: FreeSoloConfig, j1: int, candidates: bool) -> int:
    """Width U (cells) of the union buffer of a chunk whose last block is j1 - 1, a function of the
    config and the chunk's position only (L12): with `candidates` (FS-L's candidate sets), the
    largest set, min(P + W, cells available to the last block); else every cell available to the
    last block, (j1 - 1) * Bq / s. U >= 1."""
    U = (j1 - 1) * cfg.block // cfg.cell
    if candidates:
        U = min(U, cfg.pool + cfg.recent)
    return max(1, U)


def choose_long_path(U: int, cfg: FreeSoloConfig, D: int) -> str:
    """ "union" when its per-query tensors (~5 U*s) are no larger than the gather's (~4 K*s*(D+2)).
    U is a chunk's fixed width (`union_width`), so the choice never depends on the data."""
    return "union" if 5 * U <= 4 * cfg.top_k * (D + 2) else "gather"


def readout_bytes_per_query(
    Hq: int, D: int, cfg: FreeSoloConfig, itemsize: int, candidates: bool, long_path: str = "auto"
) -> int:
    """Transient bytes per query position of one row's readout chunk, backward recomputation
    included, for the largest layout a chunk may take (a function of the config, the head shapes
    and `long_path` only, so the chunk size never depends on B, T or the data). `long_path`
    "union" without candidate sets reads every available cell: its chunks are sized for the
    widest "auto" union, and its memory grows with T past it (a layout for tests and short rows)."""
    local = 6 * window_blocks(cfg) * cfg.block  # logits, mask, probabilities and their gradients
    gather = 4 * cfg.top_k * cfg.cell * (D + 2)  # gathered k, v, their gradients, logits
    if long_path == "gather":
        return Hq * itemsize * (local + gather)
    if candidates:
        U = cfg.pool + cfg.recent
        if long_path == "union" or choose_long_path(U, cfg, D) == "union":
            return Hq * itemsize * (local + 6 * U * cfg.cell + U * cfg.top_k)
    U = max(1, 4 * cfg.top_k * (D + 2) // 5)  # the widest union "auto" still reads as union
    union = 6 * U * cfg.cell + U * cfg.top_k  # logits, probabilities, their gradients, slots
    return Hq * itemsize * (local + (union if long_path == "union" else max(gather, union)))


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
        k_long, v_long: "gather": [B, Hkv, G, L, K*s, D]; "union": [B, Hkv, nb, U*s, D] (a buffer
            per block) or [B, Hkv, U*s, D] (one buffer shared by the chunk's blocks), unrotated.
        long_mask: "gather": [B, Hkv, G, L, K*s] bool; "union": [B, Hkv, G, nb, Bq, K] int64, the
            buffer slot of each of the query's K selected cells in selection order (U: none).
        beta: [Hkv, G]. pad_front: zero keys before kr_span (the window starts before token 0).
    Returns:
        o [B, Hkv, G, L, D] in the compute dtype (zeros are +0.0: see the module docstring).
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
        # logits of the block's buffer by one matmul; each query then reads its own K cells'
        # logits (its selection order: a fixed layout), softmaxes them and scatters the weights
        # back into the buffer's columns for the value matmul: the wide [Bq, U*s] tensors are
        # written twice and read twice (no mask / exp / max passes over them)
        s = cfg.cell
        qu = torch.nn.functional.pad(q, (0, 0, 0, pad_q)) if pad_q else q
        qu = qu.reshape(B, Hkv, G, nb, Bq, D)
        per_block = k_long.dim() == 5  # [B, Hkv, nb, U*s, D]; else one buffer [B, Hkv, U*s, D]
        eq_k = "bhgnqd,bhnud->bhgnqu" if per_block else "bhgnqd,bhud->bhgnqu"
        eq_v = "bhgnqu,bhnud->bhgnqd" if per_block else "bhgnqu,bhud->bhgnqd"
        lg = torch.einsum(eq_k, qu * scale, k_long)  # (B, Hkv, G, nb, Bq, U*s)
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
        # weights back into the buffer's columns; a masked entry adds +0 (exact, so the order of
        # the additions into a column, atomic on CUDA, never changes a bit)
        if torch.is_grad_enabled():
            p = torch.zeros_like(lg).scatter_add(-1, col, e)
        else:
            p = lg.zero_().scatter_add_(-1, col, e)  # forward: reuse the logits' storage
        num = torch.einsum(eq_v, p, v_long)
        num = num.reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
        den = den.reshape(B, Hkv, G, nb * Bq, 1)[:, :, :, :L]
    else:
        lg = torch.einsum("bhgld,bhglnd->bhgln", q, k_long) * scale  # (B, Hkv, G, L, K*s)
        num, den = _masked_softmax_readout(lg, long_mask, "bhgln,bhglnd->bhgld", v_long)
    o_long = num / torch.where(den > 0, den, torch.ones_like(den))
    rms = torch.rsqrt((o_long * o_long).mean(dim=-1, keepdim=True) + cfg.eps)
    return o_loc + beta.view(1, Hkv, G, 1, 1) * (o_long * rms) + 0.0  # + 0.0: -0.0 -> +0.0 (L12)


class _Chunk:
    """Index bookkeeping of one chunk: query range, key span, long-branch layout, token indices,
    buffer slots and RoPE tables (every shape a function of the config and the chunk's position;
    every buffer's content a function of the cells available to its block)."""

    def __init__(self, j0, j1, T, cfg, idx, cand, long_path, D, cdt):
        Bq, s = cfg.block, cfg.cell
        dev = idx.device
        if cand is not None and (j1 - 1) * Bq // s <= cfg.pool + cfg.recent:
            cand = None  # every available cell fits the candidates' width: the shared slice, no gather
        self.U = union_width(cfg, j1, cand is not None)
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
        self.span = None  # "union" without candidates: the buffer is the token span [0, span)
        if path == "union":
            nb = j1 - j0
            U = self.U
            sel = torch.nn.functional.pad(cells, (0, 0, 0, nb * Bq - L), value=-1).reshape(B, Hkv, G, nb, Bq, K)
            if cand is None:  # every cell available to the last block, slot = cell id
                self.span = U * s  # <= (j1 - 1) * Bq <= T (the row is padded to whole chunks)
                self.mask = torch.where(sel >= 0, sel, torch.full_like(sel, U))  # U: no cell
            else:  # block j's candidates, increasing (-1 pads first): slot of a cell by binary search
                uc = cand[:, :, j0:j1, :U].flip(dims=[-1])  # (B, Hkv, nb, U)
                self.tok = (uc.clamp(min=0)[..., None] * s + ar).clamp(max=T - 1).reshape(B, Hkv, nb, U * s)
                x = sel.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv, nb, G * Bq * K)  # (B, Hkv, nb, G*Bq*K)
                slot = torch.searchsorted(uc, x).clamp(max=U - 1)
                hit = (torch.gather(uc, -1, slot) == x) & (x >= 0)
                slot = torch.where(hit, slot, torch.full_like(slot, U))  # U: no cell (or none of C_j)
                self.mask = slot.reshape(B, Hkv, nb, G, Bq, K).permute(0, 1, 3, 2, 4, 5)  # (B, Hkv, G, nb, Bq, K)
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
        if self.span is not None:
            return x[:, :, : self.span]
        return take_rows(x, self.tok)

    def scatter_add(self, dst, src):
        """dst [B, Hkv, T, D] (contiguous) += src (layout of `gather`) at the same tokens."""
        if self.span is not None:
            dst[:, :, : self.span] += src
            return
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

    forward(q, k, v, beta, idx, cand, cfg, nblocks_per_chunk, long_path):
        q: [B, Hkv, G, T, D] unrotated queries; k, v: [B, Hkv, T, D] (the inputs' dtype);
        beta [Hkv, G] in the compute dtype (its dtype);
        idx: int64 [B, Hkv, G, T, K] selected cells (-1 padded);
        cand: None, or int64 [B, Hkv, ceil(T / Bq), P + W], FS-L's candidate set of every block
        (decreasing, -1 padded), a superset of the block's selected cells: the "union" buffers;
        long_path: "auto", "union" or "gather".
        Row independence needs B = 1 and T a whole number of chunks (backend.attention does it).
        Returns o [B, Hkv, G, T, D] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, idx, cand, cfg, nblocks_per_chunk, long_path):
        B, Hkv, G, T, D = q.shape
        nblocks = -(-T // cfg.block)
        cdt = beta.dtype
        out = q.new_empty(B, Hkv, G, T, D)
        with torch.no_grad():
            for j0 in range(0, nblocks, nblocks_per_chunk):
                j1 = min(nblocks, j0 + nblocks_per_chunk)
                c = _Chunk(j0, j1, T, cfg, idx, cand, long_path, D, cdt)
                x = c.leaves(q, k, v, beta)
                out[:, :, :, c.i0 : c.i1] = chunk_forward(
                    *x[:5], c.mask, x[5], c.rope_q(), c.rope_k(), j0, c.pad_front, cfg, c.path
                )
        ctx.has_cand = cand is not None
        ctx.save_for_backward(q, k, v, beta, idx, *((cand,) if ctx.has_cand else ()))
        ctx.cfg, ctx.nblocks_per_chunk, ctx.long_path = cfg, nblocks_per_chunk, long_path
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, beta, idx, *rest = ctx.saved_tensors
        cand = rest[0] if ctx.has_cand else None
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
            c = _Chunk(j0, j1, T, cfg, idx, cand, ctx.long_path, D, cdt)
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
        return dq, dk.to(k.dtype), dv.to(v.dtype), dbeta, None, None, None, None, None
