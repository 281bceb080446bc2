"""`numpy` backend: the float64 loop-based oracle itself."""

from __future__ import annotations

from ..reference import oracle
from .base import HostBackend

__all__ = ["NumpyBackend"]


class NumpyBackend(HostBackend):
    name = "numpy"

    def attention(self, q, k, v, cfg, beta):
        return oracle.attention(q, k, v, cfg, beta)

    def select_cells(self, q, k, cfg):
        return oracle.select_cells(q, k, cfg)
