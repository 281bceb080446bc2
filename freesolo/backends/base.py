"""The contract every backend fulfils (spec §12). Backends are loaded lazily by the registry."""

from __future__ import annotations

from typing import Optional

from .._validation import InputInfo
from ..config import FreeSoloConfig

__all__ = ["Backend", "HostBackend"]


class Backend:
    """A way to compute FreeSolo attention.

    `array_kind` is what `attention` / `select_cells` receive: "numpy" (float64 arrays, beta a
    float64 [Hq] array) or "torch" (tensors as the user passed them, beta a tensor [Hq] or None).
    """

    name: str = ""
    array_kind: str = "numpy"

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run on this machine at all (a missing package), or None."""
        return None

    def unsupported_reasons(self, info: InputInfo, cfg: FreeSoloConfig) -> list[str]:
        """Why this backend cannot run these inputs (device, dtype, autograd, variant); [] if it can."""
        return []

    def attention(self, q, k, v, cfg: FreeSoloConfig, beta):
        """q [B, T, Hq, D], k / v [B, T, Hkv, D], beta [Hq] -> o [B, T, Hq, D]."""
        raise NotImplementedError

    def select_cells(self, q, k, cfg: FreeSoloConfig):
        """q [B, T, Hq, D], k [B, T, Hkv, D] -> int64 [B, T, Hq, K], -1 padded."""
        raise NotImplementedError


class HostBackend(Backend):
    """A CPU backend computing in float64 NumPy arrays (numpy, numba)."""

    array_kind = "numpy"
    variants = ("fs", "fsl", "fsb")

    def unsupported_reasons(self, info: InputInfo, cfg: FreeSoloConfig) -> list[str]:
        reasons = []
        if info.device != "cpu":
            reasons.append(f"{self.name} runs on the CPU, inputs are on {info.device}")
        if info.requires_grad:
            reasons.append(f"{self.name} has no autograd, inputs require grad (use backend='torch')")
        if cfg.variant not in self.variants:
            reasons.append(f"{self.name} does not implement variant={cfg.variant!r} yet")
        return reasons
