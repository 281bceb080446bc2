"""Training batches: a mixture of the retrieval tasks and plain next-token prediction over filler."""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from .tasks import TASKS, _haystack, generate, lm_sequence, min_length
from .vocab import VOCAB, Vocab

__all__ = ["Mixture", "ROW_KINDS", "batches", "copy_sequence", "lengths_up_to", "make_batch", "recall_sequence"]

# What a training row is (`make_batch(..., return_kinds=True)`): plain text, a copy drill, a recall drill, a task sample.
ROW_KINDS = {"lm": 0, "copy": 1, "recall": 2, "task": 3}


@dataclass(frozen=True)
class Mixture:
    """What `freesolo train` feeds the model.

    Each row of a batch is a plain language-modelling sequence (probability `lm_fraction`; half
    `text`, half `noise` haystack), a copy drill (`copy_fraction`, `copy_sequence`), a recall drill
    (`recall_fraction`, `recall_sequence`) or a sample of one of `tasks` (chosen with `weights`) with
    its needle at a uniform random depth. All rows of a batch share one length, drawn from `lengths`
    (every one <= the training length); the batch holds about `batch_tokens` tokens.

    Why the drills: a task sample has 4-16 answer tokens in up to 2048, too sparse a signal for a
    small model to discover the copy circuit (induction head) that retrieval needs within minutes
    (measured: 2,500 steps at ~17 % answer-token accuracy, chance level, on the tasks alone). A copy
    drill makes half of its tokens copy targets; a recall drill asks many keys of one haystack.
    """

    tasks: tuple = tuple(TASKS)
    weights: tuple | None = None  # per task; None = uniform
    lm_fraction: float = 0.1
    lengths: tuple = (1024,)
    batch_tokens: int = 32768
    copy_fraction: float = 0.0
    recall_fraction: float = 0.0

    def __post_init__(self):
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"tasks: {t!r} is not one of {list(TASKS)}")
        if self.weights is not None and len(self.weights) != len(self.tasks):
            raise ValueError(f"weights has {len(self.weights)} entries for {len(self.tasks)} tasks")
        for name in ("lm_fraction", "copy_fraction", "recall_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.lm_fraction + self.copy_fraction + self.recall_fraction > 1.0:
            raise ValueError(
                f"lm_fraction + copy_fraction + recall_fraction = "
                f"{self.lm_fraction + self.copy_fraction + self.recall_fraction} must be <= 1"
            )
        for L in self.lengths:
            shortest = max(min_length(t) for t in self.tasks) + 8
            if L < shortest:
                raise ValueError(f"lengths: {L} is shorter than {shortest} (the longest task's minimum + 8)")
        if self.batch_tokens < max(self.lengths):
            raise ValueError(f"batch_tokens={self.batch_tokens} must be >= the longest length {max(self.lengths)}")

    def to_json(self) -> dict:
        return {
            "tasks": list(self.tasks),
            "weights": None if self.weights is None else list(self.weights),
            "lm_fraction": self.lm_fraction,
            "lengths": list(self.lengths),
            "batch_tokens": self.batch_tokens,
            "copy_fraction": self.copy_fraction,
            "recall_fraction": self.recall_fraction,
        }


def _content_alphabet(vocab: Vocab) -> np.ndarray:
    """Every content token id (digits, keys, filler words, variable names). int64 [n]."""
    return np.concatenate(
        [vocab.digits(np.arange(vocab.n_digits)), vocab.keys(np.arange(vocab.n_keys)),
         vocab.filler(np.arange(vocab.n_filler)), vocab.vars(np.arange(vocab.n_vars))]
    ).astype(np.int64)


def copy_sequence(length: int, rng: np.random.Generator, vocab: Vocab = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """An induction drill: `<bos>`, then pieces that are either a new span of 4-24 random content
    tokens or a repeat of an earlier span (probability 1/2 once one exists), until `length` tokens.
    Repeats sit at random distances from their source, so only a content match (the previous
    token's earlier occurrence) predicts them, not a fixed offset (a `<bos> r r` drill is solved by
    a positional head). tokens int64 [length], mask bool [length]: True on every token of a repeat
    but its first (which nothing predicts)."""
    if length < 5:
        raise ValueError(f"length={length} must be >= 5 for a copy drill")
    alphabet = _content_alphabet(vocab)
    tokens, mask, spans, n = [np.array([vocab.tok("<bos>")], dtype=np.int64)], [np.zeros(1, dtype=bool)], [], 1
    while n < length:
        if spans and rng.random() < 0.5:
            piece = spans[int(rng.integers(len(spans)))]
            m = np.ones(len(piece), dtype=bool)
            m[0] = False
        else:
            piece = alphabet[rng.integers(0, len(alphabet), size=int(rng.integers(4, 25)))]
            spans.append(piece)
            m = np.zeros(len(piece), dtype=bool)
        tokens.append(piece)
        mask.append(m)
        n += len(piece)
    return np.concatenate(tokens)[:length], np.concatenate(mask)[:length]


def recall_sequence(
    length: int, rng: np.random.Generator, haystack: str = "text", vocab: Vocab = VOCAB
) -> tuple[np.ndarray, np.ndarray]:
    """A recall drill (many-key NIAH): `n` needles `<needle> KEY v1..v4 .` with distinct keys at
    random sentence boundaries of a haystack, then `a` questions `<query> KEY v1..v4 .` (the
    last without its `.`) for distinct keys in random order; `n = clip(length // 48, 2, 16)`,
    `a = max(1, n // 2)`. Same needle and question format as the tasks. tokens int64 [length],
    mask bool [length]: True on the value tokens of the answers."""
    T = vocab.tok
    n = int(np.clip(length // 48, 2, 16))
    a = max(1, n // 2)
    H = length - 1 - 7 * n - (7 * a - 1)
    if H < 0:
        raise ValueError(f"length={length} is too short for a recall drill (needs {length - H})")
    keys = vocab.keys(rng.choice(vocab.n_keys, size=n, replace=False))
    values = vocab.digits(rng.integers(0, vocab.n_digits, size=(n, 4)))
    hay, bounds = _haystack(haystack, H, rng, vocab)
    slots = np.sort(rng.choice(bounds, size=n, replace=True))
    pieces, cursor = [np.array([T("<bos>")])], 0
    for i in range(n):
        pieces += [hay[cursor : slots[i]], [T("<needle>"), keys[i]], values[i], [T(".")]]
        cursor = int(slots[i])
    pieces.append(hay[cursor:])
    starts = []
    pos = 1 + H + 7 * n
    for j, i in enumerate(rng.choice(n, size=a, replace=False)):
        pieces += [[T("<query>"), keys[i]], values[i]] + ([[T(".")]] if j < a - 1 else [])
        starts.append(pos + 2)
        pos += 7
    tokens = np.concatenate(pieces).astype(np.int64)
    if len(tokens) != length:  # an internal invariant, not a user error
        raise AssertionError(f"recall drill: {len(tokens)} tokens for length={length}")
    mask = np.zeros(length, dtype=bool)
    for s0 in starts:
        mask[s0 : s0 + 4] = True
    return tokens, mask


def make_batch(mix: Mixture, rng: np.random.Generator, vocab: Vocab = VOCAB, return_kinds: bool = False):
    """One batch: tokens int64 [B, L] and answer mask bool [B, L] (True on answer tokens: a task's
    answer span, a drill's targets); with `return_kinds`, also kinds int8 [B] (`ROW_KINDS` values)."""
    L = int(rng.choice(np.asarray(mix.lengths)))
    B = max(1, mix.batch_tokens // L)
    tokens = np.empty((B, L), dtype=np.int64)
    mask = np.zeros((B, L), dtype=bool)
    kinds = np.full(B, ROW_KINDS["task"], dtype=np.int8)
    p = None if mix.weights is None else np.asarray(mix.weights, dtype=np.float64) / float(np.sum(mix.weights))
    copy_end = mix.lm_fraction + mix.copy_fraction
    recall_end = copy_end + mix.recall_fraction
    for b in range(B):
        u = rng.random()
        if u < mix.lm_fraction:
            tokens[b] = lm_sequence(L, rng, "text" if rng.random() < 0.5 else "noise", vocab)
            kinds[b] = ROW_KINDS["lm"]
        elif u < copy_end:
            tokens[b], mask[b] = copy_sequence(L, rng, vocab)
            kinds[b] = ROW_KINDS["copy"]
        elif u < recall_end:
            tokens[b], mask[b] = recall_sequence(L, rng, "text" if rng.random() < 0.5 else "noise", vocab)
            kinds[b] = ROW_KINDS["recall"]
        else:
            task = mix.tasks[int(rng.choice(len(mix.tasks), p=p))]
            s = generate(task, L, float(rng.random()), None, vocab, rng=rng)
            tokens[b] = s.tokens
            mask[b, s.answer_start : s.answer_start + s.answer_len] = True
    return (tokens, mask, kinds) if return_kinds else (tokens, mask)


def batches(mix: Mixture, seed: int, vocab: Vocab = VOCAB, worker: int = 0, workers: int = 1, return_kinds: bool = False):
    """Endless batches of worker `worker` (of `workers`): a deterministic stream per (seed, worker)."""
    rng = np.random.default_rng([int(seed), 7919, int(worker), int(workers)])
    while True:
        yield make_batch(mix, rng, vocab, return_kinds)


def sequences_like_training(mix: Mixture, n: int, length: int, seed: int, vocab: Vocab = VOCAB) -> np.ndarray:
    """`n` rows of training-distribution sequences of `length` tokens (FS-B tau calibration). int64 [n, length]."""
    rng = np.random.default_rng([int(seed), 104729])
    rows = []
    for i in range(n):
        task = mix.tasks[i % len(mix.tasks)]
        rows.append(generate(task, length, float(rng.random()), None, vocab, rng=rng).tokens)
    return np.stack(rows)


def lengths_up_to(train_length: int, n: int = 3) -> tuple:
    """Training lengths: `train_length / 2^k` for k < n (no shorter than 128)."""
    out = sorted({max(128, train_length >> k) for k in range(n)} | {train_length})
    return tuple(x for x in out if x <= train_length)


