"""PyTorch backend (CPU and CUDA, autograd): `TorchBackend`, registered as "torch".

Note: this package is `freesolo.backends.torch`; its modules import PyTorch with absolute
`import torch` (Python 3 absolute imports), never relatively.
"""

from ._ops import selection_chunk_scope
from .backend import TorchBackend, attention, select_cells

__all__ = ["TorchBackend", "attention", "select_cells", "selection_chunk_scope"]
