"""Torch streaming state (spec §9): CPU and CUDA, any float dtype, fp32 accumulation (fp64 for fp64).

Vectorized over batch rows and heads. Per batch row and kv head the state holds:

- `ring_k` / `ring_v` [B, Hkv, w, D]: the last `w` keys (rotated at their absolute position, in
  the storage dtype) and values, token t in slot t % w;
- `block_k` / `block_v` [B, Hkv, Bq, D]: the current query block's tokens (unrotated), slot t % Bq;
- the cell store, S slots: `cell_k` / `cell_v` [B, Hkv, S, s, D] (unrotated), `cell_kbar`
  [B, Hkv, S, D] and `cell_a` [B, Hkv, S] (accumulation dtype), `cell_ids` [B, Hkv, S] int64
  (-1 = empty). FS-L: S = P + W, exactly the candidate set C_j (fixed size: memory does not
  depend on T, lemma L7). FS: every available cell (the archive), slot = cell id, grown by doubling.
- `pos` []: int64 token count on the device (the host keeps `length`, the same number).

Decode without host synchronisation (FS-L and FS): a step of one token reads its position from
`pos` on the device, writes the ring and block slots with `index_copy_`, scores the <= P+W held
cells, takes the top-K with two stable sorts (ties: larger cell first) and reads the K*s tokens with
`index_select`: no `.item()`, no `nonzero`, no boolean-mask indexing, no branch on tensor values.
The host branches only on integers it knows (the token count): the block boundary (every Bq
tokens), the local-window mask (T < w) and K_eff = min(K, |C_j|) (|C_j| depends on T only).
Finite checks sync (`bool(isfinite(x).all())`): pass `check_finite=False` to `extend` on the
decode path. `decode_graph()` captures the steady-state FS-L step (and the block-boundary step)
in CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..config import FreeSoloConfig

SDPA_MAX_BATCH = 32768  # batch entries per SDPA call in the long-branch readout

__all__ = [
    "DECODE_KERNELS",
    "DecodeGraph",
    "DecodeTiles",
    "RaggedDecodeGraph",
    "TorchCacheState",
    "fsl_candidate_count",
]

# One-token step: "torch" (torch ops), "triton" (fused kernels, freesolo.backends.triton.decode,
# shaped by `DecodeTiles`), "auto" (triton on CUDA when triton imports and the dtype is float32 /
# bfloat16 / float16).
DECODE_KERNELS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class DecodeTiles:
    """How the fused Triton decode step splits its work (`TorchCacheState.decode_tiles`).

    None of these depends on B, T or the data (row independence, L12); they change float32
    rounding order only (the window's online-softmax split), never the selection.
    """

    impl: str = "split"
    """"split" (default): two kernels: (B*Hkv, NW + NL) programs (window chunks of `window_chunk`
    slots for the G query heads of a kv head; FS-L: one long-branch program per query head; FS:
    one scoring program per archive chunk), then (B*Hq,) programs that merge the partials (FS: the
    top-K merge and the readout) and advance pos; one batched launch also serves rows at
    different positions. "single": one program per (row, kv head) doing everything for its G
    heads in sequence (the first kernel; FS-B's fused step runs it). H200, H 16, D 64, bf16, CUDA
    graph, device time per step (`benchmarks/results/session_2026-12-01_s21/call2/`): the default
    (split, 64 slots, 2 warps) FS-L 11.5 us at B 1 and 46.8 us at B 32 from 4k to 1M, FS 69.7 us at
    1M (SDPA 946 us); single (128 slots, 8 warps) 21.1 / 108.4 us and 86.0 us; split with 128
    slots at 8 warps (the default before s21) 8.9 / 119.1 us and 165.8 us: at B = 32 fewer warps
    per program leave room for more programs per SM."""
    window_chunk: int = 64
    """split: ring slots per window program (power of 2; the window is split in
    ceil(w / window_chunk)); single: at most this many ring slots per window tile."""
    num_warps: int = 2
    """warps per program (split: of both kernels; single: of `_decode_kernel`)."""
    fs_chunk: Optional[int] = None
    """FS: archive cells per scoring program (power of 2); None: 128, more past 2048 chunks."""
    boundary: str = "torch"
    """FS-L block boundary of the fused path: "torch" (`TorchCacheState._advance`, ~30 torch ops)
    or "triton" (one launch of `fsl_boundary`: only the new cells move; a no-op for rows not at a
    boundary, so rows at different positions need no per-row host work). "triton" once failed the
    H200 paper-size float32 test (it dropped the first block's cells while fewer than `recent`
    cells were available, issue 12); fixed in 2e35fb3, the test passes on the H200 (2026-12-01)."""

    def __post_init__(self):
        if self.impl not in ("split", "single"):
            raise ValueError(f"DecodeTiles.impl={self.impl!r} must be 'split' or 'single'")
        if self.boundary not in ("torch", "triton"):
            raise ValueError(f"DecodeTiles.boundary={self.boundary!r} must be 'torch' or 'triton'")
        for name in ("window_chunk", "num_warps") + (("fs_chunk",) if self.fs_chunk is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"DecodeTiles.{name}={value!r} must be a power of 2")

_BUFFERS = (
    "pos",
    "inv_freq",
    "sigma",
    "lam",
    "ones_beta",
    "ring_k",
    "ring_v",
    "block_k",
    "block_v",
    "cell_ids",
    "cell_k",
    "cell_v",
    "cell_kbar",
    "cell_a",
)


_ROW_BUFFERS = ("ring_k", "ring_v", "block_k", "block_v", "cell_ids", "cell_k", "cell_v", "cell_kbar", "cell_a")


def fsl_candidate_count(cfg: FreeSoloConfig, n_avail: int) -> int:
    """|C_j| for a block with n_avail available cells (the same for every kv head and batch row)."""
    if cfg.variant == "fsl":
        return min(n_avail, cfg.recent) + min(cfg.pool, max(0, n_avail - cfg.recent))
    return n_avail


def _sort_desc_ties_larger_id(values: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest `values` along the last dim, ties to the larger id, in order.

    values [..., S] (float), ids [..., S] (int64, broadcastable to values) -> int64 [..., k].
    Two stable sorts (by id, then by value): no host synchronisation.
    """
    ids = ids.expand_as(values)
    by_id = torch.sort(ids, dim=-1, descending=True, stable=True).indices  # [..., S]
    by_value = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True).indices
    return by_id.gather(-1, by_value[..., :k])


def _gather_cells(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """store [B, Hkv, S, ...], slots int64 [B, Hkv, M] -> [B, Hkv, M, ...] (index_select of rows)."""
    B, Hkv, S = store.shape[:3]
    rows = torch.arange(B * Hkv, device=store.device).view(B, Hkv, 1) * S + slots  # [B, Hkv, M]
    flat = store.reshape((B * Hkv * S,) + store.shape[3:])
    return flat.index_select(0, rows.reshape(-1)).view((B, Hkv, slots.shape[2]) + store.shape[3:])


class TorchCacheState:
    """Streaming state of one layer in torch tensors (FS, FS-L).

    Args:
        cfg: FreeSoloConfig (variant "fs" or "fsl"). batch, num_heads, num_kv_heads, head_dim.
        dtype, device: storage dtype / device; when None they are taken from the first chunk.
    """

    kind = "torch"
    variants = ("fs", "fsl")

    def __init__(
        self,
        cfg: FreeSoloConfig,
        batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Optional[torch.dtype] = None,
        device=None,
        decode_kernel: str = "torch",
        decode_tiles: Optional[DecodeTiles] = None,
    ):
        if cfg.variant not in self.variants:
            raise ValueError(f"{type(self).__name__} implements variants {self.variants}, not {cfg.variant!r}")
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={decode_kernel!r} must be one of {DECODE_KERNELS}")
        if decode_tiles is not None and not isinstance(decode_tiles, DecodeTiles):
            raise TypeError(f"decode_tiles must be a DecodeTiles, got {type(decode_tiles).__name__}")
        self.decode_kernel = decode_kernel
        self.decode_tiles = DecodeTiles() if decode_tiles is None else decode_tiles
        self.cfg = cfg
        self.B, self.Hq, self.Hkv, self.D = batch, num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.length = 0
        self.dtype: Optional[torch.dtype] = None
        self.device: Optional[torch.device] = None
        if dtype is not None and device is not None:
            self.allocate(dtype, device)

    # ---- storage --------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.dtype is not None

    def allocate(self, dtype: torch.dtype, device) -> None:
        """Allocate every buffer (FS-L: their final size) for storage `dtype` on `device`."""
        if not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype} must be a floating dtype")
        cfg, B, Hkv, D, G = self.cfg, self.B, self.Hkv, self.D, self.group
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" -> "cuda:N": equal to its tensors' device
            device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.device = dtype, device
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.pos = torch.zeros((), dtype=torch.int64, device=device)
        half = torch.arange(D // 2, dtype=torch.float64, device=device)
        self.inv_freq = cfg.rope_theta ** (-2.0 * half / D)  # [D/2] float64
        self.sigma = torch.tensor(cfg.per_head("sigma", self.Hq), dtype=self.acc, device=device).view(Hkv, G)
        self.lam = torch.tensor(cfg.per_head("lam", self.Hq), dtype=self.acc, device=device).view(Hkv, G)
        self.ones_beta = torch.ones(self.Hq, dtype=self.acc, device=device)
        self.ring_k = torch.zeros(B, Hkv, cfg.window, D, dtype=dtype, device=device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.block_k = torch.zeros(B, Hkv, cfg.block, D, dtype=dtype, device=device)
        self.block_v = torch.zeros_like(self.block_k)
        slots = cfg.pool + cfg.recent if cfg.variant == "fsl" else max(16, cfg.top_k)
        self._alloc_store(slots)
        self._fused = self._resolve_decode_kernel()

    def _resolve_decode_kernel(self) -> bool:
        """True when one-token steps run the fused Triton kernel (after allocation: device known)."""
        if self.decode_kernel == "torch":
            return False
        if self.decode_kernel == "auto":
            if self.device.type != "cuda":
                return False
            if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                return False
            try:
                import triton  # noqa: F401
            except ImportError:
                return False
        from ..backends.triton.decode import decode_supported_reasons

        reasons = decode_supported_reasons(self)
        if reasons:
            raise ValueError("decode_kernel='triton': " + "; ".join(reasons))
        return True

    def _alloc_store(self, slots: int) -> None:
        B, Hkv, D, s, dev = self.B, self.Hkv, self.D, self.cfg.cell, self.device
        self.cell_ids = torch.full((B, Hkv, slots), -1, dtype=torch.int64, device=dev)
        self.cell_k = torch.zeros(B, Hkv, slots, s, D, dtype=self.dtype, device=dev)
        self.cell_v = torch.zeros_like(self.cell_k)
        self.cell_kbar = torch.zeros(B, Hkv, slots, D, dtype=self.acc, device=dev)
        self.cell_a = torch.zeros(B, Hkv, slots, dtype=self.acc, device=dev)

    def buffers(self) -> dict:
        """Every tensor the state holds ({} before the first chunk)."""
        return {name: getattr(self, name) for name in _BUFFERS} if self.allocated else {}

    def memory_bytes(self) -> int:
        """Bytes of the tensors held (numel * element_size, summed)."""
        return int(sum(t.numel() * t.element_size() for t in self.buffers().values()))

    def _grow_store(self, needed: int) -> None:
        """FS: make room for `needed` cell slots (capacity doubles)."""
        slots = self.cell_ids.shape[2]
        if needed <= slots:
            return
        old = {name: getattr(self, name) for name in ("cell_ids", "cell_k", "cell_v", "cell_kbar", "cell_a")}
        self._alloc_store(max(needed, 2 * slots))
        for name, tensor in old.items():
            getattr(self, name)[:, :, :slots] = tensor

    # ---- RoPE and cell statistics ---------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Half-split RoPE in the accumulation dtype. x [..., n, D], positions [n] int64 -> [..., n, D]."""
        angle = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [n, D/2], float64
        cos, sin = angle.cos().to(self.acc), angle.sin().to(self.acc)
        x = x.to(self.acc)
        half = self.D // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _cell_stats(self, tokens: torch.Tensor):
        """tokens [B, Hkv, m*s, D] -> cells [B, Hkv, m, s, D], kbar [B, Hkv, m, D], a [B, Hkv, m]."""
        B, Hkv, n, D = tokens.shape
        cells = tokens.reshape(B, Hkv, n // self.cfg.cell, self.cfg.cell, D)
        x = cells.to(self.acc)
        kbar = x.mean(dim=3)
        a = (x * x).sum(dim=-1).sqrt().amax(dim=3)
        return cells, kbar, a

    # ---- cells becoming available ---------------------------------------------------------
    def _advance(self, tokens_k: torch.Tensor, tokens_v: torch.Tensor, n_avail) -> None:
        """Make the m = tokens // s cells ending at cell n_avail available.

        tokens_k / tokens_v [B, Hkv, m*s, D] (unrotated) hold cells [n_avail - m, n_avail).
        n_avail: an int, or (FS-L, inside a CUDA graph) a 0-dim int64 tensor on the device.
        FS: appended to the archive. FS-L: the union of the held cells and the new ones keeps the
        W most recent and the top-P older by (a_c, c); the rest is dropped for ever (spec §5).
        """
        cfg = self.cfg
        k_cells, kbar, a = self._cell_stats(tokens_k)
        v_cells = tokens_v.reshape(k_cells.shape)
        m = k_cells.shape[2]
        new_ids = (n_avail - m + torch.arange(m, device=self.device)).expand(self.B, self.Hkv, m)
        if cfg.variant != "fsl":  # FS, FS-B: the archive
            self._grow_store(n_avail)
            lo = n_avail - m
            self.cell_ids[:, :, lo:n_avail] = new_ids
            self.cell_k[:, :, lo:n_avail] = k_cells
            self.cell_v[:, :, lo:n_avail] = v_cells
            self.cell_kbar[:, :, lo:n_avail] = kbar
            self.cell_a[:, :, lo:n_avail] = a
            return
        S = self.cell_ids.shape[2]
        ids = torch.cat([self.cell_ids, new_ids], dim=2)  # [B, Hkv, S+m]
        a_all = torch.cat([self.cell_a, a], dim=2)
        recent = ids >= n_avail - cfg.recent
        inf = torch.full_like(a_all, float("inf"))
        key = torch.where(recent, inf, torch.where(ids >= 0, a_all, -inf))  # recent first, empty last
        order = _sort_desc_ties_larger_id(key, ids, S + m)  # [B, Hkv, S+m]: the union ranked
        rank = torch.empty_like(order).scatter_(2, order, torch.arange(S + m, device=self.device).expand_as(order))
        kept = (rank < S) & (key > float("-inf"))  # the new candidate set (spec §5), <= S cells
        # Slot-stable layout: kept held cells stay in their slots; the kept new cells, in id order,
        # fill the freed slots in slot order; other freed slots become empty. (Any layout gives the
        # same outputs: selection and readout order go by score and cell id, never by slot.)
        freed = ~kept[:, :, :S]  # [B, Hkv, S]
        kept_new = kept[:, :, S:]  # [B, Hkv, m]
        slot_idx = torch.arange(S, device=self.device).expand_as(freed)
        freed_slots = torch.sort(torch.where(freed, slot_idx, slot_idx + S), dim=2, stable=True).values  # freed first
        nidx = torch.cumsum(kept_new.to(torch.int64), dim=2) - 1  # rank of a kept new cell among them
        target = freed_slots.gather(2, nidx.clamp(0, S - 1))  # its slot (a freed one: kept new <= freed)
        src = torch.full((self.B, self.Hkv, S + 1), -1, dtype=torch.int64, device=self.device)
        src.scatter_(2, torch.where(kept_new, target, S), torch.arange(m, device=self.device).expand_as(target))
        src = src[:, :, :S]  # [B, Hkv, S]: the new cell a slot receives, -1 none (S: a dump for the others)
        has = src >= 0
        take = src.clamp(min=0)
        self.cell_ids.copy_(
            torch.where(freed, torch.where(has, new_ids.gather(2, take), torch.full_like(take, -1)), self.cell_ids)
        )
        for name, new in (("cell_k", k_cells), ("cell_v", v_cells), ("cell_kbar", kbar), ("cell_a", a)):
            store = getattr(self, name)
            mask = has.view(has.shape + (1,) * (store.dim() - 3))
            store.copy_(torch.where(mask, _gather_cells(new.contiguous(), take), store))

    def _boundary(self, t: Optional[int] = None) -> None:
        """The block boundary at token count t (host int; None: read from `pos` on the device):
        the finished block's cells become available. Fused FS-L with DecodeTiles(boundary="triton"):
        one Triton launch; otherwise `_advance` (torch ops)."""
        cfg = self.cfg
        if self._fused and cfg.variant == "fsl" and self.decode_tiles.boundary == "triton":
            from ..backends.triton.decode import fsl_boundary

            fsl_boundary(self)
            return
        n_avail = torch.div(self.pos, cfg.cell, rounding_mode="floor") if t is None else t // cfg.cell
        self._advance(self.block_k, self.block_v, n_avail)

    # ---- one piece of a chunk (inside one query block) ------------------------------------
    def _piece(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """n tokens inside one query block (boundary already applied).

        q [B, n, Hq, D], k / v [B, n, Hkv, D] (storage dtype), beta [Hq] -> o [B, n, Hq, D].
        """
        cfg, B, Hkv, G, D = self.cfg, self.B, self.Hkv, self.group, self.D
        n, t0 = q.shape[1], self.length
        if n == 1 and self._fused:  # fused Triton step (ring / block writes, both branches, output)
            from ..backends.triton.decode import decode_step

            return decode_step(self, q, k, v, beta)  # advances pos
        w = cfg.window
        scale = 1.0 / math.sqrt(D)
        steps = torch.arange(n, device=self.device)
        positions = self.pos + steps  # [n] int64, on the device
        kt = k.permute(0, 2, 1, 3)  # (B, Hkv, n, D)
        vt = v.permute(0, 2, 1, 3)
        k_rot = self._rope(kt, positions).to(self.dtype)  # (B, Hkv, n, D)
        qg = q.reshape(B, n, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D)
        q_rot = self._rope(qg.reshape(B, Hkv, G, n, D), positions).reshape(B, Hkv, G * n, D).to(self.dtype)

        # local branch: RoPE window over keys i-w < t <= i
        if n == 1:
            slot = positions % w
            self.ring_k.index_copy_(2, slot, k_rot)
            self.ring_v.index_copy_(2, slot, vt)
            mask = None
            if t0 < w - 1:  # some slots still empty (host-known)
                ring_pos = self.pos - torch.remainder(self.pos - torch.arange(w, device=self.device), w)  # [w]
                mask = (ring_pos >= 0).view(1, 1, 1, w)
            o_loc = F.scaled_dot_product_attention(q_rot, self.ring_k, self.ring_v, attn_mask=mask, scale=scale)
        else:
            last = self.pos - 1
            ring_pos = last - torch.remainder(last - torch.arange(w, device=self.device), w)  # [w] positions held
            key_pos = torch.cat([ring_pos, positions])  # [w + n]
            qp = positions[:, None]
            mask = (key_pos[None, :] <= qp) & (key_pos[None, :] > qp - w) & (key_pos[None, :] >= 0)  # [n, w+n]
            mask = mask.repeat(G, 1).view(1, 1, G * n, w + n)
            keys = torch.cat([self.ring_k, k_rot], dim=2)  # (B, Hkv, w+n, D)
            values = torch.cat([self.ring_v, vt], dim=2)
            o_loc = F.scaled_dot_product_attention(q_rot, keys, values, attn_mask=mask, scale=scale)
            slot = positions % w
            self.ring_k.index_copy_(2, slot, k_rot)
            self.ring_v.index_copy_(2, slot, vt)
        self.block_k.index_copy_(2, positions % cfg.block, kt)
        self.block_v.index_copy_(2, positions % cfg.block, vt)

        out = o_loc.to(self.acc).view(B, Hkv, G, n, D)
        n_avail = (t0 // cfg.block) * cfg.block // cfg.cell
        k_eff = min(cfg.top_k, self._candidate_count(n_avail))
        if k_eff > 0:
            o_long = self._long_range(qg, positions, n_avail, k_eff)  # (B, Hkv, G, n, D), acc
            normed = o_long * torch.rsqrt((o_long * o_long).mean(dim=-1, keepdim=True) + cfg.eps)
            out = out + beta.to(self.acc).view(1, Hkv, G, 1, 1) * normed
        self.pos += n
        return out.permute(0, 3, 1, 2, 4).reshape(B, n, self.Hq, D).to(self.dtype)  # (B, n, Hq, D)

    def _candidate_count(self, n_avail: int) -> int:
        """|C_j| (FS, FS-L): the same for every batch row and kv head, known on the host."""
        return fsl_candidate_count(self.cfg, n_avail)

    def _long_range(self, qg: torch.Tensor, positions: torch.Tensor, n_avail: int, k_eff: int) -> torch.Tensor:
        """NoPE readout of the top-k_eff held cells. qg [B, Hkv, G*n, D] -> [B, Hkv, G, n, D] (acc)."""
        cfg, B, Hkv, G, D, s = self.cfg, self.B, self.Hkv, self.group, self.D, self.cfg.cell
        n = positions.shape[0]
        used = self.cell_ids.shape[2] if cfg.variant == "fsl" else n_avail
        ids = self.cell_ids[:, :, :used]  # [B, Hkv, S]
        kbar = self.cell_kbar[:, :, :used]  # [B, Hkv, S, D]
        a = self.cell_a[:, :, :used]
        qa = qg.to(self.acc)
        dots = torch.matmul(qa, kbar.transpose(-1, -2)).view(B, Hkv, G, n, used)  # (B, Hkv, G, n, S)
        dist = (positions.view(1, 1, 1, n, 1) - ids.view(B, Hkv, 1, 1, used) * s).to(self.acc)  # i - p_c
        prior = torch.erf(self.sigma.view(1, Hkv, G, 1, 1) * dist / (2.0 * s))
        scores = scale_dot(dots, D) + self.lam.view(1, Hkv, G, 1, 1) * a.view(B, Hkv, 1, 1, used) * prior
        scores = torch.where(ids.view(B, Hkv, 1, 1, used) >= 0, scores, torch.full_like(scores, float("-inf")))
        chosen = _sort_desc_ties_larger_id(scores, ids.view(B, Hkv, 1, 1, used), k_eff)  # (B, Hkv, G, n, k_eff) slots
        flat = chosen.reshape(B, Hkv, G * n * k_eff)
        keys = _gather_cells(self.cell_k, flat)  # (B, Hkv, G*n*k_eff, s, D)
        values = _gather_cells(self.cell_v, flat)
        N = B * Hkv * G * n
        keys = keys.reshape(N, 1, k_eff * s, D)
        values = values.reshape(N, 1, k_eff * s, D)
        query = qg.reshape(N, 1, 1, D)
        # SDPA's CUDA kernels launch one grid row per batch entry (cuDNN fails past 65535): fixed slices of
        # SDPA_MAX_BATCH entries (each entry is computed alone, so the slicing changes no bit).
        o_long = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[j : j + SDPA_MAX_BATCH], keys[j : j + SDPA_MAX_BATCH], values[j : j + SDPA_MAX_BATCH],
                    scale=1.0 / math.sqrt(D),
                )
                for j in range(0, N, SDPA_MAX_BATCH)
            ]
        )  # (N, 1, 1, D)
        return o_long.to(self.acc).view(B, Hkv, G, n, D)

    # ---- public operations ----------------------------------------------------------------
    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: Optional[torch.Tensor]) -> torch.Tensor:
        """q [B, n, Hq, D], k / v [B, n, Hkv, D] -> o [B, n, Hq, D] (split at block boundaries)."""
        cfg = self.cfg
        if not self.allocated:
            self.allocate(q.dtype, q.device)
        beta = self.ones_beta if beta is None else beta
        outs, off, n = [], 0, q.shape[1]
        with torch.no_grad():
            while off < n:
                t = self.length
                if t > 0 and t % cfg.block == 0:
                    self._boundary(t)
                m = min(n - off, cfg.block - t % cfg.block)
                outs.append(self._piece(q[:, off : off + m], k[:, off : off + m], v[:, off : off + m], beta))
                self.length += m
                off += m
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Consume k / v [B, n, Hkv, D] without outputs, vectorized over the whole chunk.

        The resulting state is the one `extend` would leave (tested): the ring gets the last w
        tokens, every block boundary inside the chunk is applied at once (FS-L: top-P of the
        union is the streaming pool, lemma L3), the block buffer gets the tokens of the last block.
        """
        cfg, Bq, s = self.cfg, self.cfg.block, self.cfg.cell
        if not self.allocated:
            self.allocate(k.dtype, k.device)
        with torch.no_grad():
            t0, n = self.length, k.shape[1]
            t1 = t0 + n
            kt = k.permute(0, 2, 1, 3)  # (B, Hkv, n, D)
            vt = v.permute(0, 2, 1, 3)
            # ring: the last min(n, w) tokens
            tail = min(n, cfg.window)
            positions = self.pos + torch.arange(n - tail, n, device=self.device)
            slot = positions % cfg.window
            self.ring_k.index_copy_(2, slot, self._rope(kt[:, :, n - tail :], positions).to(self.dtype))
            self.ring_v.index_copy_(2, slot, vt[:, :, n - tail :])
            # blocks: the state's current block j0 (its tokens [j0*Bq, t0) are buffered)
            j0 = (t0 - 1) // Bq if t0 > 0 else 0
            j1 = (t1 - 1) // Bq  # block of the chunk's last token
            buffered = t0 - j0 * Bq
            if j1 > j0:
                pend_k = torch.cat([self.block_k[:, :, :buffered], kt], dim=2)  # tokens [j0*Bq, t1)
                pend_v = torch.cat([self.block_v[:, :, :buffered], vt], dim=2)
                done = (j1 - j0) * Bq
                self._advance(pend_k[:, :, :done], pend_v[:, :, :done], j1 * Bq // s)
                self.block_k[:, :, : t1 - j1 * Bq] = pend_k[:, :, done:]
                self.block_v[:, :, : t1 - j1 * Bq] = pend_v[:, :, done:]
            else:
                self.block_k[:, :, buffered : buffered + n] = kt
                self.block_v[:, :, buffered : buffered + n] = vt
            self.pos += n
            self.length = t1

    def state_dict(self) -> dict:
        """Clones of every tensor plus the token count and storage dtype."""
        out = {name: t.clone() for name, t in self.buffers().items()}
        out["length"] = self.length
        out["dtype"] = None if self.dtype is None else str(self.dtype)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`; FS-L copies into the existing buffers (CUDA graphs stay valid)."""
        if state.get("dtype") is None:
            self.__init__(
                self.cfg, self.B, self.Hq, self.Hkv, self.D,
                decode_kernel=self.decode_kernel, decode_tiles=self.decode_tiles,
            )  # fmt: skip
            return
        dtype = getattr(torch, state["dtype"].replace("torch.", ""))
        if not self.allocated:
            self.allocate(dtype, state["ring_k"].device)
        if dtype != self.dtype:
            raise ValueError(f"state dtype {dtype} != cache dtype {self.dtype}")
        for name in ("ring_k", "block_k"):
            if tuple(state[name].shape) != tuple(getattr(self, name).shape):
                raise ValueError(f"state {name} shape {tuple(state[name].shape)} != {tuple(getattr(self, name).shape)}")
        if tuple(state["cell_ids"].shape) != tuple(self.cell_ids.shape):
            if self.cfg.variant == "fsl":
                raise ValueError(
                    f"state cell_ids shape {tuple(state['cell_ids'].shape)} != {tuple(self.cell_ids.shape)}"
                )
            self._alloc_store(state["cell_ids"].shape[2])
        for name in _BUFFERS:
            getattr(self, name).copy_(state[name])
        self.length = int(state["length"])

    def row_view(self, b: int, pos: torch.Tensor) -> "TorchCacheState":
        """A batch-1 FS-L state whose buffers are views of row b's: its operations (`extend`,
        `prefill`, `_advance`, the fused step) write through to this state. pos: the row's 0-dim
        int64 position tensor on the device (e.g. a view of a per-row position vector)."""
        if self.cfg.variant != "fsl" or not self.allocated:
            raise ValueError("row views need an allocated FS-L state (FS's archive is reallocated as it grows)")
        row = TorchCacheState.__new__(TorchCacheState)
        row.__dict__.update(self.__dict__)  # config, dtype, device, RoPE / prior tables, decode flags
        for name in ("_triton_split_scratch", "_triton_fs_scratch"):  # sized for B rows
            row.__dict__.pop(name, None)
        row.B = 1
        for name in _ROW_BUFFERS:
            setattr(row, name, getattr(self, name)[b : b + 1])
        row.pos = pos
        return row

    def decode_graph(self, beta: Optional[torch.Tensor] = None) -> "DecodeGraph":
        """A CUDA graph of the one-token step (`DecodeGraph`): FS-L (torch step: steady state T >= w
        and |C_j| >= K), FS and FS-B with the fused step."""
        return DecodeGraph(self, beta)


def scale_dot(dots: torch.Tensor, D: int) -> torch.Tensor:
    """scale * q . kbar with scale = 1/sqrt(D)."""
    return dots * (1.0 / math.sqrt(D))


class DecodeGraph:
    """The one-token FS-L decode step captured in CUDA graphs: no host sync, no Python per kernel.

    Two graphs share one memory pool: `step` (a token inside a block) and `boundary_step` (the
    block boundary, i.e. the pool update, then the token). `graph(q, k, v)` with q [B, 1, Hq, D],
    k / v [B, 1, Hkv, D] copies the inputs into static buffers, replays the right graph (the host
    knows T) and returns the static output [B, 1, Hq, D], overwritten by the next call (clone it
    to keep it). Inputs are not validated (no finite check). With the torch step it needs the
    steady state when built: T >= w and |C_j| >= K, so that every later step runs the same kernels.

    With the fused Triton step (`decode_kernel="triton"`), the kernel reads T from the device, so
    the graph can be built at any T >= 1, and FS and FS-B are captured too: their step graph is
    replayed inside blocks; at a block boundary the archive append (`_boundary`: torch ops, FS-B
    with its forest carries; no host sync) runs eagerly before the replay, and
    when a buffer the step reads is re-allocated there (the archive doubles, and FS-B's forest tables
    with it: host-known) the step is captured again.
    """

    def __init__(self, state: TorchCacheState, beta: Optional[torch.Tensor] = None):
        cfg = state.cfg
        self._check(state)
        t = state.length
        n_avail = (t // cfg.block) * cfg.block // cfg.cell
        fused = bool(getattr(state, "_fused", False))
        if fused and t < 1:
            raise ValueError("decode_graph needs at least one token in the cache (T=0): decode one eagerly first")
        if not fused and (t < cfg.window or fsl_candidate_count(cfg, n_avail) < cfg.top_k):
            raise ValueError(
                f"decode_graph needs the steady state (T >= window={cfg.window}, at least top_k={cfg.top_k} "
                f"held cells); T={t}: decode eagerly a few tokens first"
            )
        self.state = state
        self.archive = cfg.variant != "fsl"  # FS: boundaries eager, step re-captured when the store grows
        B, Hq, Hkv, D = state.B, state.Hq, state.Hkv, state.D
        self.q = torch.zeros(B, 1, Hq, D, dtype=state.dtype, device=state.device)
        self.k = torch.zeros(B, 1, Hkv, D, dtype=state.dtype, device=state.device)
        self.v = torch.zeros_like(self.k)
        self.beta = (state.ones_beta if beta is None else beta).detach().clone()
        self._build()

    def _build(self) -> None:
        state = self.state
        snapshot = state.state_dict()
        self._warmup((self._step,) if self.archive else (self._step, self._boundary_step))
        state.load_state_dict(snapshot)
        self.graph, self.out = self._capture(self._step, None)
        if not self.archive:
            self.boundary_graph, self.boundary_out = self._capture(self._boundary_step, self.graph)
        state.load_state_dict(snapshot)  # capture records without running; restore anyway
        self.layout = self._layout()

    def _layout(self) -> tuple:
        """Addresses of the state's buffers: a captured step reads these (FS / FS-B: they change
        only when the archive, with FS-B's forest tables, is re-allocated at a block boundary)."""
        return tuple(x.data_ptr() for x in self.state.buffers().values())

    def _step(self) -> torch.Tensor:
        return self.state._piece(self.q, self.k, self.v, self.beta)

    def _boundary_step(self) -> torch.Tensor:
        state = self.state
        state._boundary(None)  # n_avail = T // s read on the device
        return state._piece(self.q, self.k, self.v, self.beta)

    # CUDA specifics (a CPU test replaces these three)
    @staticmethod
    def _check(state: TorchCacheState) -> None:
        if not state.allocated or state.device.type != "cuda":
            raise ValueError("decode_graph needs an allocated cache on a CUDA device")
        if state.cfg.variant != "fsl" and not getattr(state, "_fused", False):
            raise ValueError(
                f"decode_graph captures the FS-L step (and FS / FS-B with decode_kernel='triton'), not "
                f"variant={state.cfg.variant!r} with the torch step (its store grows)"
            )

    def _warmup(self, fns) -> None:
        """Run each step once on a side stream (allocator, kernel selection); the caller restores the state."""
        device = self.state.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream(device).wait_stream(side)

    def _capture(self, fn, share_with):
        graph = torch.cuda.CUDAGraph()
        pool = None if share_with is None else share_with.pool()
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch._foreach_copy_((self.q, self.k, self.v), (q, k, v))  # one launch where it can (host time)
        return self.replay()

    def replay(self) -> torch.Tensor:
        """The step on the static inputs `self.q` [B, 1, Hq, D], `self.k` / `self.v` [B, 1, Hkv, D]
        as they are (a caller that writes its q / k / v there, e.g. as the output of its
        projection, saves `__call__`'s copy launch). Returns the static output."""
        state = self.state
        if self.archive:
            if state.length % state.cfg.block == 0:  # FS / FS-B: the block's cells, eagerly
                state._boundary(state.length)
                if self._layout() != self.layout:  # the archive (and FS-B's forests) moved: capture again
                    self._build()
            self.graph.replay()
            out = self.out
        elif state.length % state.cfg.block == 0:
            self.boundary_graph.replay()
            out = self.boundary_out
        else:
            self.graph.replay()
            out = self.out
        state.length += 1
        return out


class RaggedDecodeGraph:
    """One CUDA graph of the one-token FS-L step for rows at different positions.

    The state is a ragged FS-L cache's batched state (rows are views of it, positions in
    `state.pos_rows` [B]) on the fused split step with `DecodeTiles(boundary="triton")`: the graph
    holds the boundary kernel (a no-op for rows not at a boundary), the partials and the finish
    kernel, all reading each row's position on the device, so no host branch depends on the rows'
    lengths. `graph(q, k, v, active)` copies q [B, 1, Hq, D], k / v [B, 1, Hkv, D] and the int8
    [B] device mask `active` (rows with 0 are left untouched, zero outputs) into static buffers,
    replays, and returns the static output (overwritten by the next call). The caller keeps the
    host lengths (`FreeSoloCache` does, through `decode_graph()` of a ragged cache).
    """

    def __init__(self, state: TorchCacheState, beta: Optional[torch.Tensor] = None):
        if getattr(state, "pos_rows", None) is None or not state._fused or state.cfg.variant != "fsl":
            raise ValueError("RaggedDecodeGraph needs the batched state of a ragged FS-L cache on the fused step")
        tiles = state.decode_tiles
        if tiles.impl != "split" or tiles.boundary != "triton":
            raise ValueError(
                f"a ragged decode graph needs DecodeTiles(impl='split', boundary='triton'), not {tiles}"
            )
        DecodeGraph._check(state)
        self.state = state
        B, Hq, Hkv, D = state.B, state.Hq, state.Hkv, state.D
        self.q = torch.zeros(B, 1, Hq, D, dtype=state.dtype, device=state.device)
        self.k = torch.zeros(B, 1, Hkv, D, dtype=state.dtype, device=state.device)
        self.v = torch.zeros_like(self.k)
        self.active = torch.zeros(B, dtype=torch.int8, device=state.device)  # all 0 while warming up: no effect
        self.out = torch.zeros(B, 1, Hq, D, dtype=state.dtype, device=state.device)
        self.beta = (state.ones_beta if beta is None else beta).detach().clone()
        DecodeGraph._warmup(self, (self._step,))  # every row inactive: the state does not move
        self.graph, _ = DecodeGraph._capture(self, self._step, None)

    def _step(self) -> torch.Tensor:
        from ..backends.triton.decode import decode_step, fsl_boundary

        state = self.state
        fsl_boundary(state, pos=state.pos_rows, active=self.active)
        pos, active = state.pos_rows, self.active
        return decode_step(state, self.q, self.k, self.v, self.beta, out=self.out, pos=pos, active=active)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        torch._foreach_copy_((self.q, self.k, self.v, self.active), (q, k, v, active))
        self.graph.replay()
        return self.out
