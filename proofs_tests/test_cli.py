"""The `freesolo` command: `info` names every backend and says why one cannot run here (issue 10's
acceptance: triton "available on the GPU, and why not on a CPU machine"), and every option's help text
is written (a placeholder reached users once: `decode --decode-kernel` said "XX")."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from freesolo.backends.registry import BACKENDS
from freesolo.cli import build_parser


def _info(extra_env: dict) -> str:
    """stdout of `python -m freesolo.cli info` in a fresh process without GPUs (CUDA_VISIBLE_DEVICES="")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", **extra_env)
    result = subprocess.run(
        [sys.executable, "-m", "freesolo.cli", "info"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_info_lists_every_backend_and_why_triton_cannot_run_on_a_cpu_machine():
    pytest.importorskip("torch", reason="the triton backend needs torch")
    pytest.importorskip("triton", reason="triton is not installed: info then reports the import error instead")
    out = _info({})
    backends = out[out.index("backends:") :].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in backends] == list(BACKENDS), out
    assert "  numpy: ok" in backends and "  torch: ok" in backends, out
    assert "  triton: no CUDA device (set TRITON_INTERPRET=1" in out, out
    # the interpreter makes it available on the CPU (float32 tensors), as the tests use it
    assert "  triton: ok" in _info({"TRITON_INTERPRET": "1"})


def _options(parser: argparse.ArgumentParser, path: str = "freesolo"):
    """(command path, option strings, help) of every option of the parser and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield path, action.option_strings, action.help


def test_no_option_help_is_a_placeholder():
    options = list(_options(build_parser()))
    assert any(path == "freesolo decode" for path, _, _ in options)  # the walk reaches the subcommands
    for path, names, text in options:
        if text is None:  # argparse prints the option alone
            continue
        words = text.replace("%(default)s", "").strip()
        assert len(words) >= 8 and words.upper() not in {"XX", "XXX", "TODO", "TBD", "FIXME"}, (path, names, text)
