"""The Triton FS-B tree-slot build (`freesolo.backends.triton.fsb_build.build_tree_slot`).

- it equals the torch backend's `build_segments` on the 2^h elements at `first` (one segment per
  row): e, cell, A exactly; mu within rounding (float32: rtol 1e-5, atol 1e-6; float64: 1e-12);
  rad within rounding of torch's, and covering the node's leaves about the kernel's own mu;
  heights 0..6, D 8 / 6 (padded) / 64, both leaf orders, outward or not, float32 / float64,
  codes with many ties (the sort is stable), `first` differing per row, the slot at lo > 0 in a
  larger table;
- rows whose `changed` is False, and every node outside the slot, stay bit-for-bit as they were;
- the outward radius is exactly the plain radius times (1 + 8 eps), as torch rounds it;
- small leaf chunks and top blocks (the per-node block loops of the top levels, masked blocks),
  D = 256, a taller tree;
- bad input raises ValueError;
- the kernel is launched without FP fusion (the radius reduction race of s32).
On a CPU machine the kernel runs under the interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel
pytest.importorskip("triton", reason="triton is not installed: the Triton FS-B build cannot run")

from freesolo.backends.torch.fsb import build_segments, level_offset, tree_nodes  # noqa: E402
from freesolo.backends.triton.fsb_build import _build_tree_slot, build_tree_slot  # noqa: E402
from freesolo.config import FreeSoloConfig  # noqa: E402

from .helpers import triton_kernel_tests  # noqa: E402

CUDA, INTERPRETED, DEVICE, pytestmark = triton_kernel_tests()

CELL = 16
SENTINEL = {"mu": -7.25, "rad": -3.5, "A": -9.75, "e": -12345, "cell": -6789}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def make_case(B, Hkv, M, D, h, dtype, seed, n_codes=3, pad_nodes=5):
    """Random elements (codes in range(n_codes): many ties), a sentinel-filled table with the slot
    at lo = pad_nodes, a per-row `first`, and `changed` with some False rows (their `first` out of
    range: never read)."""
    g = torch.Generator().manual_seed(seed)
    S = 1 << h
    elems = {
        "kbar": torch.randn(B, Hkv, M, D, generator=g, dtype=torch.float64).to(dtype) * 3 + 1,
        "a": torch.randn(B, Hkv, M, generator=g, dtype=torch.float64).to(dtype),
        "cells": torch.randint(0, 1000, (B, Hkv, M), generator=g),
        "codes": torch.randint(0, n_codes, (B, Hkv, M), generator=g),
    }
    first = torch.randint(0, M - S + 1, (B, Hkv), generator=g)
    changed = torch.ones(B, Hkv, dtype=torch.bool)
    changed.view(-1)[1::3] = False
    first[~changed] = torch.tensor([-1, M + 5]).repeat(B * Hkv)[: int((~changed).sum())]
    N = pad_nodes + tree_nodes(h) + 3
    fields = {
        "mu": torch.full((B, Hkv, N, D), SENTINEL["mu"], dtype=dtype),
        "rad": torch.full((B, Hkv, N), SENTINEL["rad"], dtype=dtype),
        "A": torch.full((B, Hkv, N), SENTINEL["A"], dtype=dtype),
        "e": torch.full((B, Hkv, N), SENTINEL["e"], dtype=torch.int64),
        "cell": torch.full((B, Hkv, N), SENTINEL["cell"], dtype=torch.int64),
    }
    to = lambda d: {k: v.to(DEVICE) for k, v in d.items()}  # noqa: E731
    return to(fields), pad_nodes, to(elems), first.to(DEVICE), changed.to(DEVICE)


def reference(elems, first, h, leaf_order, outward):
    """build_segments on the 2^h elements at first (clamped into range for unchanged rows)."""
    S = 1 << h
    M = elems["kbar"].shape[2]
    D = elems["kbar"].shape[3]
    idx = first.clamp(0, M - S)[..., None] + torch.arange(S, device=first.device)
    part = {
        k: torch.gather(v, 2, idx[..., None].expand(-1, -1, -1, D) if v.dim() == 4 else idx) for k, v in elems.items()
    }
    cfg = FreeSoloConfig(variant="fsb", cell=CELL, leaf_order=leaf_order)
    return build_segments(part, h, cfg, outward)


def check_build(fields, before, lo, elems, first, changed, h, leaf_order, outward):
    """The slot of changed rows == build_segments (see the module docstring); all else untouched."""
    dtype = fields["mu"].dtype
    eps = torch.finfo(dtype).eps
    ref = reference(elems, first, h, leaf_order, outward)
    hi = lo + tree_nodes(h)
    ch = changed.cpu()
    for name in ("mu", "rad", "A", "e", "cell"):
        got, old = fields[name].cpu(), before[name].cpu()
        # untouched: unchanged rows entirely, and every node outside the slot
        assert torch.equal(got[~ch], old[~ch]), name
        assert torch.equal(got[:, :, :lo], old[:, :, :lo]), name
        assert torch.equal(got[:, :, hi:], old[:, :, hi:]), name
        slot, want = got[:, :, lo:hi][ch], ref[name].cpu()[ch]
        if name in ("A", "e", "cell"):
            assert torch.equal(slot, want), name
        elif name == "mu":
            torch.testing.assert_close(slot, want, **TOL[dtype])
        else:
            torch.testing.assert_close(slot, want, rtol=64 * eps, atol=64 * eps)
    # covering: rad >= max |leaf - mu| about the kernel's own mu (float64 distances)
    mu = fields["mu"].cpu()[:, :, lo:hi][ch].double()  # (rows, nodes, D)
    rad = fields["rad"].cpu()[:, :, lo:hi][ch].double()
    leaves = mu[:, :(1 << h)]  # level 0: the sorted leaves (an exact copy: checked above)
    D = mu.shape[-1]
    for level in range(1, h + 1):
        off, n = level_offset(h, level), 1 << (h - level)
        node_mu = mu[:, off : off + n]  # (rows, n, D)
        grp = leaves.reshape(-1, n, 1 << level, D)
        dist = torch.linalg.vector_norm(grp - node_mu[:, :, None], dim=-1).amax(dim=-1)
        slack = 4 * D * eps * dist + 1e-300
        assert bool((rad[:, off : off + n] >= dist - slack).all()), (level, (dist - rad[:, off : off + n]).max())
        if outward:  # outward rounding covers the float64 distance outright at these sizes
            assert bool((rad[:, off : off + n] >= dist).all()), level


def run_build(fields, lo, elems, first, changed, h, leaf_order, outward, **tiles):
    before = {k: v.clone() for k, v in fields.items()}
    if not tiles:
        build_tree_slot(fields, lo, elems, first, changed, h, CELL, leaf_order, outward)
    else:
        _build_tree_slot(fields, lo, elems, first, changed, h, CELL, leaf_order, outward, **tiles)
    check_build(fields, before, lo, elems, first, changed, h, leaf_order, outward)
    return before


def assert_outward_exact(fields_in, fields_out, lo, h, changed):
    """The outward radius of levels >= 1 is the plain one times (1 + 8 eps), rounded as torch does."""
    dtype = fields_in["rad"].dtype
    ch = changed.cpu()
    r_in = fields_in["rad"].cpu()[:, :, lo + (1 << h) : lo + tree_nodes(h)][ch]
    r_out = fields_out["rad"].cpu()[:, :, lo + (1 << h) : lo + tree_nodes(h)][ch]
    assert torch.equal(r_out, r_in * (1.0 + 8 * torch.finfo(dtype).eps))
    assert torch.equal(fields_in["mu"].cpu(), fields_out["mu"].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("D", [8, 6, 64])
@pytest.mark.parametrize("h", range(7))
def test_matches_build_segments(h, D, dtype):
    """Heights 0..6, both leaf orders, outward or not, vs build_segments; outward == plain * (1 + 8 eps)."""
    B, Hkv = 2, 3
    M = (1 << h) + 5
    for k, leaf_order in enumerate(("content", "position")):
        built = {}
        for outward in (False, True):
            fields, lo, elems, first, changed = make_case(B, Hkv, M, D, h, dtype, seed=100 * h + D + k)
            run_build(fields, lo, elems, first, changed, h, leaf_order, outward)
            built[outward] = fields
        assert_outward_exact(built[False], built[True], lo, h, changed)


@pytest.mark.parametrize(
    "h, log_chunk, log_top_block, dtype, leaf_order",
    [
        (1, 0, 0, torch.float32, "content"),
        (3, 0, 0, torch.float64, "content"),
        (3, 0, 2, torch.float32, "content"),
        (4, 1, 1, torch.float32, "position"),
        (5, 2, 4, torch.float64, "content"),
        (6, 2, 3, torch.float32, "content"),
    ],
)
def test_small_tiles(h, log_chunk, log_top_block, dtype, leaf_order):
    """Chunks of 2^log_chunk leaves and top blocks of 2^log_top_block: levels above log_chunk are
    built by one program per node, looping over its leaves in blocks (compensated sums across
    blocks), a block wider than the node masked."""
    fields, lo, elems, first, changed = make_case(2, 3, (1 << h) + 3, 6, h, dtype, seed=7 + h, n_codes=2)
    run_build(fields, lo, elems, first, changed, h, leaf_order, True, log_chunk=log_chunk, log_top_block=log_top_block)


@pytest.mark.parametrize(
    "h, D, dtype",
    [(6, 256, torch.float64), (6, 256, torch.float32), (10, 8, torch.float32)],
    ids=["D256-f64", "D256-f32", "h10"],
)
def test_default_chunks_top_levels(h, D, dtype):
    """Default tiles smaller than the tree (D = 256: chunks of 8 or 16 leaves, top blocks of 64;
    h = 10 at D = 8: chunks of 256 leaves, top blocks of 128),
    with rows at the ends of the element range (first = 0 and first = M - 2^h)."""
    M = (1 << h) + 2
    fields, lo, elems, first, changed = make_case(1, 3, M, D, h, dtype, seed=h + D, n_codes=4)
    first[0, 0], first[0, 2] = 0, M - (1 << h)
    changed[0] = torch.tensor([True, False, True])
    run_build(fields, lo, elems, first, changed, h, "content", True)


def test_nothing_changed_leaves_table_untouched():
    """All rows unchanged (their first out of range, negative or past M): no node is written."""
    fields, lo, elems, first, changed = make_case(2, 2, 12, 8, 3, torch.float32, seed=3)
    changed.zero_()
    first.copy_(torch.tensor([[-1, 50], [7, -100]]))
    before = {k: v.clone() for k, v in fields.items()}
    build_tree_slot(fields, lo, elems, first, changed, 3, CELL, "content", True)
    for name in fields:
        assert torch.equal(fields[name], before[name]), name


@pytest.mark.parametrize("check", [True, False])
def test_first_host_equals_the_gather_path(check):
    """One start for every row passed as a host int (the all-cells forest) sorts the codes from a
    slice: the same slot, bit for bit, as the per-row gather; with check=False too (no input
    checks: the ForestTable's calls). A start outside [0, M - 2^h] raises."""
    h = 4
    fields, lo, elems, first, changed = make_case(2, 3, 40, 12, h, torch.float32, seed=5)
    first.fill_(9)
    changed.fill_(True)
    a = {k: v.clone() for k, v in fields.items()}
    b = {k: v.clone() for k, v in fields.items()}
    build_tree_slot(a, lo, elems, first, changed, h, CELL, "content", True)
    build_tree_slot(b, lo, elems, first, changed, h, CELL, "content", True, first_host=9, check=check)
    for name in fields:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="first_host"):
        build_tree_slot(b, lo, elems, first, changed, h, CELL, "content", True, first_host=40 - 15)


def test_slot_at_table_start_and_end():
    """lo = 0 and a slot that ends at the table's last node."""
    h = 2
    fields, _, elems, first, changed = make_case(1, 2, 9, 4, h, torch.float64, seed=11, pad_nodes=0)
    run_build(fields, 0, elems, first, changed, h, "content", False)
    fields, _, elems, first, changed = make_case(1, 2, 9, 4, h, torch.float64, seed=12, pad_nodes=6)
    N = fields["mu"].shape[2]
    run_build(fields, N - tree_nodes(h), elems, first, changed, h, "position", True)


def _bad_inputs():
    """(name, mutate) pairs; mutate(args) edits the keyword arguments of build_tree_slot."""

    def set_(key, value):
        return lambda a: a.__setitem__(key, value)

    def field(name, fn):
        return lambda a: a["fields"].__setitem__(name, fn(a["fields"][name]))

    def elem(name, fn):
        return lambda a: a["elems"].__setitem__(name, fn(a["elems"][name]))

    return [
        ("h negative", set_("h", -1)),
        ("h too tall", set_("h", 26)),
        ("h not int", set_("h", 2.0)),
        ("leaf order", set_("leaf_order", "random")),
        ("cell zero", set_("cell", 0)),
        ("lo negative", set_("lo", -1)),
        ("slot past table", set_("lo", 20)),
        ("mu dtype", field("mu", lambda t: t.half())),
        ("rad dtype", field("rad", lambda t: t.double())),
        ("e dtype", field("e", lambda t: t.int())),
        ("cell shape", field("cell", lambda t: t[:, :1])),
        ("mu not contiguous", field("mu", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1))),
        ("missing field", lambda a: a["fields"].pop("A")),
        ("kbar dtype", elem("kbar", lambda t: t.double())),
        ("kbar D", elem("kbar", lambda t: t[..., :4].contiguous())),
        ("a shape", elem("a", lambda t: t[..., :-1].contiguous())),
        ("cells dtype", elem("cells", lambda t: t.int())),
        ("codes missing", lambda a: a["elems"].pop("codes")),
        ("too few elements", lambda a: a["elems"].update({k: v[:, :, :3].contiguous() for k, v in a["elems"].items()})),
        ("kbar not contiguous", elem("kbar", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3))),
        ("first dtype", set_("first", torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))),
        ("first shape", set_("first", torch.zeros(2, 1, dtype=torch.int64, device=DEVICE))),
        ("changed dtype", set_("changed", torch.ones(2, 3, dtype=torch.int64, device=DEVICE))),
        ("changed not tensor", set_("changed", [[True] * 3] * 2)),
        ("odd D", lambda a: (field("mu", lambda t: t[..., :5].contiguous())(a), elem("kbar", lambda t: t[..., :5].contiguous())(a))),
        ("D too large", lambda a: (
            field("mu", lambda t: torch.zeros(*t.shape[:3], 258, dtype=t.dtype, device=t.device))(a),
            elem("kbar", lambda t: torch.zeros(*t.shape[:3], 258, dtype=t.dtype, device=t.device))(a),
        )),
    ] + ([("device", set_("first", torch.zeros(2, 3, dtype=torch.int64)))] if CUDA else [])


@pytest.mark.parametrize("name, mutate", _bad_inputs(), ids=[n for n, _ in _bad_inputs()])
def test_bad_input_raises(name, mutate):
    fields, lo, elems, first, changed = make_case(2, 3, 10, 8, 2, torch.float32, seed=1)
    args = dict(fields=fields, lo=lo, elems=elems, first=first, changed=changed, h=2, cell=CELL,
                leaf_order="content", outward=True)
    mutate(args)
    with pytest.raises(ValueError):
        build_tree_slot(**args)


def test_build_kernel_compiles_without_fp_fusion(monkeypatch):
    """The build kernel is launched with enable_fp_fusion=False (fsb_build._NO_FP_FUSION: with FMA
    contraction the radius's reduction lanes round differently and race on shared memory, s32)."""
    from freesolo.backends.triton import fsb_build

    seen = []
    original = fsb_build.launch

    def recording(kernel, grid, *args, **kwargs):
        seen.append(kwargs.get("enable_fp_fusion"))
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(fsb_build, "launch", recording)
    fields, lo, elems, first, changed = make_case(1, 2, 8, 6, 2, torch.float32, seed=3)
    build_tree_slot(fields, lo, elems, first, changed, 2, CELL, "content", False)
    assert seen == [False]
