"""FS-B streaming state on torch (spec §6, §9): the archive plus two forests grown at carries.

The state is `TorchCacheState`'s FS archive (every complete cell, slot = cell id; ring; block
buffer) plus, per batch row and kv head:

- the element sequences of the two forests: all cells, and the high-norm cells (a_c > tau_h,
  tested in float64 like the torch backend) compacted per row (`high_cells`, `n_high`);
- one flat node table per forest (`ForestTable`) holding the forest's live trees only: one tree
  per set bit of the row's element count, in one slot per height (the torch backend's
  `NodeTable` layout with `one_tree_per_height`: O(n) nodes, not the O(n log n) of every segment
  of every height). A slot is rebuilt at a carry of the binary counter, from its tree's own
  elements (`build_segments`: the torch backend's construction restricted to one segment), for
  the rows whose tree changed (the high-norm forest: rows' counts differ).

Queries search the tables with the torch backend's level-wise beam (`beam_search`), rerank the
union by rho and read the top-K cells (`topk_cells`: ties to the larger cell). With
`decode_kernel="triton"` a one-token step is the fused Triton step (`backends.triton.decode.
decode_step`): two launches for the search of both forests (side by side) and the rerank
(`fsb_search.decode_select_cells`, same tables, same tie rules), one for the local window, the
readout of the chosen cells, RMSNorm and beta (`_decode_kernel`). None reads a host value that changes inside a block, so
`FreeSoloCache.decode_graph()` captures the step in a CUDA graph; a block boundary (`_advance`:
archive append, forest carries) runs eagerly and syncs the host once (counts of high cells).
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

__all__ = ["FSB_DECODE_TILES", "ForestTable", "TorchFsbDeviceState"]

# The fused FS-B step runs the "single" kernel after its search: 128 ring slots per tile, 8 warps.
FSB_DECODE_TILES = DecodeTiles(impl="single", window_chunk=128, num_warps=8)
_BASE_TABLES: dict = {}  # (heights, device) -> ForestTable.base_tensor's int64 table


class ForestTable:
    """The live trees of one forest kind for every (b, kv head): one tree slot per height.

    A forest over n elements is, by the binary counter, one perfect tree per set bit h of n, over
    elements [start_h, start_h + 2^h) with start_h = (n >> (h + 1)) << (h + 1); a query over n
    elements searches exactly these trees (spec §6.4), so the table keeps one slot per height:
    height h's tree at base(h) = nodes(0) + ... + nodes(h - 1), levels 0..h inside (the NodeTable
    layout with `one_tree_per_height`). That is O(n) nodes per row and kv head (every segment of
    every height would be O(n log n): 21.6 GiB at 1M tokens, H 16, D 64). A slot is rebuilt from
    its own elements (`build_segments`) when its row's tree changes (a carry), so each element
    enters one build per height: O(n log n) work in total.

    mu [B, Hkv, N, D]; rad, A [B, Hkv, N] (accumulation dtype); e, cell [B, Hkv, N] int64, with
    N = base(heights). `starts[h]`: per (b, kv head) the first element of the tree held at height
    h, -1 for none (host tuples, row-major over (b, kv head)).
    """

    def __init__(self, B: int, Hkv: int, D: int, dtype: torch.dtype, device, heights: int = 4):
        self.B, self.Hkv, self.D, self.dtype, self.device = B, Hkv, D, dtype, device
        self.heights = 0
        self.starts: list[tuple] = []
        self._allocate(heights)

    @staticmethod
    def base(h: int) -> int:
        """Flat id of the slot of height h: nodes(0) + ... + nodes(h - 1) = 2^(h+1) - 2 - h."""
        return (2 << h) - 2 - h

    def _allocate(self, heights: int) -> None:
        """Slots for trees of heights 0 .. heights - 1 (the built ones keep their place)."""
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
        self.starts = self.starts + [(-1,) * (B * Hkv)] * (heights - self.heights)
        self.heights = heights

    def update(self, elems: dict, counts: list, cfg: FreeSoloConfig, outward: bool) -> None:
        """Hold the live trees of element counts `counts` (host ints, one per (b, kv head),
        row-major): every slot whose tree changed is rebuilt for the rows where it changed.

        elems: kbar [B, Hkv, >= max(counts), D], a, cells, codes [B, Hkv, >= max(counts)] in
        position order (a row's elements past its own count are never read).
        """
        n_max = max(counts)
        if n_max.bit_length() > self.heights:
            self._allocate(n_max.bit_length())
        B, Hkv, dev = self.B, self.Hkv, self.device
        for h in range(n_max.bit_length()):
            start = tuple(((n >> (h + 1)) << (h + 1)) if (n >> h) & 1 else -1 for n in counts)
            if start == self.starts[h]:
                continue
            changed = torch.tensor([x != y for x, y in zip(start, self.starts[h])], device=dev).view(B, Hkv, 1)
            first = torch.tensor([max(x, 0) for x in start], dtype=torch.int64, device=dev).view(B, Hkv, 1)
            idx = first + torch.arange(1 << h, device=dev)  # (B, Hkv, 2^h); rows without a tree: never read
            part = {
                key: torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]) if x.dim() == 4 else idx)
                for key, x in elems.items()
            }
            built = build_segments(part, h, cfg, outward)  # one segment per row: (B, Hkv, nodes(h)[, D])
            lo, hi = self.base(h), self.base(h + 1)
            for name in _FIELDS:
                dst = getattr(self, name)
                mask = changed if dst.dim() == 3 else changed[..., None]
                dst[:, :, lo:hi] = torch.where(mask, built[name], dst[:, :, lo:hi])
            self.starts[h] = start

    def base_tensor(self) -> torch.Tensor:
        """int64 [heights + 1] on the device: base(h) (made once per (heights, device), shared)."""
        key = (self.heights, str(self.device))
        table = _BASE_TABLES.get(key)
        if table is None:
            table = torch.tensor([self.base(h) for h in range(self.heights + 1)], dtype=torch.int64, device=self.device)
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
        self.n_high_range = (0, 0)  # host copy of (min, max) of n_high
        self.forest_all = ForestTable(B, Hkv, D, self.acc, self.device)
        self.forest_high = ForestTable(B, Hkv, D, self.acc, self.device)

    def buffers(self) -> dict:
        out = super().buffers()
        if self.allocated:
            out.update(
                tau=self.tau, planes=self.planes, codes=self.codes, high_cells=self.high_cells, n_high=self.n_high
            )
            out.update(self.forest_all.tensors("forest_all"))
            out.update(self.forest_high.tensors("forest_high"))
        return out

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
        self.n_high += high.sum(dim=-1)
        counts = self.n_high.flatten().tolist()  # host sync (FS-B only): the high forests' element counts
        self.n_high_range = (min(counts), max(counts))
        outward = self.acc != torch.float64
        all_elems = {
            "kbar": self.cell_kbar[:, :, :n_avail],
            "a": self.cell_a[:, :, :n_avail],
            "cells": self.cell_ids[:, :, :n_avail],
            "codes": self.codes[:, :, :n_avail],
        }
        self.forest_all.update(all_elems, [n_avail] * (B * Hkv), cfg, outward)
        n_max = self.n_high_range[1]
        if n_max:
            hc = self.high_cells[:, :, :n_max].clamp(min=0)  # (B, Hkv, n_max); rows with fewer: padding
            high_elems = {
                "kbar": torch.gather(self.cell_kbar, 2, hc[..., None].expand(B, Hkv, n_max, self.D)),
                "a": torch.gather(self.cell_a, 2, hc),
                "cells": torch.gather(self.cell_ids, 2, hc),
                "codes": torch.gather(self.codes, 2, hc),
            }
            self.forest_high.update(high_elems, counts, cfg, outward)

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
        if self.n_high_range[1]:
            table = self.forest_high.node_table(self.n_high_range[1])
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
            out["forest_starts"] = (list(self.forest_all.starts), list(self.forest_high.starts))
            out["n_high_range"] = self.n_high_range
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
        for forest, prefix, heights, starts in zip(
            (self.forest_all, self.forest_high),
            ("forest_all", "forest_high"),
            state["forest_heights"],
            state["forest_starts"],
        ):
            forest.heights, forest.starts = int(heights), [tuple(int(x) for x in st) for st in starts]
            for name in _FIELDS:
                self._restore(forest, name, state[f"{prefix}.{name}"])
        self.n_high_range = tuple(state["n_high_range"])
