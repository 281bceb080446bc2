"""Parsers of `freesolo train` and `freesolo eval` (imported by `freesolo.cli`; torch is imported only when a command runs)."""

from __future__ import annotations

from .evaluate import add_eval_parser
from .train import add_train_parser

__all__ = ["add_train_parser", "add_eval_parser"]
