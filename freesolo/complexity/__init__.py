"""Complexity of FreeSolo selection: counted cost (exact, spec §10), measured time and memory,
log-log fits, plots, and the `freesolo scaling` command (`scaling.scaling_main`).

Importing this package needs NumPy only (the fits too); plots import matplotlib and the
measured sweep tqdm when first used.
"""

from .counted import (
    available_per_query,
    beam_node_keys,
    count_per_query,
    count_totals,
    counted_sweep,
    forest_build_cost,
    l9_node_key_bound,
)
from .fits import ModelFit, SlopeFit, fit_cost_model, loglog_slope
from .measured import measure_point, measured_sweep, peak_memory

__all__ = [
    "available_per_query",
    "beam_node_keys",
    "count_per_query",
    "count_totals",
    "counted_sweep",
    "forest_build_cost",
    "l9_node_key_bound",
    "SlopeFit",
    "ModelFit",
    "loglog_slope",
    "fit_cost_model",
    "measure_point",
    "measured_sweep",
    "peak_memory",
]
