"""Float64 NumPy streaming state (spec §9) for the "numpy" and "numba" backends.

One token at a time, built from the oracle's primitives (`rope`, `cell_stats`, `position_prior`,
`FslPoolStream`, `top_k_cells`, `rmsnorm`, `softmax_readout`), so that it is the readable
reference of the streaming form. Every kv head of every batch row holds:

- a ring of the last `w` keys (rotated at their absolute position) and values, slot `t % w`;
- the tokens of the current query block (unrotated), slot `t % Bq`;
- a cell store: keys / values [s, D], mean key, max norm and cell id of each held cell.
  FS-L holds exactly the candidate set `C_j` (<= P+W cells, fixed-size arrays: memory does not
  grow with T); FS and FS-B hold every complete available cell (the archive), slot = cell id.
- FS-B only: the two causal forests of spec §6 (`reference.forest.CausalForests`), grown one
  cell at a time at block boundaries (a carry merges two sorted segments).

Shapes: B batch, Hq / Hkv heads, D head dim, w window, Bq block, s cell, S store slots.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import FreeSoloConfig
from ..reference.primitives import (
    FslPoolStream,
    cell_stats,
    position_prior,
    rmsnorm,
    rope,
    softmax_readout,
    top_k_cells,
)

__all__ = ["HostCacheState"]

_FIXED = ("ring_k", "ring_v", "block_k", "block_v")
_STORE = ("cell_ids", "cell_k", "cell_v", "cell_kbar", "cell_a")


class HostCacheState:
    """Streaming state of one layer on the host (float64), every variant.

    Args:
        cfg: the FreeSoloConfig. batch, num_heads, num_kv_heads, head_dim: B, Hq, Hkv, D.
    """

    kind = "numpy"

    def __init__(self, cfg: FreeSoloConfig, batch: int, num_heads: int, num_kv_heads: int, head_dim: int):
        self.cfg = cfg
        self.B, self.Hq, self.Hkv, self.D = batch, num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.sigma = cfg.per_head("sigma", num_heads)  # [Hq]
        self.lam = cfg.per_head("lam", num_heads)  # [Hq]
        self.length = 0  # tokens consumed so far (T)
        B, Hkv, D, s = batch, num_kv_heads, head_dim, cfg.cell
        self.ring_k = np.zeros((B, Hkv, cfg.window, D))  # rotated keys, slot t % w
        self.ring_v = np.zeros((B, Hkv, cfg.window, D))
        self.block_k = np.zeros((B, Hkv, cfg.block, D))  # unrotated keys of the current block, slot t % Bq
        self.block_v = np.zeros((B, Hkv, cfg.block, D))
        slots = cfg.pool + cfg.recent if cfg.variant == "fsl" else 16
        self.cell_ids = np.full((B, Hkv, slots), -1, dtype=np.int64)  # cell id per slot, -1 empty
        self.cell_k = np.zeros((B, Hkv, slots, s, D))
        self.cell_v = np.zeros((B, Hkv, slots, s, D))
        self.cell_kbar = np.zeros((B, Hkv, slots, D))
        self.cell_a = np.zeros((B, Hkv, slots))
        self.forests = None
        if cfg.variant == "fsb":
            from ..reference.forest import CausalForests, hyperplanes

            tau = cfg.tau_array(Hkv)
            planes = hyperplanes(cfg.hash_seed, Hkv, cfg.hash_bits, D)  # [Hkv, r, D]
            self.forests = [
                [
                    CausalForests(
                        D, s, float(tau[g]), cfg.leaf_order, planes[g].copy() if cfg.leaf_order == "content" else None
                    )
                    for g in range(Hkv)
                ]
                for _ in range(B)
            ]

    # ---- storage --------------------------------------------------------------------------
    def buffers(self) -> dict:
        """Every array the state holds (the forests' arrays included for FS-B)."""
        out = {name: getattr(self, name) for name in _FIXED + _STORE}
        if self.forests is not None:
            for b, row in enumerate(self.forests):
                for g, forest in enumerate(row):
                    for key, value in forest.state_dict().items():
                        out[f"forest.{b}.{g}.{key}"] = np.asarray(value)
        return out

    def memory_bytes(self) -> int:
        """Bytes of every array held (per-head constants and, for FS-B, the forests included)."""
        total = sum(getattr(self, name).nbytes for name in _FIXED + _STORE + ("sigma", "lam"))
        if self.forests is not None:
            for row in self.forests:
                for cf in row:
                    if cf.all.planes is not None:  # shared by the two forests
                        total += cf.all.planes.nbytes
                    for forest in (cf.all, cf.high):
                        total += sum(x.nbytes for x in (forest._kbar, forest._a, forest._cell, forest._code))
                        for tree in forest.history.values() if forest.keep_history else forest.trees:
                            total += sum(getattr(tree, f).nbytes for f in ("leaves", "cells", "mu", "rad", "A", "e"))
        return int(total)

    def _grow_store(self, needed: int) -> None:
        """FS / FS-B: make room for `needed` slots (capacity doubles)."""
        slots = self.cell_ids.shape[2]
        if needed <= slots:
            return
        new_slots = max(needed, 2 * slots)
        for name in _STORE:
            old = getattr(self, name)
            new = np.full((self.B, self.Hkv, new_slots) + old.shape[3:], -1 if name == "cell_ids" else 0, old.dtype)
            new[:, :, :slots] = old
            setattr(self, name, new)

    # ---- block boundary -------------------------------------------------------------------
    def _boundary(self) -> None:
        """At token i = j*Bq: the cells of block j-1 become available (n_j = i // s)."""
        cfg, s = self.cfg, self.cfg.cell
        n_j = self.length // s
        per_block = cfg.block // s
        n_prev = n_j - per_block
        new_ids = np.arange(n_prev, n_j, dtype=np.int64)
        for b in range(self.B):
            for g in range(self.Hkv):
                kbar, a = cell_stats(self.block_k[b, g], s)  # [Bq/s, D], [Bq/s]
                k_cells = self.block_k[b, g].reshape(per_block, s, self.D)
                v_cells = self.block_v[b, g].reshape(per_block, s, self.D)
                if cfg.variant == "fsl":
                    self._pool_advance(b, g, n_prev, n_j, new_ids, kbar, a, k_cells, v_cells)
                else:
                    self._grow_store(n_j)
                    self.cell_ids[b, g, n_prev:n_j] = new_ids
                    self.cell_k[b, g, n_prev:n_j] = k_cells
                    self.cell_v[b, g, n_prev:n_j] = v_cells
                    self.cell_kbar[b, g, n_prev:n_j] = kbar
                    self.cell_a[b, g, n_prev:n_j] = a
                    if self.forests is not None:
                        for c in range(per_block):
                            self.forests[b][g].append_cell(kbar[c], a[c], int(new_ids[c]))

    def _pool_advance(self, b, g, n_prev, n_j, new_ids, kbar, a, k_cells, v_cells) -> None:
        """FS-L: the oracle's FslPoolStream on the held cells only; the losers are dropped."""
        held = self.cell_ids[b, g] >= 0
        ids = np.concatenate([self.cell_ids[b, g, held], new_ids])  # [U]
        source_k = np.concatenate([self.cell_k[b, g, held], k_cells])  # [U, s, D]
        source_v = np.concatenate([self.cell_v[b, g, held], v_cells])
        source_kbar = np.concatenate([self.cell_kbar[b, g, held], kbar])  # [U, D]
        source_a = np.concatenate([self.cell_a[b, g, held], a])  # [U]
        a_of = {int(c): float(x) for c, x in zip(ids, source_a)}  # stats of the held cells only
        stream = FslPoolStream(self.cfg.pool, self.cfg.recent)
        stream.n_avail = n_prev
        stream.kept = [int(c) for c in ids if c < max(0, n_prev - self.cfg.recent)]
        keep = stream.advance(a_of, n_j)  # sorted cell ids, <= P + W
        where = {int(c): u for u, c in enumerate(ids)}
        rows = np.array([where[int(c)] for c in keep], dtype=np.int64)
        m = len(rows)
        self.cell_ids[b, g] = -1
        self.cell_ids[b, g, :m] = keep
        for name, source in (
            ("cell_k", source_k),
            ("cell_v", source_v),
            ("cell_kbar", source_kbar),
            ("cell_a", source_a),
        ):
            array = getattr(self, name)
            array[b, g] = 0
            array[b, g, :m] = source[rows]

    # ---- one token ------------------------------------------------------------------------
    def _ingest(self, k_i: np.ndarray, v_i: np.ndarray) -> None:
        """Store token i = self.length: k_i, v_i [B, Hkv, D] (boundary first if i starts a block)."""
        cfg, i = self.cfg, self.length
        if i > 0 and i % cfg.block == 0:
            self._boundary()
        positions = np.full(self.B * self.Hkv, i)
        self.ring_k[:, :, i % cfg.window] = rope(k_i.reshape(-1, self.D), positions, cfg.rope_theta).reshape(
            self.B, self.Hkv, self.D
        )
        self.ring_v[:, :, i % cfg.window] = v_i
        self.block_k[:, :, i % cfg.block] = k_i
        self.block_v[:, :, i % cfg.block] = v_i

    def _select(self, q_i: np.ndarray, i: int, b: int, h: int, g: int) -> np.ndarray:
        """Selected store slots of query i, head h, in descending final score (no padding)."""
        cfg = self.cfg
        if self.forests is not None:
            return self._select_fsb(q_i, i, b, h, g)
        held = np.flatnonzero(self.cell_ids[b, g] >= 0)  # slots, cells ascending
        if len(held) == 0:
            return held
        cells = self.cell_ids[b, g, held]
        scale = 1.0 / math.sqrt(self.D)
        scores = scale * (self.cell_kbar[b, g, held] @ q_i) + self.lam[h] * self.cell_a[b, g, held] * position_prior(
            i, cells, self.sigma[h], cfg.cell
        )
        chosen = top_k_cells(cells, scores, cfg.top_k)
        chosen = chosen[chosen >= 0]
        return held[np.searchsorted(cells, chosen)]

    def _select_fsb(self, q_i, i, b, h, g) -> np.ndarray:
        """FS-B: beam search in the two streaming forests, rerank by rho (reference.fsb pieces)."""
        from ..reference.fsb import beam_search, node_key, rerank_scores

        cfg = self.cfg
        forests = self.forests[b][g]
        if forests.count == 0:
            return np.zeros(0, dtype=np.int64)
        trees_all, trees_high = forests.forests()  # over the available cells [0, n_j)
        scale = 1.0 / math.sqrt(self.D)
        q_norm = math.sqrt(float(q_i @ q_i))

        def key(tree, level, m):
            return node_key(
                q_i,
                q_norm,
                i,
                tree,
                tree.node(level, m),
                scale,
                self.sigma[h],
                self.lam[h],
                cfg.cell,
                cfg.radius_weight,
            )

        found_all, _ = beam_search(trees_all, key, cfg.beam)
        found_high, _ = beam_search(trees_high, key, cfg.beam)
        union = np.array(sorted(set(found_all) | set(found_high)), dtype=np.int64)
        archive = self.cell_k[b, g].reshape(-1, self.D)  # slot == cell id: token t of cell c at row t
        rho = rerank_scores(q_i, archive, union, cfg.cell)
        chosen = top_k_cells(union, rho, cfg.top_k)
        return chosen[chosen >= 0]  # slot == cell id

    def _query(self, q_i: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """Output of query i = self.length (already ingested): q_i [B, Hq, D] -> [B, Hq, D]."""
        cfg, i = self.cfg, self.length
        lo = max(0, i - cfg.window + 1)
        slots = np.arange(lo, i + 1) % cfg.window  # positions lo..i in order
        q_rot = rope(q_i.reshape(-1, self.D), np.full(self.B * self.Hq, i), cfg.rope_theta).reshape(q_i.shape)
        out = np.zeros_like(q_i)
        for b in range(self.B):
            for h in range(self.Hq):
                g = h // self.group
                o_loc = softmax_readout(q_rot[b, h], self.ring_k[b, g, slots], self.ring_v[b, g, slots])
                chosen = self._select(q_i[b, h], i, b, h, g)
                o_long = np.zeros(self.D)
                if len(chosen):
                    keys = self.cell_k[b, g, chosen].reshape(-1, self.D)  # [K*s, D] in selection order
                    values = self.cell_v[b, g, chosen].reshape(-1, self.D)
                    o_long = softmax_readout(q_i[b, h], keys, values)
                out[b, h] = o_loc + beta[h] * rmsnorm(o_long, cfg.eps)
        return out

    # ---- public operations ----------------------------------------------------------------
    def extend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """q [B, n, Hq, D], k / v [B, n, Hkv, D] float64, beta [Hq] -> outputs [B, n, Hq, D]."""
        out = np.zeros_like(q)
        for t in range(q.shape[1]):
            self._ingest(k[:, t], v[:, t])
            out[:, t] = self._query(q[:, t], beta)
            self.length += 1
        return out

    def prefill(self, k: np.ndarray, v: np.ndarray) -> None:
        """Consume k / v [B, n, Hkv, D] without computing outputs (the state is the same)."""
        for t in range(k.shape[1]):
            self._ingest(k[:, t], v[:, t])
            self.length += 1

    def state_dict(self) -> dict:
        """Copies of every array plus the token count."""
        out = {name: value.copy() for name, value in self.buffers().items()}
        out["length"] = np.int64(self.length)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` (shapes checked)."""
        for name in _FIXED:
            if tuple(state[name].shape) != getattr(self, name).shape:
                raise ValueError(f"state {name} shape {tuple(state[name].shape)} != {getattr(self, name).shape}")
        for name in _FIXED + _STORE:
            setattr(self, name, np.array(state[name], dtype=getattr(self, name).dtype, copy=True))
        self.length = int(state["length"])
        if self.forests is not None:
            from ..reference.forest import CausalForests

            for b in range(self.B):
                for g in range(self.Hkv):
                    prefix = f"forest.{b}.{g}."
                    sub = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
                    self.forests[b][g] = CausalForests.from_state_dict(sub)
