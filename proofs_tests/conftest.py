"""Hypothesis profiles: `ci` (derandomized, few examples, fits the CI budget) and `dev` (explores).

Select with HYPOTHESIS_PROFILE=ci|dev (default: dev locally, ci when CI is set).
On a machine without CUDA, TRITON_INTERPRET=1 is set so the Triton backend runs interpreted.
FREESOLO_TRITON_GRAPHS=0 (unless set outside): the CUDA tests check the triton backend's eager
kernels and launch paths; test_triton_graphs.py turns its CUDA-graph cache on and checks that a
replay gives those kernels' bits.
"""

import os

# Without a CUDA device the Triton kernels run on CPU float32 tensors under Triton's interpreter.
# The variable must be set before any kernel module is imported (Triton reads it at decoration).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # torch is optional for the host backends
    pass

# the triton backend's CUDA-graph cache off by default in the tests (docstring)
os.environ.setdefault("FREESOLO_TRITON_GRAPHS", "0")

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=12, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=100, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
