"""freesolo: FreeSolo sparse attention — a float64 oracle, fast backends, proofs and benchmarks.

`import freesolo` needs only NumPy (and Numba for the numba backend); torch and triton are
imported when their backend is first used.
"""

from .api import calibrate_tau, freesolo_attention, select_cells
from .backends.registry import (
    BackendUnavailableError,
    available_backends,
    get_backend,
    set_backend,
    use_backend,
)
from .config import FreeSoloConfig

__version__ = "0.1.0"

__all__ = [
    "FreeSoloConfig",
    "freesolo_attention",
    "select_cells",
    "calibrate_tau",
    "set_backend",
    "get_backend",
    "use_backend",
    "available_backends",
    "BackendUnavailableError",
    "FreeSoloCache",
    "__version__",
]


def __getattr__(name):
    if name == "FreeSoloCache":
        from .cache import FreeSoloCache

        return FreeSoloCache
    raise AttributeError(f"module 'freesolo' has no attribute {name!r}")
