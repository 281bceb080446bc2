"""`task.json`: the vocabulary, needle formats and training mixture saved beside each checkpoint.

Anyone holding a checkpoint folder can regenerate test instances for it::

    info = read_task_json(ckpt)            # checks the vocabulary against this version's
    sample = generate("s-niah-1", 8192, depth=0.5, seed=sample_seed(0, "s-niah-1", 8192, 0))
"""

from __future__ import annotations

import json
import os

from .tasks import BANK_SEED, BANK_SIZE, TASKS
from .vocab import VOCAB, Vocab

__all__ = ["TASK_JSON", "FORMAT", "task_json", "write_task_json", "read_task_json"]

TASK_JSON = "task.json"
FORMAT = "freesolo-retrieval-v2"

NEEDLE_FORMATS = {
    "niah": "needle: <needle> KEY VALUE . ; question: <query> KEY (mq-niah: <query> KEY KEY .. <is>) ; answer: VALUE (<sep> VALUE)*",
    "vt": "statements: <var> X1 = VALUE . then <var> X(h+1) = X(h) . ; question: <vt-query> VALUE <is> ; answer: X1 .. X(hops+1)",
    "sequence": "<bos> haystack-with-needles question answer; exactly `length` tokens; the answer is the last span",
    "haystack": {
        "noise": "the first 5 sentences of the bank, repeated",
        "text": f"sentences drawn uniformly from a bank of {BANK_SIZE} sentences (Markov chain over the filler words, seed {BANK_SEED})",
    },
    "depth": "the asked needle sits at the sentence boundary nearest to depth * haystack length",
}


def task_json(train_length: int, mixture: dict | None = None, vocab: Vocab = VOCAB, extra: dict | None = None) -> dict:
    """The `task.json` content of a checkpoint trained at `train_length`."""
    out = {
        "format": FORMAT,
        "vocab": vocab.to_json(),
        "tasks": {name: spec.to_json() for name, spec in TASKS.items()},
        "needle_format": NEEDLE_FORMATS,
        "train_length": int(train_length),
        "mixture": mixture,
        "generator": "freesolo.retrieval.tasks.generate(task, length, depth, seed)",
    }
    if extra:
        out.update(extra)
    return out


def write_task_json(folder: str, data: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, TASK_JSON)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    return path


def read_task_json(folder: str) -> dict:
    """Load and check a checkpoint's `task.json` (vocabulary and task definitions must match this version)."""
    path = os.path.join(folder, TASK_JSON)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: the checkpoint was not written by `freesolo train`")
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format={data.get('format')!r}, expected {FORMAT!r}")
    vocab = Vocab.from_json(data["vocab"])  # raises on inconsistent ranges or other special tokens
    if vocab != VOCAB:
        diff = {k: v for k, v in vocab.to_json().items() if VOCAB.to_json().get(k) != v}
        raise ValueError(f"{path}: vocab fields {diff} differ from this version's {VOCAB}")
    for name, spec in data.get("tasks", {}).items():
        if name in TASKS and TASKS[name].to_json() != spec:
            raise ValueError(f"{path}: task {name!r} is {spec}, this version generates {TASKS[name].to_json()}")
    return data
