"""Synthetic RULER-style retrieval suite: tasks, exact-match scoring, `freesolo train` / `freesolo eval`."""

__all__ = ["cli", "data", "diagnose", "evaluate", "modelio", "scoring", "taskfile", "tasks", "train", "vocab"]  # submodules
