"""`freesolo eval`: exact-match accuracy of a checkpoint on any task at any list of lengths.

Records (one per task and length): `{model, variant, task, train_length, length, accuracy, n,
seconds}`; with `--grid`, S-NIAH-1 also gets one record per depth (`grid` list: the depth x
length heat map). Sample `i` of (task, length) has depth `depths_for(n, n_depths)[i]` and seed
`sample_seed(seed, task, length, i)`: the same command gives the same samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np

from .data import Mixture, sequences_like_training
from .modelio import backend_scope, calibrate_fsb, load_model, pick_backend, pick_device, retarget
from .scoring import score_samples
from .taskfile import read_task_json
from .tasks import TASKS, depths_for, generate, sample_seed

__all__ = ["add_eval_parser", "cmd_eval", "evaluate", "extend_records", "merge_records"]


def _forward_fn(model, device):
    import torch

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def forward(tokens: np.ndarray):
        with torch.no_grad(), autocast:
            return model(torch.as_tensor(tokens, device=device))

    return forward


def evaluate(
    model,
    device,
    tasks,
    lengths,
    n: int,
    n_depths: int,
    seed: int,
    batch_tokens: int,
    meta: dict,
    grid_tasks=("s-niah-1",),
    deadline: float | None = None,
    quiet: bool = False,
    on_record=None,
    diagnose: int = 0,
    diagnoses: list | None = None,
    selection_chunk: int | None = None,
    first: int = 0,
) -> tuple[list, list]:
    """Score `model` on every (task, length); returns (records, grid records).

    `meta` holds `model`, `variant`, `train_length` (copied into each record). `deadline`
    (time.perf_counter() value): cells not started by then are skipped (and reported).
    `diagnose` > 0 (FreeSolo models): up to that many failed and as many correct samples per cell are
    diagnosed (`diagnose.diagnose_sample`) and appended to the list `diagnoses`.
    `selection_chunk`: the torch backend's selection chunks min(length, selection_chunk) positions
    long (`selection_chunk_scope`: FS-B's search is launch-bound, one chunk per row is fastest).
    `first` > 0: score samples first..n-1 only (the same samples as a full run's); the records
    carry `first`, and `extend_records` adds them to a run that scored 0..first-1.
    """
    if not 0 <= first < n:
        raise ValueError(f"first={first} must be in [0, n={n})")
    from tqdm import tqdm

    forward = _forward_fn(model, device)
    records, grid = [], []
    for length in lengths:
        for task in tasks:
            if deadline is not None and time.perf_counter() > deadline:
                print(f"  skipped {task} @ {length}: past the deadline")
                continue
            depths = depths_for(n, n_depths)[first:]
            samples = [generate(task, length, float(depths[i - first]), sample_seed(seed, task, length, i)) for i in range(first, n)]
            bar = tqdm(total=n - first, desc=f"{meta['variant']} {task} L={length}", unit="sample", disable=quiet, leave=False)
            start = time.perf_counter()
            with _selection_chunk(selection_chunk, length):
                ok = score_samples(forward, samples, max(1, batch_tokens // length), progress=bar.update, deadline=deadline)
            bar.close()
            if len(ok) < n - first:
                print(f"  {task} @ {length}: deadline after {len(ok)} of {n - first} samples")
                depths = depths[: len(ok)]
            rec = {
                **meta,
                "task": task,
                "length": int(length),
                "accuracy": float(ok.mean()),
                "n": int(len(ok)),
                "seconds": round(time.perf_counter() - start, 2),
                "seed": int(seed),
                **({"first": int(first)} if first else {}),
            }
            records.append(rec)
            if on_record is not None:
                on_record(rec)
            print(f"  {meta['model']:<16} {meta['variant']:<6} {task:<9} L={length:<7} acc={rec['accuracy']:.3f} n={rec['n']}  ({rec['seconds']} s)")
            if diagnose > 0 and diagnoses is not None and meta["variant"] in ("fs", "fsl", "fsb"):
                from .diagnose import diagnose_sample

                picks = [i for i in range(len(ok)) if not ok[i]][:diagnose] + [i for i in range(len(ok)) if ok[i]][:diagnose]
                for i in picks:
                    d = diagnose_sample(model, samples[i], device)
                    diagnoses.append({**meta, "task": task, "length": int(length), "depth": float(depths[i]), "index": first + i, "correct": bool(ok[i]), **d})
            if task in grid_tasks:
                for d in np.unique(depths):
                    sel = depths == d
                    grid.append({
                        **meta, "task": task, "length": int(length), "depth": float(d), "accuracy": float(ok[sel].mean()), "n": int(sel.sum()),
                        **({"first": int(first)} if first else {}),
                    })
    return records, grid


def _selection_chunk(tokens: int | None, length: int):
    """The torch backend's selection chunk scope for one cell (a no-op when `tokens` is None)."""
    if tokens is None:
        return contextlib.nullcontext()
    from ..backends.torch import selection_chunk_scope

    return selection_chunk_scope(min(int(length), int(tokens)))


def extend_records(old: list, new: list, keys=("model", "variant", "task", "length", "depth")) -> list:
    """`merge_records`, except that a new record with `first` > 0 (samples first..first+n-1 of a
    cell) is added to the old record of the same key that covers samples 0..first-1: n summed,
    accuracy the pooled mean (accuracy x n counts samples exactly), `parts` lists the sample ranges.
    A result record (no `depth`) must continue its old record exactly (old n == first); a grid
    record (per depth) follows its cell's result record (a depth the first part did not reach is
    added as it is)."""
    plain = [r for r in new if not r.get("first")]
    out = merge_records(old, plain, keys)
    index = {tuple(r.get(k) for k in keys): i for i, r in enumerate(out)}
    for r in new:
        first = r.get("first")
        if not first:
            continue
        key = tuple(r.get(k) for k in keys)
        is_grid = r.get("depth") is not None
        if key not in index:
            if not is_grid:
                raise ValueError(f"record {key} continues from sample {first}, but no record covers samples 0..{first - 1}")
            index[key] = len(out)  # a depth the earlier samples did not reach
            out.append({**{k: v for k, v in r.items() if k != "first"}, "parts": [[first, first + r["n"]]]})
            continue
        base = out[index[key]]
        if not is_grid and (base.get("first") or base["n"] != first):
            raise ValueError(f"record {key} starts at sample {first}, the old one covers {base.get('first', 0)}..{base.get('first', 0) + base['n'] - 1}")
        n = base["n"] + r["n"]
        merged = {**base, "n": n, "accuracy": (base["accuracy"] * base["n"] + r["accuracy"] * r["n"]) / n}
        merged["parts"] = base.get("parts", [[0, base["n"]]]) + [[first, first + r["n"]]]
        if "seconds" in base and "seconds" in r:
            merged["seconds"] = round(base["seconds"] + r["seconds"], 2)
        out[index[key]] = merged
    return out


def merge_records(old: list, new: list, keys=("model", "variant", "task", "length", "depth")) -> list:
    """`old` with every record of `new` replacing the one with the same key (new ones appended)."""
    index = {tuple(r.get(k) for k in keys): i for i, r in enumerate(old)}
    out = list(old)
    for r in new:
        key = tuple(r.get(k) for k in keys)
        if key in index:
            out[index[key]] = r
        else:
            index[key] = len(out)
            out.append(r)
    return out


def prepare(ckpt: str, attention: str | None, device, calib_n: int = 8, seed: int = 0, **fs_overrides):
    """(model ready for eval, task.json). FS-B on FS weights: tau calibrated on training-like sequences."""
    info = read_task_json(ckpt)
    model = load_model(ckpt).to(device)
    kind = attention or model.config.attention
    if kind == "fsb" and (model.config.attention != "fsb" or fs_overrides):
        mix = Mixture(**{k: tuple(v) if isinstance(v, list) else v for k, v in info["mixture"].items()})
        tokens = sequences_like_training(mix, calib_n, info["train_length"], seed)
        model = calibrate_fsb(model, tokens, device) if not fs_overrides else calibrate_fsb(retarget(model, model.config.attention, **fs_overrides), tokens, device)
    elif kind != model.config.attention or fs_overrides:
        model = retarget(model, kind, **fs_overrides)
    model.eval()
    return model, info, kind


def cmd_eval(args) -> int:
    import torch

    device = pick_device(args.device)
    backend = pick_backend(args.backend, device)
    tasks = args.task or ["s-niah-1"]
    if tasks == ["all"]:
        tasks = list(TASKS)
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"--task {t!r} is not one of {list(TASKS)}")
    overrides = {}
    if args.beam is not None:
        overrides["beam"] = args.beam
    if args.radius_weight is not None:
        overrides["radius_weight"] = args.radius_weight
    with backend_scope(backend):
        model, info, kind = prepare(args.ckpt, args.attention, device, **overrides)
        train_length = int(info["train_length"])
        lengths = args.lengths or [train_length * m for m in (1, 2, 4, 8, 16, 32, 64)]
        meta = {"model": args.name or os.path.basename(os.path.normpath(args.ckpt)), "variant": kind, "train_length": train_length}
        print(f"freesolo eval: {meta['model']} attention={kind} backend={backend} device={device} tasks={tasks} lengths={lengths} n={args.n}")
        deadline = time.perf_counter() + args.minutes * 60 if args.minutes else None
        diagnoses: list = []
        env = {"backend": backend, "device": str(device), "torch": torch.__version__}
        done: list = []

        def save_so_far(record):  # after every cell: a killed run keeps what it measured
            done.append(record)
            if args.out:
                _write_results(args.out, done, [], [], meta["model"] + "/" + kind, env)

        records, grid = evaluate(
            model, device, tasks, lengths, args.n, args.depths, args.seed, args.batch_tokens, meta,
            grid_tasks=("s-niah-1",) if args.grid else (), deadline=deadline, quiet=args.quiet,
            on_record=save_so_far, diagnose=args.diagnose, diagnoses=diagnoses, selection_chunk=args.selection_chunk,
            first=args.first,
        )
        if diagnoses:
            from .diagnose import summarize

            for length in lengths:
                summ = summarize([d for d in diagnoses if d["length"] == length])
                print(f"  diagnosis L={length}: {json.dumps(summ)}")
    if args.out:
        _write_results(args.out, records, grid, diagnoses, meta["model"] + "/" + kind, env)
        print(f"wrote {len(records)} records (+{len(grid)} grid) to {args.out}")
    return 0


def _write_results(path: str, records: list, grid: list, diagnoses: list, env_key: str, env: dict) -> None:
    """Merge records (and grid / diagnosis records) into the JSON file at `path` (created if absent)."""
    data = {"results": [], "grid": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["results"] = merge_records(data.get("results", []), records)
    data["grid"] = merge_records(data.get("grid", []), grid)
    if diagnoses:
        data["diagnosis"] = merge_records(data.get("diagnosis", []), diagnoses, keys=("model", "variant", "task", "length", "index"))
    data.setdefault("env", {})[env_key] = env
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="exact-match accuracy of a checkpoint on retrieval tasks at given lengths")
    p.add_argument("--ckpt", required=True, help="checkpoint folder written by `freesolo train`")
    p.add_argument("--task", nargs="+", default=None, help=f"tasks (default s-niah-1; 'all' for every one): {list(TASKS)}")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="sequence lengths (default 1x..64x the training length)")
    p.add_argument("--n", type=int, default=50, help="samples per task and length")
    p.add_argument("--depths", type=int, default=10, help="needle depths, evenly spaced in [0, 1], cycled over samples")
    p.add_argument("--attention", choices=["dense", "window", "fs", "fsl", "fsb"], default=None, help="override the checkpoint's attention (fsb: tau calibrated on training-like sequences)")
    p.add_argument("--beam", type=int, default=None, help="FS-B beam override")
    p.add_argument("--radius-weight", type=float, default=None, help="FS-B radius_weight override")
    p.add_argument("--diagnose", type=int, default=0, help="FreeSolo models: diagnose up to N failed and N correct samples per cell")
    p.add_argument("--grid", action="store_true", help="also record S-NIAH-1 accuracy per depth (heat map)")
    p.add_argument("--name", default=None, help="model name in the records (default: the folder name)")
    p.add_argument("--out", default=None, help="JSON file to merge the records into ({results: [...], grid: [...]})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=int, default=0, help="score samples FIRST..n-1 only (continue a run cut short; merged by extend_records)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="samples per forward = max(1, batch_tokens // length)")
    p.add_argument("--selection-chunk", type=int, default=None, help="torch backend selection chunk: min(length, N) positions (FS-B: fewer launches; default: the budget)")
    p.add_argument("--minutes", type=float, default=0.0, help="skip cells not started within this budget (0: no limit)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_eval)
