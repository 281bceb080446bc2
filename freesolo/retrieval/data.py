"""Training batches: a mixture of the retrieval tasks and plain next-token prediction over filler."""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from .tasks import TASKS, generate, lm_sequence, min_length
from .vocab import VOCAB, Vocab

__all__ = ["Mixture", "make_batch"]


@dataclass(frozen=True)
class Mixture:
    """What `freesolo train` feeds the model.

    Each row of a batch is a plain language-modelling sequence (probability `lm_fraction`; half
    `text`, half `noise` haystack) or a sample of one of `tasks` (chosen with `weights`) with its
    needle at a uniform random depth. All rows of a batch share one length, drawn from `lengths`
    (every one <= the training length); the batch holds about `batch_tokens` tokens.
    """

    tasks: tuple = tuple(TASKS)
    weights: tuple | None = None  # per task; None = uniform
    lm_fraction: float = 0.1
    lengths: tuple = (1024,)
    batch_tokens: int = 32768

    def __post_init__(self):
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"tasks: {t!r} is not one of {list(TASKS)}")
        if self.weights is not None and len(self.weights) != len(self.tasks):
            raise ValueError(f"weights has {len(self.weights)} entries for {len(self.tasks)} tasks")
        if not 0.0 <= self.lm_fraction <= 1.0:
            raise ValueError(f"lm_fraction={self.lm_fraction} must be in [0, 1]")
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
        }


def make_batch(mix: Mixture, rng: np.random.Generator, vocab: Vocab = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """One batch: tokens int64 [B, L] and answer mask bool [B, L] (True on answer tokens)."""
    L = int(rng.choice(np.asarray(mix.lengths)))
    B = max(1, mix.batch_tokens // L)
    tokens = np.empty((B, L), dtype=np.int64)
    mask = np.zeros((B, L), dtype=bool)
    p = None if mix.weights is None else np.asarray(mix.weights, dtype=np.float64) / float(np.sum(mix.weights))
    for b in range(B):
        if rng.random() < mix.lm_fraction:
            tokens[b] = lm_sequence(L, rng, "text" if rng.random() < 0.5 else "noise", vocab)
            continue
        task = mix.tasks[int(rng.choice(len(mix.tasks), p=p))]
        s = generate(task, L, float(rng.random()), None, vocab, rng=rng)
        tokens[b] = s.tokens
        mask[b, s.answer_start : s.answer_start + s.answer_len] = True
    return tokens, mask


def batches(mix: Mixture, seed: int, vocab: Vocab = VOCAB, worker: int = 0, workers: int = 1):
    """Endless batches of worker `worker` (of `workers`): a deterministic stream per (seed, worker)."""
    rng = np.random.default_rng([int(seed), 7919, int(worker), int(workers)])
    while True:
        yield make_batch(mix, rng, vocab)


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


