"""Registry entry of the `triton` backend (integration in progress)."""

from __future__ import annotations

from ..base import Backend

__all__ = ["TritonBackend"]


class TritonBackend(Backend):
    name = "triton"
    array_kind = "torch"

    def unavailable_reason(self):
        return "the fused Triton kernels are being integrated; use backend='torch' on the GPU"
