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
  weights into the buffer's columns for the value matmul. Cost per query: two matmuls of
  depth D over U*s columns;
  "gather": each query's own K cells, [B, Hkv, G, L, K*s, D] (a fixed width K*s per query, the
  cells gathered whole by cell index); cost per query: copies of 2*K*s*D elements, no wide
  matmul.
- the layout of each chunk follows a mode (`long_path`, or the environment variable
  FREESOLO_TORCH_READOUT when the caller passes none; `readout_mode`):
  "auto" (default): FS-L with its candidate sets: "union" (C_j, at most P + W cells); otherwise
      "union" while every cell available to the chunk is at most P + W cells (no wider than
      FS-L's buffers), then "gather";
  "union": "union" for every chunk (FS / FS-B: every available cell, however many: a layout for
      tests and short rows, its memory grows with T);
  "gather": "gather" for every chunk and variant (FS-L's candidate sets unused);
  "wide": the rule of commit 9d31a86: "union" while its per-query tensors (~5 U*s) are no
      larger than the gather's (~4 K*s*(D+2)), i.e. up to 211 cells at D = 64, K = 4.
  Each mode sizes the chunks for the widest layout it may take (`readout_bytes_per_query`), so
  "auto" and "gather" cut FS / FS-B rows into chunks twice as long as "wide" (fewer launches).
  `benchmarks/torch_readout_ab.py` times the modes on a GPU.
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
the positions); queries stay in their own dtype and each chunk is cast to the compute dtype on
entry; keys and values are cast once per row (a copy for 16-bit inputs: the chunks' gathers then
move compute-dtype rows, no cast per gathered token; exact, so the bits are those of a cast per
chunk). Forward keeps only the inputs; backward recomputes one chunk at a time under autograd
and scatters the chunk's gradients into full-size buffers (dk, dv accumulate in the compute
dtype), so peak memory is O(T) plus one chunk.
Selection indices are constants (no gradient).
"""

from __future__ import annotations

import os

import torch

from ...config import FreeSoloConfig
from ._ops import rope, rope_tables

__all__ = [
    "READOUT_ENV",
    "READOUT_MODES",
    "FreeSoloReadout",
    "choose_long_path",
    "chunk_forward",
    "readout_bytes_per_query",
    "readout_mode",
    "union_width",
]

READOUT_ENV = "FREESOLO_TORCH_READOUT"
READOUT_MODES = ("auto", "union", "gather", "wide")


def readout_mode(long_path: str | None = None) -> str:
    """The readout's layout mode: `long_path` when given, else the environment variable
    FREESOLO_TORCH_READOUT (read at every call), else "auto". See the module docstring."""
    if long_path is None:
        long_path = os.environ.get(READOUT_ENV, "").strip() or "auto"
        if long_path not in READOUT_MODES:
            raise ValueError(f"{READOUT_ENV}={long_path!r} must be one of {READOUT_MODES}")
    elif long_path not in READOUT_MODES:
        raise ValueError(f"long_path={long_path!r} must be one of {READOUT_MODES}")
    return long_path


def union_width(cfg: FreeSoloConfig, j1: int, candidates: bool) -> int:
    """Width U (cells) of the union buffer of a chunk whose last block is j1 - 1, a function of the
    config and the chunk's position only (L12): with `candidates` (FS-L's candidate sets), the
    largest set, min(P + W, cells available to the last block); else every cell available to the
    last block, (j1 - 1) * Bq / s. U >= 1."""
    U = (j1 - 1) * cfg.block // cfg.cell
    if candidates:
        U = min(U, cfg.pool + cfg.recent)
    return max(1, U)


def _wide_cells(cfg: FreeSoloConfig, D: int) -> int:
    """The widest union "wide" reads: its per-query tensors (~5 U*s) no larger than the gather's
    (~4 K*s*(D+2)); 211 cells at D = 64, K = 4, s = 32."""
    return max(1, 4 * cfg.top_k * (D + 2) // 5)


def choose_long_path(U: int, cfg: FreeSoloConfig, D: int, mode: str = "auto") -> str:
    """The layout of a chunk whose union width is U (`union_width`, a function of the config and
    the chunk's position), under `mode` (`readout_mode`): never a function of the data."""
    if mode in ("union", "gather"):
        return mode
    limit = cfg.pool + cfg.recent if mode == "auto" else _wide_cells(cfg, D)
    return "union" if U <= limit else "gather"


def readout_bytes_per_query(
    Hq: int, D: int, cfg: FreeSoloConfig, itemsize: int, candidates: bool, long_path: str = "auto"
) -> int:
    """Transient bytes per query position of one row's readout chunk, backward recomputation
    included, for the largest layout a chunk may take under mode `long_path` (a function of the
    config, the head shapes and the mode only, so the chunk size never depends on B, T or the
    data). "union" without candidate sets reads every available cell: its chunks are sized for
    the widest "wide" union, and its memory grows with T past it (a layout for tests and short
    rows)."""
    local = 6 * window_blocks(cfg) * cfg.block  # logits, mask, probabilities and their gradients
    gather = 4 * cfg.top_k * cfg.cell * (D + 2)  # gathered k, v, their gradients, logits

    def union(U):  # logits, probabilities, their gradients, slots
        return 6 * U * cfg.cell + U * cfg.top_k

    mode = long_path
    if mode == "gather":
        long = gather
    elif candidates:  # FS-L's candidate sets: at most P + W cells, "union" in every other mode
        long = union(cfg.pool + cfg.recent)
    elif mode == "auto":
        long = max(gather, union(cfg.pool + cfg.recent))
    elif mode == "wide":
        long = max(gather, union(_wide_cells(cfg, D)))
    else:  # "union"
        long = union(_wide_cells(cfg, D))
    return Hq * itemsize * (local + long)


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


def _local_hidden(j0: int, nb: int, cfg: FreeSoloConfig, device, cache: dict | None = None) -> torch.Tensor:
    """~_local_mask: the window keys query rows may not see. With `cache` (a dict owned by one
    readout call), the chunks whose windows start at or after token 0 (j0 >= nwin - 1: the same
    mask) share one tensor (fewer launches per chunk)."""
    nwin = window_blocks(cfg)
    if cache is None or j0 < nwin - 1:
        return ~_local_mask(j0, nb, cfg, device)
    key = ("local", nb)
    if key not in cache:
        cache[key] = ~_local_mask(nwin - 1, nb, cfg, device)
    return cache[key]


def _own_softmax(lk: torch.Tensor, absent: torch.Tensor, s: int):
    """lk [..., K*s] a query's own logits (its K cells in selection order; a fresh tensor),
    absent [..., K] bool (no cell in that slot) -> (e [..., K*s] unnormalized weights, masked
    entries +0; den [..., 1], summed in the query's own order). Rows with no cell: e = 0, den = 0."""
    shape = lk.shape
    lk = lk.reshape(*shape[:-1], -1, s)  # (..., K, s): the mask of a cell covers its s tokens
    grad = torch.is_grad_enabled()
    lk = lk.masked_fill(absent[..., None], float("-inf")) if grad else lk.masked_fill_(absent[..., None], float("-inf"))
    mx = lk.detach().amax(dim=(-2, -1), keepdim=True)  # max: exact in any order
    mx = torch.nan_to_num(mx, nan=0.0, posinf=0.0, neginf=0.0)  # rows with no cell (-inf): 0
    e = (torch.exp(lk - mx) if grad else lk.sub_(mx).exp_()).reshape(shape)  # masked entries: exp(-inf) = +0
    return e, e.sum(dim=-1, keepdim=True)


def _union_long(qu, k_long, v_long, slot, s: int):
    """Long branch of blocks reading a buffer of cells ("union" layout) -> (num [..., nb, Bq, D],
    den [..., nb, Bq, 1]).

    qu [B, Hkv, G, nb, Bq, D] scaled queries; k_long, v_long [B, Hkv, nb, U*s, D] (a buffer per
    block) or [B, Hkv, U*s, D] (one shared by the blocks); slot [B, Hkv, G, nb, Bq, K] the buffer
    slot of each selected cell in selection order (>= U: none). The logits of the buffer come
    from one matmul; each query reads its own K*s logits (its selection order: a fixed layout),
    softmaxes them and scatters the weights back into the buffer's columns for the value matmul:
    the wide [Bq, U*s] tensors are written twice and read twice."""
    B, Hkv, G, nb, Bq, D = qu.shape
    per_block = k_long.dim() == 5
    eq_k = "bhgnqd,bhnud->bhgnqu" if per_block else "bhgnqd,bhud->bhgnqu"
    eq_v = "bhgnqu,bhnud->bhgnqd" if per_block else "bhgnqu,bhud->bhgnqd"
    lg = torch.einsum(eq_k, qu, k_long)  # (B, Hkv, G, nb, Bq, U*s)
    U = k_long.shape[-2] // s
    K = slot.shape[-1]
    col = (slot[..., None] * s + torch.arange(s, device=qu.device)).reshape(B, Hkv, G, nb, Bq, K * s)
    col = col.clamp(max=U * s - 1)  # slot >= U (no cell): any column, its weight is 0 (masked)
    lk = torch.gather(lg, -1, col)  # (B, Hkv, G, nb, Bq, K*s): the query's own logits
    e, den = _own_softmax(lk, slot >= U, s)  # den (B, Hkv, G, nb, Bq, 1), in the query's own order
    # weights back into the buffer's columns; a masked entry adds +0 (exact, so the order of the
    # additions into a column, atomic on CUDA, never changes a bit)
    if torch.is_grad_enabled():
        p = torch.zeros_like(lg).scatter_add(-1, col, e)
    else:
        p = lg.zero_().scatter_add_(-1, col, e)  # forward: reuse the logits' storage
    return torch.einsum(eq_v, p, v_long), den


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
    local_hidden: torch.Tensor | None = None,
):
    """One chunk of the readout; differentiable in q, k_span, v_span, k_long, v_long, beta.

    Args:
        q: [B, Hkv, G, L, D] unrotated queries of positions [j0*Bq, j0*Bq + L) (any float dtype).
        k_span, v_span: [B, Hkv, S, D] unrotated keys / values of tokens [max(0, (j0-nwin+1)*Bq), ...),
            S <= L + (nwin-1)*Bq (missing tokens are padded with zeros and masked out).
        rope_q, rope_k: (cos, sin) [L, D/2] / [S, D/2] of those positions, in the compute dtype.
        k_long, v_long: "gather": [B, Hkv, G, L, K*s, D]; "union": [B, Hkv, nb, U*s, D] (a buffer
            per block) or [B, Hkv, U*s, D] (one buffer shared by the chunk's blocks), unrotated.
        long_mask: "gather": [B, Hkv, G, L, K] bool (False: no cell in that slot); "union":
            [B, Hkv, G, nb, Bq, K] int64, the buffer slot of each of the query's K selected cells
            in selection order (U: none).
        beta: [Hkv, G]. pad_front: zero keys before kr_span (the window starts before token 0).
        local_hidden: ~_local_mask(j0, nb) (computed when None).
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
    # scale on the queries (D wide), not on the logits (nwin*Bq wide): one wide pass less
    logits = torch.einsum("bhgnqd,bhnkd->bhgnqk", qb * scale, kw)  # (B, Hkv, G, nb, Bq, nwin*Bq)
    if local_hidden is None:
        local_hidden = _local_hidden(j0, nb, cfg, q.device)
    if torch.is_grad_enabled():  # (in place under autograd would rebase the einsum's view: copies)
        logits = logits.masked_fill(local_hidden, float("-inf"))
    else:
        logits.masked_fill_(local_hidden, float("-inf"))
    o_loc = torch.einsum("bhgnqk,bhnkd->bhgnqd", torch.softmax(logits, dim=-1), vw)
    o_loc = o_loc.reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
    # ---- long branch: NoPE softmax over the selected tokens
    if path == "union":
        qu = torch.nn.functional.pad(q, (0, 0, 0, pad_q)) if pad_q else q
        qu = qu.reshape(B, Hkv, G, nb, Bq, D) * scale  # (B, Hkv, G, nb, Bq, D)
        num, den = _union_long(qu, k_long, v_long, long_mask, cfg.cell)
        num = num.reshape(B, Hkv, G, nb * Bq, D)[:, :, :, :L]
        den = den.reshape(B, Hkv, G, nb * Bq, 1)[:, :, :, :L]
    else:
        # keys on the left: the gradient of k_long comes out [K*s, D] (no transposed copy)
        lg = torch.matmul(k_long, (q * scale).unsqueeze(-1)).squeeze(-1)  # (B, Hkv, G, L, K*s)
        e, den = _own_softmax(lg, ~long_mask, cfg.cell)
        num = torch.matmul(e.unsqueeze(-2), v_long).squeeze(-2)  # (B, Hkv, G, L, D)
    o_long = num / torch.where(den > 0, den, 1.0)  # rows with no cell: num = 0
    rms = torch.rsqrt((o_long * o_long).mean(dim=-1, keepdim=True) + cfg.eps)
    return o_loc + beta.view(1, Hkv, G, 1, 1) * (o_long * rms) + 0.0  # + 0.0: -0.0 -> +0.0 (L12)


class _Chunk:
    """Index bookkeeping of one chunk: query range, key span, long-branch layout, cell indices,
    buffer slots and RoPE tables (every shape a function of the config and the chunk's position;
    every buffer's content a function of the cells available to its block).

    `mode` is the readout mode (`readout_mode`); `cache` a dict shared by one readout call's
    chunks (the local mask of the chunks past the first window)."""

    def __init__(self, j0, j1, T, cfg, idx, cand, mode, D, cdt, cache=None):
        Bq, s = cfg.block, cfg.cell
        dev = idx.device
        if mode == "gather" or (cand is not None and (j1 - 1) * Bq // s <= cfg.pool + cfg.recent):
            cand = None  # "gather", or every available cell fits the candidates' width: the shared slice
        self.U = union_width(cfg, j1, cand is not None)
        path = choose_long_path(self.U, cfg, D, mode)
        self.path = path
        self.j0 = j0
        self.i0, self.i1 = j0 * Bq, min(T, j1 * Bq)
        start = self.i0 - (window_blocks(cfg) - 1) * Bq
        self.lo, self.hi = max(0, start), min(T, j1 * Bq)
        self.pad_front = self.lo - start
        self.local_hidden = _local_hidden(j0, j1 - j0, cfg, dev, cache)
        theta = cfg.rope_theta
        self.cos_k, self.sin_k = rope_tables(self.hi - self.lo, D, theta, dev, cdt, start=self.lo)  # [S, D/2]
        # the key span ends with the chunk's queries (hi == i1): their table is its tail
        self.cos_q, self.sin_q = self.cos_k[self.i0 - self.lo :], self.sin_k[self.i0 - self.lo :]  # [L, D/2]
        cells = idx[:, :, :, self.i0 : self.i1]  # (B, Hkv, G, L, K)
        B, Hkv, G, L, K = cells.shape
        self.span = None  # "union" without candidates: the buffer is the token span [0, span)
        self.s = s
        if path == "union":
            nb = j1 - j0
            U = self.U
            sel = torch.nn.functional.pad(cells, (0, 0, 0, nb * Bq - L), value=-1).reshape(B, Hkv, G, nb, Bq, K)
            if cand is None:  # every cell available to the last block, slot = cell id
                self.span = U * s  # <= (j1 - 1) * Bq <= T (the row is padded to whole chunks)
                self.mask = torch.where(sel >= 0, sel, torch.full_like(sel, U))  # U: no cell
            else:  # block j's candidates, increasing (-1 pads first): slot of a cell by binary search
                uc = cand[:, :, j0:j1, :U].flip(dims=[-1])  # (B, Hkv, nb, U)
                self.cells = uc.clamp(min=0)  # (B, Hkv, nb, U): the buffer's cells (pads read cell 0)
                x = sel.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv, nb, G * Bq * K)  # (B, Hkv, nb, G*Bq*K)
                slot = torch.searchsorted(uc, x).clamp(max=U - 1)
                hit = (torch.gather(uc, -1, slot) == x) & (x >= 0)
                slot = torch.where(hit, slot, torch.full_like(slot, U))  # U: no cell (or none of C_j)
                self.mask = slot.reshape(B, Hkv, nb, G, Bq, K).permute(0, 1, 3, 2, 4, 5)  # (B, Hkv, G, nb, Bq, K)
        else:  # the query's own K cells, gathered whole: (B, Hkv, G, L, K) cell indices, -1 pads read cell 0
            self.cells = cells.clamp(min=0)
            self.mask = cells >= 0  # (B, Hkv, G, L, K): slot holds a cell

    def rope_q(self):
        """cos / sin of the chunk's query positions [L, D/2]."""
        return self.cos_q, self.sin_q

    def rope_k(self):
        """cos / sin of the chunk's key span [S, D/2]."""
        return self.cos_k, self.sin_k

    def _cell_rows(self, x):
        """x [B, Hkv, T, D] -> (its cells [B*Hkv*C, s*D] as a view, flat row of each of self.cells).
        Needs T % s == 0 (the backend pads rows to whole chunks of whole blocks)."""
        B, Hkv, T, D = x.shape
        s = self.s
        if T % s:
            raise ValueError(f"T={T} must be a multiple of cell={s} (pad the row to whole blocks)")
        C = T // s
        base = (torch.arange(B * Hkv, device=x.device) * C).view(B, Hkv, *([1] * (self.cells.dim() - 2)))
        return x.view(B * Hkv * C, s * D), (self.cells + base).reshape(-1)

    def gather(self, x):
        """x [B, Hkv, T, D] -> the long branch's tokens: "union" [B, Hkv, U*s, D] (a slice) or
        [B, Hkv, nb, U*s, D]; "gather" [B, Hkv, G, L, K*s, D]."""
        if self.span is not None:
            return x[:, :, : self.span]
        rows, index = self._cell_rows(x)
        *lead, n = self.cells.shape
        return rows.index_select(0, index).view(*lead, n * self.s, x.shape[-1])

    def scatter_add(self, dst, src):
        """dst [B, Hkv, T, D] (contiguous) += src (layout of `gather`) at the same tokens."""
        if self.span is not None:
            dst[:, :, : self.span] += src
            return
        rows, index = self._cell_rows(dst)
        rows.index_add_(0, index, src.reshape(index.numel(), rows.shape[1]))

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

    def forward(self, x, cfg):
        """chunk_forward of the leaves `x` (`leaves`, maybe detached copies)."""
        return chunk_forward(
            *x[:5],
            self.mask,
            x[5],
            self.rope_q(),
            self.rope_k(),
            self.j0,
            self.pad_front,
            cfg,
            self.path,
            self.local_hidden,
        )


class FreeSoloReadout(torch.autograd.Function):
    """o = local(rope(q), rope(k), v) + beta * rmsnorm(long(q, k, v; idx)), chunked, recomputed in backward.

    forward(q, k, v, beta, idx, cand, cfg, nblocks_per_chunk, long_path):
        q: [B, Hkv, G, T, D] unrotated queries; k, v: [B, Hkv, T, D] (the inputs' dtype);
        beta [Hkv, G] in the compute dtype (its dtype);
        idx: int64 [B, Hkv, G, T, K] selected cells (-1 padded);
        cand: None, or int64 [B, Hkv, ceil(T / Bq), P + W], FS-L's candidate set of every block
        (decreasing, -1 padded), a superset of the block's selected cells: the "union" buffers;
        long_path: the readout mode, one of READOUT_MODES (see `readout_mode`).
        T must be a multiple of the cell (the backend pads rows to whole chunks); row
        independence needs B = 1 and T a whole number of chunks (backend.attention does both).
        Returns o [B, Hkv, G, T, D] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, idx, cand, cfg, nblocks_per_chunk, long_path):
        B, Hkv, G, T, D = q.shape
        nblocks = -(-T // cfg.block)
        cdt = beta.dtype
        out = q.new_empty(B, Hkv, G, T, D)
        cache = {}
        kc, vc = k.detach().to(cdt), v.detach().to(cdt)  # once per row: the chunks gather / slice them
        with torch.no_grad():
            for j0 in range(0, nblocks, nblocks_per_chunk):
                j1 = min(nblocks, j0 + nblocks_per_chunk)
                c = _Chunk(j0, j1, T, cfg, idx, cand, long_path, D, cdt, cache)
                out[:, :, :, c.i0 : c.i1] = c.forward(c.leaves(q, kc, vc, beta), cfg)
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
        cache = {}
        kc, vc = k.to(cdt), v.to(cdt)
        for j0 in range(0, nblocks, ctx.nblocks_per_chunk):
            j1 = min(nblocks, j0 + ctx.nblocks_per_chunk)
            c = _Chunk(j0, j1, T, cfg, idx, cand, ctx.long_path, D, cdt, cache)
            x = [t.detach().to(cdt).requires_grad_(True) for t in c.leaves(q, kc, vc, beta)]
            with torch.enable_grad():
                o = c.forward(x, cfg)
                g = torch.autograd.grad(o, x, dout[:, :, :, c.i0 : c.i1].to(cdt))
            dq[:, :, :, c.i0 : c.i1] = g[0]
            dk[:, :, c.lo : c.hi] += g[1]
            dv[:, :, c.lo : c.hi] += g[2]
            c.scatter_add(dk, g[3])
            c.scatter_add(dv, g[4])
            dbeta += g[5]
        return dq, dk.to(k.dtype), dv.to(v.dtype), dbeta, None, None, None, None, None
