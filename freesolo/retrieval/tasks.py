"""RULER-style synthetic retrieval tasks over the fixed vocabulary (`vocab.py`).

Every sample is one token sequence of exactly `length` tokens::

    <bos> haystack-with-needles  question  answer

The answer is one contiguous span at the end of the sequence, so scoring the argmax of a
teacher-forced forward over that span is exact-match greedy decoding (`scoring.py`).

Needle (NIAH tasks): ``<needle> KEY v_1 .. v_n .`` ("one of the special magic numbers for
KEY: v."); question ``<query> KEY`` (MQ-NIAH: ``<query> KEY_1 .. KEY_m <is>``); the answer is the
value tokens. The value follows its key directly, in the needle as in the question, so one
content match (the question's key against the needle's) finds it: format v2. Format v1 put
``<is>`` between key and value in both; a 4.5M-parameter model did not learn that two-token
match in 3,500 steps (benchmarks/results/extrapolation_findings.md). Variable tracking
(RULER "vt"): statements ``<var> X1 = d_1 .. d_n .`` and ``<var> X2 = X1 .`` (a chain of
`n_hops` copies), question ``<vt-query> d_1 .. d_n <is>``, answer ``X1 X2 .. X_{hops+1}`` (the
chain's variables in the order they were assigned).

Haystacks are made of whole sentences (ending in ``.``) and needles go between sentences:
- ``noise``: five fixed sentences repeated (RULER's "The grass is green. The sky is blue. ...");
- ``text``: sentences drawn at random from a fixed bank of 2048 sentences sampled once (seed
  20240401) from a sparse Markov chain over the 256 filler words: text-like and learnable, but
  never the same twice (RULER's essays).

Tasks (RULER names in brackets):

| task | haystack | needles | asked | value |
|---|---|---|---|---|
| s-niah-1 (niah_single_1, passkey) | noise | 1 | its value | digits |
| s-niah-2 (niah_single_2) | text | 1 | its value | digits |
| s-niah-3 (niah_single_3, uuid) | text | 1 | its value | filler words: looks like the haystack |
| mk-niah (niah_multikey_1) | text | 4, distinct keys | one key | digits |
| mv-niah (niah_multivalue) | text | 4, one key | all 4 values, document order, `<sep>` between | digits |
| mq-niah (niah_multiquery) | text | 4, distinct keys | all 4 keys, answers in question order | digits |
| vt (ruler_vt) | noise | 1 chain of 4 hops (5 statements) | every variable of the chain | var names |

Depth: the needle that is asked (MV, MQ: the first written; VT: the chain's first statement) is
inserted at the sentence boundary nearest to `depth * len(haystack)` (0 = right after `<bos>`,
1 = right before the question); the other needles go at boundaries drawn uniformly (VT: after the
first statement, in chain order). Everything is a function of `(task, length, depth, seed)`.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from .vocab import VOCAB, Vocab

__all__ = ["TaskSpec", "Sample", "TASKS", "TASK_NAMES", "generate", "sample_seed", "min_length", "lm_sequence"]

BANK_SEED = 20240401
BANK_SIZE = 2048


@dataclass(frozen=True)
class TaskSpec:
    """One task's structure. Frozen; written to `task.json` so instances can be regenerated."""

    name: str
    kind: str  # "single" | "multikey" | "multivalue" | "multiquery" | "vt"
    haystack: str  # "noise" | "text"
    value_kind: str = "digits"  # "digits" | "filler"
    value_len: int = 4  # tokens per value (VT: per assigned number)
    n_needles: int = 1  # needles written (VT: chains)
    n_hops: int = 4  # VT only: copies per chain (the chain has n_hops + 1 variables)

    def __post_init__(self):
        if self.kind not in ("single", "multikey", "multivalue", "multiquery", "vt"):
            raise ValueError(f"kind={self.kind!r} of task {self.name!r} is not a known kind")
        if self.haystack not in ("noise", "text"):
            raise ValueError(f"haystack={self.haystack!r} of task {self.name!r} must be 'noise' or 'text'")
        if self.value_kind not in ("digits", "filler"):
            raise ValueError(f"value_kind={self.value_kind!r} of task {self.name!r} must be 'digits' or 'filler'")
        for name in ("value_len", "n_needles", "n_hops"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} of task {self.name!r} must be >= 1")
        if self.kind == "single" and self.n_needles != 1:
            raise ValueError(f"task {self.name!r}: kind 'single' needs n_needles=1, got {self.n_needles}")

    def to_json(self) -> dict:
        return asdict(self)


TASKS = {
    t.name: t
    for t in (
        TaskSpec("s-niah-1", "single", "noise"),
        TaskSpec("s-niah-2", "single", "text"),
        TaskSpec("s-niah-3", "single", "text", value_kind="filler"),
        TaskSpec("mk-niah", "multikey", "text", n_needles=4),
        TaskSpec("mv-niah", "multivalue", "text", n_needles=4),
        TaskSpec("mq-niah", "multiquery", "text", n_needles=4),
        TaskSpec("vt", "vt", "noise", n_needles=1, n_hops=4),
    )
}
TASK_NAMES = tuple(TASKS)


@dataclass
class Sample:
    """One instance. `tokens` int64 [length]; the answer is `tokens[answer_start:answer_start+answer_len]`.

    `evidence` lists the token spans `[start, end)` of the needles (statements) that the answer
    reads, in answer order; `needles` lists every needle span (distractors included).
    """

    task: str
    tokens: np.ndarray  # int64 [length]
    answer_start: int
    answer_len: int
    depth: float  # the requested depth in [0, 1]
    evidence: list = field(default_factory=list)  # [(start, end)] of the needles answered
    needles: list = field(default_factory=list)  # [(start, end)] of every needle

    @property
    def answer(self) -> np.ndarray:
        return self.tokens[self.answer_start : self.answer_start + self.answer_len]


# -- haystacks ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _sentence_bank(vocab: Vocab = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids, offsets [BANK_SIZE + 1]) of a fixed bank of text-like sentences."""
    rng = np.random.default_rng(BANK_SEED)
    n = vocab.n_filler
    succ = np.argsort(rng.random((n, n)), axis=1)[:, :8]  # (n, 8): each word's 8 possible successors
    probs = 1.0 / np.arange(1, 9)
    probs /= probs.sum()  # Zipf-like transition weights
    start_words = rng.choice(n, size=32, replace=False)
    lengths = rng.integers(5, 15, size=BANK_SIZE)  # words per sentence
    firsts = rng.choice(start_words, size=BANK_SIZE)
    steps = rng.choice(8, size=int(lengths.sum()), p=probs).tolist()
    succ_l, dot = succ.tolist(), vocab.tok(".")
    flat, offsets, j = [], [0], 0
    for m, w in zip(lengths.tolist(), firsts.tolist()):
        words = [w]
        for _ in range(m - 1):
            words.append(succ_l[words[-1]][steps[j]])
            j += 1
        j += 1
        flat.extend(vocab.filler_start + x for x in words)
        flat.append(dot)
        offsets.append(len(flat))
    return np.asarray(flat, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


def _haystack(kind: str, n_tokens: int, rng: np.random.Generator, vocab: Vocab) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n_tokens], boundaries): `boundaries` = positions in [0, n_tokens] where a sentence starts
    (or the haystack ends), i.e. where a needle may be inserted."""
    flat, offsets = _sentence_bank(vocab)
    lens = np.diff(offsets)
    if kind == "noise":
        picks = np.arange(5)  # the same five sentences, repeated
        reps = n_tokens // int(lens[picks].sum()) + 2
        picks = np.tile(picks, reps)
    else:
        picks = rng.integers(0, BANK_SIZE, size=n_tokens // int(lens.min()) + 2)
    plens = lens[picks]
    ends = np.cumsum(plens)
    count = int(np.searchsorted(ends, n_tokens)) + 1  # sentences needed to cover n_tokens
    picks, plens, ends = picks[:count], plens[:count], ends[:count]
    starts = ends - plens
    # gather indices: sentence p's tokens are flat[offsets[p] : offsets[p] + len]
    idx = np.repeat(offsets[picks] - starts, plens) + np.arange(int(ends[-1]))
    tokens = flat[idx][:n_tokens]
    boundaries = np.concatenate([starts[starts < n_tokens], [n_tokens]])
    return tokens, np.unique(boundaries)


def lm_sequence(length: int, rng: np.random.Generator, haystack: str = "text", vocab: Vocab = VOCAB) -> np.ndarray:
    """A plain language-modelling sequence: `<bos>` + `length - 1` haystack tokens. int64 [length]."""
    if length < 2:
        raise ValueError(f"length={length} must be >= 2")
    tokens, _ = _haystack(haystack, length - 1, rng, vocab)
    return np.concatenate([[vocab.tok("<bos>")], tokens]).astype(np.int64)


# -- needles --------------------------------------------------------------------------------------


def _values(spec: TaskSpec, count: int, rng: np.random.Generator, vocab: Vocab) -> list[np.ndarray]:
    """`count` distinct values of `spec.value_len` tokens each."""
    out, seen = [], set()
    while len(out) < count:
        if spec.value_kind == "digits":
            v = vocab.digits(rng.integers(0, vocab.n_digits, size=spec.value_len))
        else:
            v = vocab.filler(rng.integers(0, vocab.n_filler, size=spec.value_len))
        if tuple(v) not in seen:
            seen.add(tuple(v))
            out.append(v)
    return out


def _pieces(spec: TaskSpec, rng: np.random.Generator, vocab: Vocab):
    """(needles [list of token arrays], asked [needle indices the answer reads, answer order],
    question tokens, answer tokens). Needle 0 is the one placed at the requested depth."""
    T = vocab.tok
    if spec.kind == "vt":
        n_vars = spec.n_hops + 1
        names = vocab.vars(rng.choice(vocab.n_vars, size=spec.n_needles * n_vars, replace=False))
        values = _values(spec, spec.n_needles, rng, vocab)
        needles = []
        for c in range(spec.n_needles):
            chain = names[c * n_vars : (c + 1) * n_vars]
            needles.append(np.concatenate([[T("<var>"), chain[0], T("=")], values[c], [T(".")]]))
            for h in range(1, n_vars):
                needles.append(np.array([T("<var>"), chain[h], T("="), chain[h - 1], T(".")]))
        question = np.concatenate([[T("<vt-query>")], values[0], [T("<is>")]])
        return needles, list(range(n_vars)), question, names[:n_vars]
    n = spec.n_needles
    if spec.kind == "multivalue":
        keys = np.repeat(vocab.keys(rng.integers(0, vocab.n_keys, size=1)), n)
    else:
        keys = vocab.keys(rng.choice(vocab.n_keys, size=n, replace=False))
    values = _values(spec, n, rng, vocab)
    needles = [np.concatenate([[T("<needle>"), keys[i]], values[i], [T(".")]]) for i in range(n)]
    if spec.kind in ("single", "multikey"):
        asked = [0]
    elif spec.kind == "multivalue":
        asked = list(range(n))  # document order: fixed after placement below
    else:
        asked = [int(i) for i in rng.permutation(n)]  # multiquery: question order
    qkeys = [keys[0]] if spec.kind == "multivalue" else [keys[i] for i in asked]
    tail = [T("<is>")] if spec.kind == "multiquery" else []  # several keys: <is> ends the question
    question = np.concatenate([[T("<query>")], qkeys, tail]).astype(np.int64)
    return needles, asked, question, values


def _answer(values: list, asked: list, sep: int) -> np.ndarray:
    parts = []
    for j, i in enumerate(asked):
        if j:
            parts.append([sep])
        parts.append(values[i])
    return np.concatenate(parts).astype(np.int64)


def min_length(task: str, vocab: Vocab = VOCAB) -> int:
    """Shortest valid `length` for `task` (an empty haystack)."""
    spec = _spec(task)
    needles, asked, question, values = _pieces(spec, np.random.default_rng(0), vocab)
    answer = values if spec.kind == "vt" else _answer(values, asked, vocab.tok("<sep>"))
    return 1 + sum(len(n) for n in needles) + len(question) + len(answer)


def _spec(task) -> TaskSpec:
    if isinstance(task, TaskSpec):
        return task
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {list(TASKS)}")
    return TASKS[task]


def sample_seed(seed: int, task: str, length: int, index: int) -> list[int]:
    """The seed sequence of sample `index` of (`task`, `length`) under base `seed` (stable across versions)."""
    return [int(seed), zlib.crc32(task.encode()), int(length), int(index)]


def generate(
    task, length: int, depth: float, seed, vocab: Vocab = VOCAB, rng: Optional[np.random.Generator] = None
) -> Sample:
    """One sample of `task` with exactly `length` tokens and its asked needle at `depth` in [0, 1].

    `seed`: an int or a sequence of ints (see `sample_seed`); ignored when `rng` is given.
    """
    spec = _spec(task)
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    rng = rng if rng is not None else np.random.default_rng(seed)
    needles, asked, question, values = _pieces(spec, rng, vocab)
    n_needles = len(needles)
    need_len = sum(len(n) for n in needles)
    if spec.kind == "vt":
        answer = values
    else:
        answer = None  # multivalue's order depends on placement
        answer_len = len(_answer(values, asked, vocab.tok("<sep>")))
    a_len = len(answer) if answer is not None else answer_len
    H = length - 1 - need_len - len(question) - a_len
    if H < 0:
        raise ValueError(f"length={length} is too short for task {spec.name!r}: it needs at least {length - H}")
    hay, bounds = _haystack(spec.haystack, H, rng, vocab)
    # boundary index of each needle
    first = int(bounds[np.argmin(np.abs(bounds - depth * H))])
    slots = np.empty(n_needles, dtype=np.int64)
    slots[0] = first
    if spec.kind == "vt":
        chain = spec.n_hops + 1
        later = bounds[bounds >= first]
        slots[1:chain] = np.sort(rng.choice(later, size=chain - 1, replace=True))
        for c in range(1, spec.n_needles):
            slots[c * chain : (c + 1) * chain] = np.sort(rng.choice(bounds, size=chain, replace=True))
    else:
        slots[1:] = rng.choice(bounds, size=n_needles - 1, replace=True)
    order = np.lexsort((np.arange(n_needles), slots))  # by slot, ties by needle index
    pieces, spans, cursor, pos = [np.array([vocab.tok("<bos>")])], [None] * n_needles, 0, 1
    for i in order:
        s = int(slots[i])
        pieces.append(hay[cursor:s])
        pos += s - cursor
        cursor = s
        pieces.append(needles[i])
        spans[i] = (pos, pos + len(needles[i]))
        pos += len(needles[i])
    pieces.append(hay[cursor:])
    if spec.kind == "multivalue":
        asked = [int(i) for i in order]  # all values, in document order
    if answer is None:
        answer = _answer(values, asked, vocab.tok("<sep>"))
    pieces += [question, answer]
    tokens = np.concatenate(pieces).astype(np.int64)
    if len(tokens) != length:  # an internal invariant, not a user error
        raise AssertionError(f"generated {len(tokens)} tokens for length={length} (task {spec.name})")
    return Sample(
        task=spec.name,
        tokens=tokens,
        answer_start=length - len(answer),
        answer_len=len(answer),
        depth=float(depth),
        evidence=[spans[i] for i in asked],
        needles=spans,
    )


def depths_for(n: int, n_depths: int) -> np.ndarray:
    """Depth of each of `n` samples: `min(n, n_depths)` evenly spaced depths in [0, 1], cycled. float64 [n]."""
    if n_depths < 1:
        raise ValueError(f"n_depths={n_depths} must be >= 1")
    n_depths = max(1, min(n_depths, n))  # fewer samples than depths: still spread over [0, 1]
    grid = np.linspace(0.0, 1.0, n_depths) if n_depths > 1 else np.array([0.5])
    return grid[np.arange(n) % n_depths]


def generate_many(task: str, length: int, n: int, seed: int, n_depths: int = 10, vocab: Vocab = VOCAB) -> list[Sample]:
    """The `n` evaluation samples of (`task`, `length`): depths from `depths_for`, seeds from `sample_seed`."""
    depths = depths_for(n, n_depths)
    return [generate(task, length, float(depths[i]), sample_seed(seed, task, length, i), vocab) for i in range(n)]


def spec_json(names: Sequence[str]) -> dict:
    return {name: _spec(name).to_json() for name in names}
