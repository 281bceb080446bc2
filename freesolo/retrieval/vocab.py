"""The fixed token vocabulary of the retrieval suite (no tokenizer: every token is an id).

Layout (ids are stable: a checkpoint's `task.json` records them, and generators of any later
version must reproduce them):

| ids | what |
|---|---|
| 0..15 | special tokens (`SPECIALS`), e.g. `<needle>` = "one of the special magic numbers for" |
| 16..25 | digits 0-9 (values of S-NIAH-1/2, MK/MV/MQ-NIAH and variable tracking) |
| 32..95 | 64 key words (needle keys) |
| 128..383 | 256 filler words (haystack text; S-NIAH-3 values are filler words too) |
| 384..447 | 64 variable names (variable tracking) |

`vocab_size` is 512 (ids 448..511 and the gaps are unused, reserved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Vocab", "VOCAB", "SPECIALS"]

# name -> id; the names are what task.json shows and what `Vocab.decode` prints.
SPECIALS = {
    "<pad>": 0,
    "<bos>": 1,
    "<eos>": 2,
    ".": 3,  # sentence end
    "<needle>": 4,  # "one of the special magic numbers for"
    "<is>": 5,  # "is:"
    "<query>": 6,  # "what is the special magic number for"
    "<sep>": 7,  # separates the values of a multi-value answer
    "<var>": 8,  # "VAR"
    "=": 9,
    "<vt-query>": 10,  # "find all variables that are assigned the value"
}


@dataclass(frozen=True)
class Vocab:
    """Token id ranges of the suite. Frozen: its fields are written to and checked from `task.json`."""

    vocab_size: int = 512
    digit_start: int = 16
    n_digits: int = 10
    key_start: int = 32
    n_keys: int = 64
    filler_start: int = 128
    n_filler: int = 256
    var_start: int = 384
    n_vars: int = 64

    def __post_init__(self):
        ranges = sorted(
            (start, start + n, name)
            for name, start, n in (
                ("digit", self.digit_start, self.n_digits),
                ("key", self.key_start, self.n_keys),
                ("filler", self.filler_start, self.n_filler),
                ("var", self.var_start, self.n_vars),
            )
        )
        if ranges[0][0] <= max(SPECIALS.values()):
            raise ValueError(f"{ranges[0][2]}_start={ranges[0][0]} overlaps the special tokens (ids 0..15)")
        for (a0, a1, an), (b0, _, bn) in zip(ranges, ranges[1:]):
            if a1 > b0:
                raise ValueError(f"{an} ids [{a0}, {a1}) overlap {bn} ids starting at {b0}")
        if ranges[-1][1] > self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than the last id range end {ranges[-1][1]}")

    # -- id helpers ---------------------------------------------------------------------------
    def tok(self, name: str) -> int:
        """Id of a special token by name (`"<needle>"`, `"."`, ...)."""
        if name not in SPECIALS:
            raise KeyError(f"special token {name!r} is not one of {sorted(SPECIALS)}")
        return SPECIALS[name]

    def digits(self, values: np.ndarray) -> np.ndarray:
        """Digit values 0..9 -> token ids."""
        return self.digit_start + np.asarray(values, dtype=np.int64)

    def keys(self, idx: np.ndarray) -> np.ndarray:
        return self.key_start + np.asarray(idx, dtype=np.int64)

    def filler(self, idx: np.ndarray) -> np.ndarray:
        return self.filler_start + np.asarray(idx, dtype=np.int64)

    def vars(self, idx: np.ndarray) -> np.ndarray:
        return self.var_start + np.asarray(idx, dtype=np.int64)

    def decode(self, ids) -> str:
        """Readable form of a token id sequence (for debugging and the README)."""
        inverse = {v: k for k, v in SPECIALS.items()}
        words = []
        for t in np.asarray(ids, dtype=np.int64).tolist():
            if t in inverse:
                words.append(inverse[t])
            elif self.digit_start <= t < self.digit_start + self.n_digits:
                words.append(str(t - self.digit_start))
            elif self.key_start <= t < self.key_start + self.n_keys:
                words.append(f"K{t - self.key_start}")
            elif self.filler_start <= t < self.filler_start + self.n_filler:
                words.append(f"w{t - self.filler_start}")
            elif self.var_start <= t < self.var_start + self.n_vars:
                words.append(f"X{t - self.var_start}")
            else:
                words.append(f"<unused:{t}>")
        return " ".join(words)

    def to_json(self) -> dict:
        return {**asdict(self), "specials": dict(SPECIALS)}

    @classmethod
    def from_json(cls, data: dict) -> "Vocab":
        specials = data.get("specials", SPECIALS)
        if specials != SPECIALS:
            raise ValueError(f"task.json specials {specials} differ from this version's {SPECIALS}")
        return cls(**{k: v for k, v in data.items() if k != "specials"})


VOCAB = Vocab()
