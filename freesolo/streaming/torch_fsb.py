"""FS-B streaming state on torch (spec §6, §9): the archive plus two forests grown at carries.

The state is `TorchCacheState`'s FS archive (every complete cell, slot = cell id; ring; block
buffer) plus, per batch row and kv head:

- the element sequences of the two forests: all cells, and the high-norm cells (a_c > tau_h,
  tested in float64 like the torch backend) compacted per row (`high_cells`, `n_high`);
- one flat node table per forest (`ForestTable`) holding the forest's live trees only: one tree
  per set bit of the row's element count, in one slot per height (the torch backend's
  `NodeTable` layout with `one_tree_per_height`: O(n) nodes, not the O(n log n) of every segment
  of every height). A slot is rebuilt at a carry of the binary counter, from its tree's own
  elements, for the rows whose tree changed (the high-norm forest: rows' counts differ, so the
  rows are picked on the device from the old and new counts). The builder: `build_segments`
  (the torch backend's construction restricted to one segment, ~12 torch ops per level) for the
  torch step, `backends.triton.fsb_build.build_tree_slot` (a sort and one launch per slot) for
  the fused step.

No block boundary reads a device value on the host: the all-cells forest's counts are host ints,
and the high-norm forests' heights to rebuild are bounded on the host from the counts of the
previous boundary (copied without blocking into pinned memory there; `carried_heights`).

Queries search the tables with the torch backend's level-wise beam (`beam_search`), rerank the
union by rho and read the top-K cells (`topk_cells`: ties to the larger cell). With
`decode_kernel="triton"` a one-token step is the fused Triton step (`backends.triton.decode.
decode_step`): two launches for the search of both forests (side by side) and the rerank
(`fsb_search.decode_select_cells`, same tables, same tie rules), one for the local window, the
readout of the chosen cells, RMSNorm and beta (`_decode_kernel`). None reads a host value that changes inside a block, so
`FreeSoloCache.decode_graph()` captures the step in a CUDA graph; a block boundary (`_advance`:
archive append, forest carries) runs eagerly between replays, without a host sync.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..backends.torch.fsb import TREE_FIELDS as _FIELDS
from ..backends.torch.fsb import NodeTable, beam_search, build_segments, content_codes
from ..backends.torch.selection import topk_cells
from ..config import FreeSoloConfig
from ..reference.forest import hyperplanes
from .torch_state import DecodeTiles, TorchCacheState, _gather_cells

__all__ = ["FSB_DECODE_TILES", "ForestTable", "TorchFsbDeviceState", "carried_heights"]

# The fused FS-B step runs the "single" kernel after its search: 128 ring slots per tile, 8 warps.
FSB_DECODE_TILES = DecodeTiles(impl="single", window_chunk=128, num_warps=8)
_BASE_TABLES: dict = {}  # (heights, device) -> ForestTable.base_tensor's int64 table


def _tree_start(n: int, h: int) -> int:
    """First element of the height-h tree of a forest over n elements, -1 if it has none."""
    return ((n >> (h + 1)) << (h + 1)) if (n >> h) & 1 else -1


def carried_heights(counts: list, added: int) -> int:
    """Heights 0 .. H-1 hold every tree that can differ between a forest over p elements and one
    over x in [p, p + added], for every p in `counts` (host ints): H = max bit length of
    p XOR (p + added). (Every x in that range shares the bits of p and p + added above their
    highest differing bit, so the trees of greater heights, start and presence, are the same.)"""
    return max(((p ^ (p + added)).bit_length() for p in counts), default=0)


class ForestTable:
    """The live trees of one forest kind for every (b, kv head): one tree slot per height.

    A forest over n elements is, by the binary counter, one perfect tree per set bit h of n, over
    elements [start_h, start_h + 2^h) with start_h = (n >> (h + 1)) << (h + 1); a query over n
    elements searches exactly these trees (spec §6.4), so the table keeps one slot per height:
    height h's tree at base(h) = nodes(0) + ... + nodes(h - 1), levels 0..h inside (the NodeTable
    layout with `one_tree_per_height`). That is O(n) nodes per row and kv head (every segment of
    every height would be O(n log n): 21.6 GiB at 1M tokens, H 16, D 64). A slot is rebuilt from
    its own elements when its row's count gains a tree there (a carry of the binary counter), so
    each element enters one build per height: O(n log n) work in total. A tree that vanishes
    leaves its slot as it was: a search over the row's count never visits that height.

    mu [B, Hkv, N, D]; rad, A [B, Hkv, N] (accumulation dtype); e, cell [B, Hkv, N] int64, with
    N = base(heights). The table stores no counts: the caller passes the old and new element
    counts at each growth (`grow_uniform`: host ints, the same for every row; `grow_rows`: per-row
    int64 tensors on the device, no host sync).
    """

    def __init__(self, B: int, Hkv: int, D: int, dtype: torch.dtype, device, heights: int = 4, builder: str = "torch"):
        """builder: how a changed slot is rebuilt: "torch" (`build_segments`, ~12 torch ops per
        level) or "triton" (`backends.triton.fsb_build.build_tree_slot`: one torch.sort and one
        launch per slot; the fused decode's state, CUDA or TRITON_INTERPRET=1)."""
        if builder not in ("torch", "triton"):
            raise ValueError(f"builder={builder!r} must be 'torch' or 'triton'")
        self.B, self.Hkv, self.D, self.dtype, self.device = B, Hkv, D, dtype, device
        self.builder = builder
        self.heights = 0
        self._all_rows = torch.ones(B, Hkv, dtype=torch.bool, device=device)  # `changed` of a uniform growth
        self._allocate(heights)

    @staticmethod
    def base(h: int) -> int:
        """Flat id of the slot of height h: nodes(0) + ... + nodes(h - 1) = 2^(h+1) - 2 - h."""
        return (2 << h) - 2 - h

    def _allocate(self, heights: int) -> None:
        """Slots for trees of heights 0 .. heights - 1 (the built ones keep their place)."""
        if heights <= self.heights:
            return
        N = self.base(heights)
        B, Hkv, dev = self.B, self.Hkv, self.device
        new = {
            "mu": torch.zeros(B, Hkv, N, self.D, dtype=self.dtype, device=dev),
            "rad": torch.zeros(B, Hkv, N, dtype=self.dtype, device=dev),
            "A": torch.zeros(B, Hkv, N, dtype=self.dtype, device=dev),
            "e": torch.zeros(B, Hkv, N, dtype=torch.int64, device=dev),
            "cell": torch.full((B, Hkv, N), -1, dtype=torch.int64, device=dev),
        }
        if self.heights:
            old = self.base(self.heights)
            for name in _FIELDS:
                new[name][:, :, :old] = getattr(self, name)
        for name in _FIELDS:
            setattr(self, name, new[name])
        self.heights = heights

    def grow_uniform(self, elems: dict, n_old: int, n_new: int, cfg: FreeSoloConfig, outward: bool) -> None:
        """Every row goes from n_old to n_new >= n_old elements (host ints): each height whose
        tree is new is rebuilt for all rows (no host sync: the start is a host int).

        elems: contiguous kbar [B, Hkv, M, D], a, cells, codes [B, Hkv, M] in position order, M >= n_new.
        """
        self._allocate(n_new.bit_length())
        for h in range(n_new.bit_length()):
            start = _tree_start(n_new, h)
            if start >= 0 and start != _tree_start(n_old, h):
                first = torch.full((self.B, self.Hkv), start, dtype=torch.int64, device=self.device)
                self._build(elems, first, self._all_rows, h, cfg, outward, first_host=start)

    def grow_rows(self, elems: dict, old: torch.Tensor, new: torch.Tensor, heights: int, cfg, outward: bool) -> None:
        """Row (b, g) goes from old[b, g] to new[b, g] >= old elements (int64 [B, Hkv] on the
        device): every slot whose tree is new is rebuilt for the rows where it is, decided on the
        device (no host sync). heights: a host bound: heights 0 .. heights-1 hold every tree that
        differs (`carried_heights`) and every tree of the new counts.

        elems: contiguous kbar [B, Hkv, M, D], a, cells, codes [B, Hkv, M] in position order,
        M >= max(new).
        """
        self._allocate(heights)
        if heights == 0:
            return
        hs = torch.arange(heights, dtype=torch.int64, device=self.device).view(heights, 1, 1)
        above = ~((2 << hs) - 1)  # (H, 1, 1): the bits above h
        first, old_first = new[None] & above, old[None] & above  # (H, B, Hkv): start of the height-h tree
        has, had = ((new[None] >> hs) & 1) == 1, ((old[None] >> hs) & 1) == 1
        changed = has & (~had | (first != old_first))  # (H, B, Hkv): a new tree at height h
        for h in range(heights):
            self._build(elems, first[h], changed[h], h, cfg, outward)

    def _build(self, elems: dict, first: torch.Tensor, changed: torch.Tensor, h: int, cfg, outward: bool,
               first_host: Optional[int] = None) -> None:  # fmt: skip
        """Slot h := the trees over elements first .. first + 2^h - 1 of the (b, kv head) rows
        where `changed` [B, Hkv] (bool) is True; first int64 [B, Hkv] (any value elsewhere;
        first_host: the same start for every row, as a host int, when there is one)."""
        if self.builder == "triton":
            from ..backends.triton.fsb_build import build_tree_slot

            fields = {name: getattr(self, name) for name in _FIELDS}
            # the table and the state's element buffers are made here, consistent: no checks per launch
            build_tree_slot(fields, self.base(h), elems, first, changed, h, cfg.cell, cfg.leaf_order, outward,
                            first_host=first_host, check=False)  # fmt: skip
            return
        M = elems["kbar"].shape[2]
        idx = (first.clamp(0, M - (1 << h))[..., None] + torch.arange(1 << h, device=self.device))  # (B, Hkv, 2^h)
        part = {
            key: torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]) if x.dim() == 4 else idx)
            for key, x in elems.items()
        }
        built = build_segments(part, h, cfg, outward)  # one segment per row: (B, Hkv, nodes(h)[, D])
        lo, hi = self.base(h), self.base(h + 1)
        for name in _FIELDS:
            dst = getattr(self, name)
            mask = changed[..., None] if dst.dim() == 3 else changed[..., None, None]
            dst[:, :, lo:hi] = torch.where(mask, built[name], dst[:, :, lo:hi])

    def base_tensor(self) -> torch.Tensor:
        """int64 [heights + 1] on the device: base(h) (made once per (heights, device), on the
        device: no host-to-device copy, so no sync)."""
        key = (self.heights, str(self.device))
        table = _BASE_TABLES.get(key)
        if table is None:
            h = torch.arange(self.heights + 1, dtype=torch.int64, device=self.device)
            table = (2 << h) - 2 - h
            _BASE_TABLES[key] = table
        return table

    def node_table(self, n_max: int) -> NodeTable:
        """The backend's NodeTable view (trees up to the height of n_max elements, one per height)."""
        return NodeTable(
            self.mu, self.rad, self.A, self.e, self.cell, self.base_tensor(), n_max.bit_length() - 1, one_tree_per_height=True
        )

    def tensors(self, prefix: str) -> dict:
        return {f"{prefix}.{name}": getattr(self, name) for name in _FIELDS}


class TorchFsbDeviceState(TorchCacheState):
    """FS-B streaming state in torch tensors (CPU or CUDA); see the module docstring."""

    variants = ("fsb",)

    def __init__(self, cfg: FreeSoloConfig, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: Optional[torch.dtype] = None, device=None, decode_kernel: str = "torch",
                 decode_tiles: Optional[DecodeTiles] = None):  # fmt: skip
        """decode_kernel: one-token steps: "torch" (`beam_search` and readout in torch ops),
        "triton" (the fused Triton step: `fsb_search.decode_select_cells`, the search of both
        forests and the rerank of every (row, query head), then `decode._decode_kernel`; CUDA, or
        CPU under TRITON_INTERPRET=1; float32 accumulation, i.e. storage float32 / bfloat16 /
        float16) or "auto" (triton on CUDA with float32 accumulation, torch otherwise). Chunks of
        n > 1 tokens run torch ops. decode_tiles: a DecodeTiles with impl="single" (default
        `FSB_DECODE_TILES`)."""
        super().__init__(cfg, batch, num_heads, num_kv_heads, head_dim, dtype=dtype, device=device,
                         decode_kernel=decode_kernel, decode_tiles=decode_tiles or FSB_DECODE_TILES)  # fmt: skip

    def allocate(self, dtype: torch.dtype, device) -> None:
        super().allocate(dtype, device)  # sets self._fused (`_resolve_decode_kernel`)
        cfg, B, Hkv, D = self.cfg, self.B, self.Hkv, self.D
        self.tau = torch.as_tensor(cfg.tau_array(Hkv), dtype=torch.float64, device=self.device)  # [Hkv]
        self.planes = torch.as_tensor(hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D), device=self.device)
        slots = self.cell_ids.shape[2]
        self.codes = torch.zeros(B, Hkv, slots, dtype=torch.int64, device=self.device)  # per cell
        self.high_cells = torch.full((B, Hkv, slots + 1), -1, dtype=torch.int64, device=self.device)
        self.n_high = torch.zeros(B, Hkv, dtype=torch.int64, device=self.device)
        # n_high as it stood at the end of the last boundary, on the host: copied without blocking
        # into (pinned) host memory there and read at the next boundary, after its event
        self._n_high_host = torch.zeros(B * Hkv, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._n_high_event = None
        self.n_high_bound = 0  # host int >= max(n_high): the high forests' element count bound
        builder = "triton" if self._fused else "torch"  # the fused step's boundaries: one launch per slot
        # Tables sized for the archive's capacity (a forest over <= slots elements needs at most
        # slots.bit_length() heights) and grown with it in `_grow_store`: a captured decode step's
        # buffers move only when the archive does, never at a forest's own carry.
        heights = slots.bit_length()
        self.forest_all = ForestTable(B, Hkv, D, self.acc, self.device, heights=heights, builder=builder)
        self.forest_high = ForestTable(B, Hkv, D, self.acc, self.device, heights=heights, builder=builder)
        if builder == "triton":  # compile the builds of every height now, not at a boundary mid-decode
            from ..backends.triton.fsb_build import warm_up_builds

            warm_up_builds(D, self.acc, self.device, cfg.leaf_order, self.acc != torch.float64)

    def buffers(self) -> dict:
        out = super().buffers()
        if self.allocated:
            out.update(
                tau=self.tau, planes=self.planes, codes=self.codes, high_cells=self.high_cells, n_high=self.n_high
            )
            out.update(self.forest_all.tensors("forest_all"))
            out.update(self.forest_high.tensors("forest_high"))
        return out

    def memory_bytes(self) -> int:
        """Bytes of the tensors held, the host copy of n_high and the forests' row masks included."""
        if not self.allocated:
            return super().memory_bytes()
        extra = [self._n_high_host, self.forest_all._all_rows, self.forest_high._all_rows]
        return super().memory_bytes() + sum(t.numel() * t.element_size() for t in extra)

    def _grow_store(self, needed: int) -> None:
        slots = self.cell_ids.shape[2]
        super()._grow_store(needed)
        new_slots = self.cell_ids.shape[2]
        if new_slots != slots:
            codes = torch.zeros(self.B, self.Hkv, new_slots, dtype=torch.int64, device=self.device)
            codes[:, :, :slots] = self.codes
            high = torch.full((self.B, self.Hkv, new_slots + 1), -1, dtype=torch.int64, device=self.device)
            high[:, :, : slots + 1] = self.high_cells
            self.codes, self.high_cells = codes, high
            for forest in (self.forest_all, self.forest_high):  # with the archive (see `allocate`)
                forest._allocate(new_slots.bit_length())

    def _advance(self, tokens_k: torch.Tensor, tokens_v: torch.Tensor, n_avail: int) -> None:
        """Append the new cells to the archive, their codes and high-norm flags; grow both forests."""
        super()._advance(tokens_k, tokens_v, n_avail)
        cfg, s, B, Hkv = self.cfg, self.cfg.cell, self.B, self.Hkv
        m = tokens_k.shape[2] // s
        lo = n_avail - m
        x64 = tokens_k.to(torch.float64).reshape(B, Hkv, m, s, self.D)
        kbar64 = x64.mean(dim=3)  # (B, Hkv, m, D): codes and the tau test in float64 (spec §6.2)
        a64 = (x64 * x64).sum(dim=-1).sqrt().amax(dim=3)  # (B, Hkv, m)
        if cfg.leaf_order == "content":
            self.codes[:, :, lo:n_avail] = content_codes(kbar64, self.planes)
        high = a64 > self.tau.view(1, Hkv, 1)  # (B, Hkv, m)
        rank = torch.cumsum(high.to(torch.int64), dim=-1) - 1
        scratch = self.high_cells.shape[2] - 1
        dest = torch.where(high, self.n_high[:, :, None] + rank, torch.full_like(rank, scratch))
        self.high_cells.scatter_(2, dest, torch.arange(lo, n_avail, device=self.device).expand(B, Hkv, m).contiguous())
        self.high_cells[:, :, scratch] = -1
        old_high = self.n_high.clone()
        self.n_high += high.sum(dim=-1)
        outward = self.acc != torch.float64
        # the whole archive buffers (contiguous; elements past n_avail are never read)
        all_elems = {"kbar": self.cell_kbar, "a": self.cell_a, "cells": self.cell_ids, "codes": self.codes}
        self.forest_all.grow_uniform(all_elems, n_avail - m, n_avail, cfg, outward)
        before = self._high_counts_before()  # host ints: no sync (see `_high_counts_before`)
        self.n_high_bound = min(n_avail, max(before) + m)
        self._publish_high_counts()
        n_max = self.n_high_bound
        if n_max:
            hc = self.high_cells[:, :, :n_max].clamp(min=0)  # (B, Hkv, n_max); rows with fewer: padding
            high_elems = {
                "kbar": torch.gather(self.cell_kbar, 2, hc[..., None].expand(B, Hkv, n_max, self.D)),
                "a": torch.gather(self.cell_a, 2, hc),
                "cells": torch.gather(self.cell_ids, 2, hc),
                "codes": torch.gather(self.codes, 2, hc),
            }
            heights = carried_heights(before, m)  # every tree that can differ
            self.forest_high.grow_rows(high_elems, old_high, self.n_high, heights, cfg, outward)

    def _high_counts_before(self) -> list:
        """n_high at the end of the previous boundary as host ints, row-major over (b, kv head).

        On CUDA they were copied without blocking into pinned host memory at that boundary, and
        that copy's event is waited on here: the wait is for that event only, not the stream (no
        sync the debug mode flags; the GPU queue behind it keeps running). Inside a decode loop
        the event has normally completed a block of steps ago; if the host runs more than a
        block ahead of the GPU, the host waits here until the GPU reaches the previous boundary
        (measured by benchmarks/fsb_boundary_probe.py's event_wait_ms)."""
        if self._n_high_event is not None:
            self._n_high_event.synchronize()
        return self._n_high_host.tolist()

    def _publish_high_counts(self) -> None:
        """Start the copy of n_high to the host that the next boundary reads."""
        if self.device.type == "cuda":
            self._n_high_host.copy_(self.n_high.view(-1), non_blocking=True)
            self._n_high_event = torch.cuda.Event()
            self._n_high_event.record()
        else:
            self._n_high_host.copy_(self.n_high.view(-1))

    def _candidate_count(self, n_avail: int) -> int:
        return n_avail  # > 0: run the long-range branch (found cells may be fewer than K: masked)

    def _long_range(self, qg: torch.Tensor, positions: torch.Tensor, n_avail: int, k_eff: int) -> torch.Tensor:
        """Beam search in both forests, rerank by rho, NoPE readout. qg [B, Hkv, G*n, D] -> [B, Hkv, G, n, D]."""
        B, Hkv, G, D, s, K = self.B, self.Hkv, self.group, self.D, self.cfg.cell, self.cfg.top_k
        n = positions.shape[0]
        scale = 1.0 / math.sqrt(D)
        chosen = self._search(qg, positions, n_avail)  # (B, Hkv, G, n, K) cell ids (= slots), -1 padded
        flat = chosen.clamp(min=0).reshape(B, Hkv, G * n * K)
        N = B * Hkv * G * n
        sel_k = _gather_cells(self.cell_k, flat).reshape(N, 1, K * s, D)
        sel_v = _gather_cells(self.cell_v, flat).reshape(N, 1, K * s, D)
        valid = (chosen >= 0).reshape(N, K, 1).expand(N, K, s).reshape(N, 1, 1, K * s)
        has = valid.any(dim=-1, keepdim=True)  # (N, 1, 1, 1)
        mask = valid | ~has  # rows without a cell attend to anything, then are zeroed
        o_long = F.scaled_dot_product_attention(qg.reshape(N, 1, 1, D), sel_k, sel_v, attn_mask=mask, scale=scale)
        o_long = torch.where(has, o_long, torch.zeros_like(o_long))
        return o_long.to(self.acc).view(B, Hkv, G, n, D)

    def _search(self, qg: torch.Tensor, positions: torch.Tensor, n_avail: int) -> torch.Tensor:
        """The torch search: both forests' beams (`beam_search`), reranked by rho, top-K by (rho
        desc, c desc). qg [B, Hkv, G*n, D] -> chosen cells int64 [B, Hkv, G, n, K], -1 padded."""
        cfg, B, Hkv, G, D, s, K = self.cfg, self.B, self.Hkv, self.group, self.D, self.cfg.cell, self.cfg.top_k
        n = positions.shape[0]
        scale = 1.0 / math.sqrt(D)
        qc = qg.to(self.acc).view(B, Hkv, G, 1, n, D)  # (B, Hkv, G, nb=1, n, D)
        qn = torch.linalg.vector_norm(qc, dim=-1)
        pos = positions.to(self.acc).view(1, n)
        n_all = torch.full((B, Hkv, 1), n_avail, dtype=torch.int64, device=self.device)
        found = [beam_search(self.forest_all.node_table(n_avail), n_all, qc, qn, pos, self.sigma, self.lam, cfg)]
        if self.n_high_bound:
            table = self.forest_high.node_table(self.n_high_bound)
            found.append(beam_search(table, self.n_high.view(B, Hkv, 1), qc, qn, pos, self.sigma, self.lam, cfg))
        found = torch.sort(torch.cat(found, dim=-1), dim=-1, descending=True).values  # larger c first, -1 last
        found = found.view(B, Hkv, G, n, -1)
        dup = torch.zeros_like(found, dtype=torch.bool)
        dup[..., 1:] = found[..., 1:] == found[..., :-1]
        ok = (found >= 0) & ~dup
        cells = torch.where(ok, found, torch.full_like(found, -1))  # (B, Hkv, G, n, U)
        U = cells.shape[-1]
        keys = _gather_cells(self.cell_k, cells.clamp(min=0).view(B, Hkv, G * n * U))  # (B, Hkv, G*n*U, s, D)
        keys = keys.view(B, Hkv, G, n, U, s, D).to(self.acc)
        logits = torch.einsum("bhgnd,bhgnusd->bhgnus", qc.view(B, Hkv, G, n, D), keys) * scale
        rho = torch.logsumexp(logits, dim=-1).masked_fill(~ok, float("-inf"))
        return topk_cells(rho, cells, K)  # (B, Hkv, G, n, K) cell ids (= slots), -1 padded

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.allocated:
            out["forest_heights"] = (self.forest_all.heights, self.forest_high.heights)
            out["n_high_bound"] = self.n_high_bound
        return out

    def _restore(self, owner, name: str, value: torch.Tensor) -> None:
        """owner.name = value: copied into the existing buffer when its shape and dtype match (a
        captured `DecodeGraph` keeps reading it), else a new buffer on the state's device."""
        current = getattr(owner, name)
        if current.shape == value.shape and current.dtype == value.dtype:
            current.copy_(value)
        else:
            setattr(owner, name, value.clone().to(self.device))

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("dtype") is None:
            return
        for name in ("codes", "high_cells", "n_high", "tau", "planes"):
            self._restore(self, name, state[name])
        forests = (self.forest_all, self.forest_high)
        for forest, prefix, heights in zip(forests, ("forest_all", "forest_high"), state["forest_heights"]):
            forest.heights = int(heights)
            for name in _FIELDS:
                self._restore(forest, name, state[f"{prefix}.{name}"])
        self.n_high_bound = int(state["n_high_bound"])
        self._n_high_event = None
        self._n_high_host.copy_(self.n_high.view(-1).cpu())  # a restore may sync
