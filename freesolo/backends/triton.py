"""`triton` backend: registered so that the registry can say why it cannot serve.

The fused Triton kernels are not part of this release; until they land, selecting this backend
raises BackendUnavailableError with the reason below (never a silent fallback).
"""

from __future__ import annotations

from .base import Backend

__all__ = ["TritonBackend"]


class TritonBackend(Backend):
    name = "triton"
    array_kind = "torch"

    def unavailable_reason(self):
        return "the fused Triton kernels are not implemented in this release; use backend='torch' on the GPU"
