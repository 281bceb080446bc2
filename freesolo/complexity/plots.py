"""Plots of cost against T (matplotlib, Agg backend, PNG): log-log axes, one line per variant,
dashed reference slopes N, N log^2 N and N^2."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["VARIANT_STYLE", "format_tokens", "plot_cost_vs_T", "plot_scaling"]

# colour, marker and legend label per variant
VARIANT_STYLE = {
    "fs": ("tab:red", "o", "FS (scores every cell)"),
    "fsl": ("tab:blue", "s", "FS-L (pool of P+W cells)"),
    "fsb": ("tab:green", "^", "FS-B (beam search in trees)"),
    "sdpa": ("black", "D", "dense causal SDPA (reference)"),
}
_REFERENCES = (
    ("∝ N", lambda n: n),
    ("∝ N log²N", lambda n: n * np.log2(n) ** 2),
    ("∝ N²", lambda n: n**2),
)


def format_tokens(T: float) -> str:
    """2048 -> '2k', 1048576 -> '1M' (powers of two in binary units, others plain)."""
    T = int(T)
    if T >= 1 << 20 and T % (1 << 20) == 0:
        return f"{T >> 20}M"
    if T >= 1 << 10 and T % (1 << 10) == 0:
        return f"{T >> 10}k"
    return str(T)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cost_vs_T(
    ax,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    ylabel: str,
    title: str,
    slopes: Mapping[str, str] | None = None,
    references: bool = True,
    skipped: Mapping[str, Sequence[float]] | None = None,
    fit_range: tuple | None = None,
) -> None:
    """Draw one panel: series {variant: (T [n], y [n])} on log-log axes with reference slopes.

    `slopes` {variant: "1.01 [0.99, 1.03]"} is appended to the legend labels; `skipped`
    {variant: [T, ...]} marks points not measured (an x on the T axis); `fit_range` (T0, T1)
    shades the range the slopes were fitted over.
    """
    all_T, first_y = [], []
    drawn: list[tuple[str, np.ndarray, np.ndarray]] = []
    for variant, (T, y) in series.items():
        T, y = np.asarray(T, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if T.size == 0:
            continue
        colour, marker, label = VARIANT_STYLE.get(variant, ("black", "o", variant))
        if slopes and variant in slopes:
            label = f"{label}: slope {slopes[variant]}"
        for other, T_other, y_other in drawn:  # say so when a line hides another
            if T_other.shape == T.shape and np.all(T_other == T) and np.allclose(y, y_other, rtol=0.02):
                label += f" (on top of {other})"
                break
        drawn.append((variant.upper().replace("FSL", "FS-L").replace("FSB", "FS-B"), T, y))
        ax.loglog(T, y, marker=marker, color=colour, label=label, linewidth=2, markersize=5)
        all_T.extend(T.tolist())
        first_y.append(y[0])
    if skipped and all_T:
        labelled = False
        for variant, Ts in skipped.items():
            if len(Ts):
                colour = VARIANT_STYLE.get(variant, ("black",))[0]
                ax.plot(
                    Ts,
                    [ax.get_ylim()[0]] * len(Ts),
                    "x",
                    color=colour,
                    clip_on=False,
                    markersize=9,
                    mew=2,
                    label=None if labelled else "× = point skipped (too slow) or failed",
                )
                labelled = True
    if references and all_T:
        t0, t1 = min(all_T), max(all_T)
        grid = np.geomspace(t0, t1, 50)
        anchor = math.exp(np.mean(np.log(first_y)))  # geometric mean of the first points
        ylim = ax.get_ylim()
        for name, f in _REFERENCES:
            ref = anchor * f(grid) / f(t0)
            ax.loglog(grid, ref, linestyle="--", color="0.55", linewidth=1)
            inside = ref <= ylim[1] * 0.8
            k = int(np.nonzero(inside)[0][-1]) if inside.any() else 0
            ax.annotate(
                name,
                (grid[k], ref[k]),
                textcoords="offset points",
                xytext=(4, 0),
                fontsize=9,
                color="0.3",
                va="center",
                ha="left" if k == grid.size - 1 else "right",
            )
        ax.set_ylim(ylim)
    if fit_range is not None and all_T and (fit_range[0] > min(all_T) or fit_range[1] < max(all_T)):
        ax.axvspan(fit_range[0], fit_range[1], color="0.9", zorder=0, label="fit range")
    Ts = sorted(set(all_T))
    if Ts:
        ticks = [t for t in Ts if math.log2(t).is_integer()]
        step = max(1, len(ticks) // 6)
        ax.set_xticks(ticks[::step])
        ax.set_xticklabels([format_tokens(t) for t in ticks[::step]])
        ax.minorticks_off()
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    if all_T:
        ax.legend(fontsize=8, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.4")


def plot_scaling(panels: Sequence[dict], path: str, suptitle: str, ncols: int = 2) -> str:
    """Save a figure with one panel per dict (keys: the arguments of plot_cost_vs_T but `ax`) to `path` (PNG)."""
    plt = _pyplot()
    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.0 * ncols, 5.4 * nrows), squeeze=False)
    for ax, panel in zip(list(axes.flat)[: len(panels)], panels, strict=True):
        plot_cost_vs_T(ax, **panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(suptitle, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
