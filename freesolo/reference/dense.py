"""Dense cross-check of the oracle: build the attention masks from the selection and run plain
softmax attention with matrix products (no loops over queries). Float64, O(T^2) memory."""

from __future__ import annotations

import numpy as np

from ..config import FreeSoloConfig
from .primitives import rope

__all__ = ["dense_attention", "selection_mask", "window_mask"]


def window_mask(T: int, window: int) -> np.ndarray:
    """[T, T] bool: query i sees key t iff i - window < t <= i."""
    i = np.arange(T)[:, None]
    t = np.arange(T)[None, :]
    return (t <= i) & (t > i - window)


def selection_mask(idx: np.ndarray, T: int, cell: int) -> np.ndarray:
    """idx [T, K] selected cells (-1 pads) -> [T, T] bool: query i sees the tokens of its cells."""
    mask = np.zeros((T, T), dtype=bool)
    token_cell = np.arange(T) // cell  # [T]
    for slot in range(idx.shape[1]):
        c = idx[:, slot]  # [T]
        mask |= (token_cell[None, :] == c[:, None]) & (c[:, None] >= 0)
    return mask


def _masked_softmax_attention(q, k, v, mask):
    """q [T, D], k / v [T, D], mask [T, T] -> [T, D]; fully masked rows give 0."""
    logits = np.where(mask, q @ k.T / np.sqrt(q.shape[1]), -np.inf)  # [T, T]
    row_max = np.max(logits, axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(mask, np.exp(logits - row_max), 0.0)
    denom = weights.sum(axis=1, keepdims=True)
    return (weights @ v) / np.where(denom > 0, denom, 1.0)


def dense_attention(q, k, v, idx, cfg: FreeSoloConfig, beta) -> np.ndarray:
    """Same output as the oracle, given its selection idx [B, T, Hq, K]. -> [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    positions = np.arange(T)
    local = window_mask(T, cfg.window)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            g = h // group
            o_loc = _masked_softmax_attention(
                rope(q[b, :, h], positions, cfg.rope_theta),
                rope(k[b, :, g], positions, cfg.rope_theta),
                v[b, :, g],
                local,
            )
            o_long = _masked_softmax_attention(
                q[b, :, h], k[b, :, g], v[b, :, g], selection_mask(idx[b, :, h], T, cfg.cell)
            )
            rms = np.sqrt(np.mean(o_long**2, axis=1, keepdims=True) + cfg.eps)
            out[b, :, h] = o_loc + beta[h] * o_long / rms
    return out
