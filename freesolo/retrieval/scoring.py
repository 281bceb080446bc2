"""Exact-match scoring by one teacher-forced forward per sample.

The answer is a contiguous span at the end of the sequence (`tasks.py`). Greedy decoding
reproduces the answer exactly iff, at every answer position `p`, the argmax of the logits at
`p - 1` (teacher-forced on the true prefix) is `tokens[p]`: the first wrong token is the first
place where greedy decoding and the teacher-forced prefix part ways, and before it they agree.
So one forward over the whole sample decides exact match.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from .tasks import Sample

__all__ = ["answer_hits", "exact_match", "score_samples"]


def answer_hits(logits, tokens, answer_start: int, answer_len: int):
    """Per answer token: is the teacher-forced argmax right?

    Args:
        logits: [B, T, V] (torch tensor or NumPy array): the model's logits on `tokens`.
        tokens: [B, T] int: the input sequences.
        answer_start, answer_len: the answer span `[answer_start, answer_start + answer_len)`,
            the same for every row (same task and length); `answer_start >= 1`.

    Returns: bool [B, answer_len] of the same library as `logits`.
    """
    if answer_start < 1:
        raise ValueError(f"answer_start={answer_start} must be >= 1 (the first token has no prediction)")
    if logits.shape[:2] != tokens.shape[:2]:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match tokens shape {tuple(tokens.shape)}")
    end = answer_start + answer_len
    if end > tokens.shape[1]:
        raise ValueError(f"answer span end {end} is past the sequence length {tokens.shape[1]}")
    pred = logits[:, answer_start - 1 : end - 1].argmax(-1)  # [B, answer_len]
    return pred == tokens[:, answer_start:end]


def exact_match(logits, tokens, answer_start: int, answer_len: int):
    """bool [B]: every answer token right (exact match under greedy decoding)."""
    return answer_hits(logits, tokens, answer_start, answer_len).all(-1)


def score_samples(
    forward: Callable,
    samples: Sequence[Sample],
    batch_size: int = 1,
    progress: Callable | None = None,
    deadline: float | None = None,
) -> np.ndarray:
    """Exact match of each sample: bool [n] (or [m], m < n: the first m, when `deadline` passed).

    `forward(tokens)` maps an int64 NumPy array [B, T] to logits [B, T, V] (torch or NumPy);
    samples are batched `batch_size` at a time and must share length and answer span (one task
    and length). `progress(k)` is called after each batch with the number of samples scored.
    `deadline` (a `time.perf_counter()` value): stop before a batch that would start after it.
    """
    if not samples:
        return np.zeros(0, dtype=bool)
    first = samples[0]
    for s in samples:
        if len(s.tokens) != len(first.tokens) or s.answer_start != first.answer_start or s.answer_len != first.answer_len:
            raise ValueError(
                f"samples differ in length / answer span ({s.task} len {len(s.tokens)} vs {first.task} len {len(first.tokens)}): "
                "score one task and length at a time"
            )
    out = np.zeros(len(samples), dtype=bool)
    for i in range(0, len(samples), batch_size):
        if deadline is not None and i > 0 and time.perf_counter() > deadline:
            return out[:i]
        chunk = samples[i : i + batch_size]
        tokens = np.stack([s.tokens for s in chunk])  # [b, T]
        logits = forward(tokens)
        if hasattr(logits, "detach"):
            import torch

            ok = exact_match(logits, torch.as_tensor(tokens, device=logits.device), first.answer_start, first.answer_len)
            ok = ok.cpu().numpy()
        else:
            ok = exact_match(np.asarray(logits), tokens, first.answer_start, first.answer_len)
        out[i : i + len(chunk)] = ok
        if progress is not None:
            progress(len(chunk))
    return out
