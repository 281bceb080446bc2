"""`FreeSoloConfig`: every hyper-parameter of spec §1, validated once, frozen."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np

__all__ = ["FreeSoloConfig", "VARIANTS", "LEAF_ORDERS"]

VARIANTS = ("fs", "fsl", "fsb")
LEAF_ORDERS = ("content", "position")

PerHead = Union[float, Tuple[float, ...]]


def _as_per_head(name: str, value) -> PerHead:
    """Scalar -> float; sequence / array -> tuple of floats (hashable, frozen-friendly)."""
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return float(value)
    try:
        import torch  # noqa: F401  (optional)

        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
    except ImportError:
        pass
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a scalar or a 1-D sequence of per-head values, got shape {arr.shape}")
    return tuple(float(x) for x in arr)


@dataclass(frozen=True)
class FreeSoloConfig:
    """Hyper-parameters of FreeSolo attention (spec §1). Sizes are in tokens unless named cells.

    Per-head fields (`sigma`, `lam`) accept a scalar or one value per query head; `tau` is one
    value per kv head (FS-B only). Arrays are stored as tuples so the config stays hashable.
    """

    variant: str = "fsl"  # "fs" (score every cell), "fsl" (pool: linear), "fsb" (beam search in trees)
    window: int = 512  # local RoPE window: keys i-window < t <= i
    cell: int = 32  # tokens per cell
    top_k: int = 4  # cells read per query and query head
    block: int = 128  # query block; available cells change only at block boundaries
    pool: int = 64  # FS-L: high-norm cells kept per kv head
    recent: int = 8  # FS-L: most recent available cells always kept
    beam: int = 16  # FS-B: nodes kept per level per forest
    sigma: PerHead = 4.0  # position-prior sharpness (scalar or [Hq])
    lam: PerHead = 1.0  # position-prior weight (scalar or [Hq]), >= 0
    tau: Optional[Tuple[float, ...]] = None  # FS-B: high-norm threshold per kv head [Hkv]
    hash_bits: int = 16  # FS-B: bits of the content code ordering tree leaves
    hash_seed: int = 0  # FS-B: seed of the content-code hyperplanes
    leaf_order: str = "content"  # FS-B: "content" or "position"
    radius_weight: float = 1.0  # FS-B: weight of the radius term in the beam's node key
    rope_theta: float = 10000.0  # RoPE base of the local branch
    eps: float = 1e-6  # RMSNorm epsilon

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
        if self.leaf_order not in LEAF_ORDERS:
            raise ValueError(f"leaf_order={self.leaf_order!r} must be one of {LEAF_ORDERS}")
        for name in ("window", "cell", "top_k", "block", "pool", "recent", "beam", "hash_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name}={value!r} must be an int")
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
            object.__setattr__(self, name, int(value))
        if self.hash_bits > 62:
            raise ValueError(f"hash_bits={self.hash_bits} must be <= 62 (the code is an int64)")
        if isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, (int, np.integer)) or self.hash_seed < 0:
            raise ValueError(f"hash_seed={self.hash_seed!r} must be a non-negative int")
        if self.block % self.cell != 0:
            raise ValueError(f"block={self.block} must be a multiple of cell={self.cell}")
        if self.window < self.block:
            raise ValueError(f"window={self.window} must be >= block={self.block}")
        sigma = _as_per_head("sigma", self.sigma)
        lam = _as_per_head("lam", self.lam)
        for name, value in (("sigma", sigma), ("lam", lam)):
            values = value if isinstance(value, tuple) else (value,)
            if not all(math.isfinite(x) for x in values):
                raise ValueError(f"{name}={value} must be finite")
        if min(lam if isinstance(lam, tuple) else (lam,)) < 0:
            raise ValueError(f"lam={lam} must be >= 0")
        object.__setattr__(self, "sigma", sigma)
        object.__setattr__(self, "lam", lam)
        if self.tau is not None:
            tau = _as_per_head("tau", self.tau)
            tau = tau if isinstance(tau, tuple) else (tau,)
            if not all(math.isfinite(x) for x in tau):
                raise ValueError(f"tau={tau} must be finite")
            object.__setattr__(self, "tau", tau)
        for name in ("radius_weight", "rope_theta", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"{name}={value!r} must be a float")
            if not math.isfinite(value):
                raise ValueError(f"{name}={value} must be finite")
            object.__setattr__(self, name, float(value))
        if self.radius_weight < 0:
            raise ValueError(f"radius_weight={self.radius_weight} must be >= 0")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be positive")

    # ---- per-head views -------------------------------------------------------------------
    def per_head(self, name: str, num_heads: int) -> np.ndarray:
        """`sigma` or `lam` as a float64 array [num_heads] (ValueError on a length mismatch)."""
        value = getattr(self, name)
        if isinstance(value, tuple):
            if len(value) != num_heads:
                raise ValueError(f"{name} has {len(value)} values but there are {num_heads} query heads")
            return np.asarray(value, dtype=np.float64)
        return np.full(num_heads, value, dtype=np.float64)

    def tau_array(self, num_kv_heads: int) -> np.ndarray:
        """`tau` as float64 [num_kv_heads]; FS-B without tau raises a ValueError saying how to get one."""
        if self.tau is None:
            raise ValueError(
                "variant='fsb' needs tau (one high-norm threshold per kv head): compute it once per "
                "checkpoint with freesolo.calibrate_tau(k, cfg) and pass FreeSoloConfig(..., tau=tau)"
            )
        tau = self.tau
        if len(tau) == 1 and num_kv_heads != 1:
            tau = tau * num_kv_heads
        if len(tau) != num_kv_heads:
            raise ValueError(f"tau has {len(tau)} values but there are {num_kv_heads} kv heads")
        return np.asarray(tau, dtype=np.float64)

    def replace(self, **changes) -> "FreeSoloConfig":
        """A copy with some fields changed (validated again)."""
        from dataclasses import replace

        return replace(self, **changes)
