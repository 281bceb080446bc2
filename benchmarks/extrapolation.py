"""Does FreeSolo extrapolate? Train small models, evaluate the retrieval suite at 1x..64x the training length.

Three commands (each fits one 9-minute GPU call; all write under --out):

    # one model, trained and evaluated on every task and length (as far as the deadline allows)
    python benchmarks/extrapolation.py model --which fs --out DIR --train-minutes 4 --total-minutes 8.5
    python benchmarks/extrapolation.py model --which fsl --out DIR ...    # needs DIR/ckpt_fs (continued training)
    python benchmarks/extrapolation.py model --which dense | window ...
    #   --which fs also evaluates FS-B on the FS weights (tau calibrated on training-like sequences)

    # everything at once, smaller: dense + FS + FS-L, S-NIAH-1 at every length first, then the other tasks
    python benchmarks/extrapolation.py oneshot --out DIR --total-minutes 8.5

    # tables and plots from the JSON (CPU)
    python benchmarks/extrapolation.py report --results benchmarks/results/extrapolation.json --out-dir benchmarks/results

Results: DIR/extrapolation.json = {"results": [records], "grid": [S-NIAH-1 per-depth records], "env": ...};
records are {model, variant, task, train_length, length, accuracy, n, seconds, seed}. Cells that the
deadline did not reach are absent (the report prints them as "—" and lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from freesolo.retrieval.evaluate import evaluate, extend_records, merge_records, prepare  # noqa: E402
from freesolo.retrieval.tasks import TASK_NAMES  # noqa: E402

MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
# evaluation order of the length multiples: the decisive cells first (1x: learned? 32x: the paper's claim)
PRIORITY = (1, 32, 8, 64, 2, 4, 16)
VARIANT_LABEL = {"dense": "dense RoPE", "window": "window only", "fs": "FS", "fsl": "FS-L", "fsb": "FS-B"}
# The paper's shape as issue 14 states it (no per-cell figures of the paper are available here):
PAPER = {("s-niah-1", 32): {"fs": ">= 90", "fsl": ">= 90", "fsb": ">= 90", "dense": "<= 10"}}
# The paper's own figures where a task matches (../shared/seeds: models trained at 4k tokens, RULER, 100
# samples per cell): (task, multiple of the training length) -> (model size and length, {variant: accuracy %}).
PAPER_FIGURES = {
    ("s-niah-1", 64): ("340M at 256k", {"fs": "98-100", "fsl": "84"}),
    ("s-niah-2", 4): ("800M at 16k", {"fsl": "81", "fsb": "88"}),
    ("s-niah-3", 4): ("800M at 16k", {"fsl": "40", "fsb": "84"}),
    ("mk-niah", 4): ("800M at 16k", {"fsl": "23"}),
    ("mv-niah", 4): ("800M at 16k", {"fsl": "17"}),
}

# Model recipe (about 4.5M parameters, 9 MB in bf16) and FreeSolo sizes scaled to a 1024-token training length.
MODEL_ARGS = ["--d-model", "256", "--n-layers", "6", "--n-heads", "4", "--n-kv-heads", "2"]
FS_ARGS = ["--window", "128", "--cell", "16", "--block", "64", "--top-k", "4", "--pool", "32", "--recent", "4"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_info() -> dict:
    import torch

    import freesolo

    info = {"python": platform.python_version(), "torch": torch.__version__, "freesolo": freesolo.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info["backends"] = freesolo.available_backends()
    return info


def train(which: str, out_dir: str, minutes: float, train_length: int, backend: str, extra=(), init_from: str | None = None,
          name: str | None = None) -> str:
    """Train checkpoint `name` (default `ckpt_<which>`; FS-L: continued from `init_from`, else ckpt_fs); returns its folder."""
    from freesolo.cli import main

    ckpt = os.path.join(out_dir, name or f"ckpt_{which}")
    args = ["train", "--out", ckpt, "--attention", which, "--train-length", str(train_length), "--minutes", str(minutes)]
    args += ["--backend", backend, "--log-every", "25", "--quiet"]
    if which == "fsl":
        src = init_from or os.path.join(out_dir, "ckpt_fs")
        committed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoints", "ckpt_fs")
        if not os.path.isdir(src) and os.path.isdir(committed):
            src = committed
        if not os.path.isdir(src):
            raise FileNotFoundError(f"FS-L continues from {src}: train --which fs first")
        args += ["--init-from", src, "--warmup", "20", "--lr", "5e-4"]
    elif init_from:  # more training of an earlier call's checkpoint (its sizes come with it)
        args += ["--init-from", init_from, "--warmup", "50", "--lr", "1e-3", "--batch-tokens", "32768"]
    else:
        args += MODEL_ARGS + FS_ARGS + ["--batch-tokens", "32768"]
    args += list(extra)
    log(f"train {which}: {' '.join(args)}")
    start = time.perf_counter()
    try:
        main(args)
    except Exception as error:  # a backend failure: retry on the torch backend (slower, but it runs)
        if backend == "torch":
            raise
        log(f"train {which} failed on backend {backend} ({type(error).__name__}: {error}); retrying on torch")
        i = args.index("--backend")
        args[i + 1] = "torch"
        args[args.index("--minutes") + 1] = str(max(0.5, minutes - (time.perf_counter() - start) / 60))
        main(args)
    return ckpt


class Results:
    """The JSON file, rewritten after every cell (a killed run keeps what it measured)."""

    def __init__(self, path: str):
        self.path = path
        self.data = {"results": [], "grid": [], "env": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def add(self, records=(), grid=(), diagnosis=()) -> None:
        self.data["results"] = merge_records(self.data.get("results", []), list(records))
        self.data["grid"] = merge_records(self.data.get("grid", []), list(grid))
        if diagnosis:
            keys = ("model", "variant", "task", "length", "index")
            self.data["diagnosis"] = merge_records(self.data.get("diagnosis", []), list(diagnosis), keys=keys)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def _usable_backend(model, backend: str, length: int, device) -> str:
    """`backend`, or "torch" when one forward of `length` tokens fails on it (e.g. a variant it lacks)."""
    import torch

    from freesolo.retrieval.modelio import backend_scope

    if backend == "torch":
        return backend
    try:
        with backend_scope(backend), torch.no_grad():
            model(torch.zeros((1, length), dtype=torch.int64, device=device) + 1)
        return backend
    except Exception as error:  # noqa: BLE001 - any failure: fall back to the reference GPU backend
        log(f"backend {backend} cannot run attention={model.config.attention} ({type(error).__name__}: {error}); using torch")
        return "torch"


def run_plan(plan, results: Results, deadline: float, seed: int, backend: str, device) -> None:
    """plan: list of (ckpt, variant, task, multiples, n, diagnose). Models are prepared once per (ckpt, variant)."""
    from freesolo.retrieval.modelio import backend_scope

    prepared = {}
    # cells measured by an earlier call (the same JSON file): not measured again
    done = {(r["model"], r["variant"], r["task"], r["length"]): r.get("n", 0) for r in results.data.get("results", [])}
    for ckpt, variant, task, multiples, n, diagnose in plan:
        if time.perf_counter() > deadline:
            log(f"deadline: skipped {os.path.basename(ckpt)}/{variant} {task} x{list(multiples)}")
            continue
        key = (ckpt, variant)
        if key not in prepared:
            try:
                with backend_scope("torch"):  # tau calibration and weight loading: any backend will do
                    model, info, kind = prepare(ckpt, variant, device)
                prepared[key] = (model, info, kind, _usable_backend(model, backend, int(info["train_length"]), device))
            except Exception as error:  # noqa: BLE001 - report, go on with the other models
                log(f"cannot prepare {ckpt} as {variant}: {type(error).__name__}: {error}")
                prepared[key] = None
        if prepared[key] is None:
            continue
        model, info, kind, be = prepared[key]
        L = int(info["train_length"])
        meta = {"model": os.path.basename(ckpt), "variant": kind, "train_length": L}
        multiples = tuple(m for m in multiples if done.get((meta["model"], kind, task, L * m), 0) < n)
        if not multiples:
            continue
        diagnoses: list = []
        try:
            with backend_scope(be):
                records, grid = evaluate(
                    model, device, [task], [L * m for m in multiples], n, 10, seed, 65536, meta,
                    deadline=deadline, quiet=True, on_record=lambda r: results.add([r]),
                    diagnose=diagnose, diagnoses=diagnoses,
                )
        except Exception as error:  # noqa: BLE001 - e.g. out of memory at 64x: record and continue
            log(f"eval {meta['model']}/{kind} {task} failed: {type(error).__name__}: {error}")
            results.add(diagnosis=diagnoses)
            continue
        results.add(records, grid, diagnoses)


def default_plan(ckpts: dict, tasks=TASK_NAMES, n: int = 50, n_fsb: int = 20) -> list:
    """Order of evaluation (the deadline cuts the tail): S-NIAH-1 at every length for every trained model;
    FS-B (on the FS weights, the slowest) at 1x and 32x; the other tasks; then FS-B's remaining cells."""
    cheap = [(c, w) for w, c in ckpts.items()]
    fsb = [(ckpts["fs"], "fsb")] if "fs" in ckpts else []
    others = [t for t in tasks if t != "s-niah-1"]
    plan = []
    if "s-niah-1" in tasks:
        plan += [(c, v, "s-niah-1", PRIORITY, n, 3) for c, v in cheap]
        plan += [(c, v, "s-niah-1", (1, 32), n_fsb, 2) for c, v in fsb]
    plan += [(c, v, t, PRIORITY, n, 0) for t in others for c, v in cheap]
    if "s-niah-1" in tasks:
        plan += [(c, v, "s-niah-1", (8, 64, 2, 4, 16), n_fsb, 0) for c, v in fsb]
    plan += [(c, v, t, (1, 32), n_fsb, 0) for t in others for c, v in fsb]
    return plan


def cmd_model(args) -> int:
    import torch

    t0 = time.perf_counter()
    deadline = t0 + args.total_minutes * 60
    os.makedirs(args.out, exist_ok=True)
    results = Results(os.path.join(args.out, "extrapolation.json"))
    results.data.setdefault("env", {})["device"] = env_info()
    results.save()  # the file exists even when the deadline leaves no cell
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = _backend(args.backend, device)
    if args.ckpt:  # evaluate a trained checkpoint (cells already in --out's JSON are skipped)
        ckpt = args.ckpt
    else:
        ckpt = train(args.which, args.out, args.train_minutes, args.train_length, backend, args.train_extra, args.init_from, args.name)
    run_plan(default_plan({args.which: ckpt}, args.tasks, args.n, args.n_fsb), results, deadline - 10, args.seed, backend, device)
    log(f"model {args.which}: done in {time.perf_counter() - t0:.0f} s -> {results.path}")
    return 0


def cmd_oneshot(args) -> int:
    import torch

    t0 = time.perf_counter()
    deadline = t0 + args.total_minutes * 60
    os.makedirs(args.out, exist_ok=True)
    results = Results(os.path.join(args.out, "extrapolation.json"))
    results.data.setdefault("env", {})["device"] = env_info()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = _backend(args.backend, device)
    log(f"oneshot: backend={backend} env={results.data['env']['device']}")
    ckpts = {}
    for spec in args.models:
        which, minutes = spec.split(":")
        ckpts[which] = train(which, args.out, float(minutes), args.train_length, backend, args.train_extra)
    run_plan(default_plan(ckpts, args.tasks, args.n, args.n_fsb), results, deadline - args.reserve, args.seed, backend, device)
    log(f"oneshot: done in {time.perf_counter() - t0:.0f} s -> {results.path}")
    return 0


def _backend(name: str, device) -> str:
    from freesolo.retrieval.modelio import pick_backend

    return pick_backend(name, device)


# ---- report ------------------------------------------------------------------------------------


def _table(records, task: str, lengths, train_length: int) -> list[str]:
    rows = sorted({(r["model"], r["variant"]) for r in records if r["task"] == task}, key=lambda mv: list(VARIANT_LABEL).index(mv[1]) if mv[1] in VARIANT_LABEL else 99)
    cell = {(r["model"], r["variant"], r["length"]): r for r in records if r["task"] == task}
    head = "| model | " + " | ".join(f"{L // train_length}× ({L})" for L in lengths) + " |"
    lines = [head, "|" + "---|" * (len(lengths) + 1)]
    for model, variant in rows:
        vals = []
        for L in lengths:
            r = cell.get((model, variant, L))
            vals.append("—" if r is None else f"{100 * r['accuracy']:.0f} % (n={r['n']})")
        lines.append(f"| {VARIANT_LABEL.get(variant, variant)} [{model}] | " + " | ".join(vals) + " |")
    for (t, mult), claims in PAPER.items():
        if t == task:
            lines.append("")
            lines.append(f"Paper's shape at {mult}× (as issue 14 states it): " + ", ".join(f"{VARIANT_LABEL[v]} {c} %" for v, c in claims.items()))
    for (t, mult), (where, figures) in PAPER_FIGURES.items():
        if t == task:
            lines.append("")
            lines.append(f"The paper at {mult}× its training length ({where}): " + ", ".join(f"{VARIANT_LABEL[v]} {c} %" for v, c in figures.items()))
    return lines


def load_results(paths) -> dict:
    """Merge result files (later files replace earlier records with the same key; a record with
    `first` > 0 extends the earlier one: `freesolo eval --first`)."""
    data = {"results": [], "grid": [], "diagnosis": [], "env": {}}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        data["results"] = extend_records(data["results"], d.get("results", []))
        data["grid"] = extend_records(data["grid"], d.get("grid", []))
        data["diagnosis"] = merge_records(data["diagnosis"], d.get("diagnosis", []), keys=("model", "variant", "task", "length", "index"))
        data["env"].update(d.get("env", {}))
    return data


def cmd_report(args) -> int:
    data = load_results(args.results)
    if args.merged:
        with open(args.merged, "w") as f:
            json.dump(data, f, indent=1)
    records, grid = data.get("results", []), data.get("grid", [])
    if not records:
        print(f"{args.results} hold no records")
        return 1
    train_length = min(r["train_length"] for r in records)
    lengths = [train_length * m for m in MULTIPLES]
    tasks = [t for t in TASK_NAMES if any(r["task"] == t for r in records)]
    md = ["# Extrapolation: retrieval accuracy vs sequence length", ""]
    sources = ", ".join(os.path.basename(p) for p in args.results)
    md.append(f"Trained at {train_length} tokens; exact match of every answer token (teacher-forced argmax = greedy decoding), needle depths spread evenly over 10 depths. Source: `{sources}`; environment: `{json.dumps(data.get('env', {}).get('device', {}))}`.")
    md.append("")
    for task in tasks:
        md += [f"## {task}", ""] + _table(records, task, lengths, train_length) + [""]
    missing = []
    variants = sorted({(r["model"], r["variant"]) for r in records})
    for model, variant in variants:
        for task in tasks:
            for L in lengths:
                if not any(r["model"] == model and r["variant"] == variant and r["task"] == task and r["length"] == L for r in records):
                    missing.append(f"{model}/{variant} {task} {L}")
    md += _diagnosis_section(data.get("diagnosis", []), lengths, train_length)
    absent = [VARIANT_LABEL[v] for v in VARIANT_LABEL if not any(r["variant"] == v for r in records)]
    if missing or absent:
        md += ["## Not measured (deadline, failure or not trained)", ""]
        if absent:
            md += [f"No record at all: {', '.join(absent)}.", ""]
        if missing:
            md += [", ".join(missing), ""]
    os.makedirs(args.out_dir, exist_ok=True)
    plots = _plots(records, grid, tasks, lengths, train_length, args.out_dir)
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    path = os.path.join(args.out_dir, "extrapolation.md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {path} and {plots}")
    return 0


def _diagnosis_section(diag, lengths, train_length) -> list[str]:
    """Failure modes of the FreeSolo models on S-NIAH-1 (freesolo.retrieval.diagnose)."""
    from freesolo.retrieval.diagnose import summarize

    if not diag:
        return []
    md = ["## Diagnosis (S-NIAH-1, query predicting the first answer token)", ""]
    md.append("Per cell, up to 5 failed and 5 correct samples. *available*: a needle cell is complete and available to the query's block; "
              "*in cand.*: in the candidate set of some layer's kv head (FS: all available cells; FS-L: recent + high-norm pool; FS-B: not observable); "
              "*selected*: among the top-K of some layer and head; *mass*: best long-branch softmax mass on the needle tokens; "
              "*norm pct*: percentile of the needle cell's max key norm a_c among available cells, per layer (median over samples).")
    md.append("")
    md.append("| model | length | outcome | n | available | in cand. | selected | mass | norm pct by layer |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x: "—" if x is None else f"{100 * x:.0f} %"
    for model, variant in sorted({(d["model"], d["variant"]) for d in diag}):
        for L in lengths:
            items = [d for d in diag if d["model"] == model and d["variant"] == variant and d["length"] == L]
            if not items:
                continue
            summ = summarize(items)
            for outcome in ("failed", "correct"):
                a = summ[outcome]
                if a is None:
                    continue
                pct = " / ".join(f"{100 * x:.0f}" for x in a.get("norm_pct_by_layer", []))
                md.append(
                    f"| {VARIANT_LABEL.get(variant, variant)} [{model}] | {L // train_length}× | {outcome} | {a['n']} | {fmt(a['available'])} | "
                    f"{fmt(a.get('in_candidates_any'))} | {fmt(a.get('selected_any'))} | {fmt(a.get('best_mass'))} | {pct} |"
                )
    return md + [""]


def _plots(records, grid, tasks, lengths, train_length, out_dir) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return []
    out = []
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, task in zip(axes.ravel(), tasks):
        for model, variant in sorted({(r["model"], r["variant"]) for r in records if r["task"] == task}):
            pts = sorted((r["length"], r["accuracy"]) for r in records if r["task"] == task and r["model"] == model and r["variant"] == variant)
            ax.plot([p[0] / train_length for p in pts], [100 * p[1] for p in pts], "o-", label=VARIANT_LABEL.get(variant, variant))
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_title(task)
        ax.set_xlabel(f"length / train length ({train_length})")
        ax.set_ylabel("exact match %")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(tasks) :]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out_dir, "extrapolation_accuracy.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    out.append(p)
    variants = sorted({(g["model"], g["variant"]) for g in grid})
    if variants:
        fig, axes = plt.subplots(1, len(variants), figsize=(4.6 * len(variants), 3.6), squeeze=False)
        depths = sorted({g["depth"] for g in grid})
        for ax, (model, variant) in zip(axes[0], variants):
            img = np.full((len(depths), len(lengths)), np.nan)
            for g in grid:
                if g["model"] == model and g["variant"] == variant and g["length"] in lengths:
                    img[depths.index(g["depth"]), lengths.index(g["length"])] = 100 * g["accuracy"]
            im = ax.imshow(img, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(lengths)), [f"{L // train_length}×" for L in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.1f}" for d in depths])
            ax.set_title(f"S-NIAH-1: {VARIANT_LABEL.get(variant, variant)}")
            ax.set_xlabel("length")
            ax.set_ylabel("needle depth")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="exact match %")
        p = os.path.join(out_dir, "extrapolation_depth.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True)
    common.add_argument("--train-length", type=int, default=1024)
    common.add_argument("--total-minutes", type=float, default=8.5, help="wall budget of the whole command")
    common.add_argument("--n", type=int, default=50, help="samples per task and length")
    common.add_argument("--n-fsb", type=int, default=20, help="samples per cell for FS-B (its torch selection is the slowest)")
    common.add_argument("--tasks", nargs="+", default=list(TASK_NAMES))
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--backend", default="auto")
    common.add_argument("--train-extra", nargs=argparse.REMAINDER, default=[], help="more `freesolo train` flags (last)")
    m = sub.add_parser("model", parents=[common], help="train one model and evaluate it")
    m.add_argument("--which", choices=["dense", "window", "fs", "fsl"], required=True)
    m.add_argument("--train-minutes", type=float, default=4.0)
    m.add_argument("--name", default=None, help="checkpoint folder name = model name in the records (default ckpt_<which>)")
    m.add_argument("--ckpt", default=None, help="evaluate this checkpoint instead of training one (its folder name is the model name)")
    m.add_argument("--init-from", default=None, help="continue from this checkpoint (FS-L: the FS checkpoint; default OUT/ckpt_fs, then the committed one)")
    m.set_defaults(func=cmd_model)
    o = sub.add_parser("oneshot", parents=[common], help="train several models, then evaluate until the deadline")
    o.add_argument("--models", nargs="+", default=["dense:1.3", "window:0.6", "fs:3.0", "fsl:0.7"], help="which:minutes, in order")
    o.add_argument("--reserve", type=float, default=25.0, help="seconds kept after the last evaluation")
    o.set_defaults(func=cmd_oneshot)
    r = sub.add_parser("report", help="markdown table and plots from the JSON")
    r.add_argument("--results", nargs="+", required=True, help="result files, merged in order")
    r.add_argument("--merged", default=None, help="also write the merged JSON here")
    r.add_argument("--out-dir", required=True)
    r.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
