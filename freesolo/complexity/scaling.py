"""`freesolo scaling`: counted and measured cost of FS vs FS-L vs FS-B over T, fitted exponents.

With no flags it runs on the CPU numba backend in under 3 minutes (numba compile included):
counted cost (exact, spec §10) at T = 2k..1M and measured wall time / peak memory at T = 2k..32k
(B=1, Hq=2 query heads on Hkv=1 kv head, D=64). It writes to --out (default `scaling_out/`):
`counted.csv`, `measured.csv`, `scaling.json` (config, versions, rows, fits) and `scaling.png`,
and prints a table of fitted exponents.

    freesolo scaling                                   # the defaults above
    freesolo scaling --backend torch --device cuda --dtype bfloat16 --T-max 256k --heads 16
    python -m freesolo.complexity.scaling --variants fsl,fsb --T 4k,8k,16k
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from collections.abc import Sequence

import numpy as np

from ..config import VARIANTS, FreeSoloConfig
from .counted import counted_sweep
from .fits import fit_cost_model, loglog_slope
from .measured import measured_sweep
from .plots import format_tokens, plot_scaling

__all__ = ["add_scaling_parser", "run_scaling", "scaling_main", "build_parser", "parse_tokens", "powers_of_two"]

_CONFIG_FLAGS = ("window", "cell", "top_k", "block", "pool", "recent", "beam")


def parse_tokens(text: str) -> int:
    """'4096', '4k' (4096), '1M' (1048576) -> int tokens (k and M are binary)."""
    text = text.strip()
    units = {"k": 1 << 10, "K": 1 << 10, "m": 1 << 20, "M": 1 << 20}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count like 4096, 4k or 1M") from None


def _token_list(text: str) -> list[int]:
    return [parse_tokens(t) for t in text.split(",") if t.strip()]


def _variant_list(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise argparse.ArgumentTypeError(f"variants {bad or text!r} must be a comma list of {VARIANTS}")
    return variants


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... <= hi (and hi itself if it is not on the grid)."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < T-min <= T-max, got {lo}, {hi}")
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    if out[-1] != hi:
        out.append(hi)
    return out


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--variants", type=_variant_list, default=list(VARIANTS), help="comma list (default fs,fsl,fsb)"
    )
    parser.add_argument("--backend", default="numba", help="backend of the measured sweep (default numba)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n] (torch / triton backends)")
    parser.add_argument("--dtype", default=None, help="torch dtype of the inputs (float32, bfloat16, float16)")
    parser.add_argument(
        "--T", type=_token_list, default=None, help="measured lengths, e.g. 2k,4k,8k (overrides --T-min/--T-max)"
    )
    parser.add_argument(
        "--T-min", type=parse_tokens, default=2048, help="smallest T, measured and counted (default 2k)"
    )
    parser.add_argument(
        "--T-max", type=parse_tokens, default=32768, help="largest measured T (default 32k); powers of two between"
    )
    parser.add_argument("--counted-T-max", type=parse_tokens, default=1 << 20, help="largest counted T (default 1M)")
    parser.add_argument(
        "--fit-T-min",
        type=parse_tokens,
        default=16384,
        help="counted exponents are fitted over T >= this (default 16k, where the window and pool are full)",
    )
    parser.add_argument(
        "--measured-fit-T-min",
        type=parse_tokens,
        default=4096,
        help="measured exponents are fitted over T >= this (default 4k: fixed overheads dominate below)",
    )
    parser.add_argument("--heads", type=int, default=2, help="query heads Hq (default 2)")
    parser.add_argument("--kv-heads", type=int, default=1, help="kv heads Hkv (default 1)")
    parser.add_argument("--dim", type=int, default=64, help="head dim D (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point while under 1 s in total (default 3)"
    )
    parser.add_argument(
        "--max-seconds-per-point",
        type=float,
        default=20.0,
        help="skip measured points predicted to take longer (default 20 s)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=100.0,
        help="wall-clock budget of the measured points after the warm-up / numba compile (default 100 s); "
        "points that would end later are skipped and reported",
    )
    parser.add_argument("--skip-measured", action="store_true", help="counted cost only (no timing)")
    parser.add_argument("--out", default="scaling_out", help="output folder (default scaling_out)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random q, k, v (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    for name in _CONFIG_FLAGS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"FreeSoloConfig.{name} (default {getattr(FreeSoloConfig(), name)})",
        )
    return parser


def add_scaling_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `scaling` sub-command on an argparse subparsers object; sets func=run_scaling."""
    parser = subparsers.add_parser(
        "scaling",
        help="counted and measured cost of FS / FS-L / FS-B over T, with fitted exponents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    parser.set_defaults(func=run_scaling)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (python -m freesolo.complexity.scaling)."""
    return _configure(
        argparse.ArgumentParser(
            prog="freesolo scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )


# ---- fits and table -------------------------------------------------------------------------
def _fits(rows: list[dict], key: str, T_min: int = 0) -> dict[str, dict]:
    """Per variant: log-log slope and cost-model fit of rows[key] over T >= T_min (ok rows only)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [
            (r["T"], r[key])
            for r in rows
            if r["variant"] == variant and r.get(key) and r.get("status", "ok") == "ok" and r["T"] >= T_min
        ]
        if len(pts) < 2:
            out[variant] = None
            continue
        T, y = np.array(pts, dtype=np.float64).T
        slope = loglog_slope(T, y)
        model = fit_cost_model(T, y)
        out[variant] = {
            "slope": slope.as_dict(),
            "slope_text": str(slope),
            "model": model.as_dict(),
            "T_range": [int(T.min()), int(T.max())],
        }
    return out


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def format_report(result: dict) -> str:
    """The printed summary: counted exponents and per-query counts, measured exponents and times."""
    cfg, shape = result["config"], result["shape"]
    lines = [
        f"FreeSolo scaling: B={shape['batch']} Hq={shape['heads']} Hkv={shape['kv_heads']} D={shape['dim']}; "
        f"window={cfg['window']} cell={cfg['cell']} top_k={cfg['top_k']} block={cfg['block']} "
        f"pool={cfg['pool']} recent={cfg['recent']} beam={cfg['beam']}",
        "",
    ]
    counted, fits = result["counted"], result["fits"]
    if counted:
        T_max = max(r["T"] for r in counted)
        fr = result["fit_ranges"]["counted"]
        lines.append(
            f"Counted cost (exact, spec §10), exponents fitted over "
            f"T = {format_tokens(fr[0])}..{format_tokens(fr[1])}.\n"
            "  selection work = cells scored + node keys + cell * cells reranked + build (D-length dot products);\n"
            "  total work = selection + tokens read by the readout (local window + top_k * cell, the same for all\n"
            f"  variants); per-query counts at T = {format_tokens(T_max)}; state = streaming state per batch row\n"
            "  (spec §9 model, bf16)"
        )
        rows = []
        for variant in result["variants"]:
            last = next(r for r in counted if r["variant"] == variant and r["T"] == T_max)
            fit = fits["counted_selection_work"].get(variant)
            fit_all = fits["counted_work"].get(variant)
            rows.append(
                [
                    variant,
                    fit["slope_text"] if fit else "-",
                    fit["model"]["dominant"] if fit else "-",
                    fit_all["slope_text"] if fit_all else "-",
                    f"{last['cells_scored_per_query']:.1f}",
                    f"{last['node_keys_per_query']:.1f}",
                    f"{last['cells_reranked_per_query']:.1f}",
                    f"{last['tokens_read_per_query']:.1f}",
                    _fmt_bytes(last["state_bytes"]),
                ]
            )
        lines.append(
            _table(
                [
                    "variant",
                    "selection exponent [95% CI]",
                    "model term",
                    "total-work exponent",
                    f"cells scored/q @{format_tokens(T_max)}",
                    "node keys/q",
                    "cells reranked/q",
                    "tokens read/q",
                    "state (bf16)",
                ],
                rows,
            )
        )
        lines.append("")
    measured = result["measured"]
    if measured:
        Ts = sorted({r["T"] for r in measured})
        m = result["measured_setup"]
        fr = result["fit_ranges"]["measured"]
        lines.append(
            f"Measured wall time ({m['backend']}, {m['device']}, {m['dtype']}), best of up to {m['repeats']} runs, "
            f"exponents fitted over T = {format_tokens(fr[0])}..{format_tokens(fr[1])}; "
            f"peak memory of the forward call by {m['memory_method']}"
        )
        for key, what in (("time_s", "forward (attention)"), ("select_time_s", "selection only (select_cells)")):
            fit_name = "measured_time" if key == "time_s" else "measured_select_time"
            rows = []
            for variant in result["variants"]:
                vrows = {r["T"]: r for r in measured if r["variant"] == variant}
                fit = fits[fit_name].get(variant)
                cells = []
                for T in Ts:
                    r = vrows.get(T)
                    if r and r["status"] == "ok":
                        cells.append(_fmt_time(r.get(key)))
                    else:
                        cells.append("skipped" if r and r["status"].startswith("skipped") else "error")
                row = [variant, fit["slope_text"] if fit else "-", *cells]
                if key == "time_s":
                    ok = [r for r in vrows.values() if r["status"] == "ok"]
                    row.append(_fmt_bytes(max(ok, key=lambda r: r["T"])["peak_bytes"]) if ok else "-")
                rows.append(row)
            headers = ["variant", f"{what} exponent [95% CI]", *[f"T={format_tokens(T)}" for T in Ts]]
            if key == "time_s":
                headers.append("peak mem @largest")
            lines.append(_table(headers, rows))
            lines.append("")
        errors = sorted({f"{r['variant']}: {r['status']}" for r in measured if r["status"] != "ok"})
        for e in errors:
            lines.append(f"  note: {e}")
    return "\n".join(lines)


def _versions() -> dict:
    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    for module in ("numba", "torch", "triton", "scipy", "matplotlib"):
        if module in sys.modules:
            versions[module] = getattr(sys.modules[module], "__version__", "?")
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            versions["gpu"] = torch.cuda.get_device_name(0)
    return versions


def _write_csv(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _series(rows: list[dict], key: str, scale: float = 1.0) -> dict:
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted(
            (r["T"], r[key] * scale)
            for r in rows
            if r["variant"] == variant and r.get("status", "ok") == "ok" and r.get(key)
        )
        out[variant] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def run_scaling(args: argparse.Namespace) -> int:
    """Run the sweeps described by parsed `args`, write CSV / JSON / PNG under args.out, print the table."""
    start = time.perf_counter()
    overrides = {name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name, None) is not None}
    cfg = FreeSoloConfig(**overrides)
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    os.makedirs(args.out, exist_ok=True)
    measured_T = sorted(args.T) if args.T else powers_of_two(args.T_min, args.T_max)
    counted_T = powers_of_two(min(args.T_min, measured_T[0]), max(args.counted_T_max, measured_T[-1]))
    shape = dict(num_heads=args.heads, num_kv_heads=args.kv_heads, dim=args.dim, seed=args.seed, batch=args.batch)

    counted = counted_sweep(counted_T, args.variants, cfg, **shape)
    measured = []
    if not args.skip_measured:
        measured = measured_sweep(
            measured_T,
            args.variants,
            args.backend,
            cfg,
            repeats=args.repeats,
            max_seconds_per_point=args.max_seconds_per_point,
            budget_s=args.budget_s,
            device=args.device,
            dtype=args.dtype,
            progress=not args.no_progress,
            **shape,
        )
    fit_lo = max(args.fit_T_min, counted_T[0]) if counted_T[-1] >= 2 * args.fit_T_min else counted_T[0]
    # measured fits over T >= measured-fit-T-min when that leaves at least 3 points, else over all points
    mfit_lo = args.measured_fit_T_min if sum(T >= args.measured_fit_T_min for T in measured_T) >= 3 else measured_T[0]
    fits = {
        "counted_selection_work": _fits(counted, "selection_work", fit_lo),
        "counted_work": _fits(counted, "work", fit_lo),
        "counted_cells_scored": _fits(counted, "cells_scored", fit_lo),
        "counted_node_keys": _fits(counted, "node_keys", fit_lo),
        "measured_time": _fits(measured, "time_s", mfit_lo),
        "measured_select_time": _fits(measured, "select_time_s", mfit_lo),
        "measured_peak_bytes": _fits(measured, "peak_bytes", mfit_lo),
    }
    ok = [r for r in measured if r["status"] == "ok"]
    result = {
        "args": {key: value for key, value in vars(args).items() if key != "func"},
        "versions": _versions(),
        "config": {name: getattr(cfg, name) for name in (*_CONFIG_FLAGS, "sigma", "lam", "leaf_order", "hash_bits")},
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dim": args.dim,
            "seed": args.seed,
        },
        "variants": args.variants,
        "fit_ranges": {"counted": [fit_lo, counted_T[-1]], "measured": [mfit_lo, measured_T[-1]]},
        "measured_setup": {
            "backend": args.backend,
            "device": args.device,
            "dtype": ok[0]["dtype"] if ok else (args.dtype or "-"),
            "repeats": args.repeats,
            "memory_method": ok[0]["memory_method"] if ok else "-",
        },
        "counted": counted,
        "measured": measured,
        "fits": fits,
    }
    _write_csv(os.path.join(args.out, "counted.csv"), counted)
    _write_csv(os.path.join(args.out, "measured.csv"), measured)

    panels = [
        dict(
            series=_series(counted, "selection_work", 1.0 / (args.batch * args.heads)),
            ylabel="selection work per head (D-length dot products)",
            title=f"Counted selection cost (exact, spec §10), B={args.batch} D={args.dim}",
            slopes={v: f["slope_text"] for v, f in fits["counted_selection_work"].items() if f},
            fit_range=tuple(result["fit_ranges"]["counted"]),
        )
    ]
    if ok:
        skipped = {v: [r["T"] for r in measured if r["variant"] == v and r["status"] != "ok"] for v in args.variants}
        where = f"{args.backend} on {args.device}, B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.dim}"
        panels.append(
            dict(
                series=_series(measured, "time_s"),
                ylabel="wall time of one forward call (s)",
                title=f"Measured forward time ({where})",
                slopes={v: f["slope_text"] for v, f in fits["measured_time"].items() if f},
                skipped=skipped,
                fit_range=(mfit_lo, measured_T[-1]),
            )
        )
        panels.append(
            dict(
                series=_series(measured, "select_time_s"),
                ylabel="wall time of select_cells (s)",
                title=f"Measured selection time only ({args.backend} on {args.device})",
                slopes={v: f["slope_text"] for v, f in fits["measured_select_time"].items() if f},
                skipped=skipped,
                fit_range=(mfit_lo, measured_T[-1]),
            )
        )
        panels.append(
            dict(
                series=_series(measured, "peak_bytes", 1.0 / (1 << 20)),
                ylabel="peak extra memory of a forward call (MiB)",
                title=f"Measured peak memory ({result['measured_setup']['memory_method']}, inputs not counted)",
                slopes={v: f["slope_text"] for v, f in fits["measured_peak_bytes"].items() if f},
                skipped=skipped,
                fit_range=(mfit_lo, measured_T[-1]),
            )
        )
    png = plot_scaling(
        panels,
        os.path.join(args.out, "scaling.png"),
        "FreeSolo attention: cost vs sequence length T, one line per variant "
        "(grey dashed: reference slopes; legend: fitted log-log slope [95% CI])",
    )
    result["elapsed_s"] = time.perf_counter() - start
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(format_report(result))
    print(
        f"\nwrote {args.out}/counted.csv, measured.csv, scaling.json, {os.path.basename(png)} "
        f"in {result['elapsed_s']:.1f} s"
    )
    return 0


def scaling_main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse argv (default sys.argv[1:]) and run."""
    return run_scaling(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(scaling_main())
