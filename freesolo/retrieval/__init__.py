"""Synthetic RULER-style retrieval suite: tasks, exact-match scoring, `freesolo train` / `freesolo eval`."""
