"""`numba` backend: the oracle's algorithm compiled with numba (CPU, float64), registered as "numba".

Modules:
- `backend.py`: `NumbaBackend` (the registry entry) and the host functions that lay the arrays
  out and call the kernels (selection, local branch, readout, counted costs).
- `kernels.py`: the FS / FS-L kernels (RoPE, cell statistics, FS-L pools, scores and top-K,
  windowed attention, readout, token counter).
- `fsb.py`: FS-B (flat forests, beam search, rerank); imported on first FS-B use, so its kernels
  compile then.

Note: this package is `freesolo.backends.numba`; its modules import numba with absolute
`from numba import ...` (Python 3 absolute imports), never relatively. Importing this package
does not import numba: `backend.py` imports the kernel modules on first use.
"""

from .backend import NumbaBackend, attention, select_cells

__all__ = ["NumbaBackend", "attention", "select_cells"]
