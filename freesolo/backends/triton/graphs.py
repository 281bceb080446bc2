"""CUDA graphs of short eager calls: the host-bound forward / backward replayed from a graph.

At a few thousand tokens an eager triton call is bound by host time, not by the GPU: on the H200
(B 1, H 16, D 64, bf16) the FS-L forward at 4k costs 0.4-0.6 ms of Python, launches and
allocations for 0.15 ms of kernels, the forward + backward ~2 ms for 0.69 ms (s29-s31 host
probes). `torch.compile(mode="reduce-overhead")` removes that host time by CUDA graphs; this
module does the same for plain eager calls, inside the backend:

- a call is *eligible* when it runs on CUDA (not under the interpreter), its variant is fs or
  fsl, its queries hold at most `max_elements()` elements (B * T * Hq * D; default 2^23, i.e.
  8192 tokens at H 16, D 64: on the H200 a replay is faster than the eager call up to 8k tokens
  there and slower from 16k, where the GPU work hides the host work and the copies in and out of
  the graph cost more than they save: `benchmarks/graph_cache_probe.py`, s33), no CUDA-graph
  capture is under way on the current stream (the caller's own capture records the kernels as
  usual) and torch's sync debug mode is off (whoever watches for host syncs watches the kernels'
  own launches);
- the first eligible call of a key runs eagerly (it compiles the kernels and leaves one-off
  shapes out of the cache); the second captures the body once into a graph with static copies of
  its inputs, every later one copies its inputs into those buffers, replays the graph on the
  current stream and returns copies of the graph's outputs (so that calls in flight at once, e.g.
  the layers of a model before their backward, never share output memory); a forward with
  gradients (`run_forward`) copies out only o and lends the backward's statistics to its call
  (`Binding`) until the graph's next replay, which first copies them out for a call whose backward
  has not run yet;
- the backward of a replayed forward is a graph *bound* to that forward's graph (`run_forward`,
  `run_bound`, `Binding`): it reads q, k, v, beta, o and the statistics from the forward graph's
  buffers instead of copies of its own, and only the output gradient is copied in; when another
  call replayed the forward graph in between (the layers of a model of one shape), the saved
  tensors are first copied back into those buffers (`refreshes`), the copies every backward made
  before s34, so a bound backward never copies more than a free one;
- a key is the body, the shapes and dtypes of the tensors, the device, the non-tensor arguments
  and the FREESOLO_TRITON_* switches that steer the kernels (`KNOB_ENVS`), so a replay runs the
  kernels the eager call would run, on the same values: the outputs are the same bits (tested on
  the H200 against FREESOLO_TRITON_GRAPHS=0);
- at most `MAX_ENTRIES` graphs are kept (least recently used evicted); after `MAX_EVICTIONS`
  evictions in a process the shapes vary too much for a cache to pay and it turns itself off
  with a warning.

FREESOLO_TRITON_GRAPHS=0 turns the cache off; an integer N > 0 sets `max_elements()` to N.

Graphs on the caller's inputs (`run` only, i.e. forwards without gradients and free backwards;
on by default since s47, FREESOLO_TRITON_GRAPH_DIRECT=0 turns them off): a replay of the graph
above first copies q, k, v and beta into its static buffers (at 4k, H 16, D 64, bf16: 3 x 8 MB,
four memcpys; H100, s47, FS-L forward through the API, same run: 4k 0.148 vs 0.180 ms, 8k 0.260
vs 0.319, FS 4k 0.135 vs 0.162; same bits). When two calls of a key in a row pass inputs at the same addresses (same data_ptr
and strides: a benchmark loop, a decoder whose allocator hands each layer the same blocks), the
third captures a second graph that reads those addresses in place, and every later call whose
inputs lie there again replays it without copies in. A graph reads memory, not tensors: a call
whose tensors occupy exactly the captured ranges (the key fixes shapes and dtypes, the direct key
the addresses and strides) gives the graph the bytes the eager call would read, so the outputs are
the same bits. Such graphs keep no reference to the caller's tensors (their memory goes back to
the allocator as usual); they live in an LRU of their own (`MAX_DIRECT_ENTRIES`), and after
`MAX_DIRECT_EVICTIONS` evictions (addresses that keep changing) the process stops capturing them
with a warning, and the copying graphs carry on.
Past `max_elements()` and up to `direct_max_elements()` (FREESOLO_TRITON_GRAPH_DIRECT_MAX=N query
elements; unset = 2^24 = 16384 tokens at H 16, D 64, the default since s50; "0" = none) a forward
without gradients is served by a graph on its inputs only (`eligible(..., in_place=True)`): never a
copying graph, the second call of a key at the same addresses captures one, every other call runs
eagerly. H100, s50 call1 (`gpu_session_run.sh` step s49_gab, same run, same bits, API ms): FS-L 16k
0.487 against 0.651 eagerly, FS 16k 0.597 against 0.626; its graph holds 0.035 GiB (FS-L 16k,
`graph_cache_probe.py`). H100, s49 call1 (FS-L / FS,
B 1, H 16, D 64, bf16, 16k tokens, through the API, same run, same bits): FS-L 0.490 ms against
0.846 eagerly (its GPU time 0.466: the eager call is host-bound) and 0.581 with copies in; FS 0.601
against 0.631 eagerly and 0.709 with copies in; at 32k the GPU hides the host work (FS-L 0.897 against
0.896 eagerly, 1.066 with copies), and a forward + backward at 16k is slower from graphs (2.49 against
2.34 ms): hence 2^24 as the candidate default, and no copying graphs past `max_elements()`. (Those
arms ran the s47 code with FREESOLO_TRITON_GRAPHS=2^25, a copying graph captured before the graph on the
inputs; the direct-only path is tested on the CPU with emulated graphs and on the GPU since s50.)
Memory: a graph keeps static copies of its inputs and its own pool for the outputs and the
intermediates, about the size of the call's working set (a bound backward has no input copies but
the output gradient): at H 16, D 64, bf16 (s34 probe) 0.03 / 0.06 GiB per 4k-token forward /
forward + backward, 0.06 / 0.13 GiB at 8k, so at most ~0.7 GiB for the 8 graphs of 4 shapes at the
limit (`GraphCache.stats` counts graphs, captures, replays, evictions, refreshes;
`clear()` frees them). A graph on the caller's inputs has no input copies, only its pool (<= 0.03 /
0.06 GiB per 4k / 8k forward at that shape), so its 4 add at most ~0.25 GiB
(`GraphCache.direct_stats` counts them).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch

__all__ = [
    "GRAPHS_ENV",
    "DIRECT_ENV",
    "DEFAULT_MAX_ELEMENTS",
    "DIRECT_MAX_ENV",
    "DEFAULT_DIRECT_MAX_ELEMENTS",
    "KNOB_ENVS",
    "GraphCache",
    "CACHE",
    "max_elements",
    "direct_max_elements",
    "direct_inputs",
    "input_addresses",
    "eligible",
    "within_copy_limit",
    "cache_key",
    "Binding",
    "run",
    "run_forward",
    "run_bound",
    "clear",
]

GRAPHS_ENV = "FREESOLO_TRITON_GRAPHS"
DEFAULT_MAX_ELEMENTS = 1 << 23  # B * T * Hq * D of the queries: 8192 tokens at H 16, D 64
MAX_ENTRIES = 8  # graphs (a forward and a backward count apart): <= ~0.7 GiB held at the default limit
MAX_EVICTIONS = 64
CAPTURE_AFTER = 2  # the call of a key that captures it (the first runs eagerly)
MAX_SEEN = 1024  # keys counted before their capture; the counts are cleared beyond it
DIRECT_ENV = "FREESOLO_TRITON_GRAPH_DIRECT"
MAX_DIRECT_ENTRIES = 4  # graphs on callers' addresses (module docstring)
MAX_DIRECT_EVICTIONS = 32
# forwards without gradients past max_elements() and up to this many query elements: graphs on the
# caller's inputs only (module docstring; 0 = none): 16384 tokens at H 16, D 64 (s50: measured, tested on a GPU)
DIRECT_MAX_ENV = "FREESOLO_TRITON_GRAPH_DIRECT_MAX"
DEFAULT_DIRECT_MAX_ELEMENTS = 1 << 24
# the environment switches that change which kernels a call runs (read at call time by
# attention.py, attention_bwd.py, selection.py, _common.py): part of every key
KNOB_ENVS = (
    "FREESOLO_TRITON_LONG_BLOCK",
    "FREESOLO_TRITON_MAXNREG",
    "FREESOLO_TRITON_LONG_INTO_OUT",
    "FREESOLO_TRITON_WINDOW_FIRST",
    "FREESOLO_TRITON_SORTED_LONG",
    "FREESOLO_TRITON_OVERLAP_MIN_T",
    "FREESOLO_TRITON_FSL_TAIL",
    "FREESOLO_TRITON_BWD_LONG",
    "FREESOLO_TRITON_FAST_LAUNCH",
    "FREESOLO_TRITON_LONG_TMA",
    "FREESOLO_TRITON_SIDE_PRIORITY",
    "FREESOLO_TRITON_FSL_DIRECT_MAX_CELLS",
    "FREESOLO_TRITON_SORTED_LONG_MIN_T",
    "FREESOLO_TRITON_FUSED_UNIONS",
    "FREESOLO_TRITON_LONG_MAXNREG",
    "FREESOLO_TRITON_WINDOW_TILES",
)


def _element_count(name: str, default: int, zero_means: str) -> int:
    """The count of query elements the environment variable `name` gives: unset or empty = default,
    else an integer >= 0 (the error message says what 0 means: `zero_means`)."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={text!r} must be 0 ({zero_means}) or a positive count of query elements")
    return value


def max_elements() -> int:
    """The most query elements (B * T * Hq * D) a call may hold to be replayed from a graph (0: the
    cache is off). FREESOLO_TRITON_GRAPHS: unset or empty = DEFAULT_MAX_ELEMENTS, "0" = off, N > 0 = N."""
    return _element_count(GRAPHS_ENV, DEFAULT_MAX_ELEMENTS, "off")


def direct_max_elements() -> int:
    """The most query elements a forward without gradients may hold to be replayed from a graph on its
    inputs (`run` with `direct_inputs()`; module docstring), when that is more than `max_elements()`.
    FREESOLO_TRITON_GRAPH_DIRECT_MAX: unset or empty = DEFAULT_DIRECT_MAX_ELEMENTS, "0" = no such
    calls (the graphs on the inputs keep to `max_elements()`), N > 0 = N."""
    return _element_count(DIRECT_MAX_ENV, DEFAULT_DIRECT_MAX_ELEMENTS, "no larger calls than FREESOLO_TRITON_GRAPHS")


def direct_inputs() -> bool:
    """Whether `run` may replay graphs that read the caller's inputs in place (FREESOLO_TRITON_GRAPH_DIRECT:
    unset, empty or "1" = yes (the default since s47), "0" = no)."""
    text = os.environ.get(DIRECT_ENV, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{DIRECT_ENV}={text!r} must be 0 (copy the inputs into the graph's buffers) or 1")
    return text != "0"


def input_addresses(tensors: tuple) -> tuple:
    """(data_ptr, strides) of each tensor (None kept): with the shapes and dtypes of a key, the memory a
    graph on these tensors reads."""
    return tuple(None if x is None else (x.data_ptr(), x.stride()) for x in tensors)


def within_copy_limit(q: torch.Tensor) -> bool:
    """Whether queries q may be served by a graph that copies its inputs in (`max_elements()`)."""
    return q.numel() <= max_elements()


def eligible(q: torch.Tensor, variant: str, in_place: bool = False) -> bool:
    """Whether a call on queries q [B, T, Hq, D] may be replayed from a graph (module docstring);
    variant: cfg.variant. The forward and the backward of a call ask alike. in_place: the call goes
    through `run` (a forward without gradients), so past `max_elements()` and up to
    `direct_max_elements()` a graph on its inputs may serve it (with `direct_inputs()`)."""
    if not q.is_cuda or variant not in ("fs", "fsl") or CACHE.disabled:
        return False
    limit = max_elements()
    if in_place and limit and direct_inputs() and not CACHE.direct_disabled:
        limit = max(limit, direct_max_elements())
    if q.numel() > limit:  # (limit 0: off)
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    return torch.cuda.get_sync_debug_mode() == 0


class _Graph:
    """One captured body: static inputs, the graph, its static outputs.

    tensors: the call's tensor arguments (None allowed), copied into contiguous static buffers;
    fixed: None or, per tensor, None (a static copy, refreshed at every replay) or a static buffer
    of another graph that the body reads as it is (a bound backward reads its forward's buffers:
    never copied in by this graph; `run_bound` refreshes them when they hold another call's values).
    body(*static_tensors, *args) is captured on a side stream of the tensors' device.
    owner: a weak reference to the `Binding` whose values the buffers hold (None: no binding's)."""

    def __init__(self, body: Callable, tensors: tuple, args: tuple, fixed: Optional[tuple] = None):
        fixed = (None,) * len(tensors) if fixed is None else fixed
        self.inputs = tuple(
            f if f is not None else (None if x is None else x.detach().clone(memory_format=torch.contiguous_format))
            for x, f in zip(tensors, fixed)
        )
        self._copied_in = tuple(i for i, (x, f) in enumerate(zip(tensors, fixed)) if x is not None and f is None)
        self.owner: Optional[weakref.ref] = None
        self._stream = None  # the stream of the buffers' last use
        self._device = next(x for x in self.inputs if x is not None).device
        self.outputs = tuple(self._capture(body, args))

    @classmethod
    def on_inputs(cls, body: Callable, tensors: tuple, args: tuple) -> "_Graph":
        """A graph that reads `tensors` where they lie (no static copies; module docstring): replay it
        only for tensors at the same addresses and strides (`input_addresses`). It holds no reference
        to them: `inputs` is empty after the capture."""
        graph = cls.__new__(cls)
        graph.inputs = tuple(None if x is None else x.detach() for x in tensors)
        graph._copied_in = ()
        graph.owner = None
        graph._stream = None
        graph._device = next(x for x in graph.inputs if x is not None).device
        graph.outputs = tuple(graph._capture(body, args))
        graph.inputs = ()
        return graph

    def _capture(self, body: Callable, args: tuple) -> tuple:
        device = self._device
        self.graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)  # the static copies above are on the current stream
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = body(*self.inputs, *args)
            finally:
                self.graph.capture_end()
        current.wait_stream(side)
        return outputs

    def _replay(self) -> None:
        self.graph.replay()

    def enter_stream(self) -> None:
        """Order this use of the buffers (on the current stream) after their last use on another one."""
        stream = torch.cuda.current_stream(self._device)
        if self._stream is not None and self._stream != stream:
            stream.wait_stream(self._stream)
        self._stream = stream

    def release_owner(self) -> None:
        """Before the buffers are overwritten: the owning binding, if its call is alive, takes copies of
        its lent outputs (none if its backward already ran: a later one recomputes them)."""
        ref, self.owner = self.owner, None
        holder = None if ref is None else ref()
        if holder is not None:
            holder.lent = None if holder.spent else tuple(None if t is None else t.clone() for t in holder.lent)

    def __call__(self, tensors: tuple, n_outputs: Optional[int] = None, prepare: Optional[Callable] = None) -> tuple:
        """prepare() (refreshes the fixed buffers, `run_bound`), copy `tensors` in (the positions
        not fixed), replay, return copies of the first `n_outputs` outputs (None: all; the others
        come back as None)."""
        self.enter_stream()
        if prepare is not None:
            prepare()
        self.release_owner()
        # one copy (a DtoD memcpy) per tensor: torch._foreach_copy_ of one dtype takes its multi-tensor
        # kernel, 1.8x slower than the memcpy on the H200 (s34 call1), and one Triton launch for every
        # pair was slower still (s33 call6: its binder's cost for 30 arguments)
        for i in self._copied_in:
            self.inputs[i].copy_(tensors[i])
        self._replay()
        n = len(self.outputs) if n_outputs is None else n_outputs
        return tuple(None if out is None or i >= n else out.clone() for i, out in enumerate(self.outputs))


class Binding:
    """A graphed forward call's claim on its graph's static buffers (`run_forward`).

    lent: the outputs the call did not copy out (the backward's statistics): the graph's own buffers
    while `current()`, i.e. while no later call replayed the graph or refreshed its buffers; the
    replay that overwrites them first gives the binding copies (`_Graph.release_owner`), or nothing
    once `spent` (its backward ran: were it run again, retain_graph, `lent_tensors` recomputes them).
    While current, the backward's graph reads q, k, v, beta, o and the statistics in place (`run_bound`)
    instead of copies of its own: at 4k, H 16, D 64, bf16 ~34 MB and 13 copies fewer per forward +
    backward than s33's cache, which copied every input in and every output out."""

    __slots__ = ("graph", "first_lent", "lent", "spent", "__weakref__")

    def __init__(self, graph: "_Graph", first_lent: int):
        self.graph = graph
        self.first_lent = first_lent
        self.spent = False
        self.claim()

    def claim(self) -> None:
        """The graph's buffers hold this call's values (just replayed for it, or refreshed): lend them."""
        self.lent: Optional[tuple] = self.graph.outputs[self.first_lent :]
        self.graph.owner = weakref.ref(self)

    def current(self) -> bool:
        ref = self.graph.owner
        return ref is not None and ref() is self

    def lent_tensors(self, recompute: Callable) -> tuple:
        """The lent outputs: the graph's buffers while current, else their copies, else recompute()
        (the same bits: the eager body of the captured kernels, on the call's saved inputs)."""
        if self.current():
            self.graph.enter_stream()
            return self.lent
        if self.lent is None:
            self.lent = tuple(recompute())
        return self.lent


def _checked_capture(capture: Callable, what: str, switch_hint: str):
    """capture(), its error re-raised as a RuntimeError that names the call's graph (`what`) and the switch that
    turns such graphs off."""
    try:
        return capture()
    except Exception as error:
        raise RuntimeError(
            f"freesolo: capturing a triton call in a CUDA graph{what} failed ({error}); {switch_hint}"
        ) from error


def _insert_lru(graphs: OrderedDict, key, graph, max_entries: int) -> bool:
    """graphs[key] = graph as the most recent entry; True when that evicted the least recent one."""
    graphs[key] = graph
    if len(graphs) > max_entries:
        graphs.popitem(last=False)
        return True
    return False


class GraphCache:
    """Graphs of eligible calls, keyed as the module docstring says; `capture(body, tensors, args)`
    builds a replayable entry (the CUDA `_Graph` by default; tests on the CPU pass a stand-in)."""

    def __init__(self, capture: Callable = _Graph, max_entries: int = MAX_ENTRIES, max_evictions: int = MAX_EVICTIONS):
        self._capture = capture
        self.max_entries = max_entries
        self.max_evictions = max_evictions
        self._graphs: OrderedDict = OrderedDict()
        self._seen: dict = {}
        self.captures = 0
        self.replays = 0
        self.evictions = 0
        self.refreshes = 0  # `run_bound` replays that first copied saved tensors back into a forward's buffers
        self.disabled = False
        # graphs on the caller's inputs (`call_direct`): key + addresses -> graph; key -> the addresses of its last call
        self._direct: OrderedDict = OrderedDict()
        self._last_addresses: dict = {}
        self.direct_captures = 0
        self.direct_replays = 0
        self.direct_evictions = 0
        self.direct_disabled = False

    @property
    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "captures": self.captures, "replays": self.replays,
                "evictions": self.evictions, "refreshes": self.refreshes, "disabled": self.disabled}

    @property
    def direct_stats(self) -> dict:
        """The graphs on callers' inputs (`call_direct`)."""
        return {"graphs": len(self._direct), "captures": self.direct_captures, "replays": self.direct_replays,
                "evictions": self.direct_evictions, "disabled": self.direct_disabled}

    def clear(self) -> None:
        """Drop every graph (their memory goes back to torch's allocator once no `Binding` holds it),
        the counts of keys not yet captured and the statistics (`disabled` stays)."""
        self._graphs.clear()
        self._seen.clear()
        self.captures = self.replays = self.evictions = self.refreshes = 0
        self._direct.clear()
        self._last_addresses.clear()
        self.direct_captures = self.direct_replays = self.direct_evictions = 0

    def call(
        self, key, body: Callable, tensors: tuple, args: tuple, n_outputs: Optional[int] = None,
        fixed: Optional[tuple] = None, prepare: Optional[Callable] = None,
    ) -> tuple:
        """(outputs, graph): body(*tensors, *args) (a tuple of tensors / None), eagerly (graph None)
        or from the key's graph (the `_Graph` replayed); a replay returns only the first `n_outputs`
        outputs (None: all), the others as None. fixed, prepare: as `_Graph` (a capture's fixed
        buffers; prepare() runs before each replay, never before an eager call)."""
        graph = self._graphs.get(key)
        if graph is None:
            seen = self._seen.get(key, 0) + 1
            if seen < CAPTURE_AFTER or self.disabled:
                if len(self._seen) >= MAX_SEEN:
                    self._seen.clear()
                self._seen[key] = seen
                return tuple(body(*tensors, *args)), None
            self._seen.pop(key, None)
            graph = _checked_capture(
                lambda: self._capture(body, tensors, args, fixed), "", f"{GRAPHS_ENV}=0 turns the backend's graph cache off"
            )
            self.captures += 1
            if _insert_lru(self._graphs, key, graph, self.max_entries):
                self.evictions += 1
                if self.evictions >= self.max_evictions:
                    evictions = self.evictions
                    self.disabled = True
                    self.clear()
                    warnings.warn(
                        f"freesolo: the triton backend's CUDA-graph cache evicted {evictions} graphs (the call "
                        f"shapes vary too much for it to pay); it is off for the rest of the process "
                        f"({GRAPHS_ENV}=0 turns it off from the start)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        else:
            self._graphs.move_to_end(key)
        self.replays += 1
        return graph(tensors, n_outputs, prepare), graph

    def call_direct(
        self, key, body: Callable, tensors: tuple, args: tuple, n_outputs: Optional[int] = None, copies: bool = True
    ) -> tuple:
        """`call` for a key whose graph may read the caller's inputs in place (module docstring): the
        graph captured on these addresses if there is one; else, when the key's copying graph exists and
        its last call passed inputs at these same addresses, one is captured here (the capture class's
        `on_inputs(body, tensors, args)`, `_Graph.on_inputs` by default); else `call`.
        copies=False (a call past `max_elements()`): no copying graph; a graph on the inputs is captured
        at the second call of the key at the same addresses, and every other call runs eagerly."""
        addresses = input_addresses(tensors)
        direct_key = (key, addresses)
        graph = self._direct.get(direct_key)
        if graph is None:
            repeated = self._last_addresses.get(key) == addresses
            if len(self._last_addresses) >= MAX_SEEN:
                self._last_addresses.clear()
            self._last_addresses[key] = addresses
            if not repeated or self.direct_disabled or self.disabled or (copies and key not in self._graphs):
                if not copies:
                    return tuple(body(*tensors, *args)), None
                return self.call(key, body, tensors, args, n_outputs)
            graph = _checked_capture(
                lambda: self._capture.on_inputs(body, tensors, args), " on its inputs", f"{DIRECT_ENV}=0 turns such graphs off"
            )
            self.direct_captures += 1
            if _insert_lru(self._direct, direct_key, graph, MAX_DIRECT_ENTRIES):
                self.direct_evictions += 1
                if self.direct_evictions >= MAX_DIRECT_EVICTIONS:
                    self.direct_disabled = True
                    self._direct.clear()
                    warnings.warn(
                        f"freesolo: the triton backend's CUDA graphs on callers' inputs were evicted "
                        f"{self.direct_evictions} times (the input addresses keep changing); no more are "
                        f"captured in this process, calls copy their inputs into the cached graphs "
                        f"({DIRECT_ENV}=0 turns them off from the start)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        else:
            self._direct.move_to_end(direct_key)
        self.direct_replays += 1
        return graph(tensors, n_outputs), graph


CACHE = GraphCache()


def cache_key(body: Callable, tensors: tuple, args: tuple) -> tuple:
    """The key of a call (module docstring): body, (shape, dtype) of each tensor (None kept), the
    device index of the first tensor, args, the values of the `KNOB_ENVS` switches, and whether
    inference mode is on (a graph captured in it holds inference tensors, which a call outside it
    may not copy into)."""
    first = next(x for x in tensors if x is not None)
    return (
        body,
        tuple(None if x is None else (x.shape, x.dtype) for x in tensors),
        first.device.index,
        args,
        _knob_values(),
        torch.is_inference_mode_enabled(),
    )


# os.environ.get costs ~1 us per name (str encoding both ways): POSIX's os.environ keeps the encoded
# variables in a dict, which its own setitem / delitem update; read from it directly (~0.1 us)
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KNOB_KEYS = tuple(os.fsencode(name) for name in KNOB_ENVS)


def _knob_values() -> tuple:
    """The values of the `KNOB_ENVS` switches (None: unset), encoded or not by the platform."""
    if isinstance(_ENV_DATA, dict):
        return tuple(map(_ENV_DATA.get, _KNOB_KEYS))
    return tuple(os.environ.get(name) for name in KNOB_ENVS)


def _on_device(device: Optional[int], fn: Callable, *a):
    """fn(*a) with `device` (a CUDA index; None: a CPU tensor, the tests' emulated graphs) current."""
    if device is not None and device != torch.cuda.current_device():
        with torch.cuda.device(device):
            return fn(*a)
    return fn(*a)


def run(body: Callable, tensors: tuple, args: tuple, n_outputs: Optional[int] = None, copies: bool = True) -> tuple:
    """body(*tensors, *args) through `CACHE` (call it only when `eligible`).

    tensors: torch tensors (or None) on one CUDA device; args: hashable non-tensor arguments;
    n_outputs: how many of body's outputs the caller reads (None: all; a replay copies only those
    out of the graph and returns None for the others).
    Returns body's tuple of outputs (tensors or None), fresh tensors the caller owns.
    With `direct_inputs()`, a graph may read the inputs in place (`GraphCache.call_direct`).
    copies=False (a forward past `max_elements()`, `eligible(..., in_place=True)`): replayed only from
    a graph on its inputs, else run eagerly."""
    key = cache_key(body, tensors, args)
    if direct_inputs():
        return _on_device(key[2], CACHE.call_direct, key, body, tensors, args, n_outputs, copies)[0]
    if not copies:
        return tuple(body(*tensors, *args))
    return _on_device(key[2], CACHE.call, key, body, tensors, args, n_outputs)[0]


def run_forward(body: Callable, tensors: tuple, args: tuple, n_copied: int, constant: tuple = ()) -> tuple:
    """`run` for a forward whose later outputs stay in the graph: (outputs, binding).

    Eagerly (the first call of a key): body's outputs, binding None. From a graph: copies of the first
    `n_copied` outputs, None for the others, which the returned `Binding` lends (`lent_tensors`).
    constant: positions of `tensors` that hold tensors nobody writes (the backend's cached ones
    vector of beta = None): the graph reads them in place, never copies them in; the key holds them."""
    fixed = None
    key = cache_key(body, tensors, args)
    if constant:
        fixed = tuple(x if i in constant else None for i, x in enumerate(tensors))
        key += tuple(tensors[i] for i in constant)  # by identity (torch.Tensor hashes by id)
    outputs, graph = _on_device(key[2], CACHE.call, key, body, tensors, args, n_copied, fixed)
    return outputs, None if graph is None else Binding(graph, n_copied)


def run_bound(body: Callable, tensors: tuple, args: tuple, binding: Binding, fixed: tuple) -> tuple:
    """body(*tensors, *args) through `CACHE`, as `run`, for a graph that reads buffers of the graph of
    `binding` (the forward call whose saved tensors are among `tensors`) in place.

    fixed: per tensor, None (copied into this graph at each replay, e.g. the output gradient) or the
    buffer of `binding.graph` that holds its value while `binding.current()`. Before a replay with
    the binding no longer current (another call replayed that graph since), the buffers' owner gets
    its copies, `tensors` are copied into the fixed buffers and the binding is current again. The
    key holds `binding.graph`: a graph is bound to the buffers of one forward graph."""
    key = cache_key(body, tensors, args) + (binding.graph,)

    def refresh():
        graph = binding.graph
        graph.enter_stream()
        if not binding.current():
            graph.release_owner()
            for f, x in zip(fixed, tensors):
                if f is not None and f is not x:  # (a constant input is its own buffer)
                    f.copy_(x)
            binding.claim()
            CACHE.refreshes += 1

    return _on_device(key[2], CACHE.call, key, body, tensors, args, None, fixed, refresh)[0]


def clear() -> None:
    """Free every cached graph of this process."""
    CACHE.clear()
