"""Backend registry: `set_backend`, `get_backend`, `use_backend`, `available_backends`.

The current backend comes from, in order: a per-call `backend=` argument, `set_backend` /
`use_backend`, the environment variable FREESOLO_BACKEND, and the default "numba".
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Iterator, Optional

from .._validation import InputInfo
from ..config import FreeSoloConfig
from .base import Backend

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "BackendUnavailableError",
    "set_backend",
    "get_backend",
    "use_backend",
    "available_backends",
    "load_backend",
    "resolve_backend",
]

# name -> (module, class) under freesolo.backends; imported only when first used.
BACKENDS = {
    "numpy": ("numpy_backend", "NumpyBackend"),
    "numba": ("numba", "NumbaBackend"),
    "torch": ("torch", "TorchBackend"),
    "triton": ("triton", "TritonBackend"),
}
DEFAULT_BACKEND = "numba"

_current: Optional[str] = None
_loaded: dict[str, Backend] = {}


class BackendUnavailableError(RuntimeError):
    """No backend can serve the request; the message lists every backend and why."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; backends are {list(BACKENDS)}.\n{_report(None, None)}"
        )
    return name


def _import_module(name: str):
    """The module of backend `name`, by import statements (torch.compile traces these, not importlib)."""
    if name == "numpy":
        from . import numpy_backend as module
    elif name == "numba":
        from . import numba as module
    elif name == "torch":
        from . import torch as module
    elif name == "triton":
        from . import triton as module
    else:
        module = importlib.import_module(f"freesolo.backends.{BACKENDS[name][0]}")
    return module


def load_backend(name: str) -> Backend:
    """The backend object for `name`; raises BackendUnavailableError if it cannot load here."""
    _check_name(name)
    if name not in _loaded:
        module_name, class_name = BACKENDS[name]
        try:
            backend = getattr(_import_module(name), class_name)()
        except ImportError as error:
            raise BackendUnavailableError(f"backend {name!r} cannot load: {error}.\n{_report(None, None)}") from error
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}.\n{_report(None, None)}")
        _loaded[name] = backend
    return _loaded[name]


def _why_not(name: str, info: Optional[InputInfo], cfg: Optional[FreeSoloConfig]) -> list[str]:
    """Reasons backend `name` cannot serve (machine, then inputs)."""
    module_name, class_name = BACKENDS[name]
    try:
        backend = (
            _loaded.get(name) or getattr(importlib.import_module(f"freesolo.backends.{module_name}"), class_name)()
        )
    except ImportError as error:
        return [f"cannot import: {error}"]
    reason = backend.unavailable_reason()
    if reason:
        return [reason]
    if info is not None and cfg is not None:
        return backend.unsupported_reasons(info, cfg)
    return []


def _report(info: Optional[InputInfo], cfg: Optional[FreeSoloConfig]) -> str:
    lines = []
    for name in BACKENDS:
        reasons = _why_not(name, info, cfg)
        lines.append(f"  {name}: " + ("ok" if not reasons else "; ".join(reasons)))
    return "backends:\n" + "\n".join(lines)


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (packages and devices present)."""
    return [name for name in BACKENDS if not _why_not(name, None, None)]


def set_backend(name: str) -> None:
    """Make `name` the current backend (raises BackendUnavailableError if it cannot run here)."""
    global _current
    load_backend(name)
    _current = name


def get_backend() -> str:
    """The current backend's name: set_backend / use_backend, else $FREESOLO_BACKEND, else "numba"."""
    if _current is not None:
        return _current
    return _check_name(os.environ.get("FREESOLO_BACKEND", DEFAULT_BACKEND))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: run the block with backend `name`, restore the previous choice after."""
    global _current
    previous = _current
    set_backend(name)
    try:
        yield
    finally:
        _current = previous


def resolve_backend(name: Optional[str], info: InputInfo, cfg: FreeSoloConfig) -> Backend:
    """The backend that runs this call; never falls back: if it cannot serve, raise and say why."""
    name = _check_name(name) if name is not None else get_backend()
    backend = load_backend(name)
    reasons = backend.unsupported_reasons(info, cfg)
    if reasons:
        raise BackendUnavailableError(
            f"backend {name!r} cannot run these inputs: {'; '.join(reasons)}.\n{_report(info, cfg)}"
        )
    return backend
