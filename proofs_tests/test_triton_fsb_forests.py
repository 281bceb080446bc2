"""The Triton FS-B prefill forests (`freesolo.backends.triton.fsb_forests`, spec §6.2-§6.3; issue 12).

- the cell statistics of one pass over the storage-dtype keys: kbar64 equal to the torch backend's
  float64 means (exact sums of 16-bit keys), a64 within an ulp (the torch CPU sqrt is not always
  correctly rounded), and their float32 roundings within an ulp of the torch float32 statistics;
- the node tables equal the torch backend's: the layout (base, e, cell) exactly, the float32
  statistics (mu, rad, A) within float32 rounding, both leaf orders, awkward T and D, cells of 3
  and 4 tokens, GQA-free rows of 1 and 3 kv heads, high-norm forests included;
- the radii cover their leaves: every node's rad >= the float64 distance of each of its leaves
  to the node's stored mu (the bound the search relies on);
- both forests written into one joined table: the same bits as each built alone and concatenated;
- a small LEAF_BLOCK sends the upper levels through `_upper_mu_kernel` and the atomic radii: same tables;
- the search on the Triton forests equals the float64 oracle's selection (small random cases);
  on CUDA at paper sizes it differs from the search on the torch forests at float32 near-ties only;
- L10's prefix property: the trees over a prefix of the keys do not change when later keys are added;
- bad input raises.
On a CPU machine the kernels run under the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates any kernel
pytest.importorskip("triton", reason="triton is not installed: the Triton FS-B forests cannot run")

from freesolo import FreeSoloConfig  # noqa: E402
from freesolo.backends.torch import fsb as torch_fsb  # noqa: E402
from freesolo.backends.triton import fsb_forests, fsb_search  # noqa: E402
from freesolo.backends.triton.fsb_audit import near_tie_audit  # noqa: E402
from freesolo.reference.fsb import select_cells_fsb  # noqa: E402

from .helpers import triton_kernel_tests  # noqa: E402

CUDA, INTERPRETED, DEVICE, pytestmark = triton_kernel_tests()
CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (paper sizes, bf16 inputs: run on the H200)")


def _keys(seed: int, T: int, Hkv: int, D: int, dtype=torch.bfloat16, device=DEVICE) -> torch.Tensor:
    """One row of unrotated keys [1, Hkv, T, D] in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, Hkv, T, D, generator=gen).to(dtype).to(device)


def _cfg(k: torch.Tensor, cell: int, **kw) -> FreeSoloConfig:
    """A small FS-B config whose tau is the median max key norm of k's cells (so both forests are non-trivial)."""
    _, a = torch_fsb.cell_stats(k.double().cpu(), cell)
    tau = tuple(float(x) + 1e-3 for x in a[0].median(dim=-1).values)
    base = dict(variant="fsb", window=16, cell=cell, block=4 * cell, beam=3, top_k=3, hash_bits=6, tau=tau)
    return FreeSoloConfig(**{**base, **kw})


def _assert_fp32_stats_close(kbar, a, ref_kbar, ref_a, k):
    """Float32 cell statistics within float32 rounding of the torch backend's: a within 8 ulps (torch sums the squares in float32); kbar
    (means of keys that partly cancel, summed in float32 by torch) within 2 ulps of k's largest magnitude."""
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(a, ref_a, rtol=8 * eps, atol=0)
    torch.testing.assert_close(kbar, ref_kbar, rtol=0, atol=2 * eps * k.abs().max().item())


@pytest.mark.parametrize("T, Hkv, D, cell", [(70, 2, 16, 4), (61, 1, 24, 3), (33, 3, 8, 4)])
def test_cell_stats_match_torch(T, Hkv, D, cell):
    k = _keys(T, T, Hkv, D)
    kbar, a, kbar64, a64 = fsb_forests.row_cell_stats(k, cell)
    ref = torch_fsb.row_cell_stats(k.float(), cell)
    C = T // cell
    assert kbar.shape == (1, Hkv, C, D) and a64.shape == (1, Hkv, C)
    if cell & (cell - 1) == 0:  # the mean of 16-bit keys over a power-of-two cell is exact in float64
        assert torch.equal(kbar64, ref[2])
    else:
        torch.testing.assert_close(kbar64, ref[2], rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(a64, ref[3], rtol=2e-16, atol=0)
    _assert_fp32_stats_close(kbar, a, ref[0], ref[1], k)


def _assert_tables_close(got, ref):
    """Two NodeTables: the same layout exactly, float32 statistics within float32 rounding."""
    assert got.max_height == ref.max_height
    assert torch.equal(got.base, ref.base)
    assert torch.equal(got.e, ref.e) and torch.equal(got.cell, ref.cell)
    scale = ref.mu.abs().amax().item()
    torch.testing.assert_close(got.mu, ref.mu, rtol=2e-6, atol=2e-7 * scale)
    torch.testing.assert_close(got.rad, ref.rad, rtol=4e-6, atol=2e-7 * scale)
    torch.testing.assert_close(got.A, ref.A, rtol=3e-7, atol=0)


@pytest.mark.parametrize(
    "seed, T, Hkv, D, cell, leaf_order",
    [(0, 300, 2, 16, 4, "content"), (1, 203, 1, 24, 3, "position"), (2, 517, 3, 8, 4, "content")],
)
def test_node_tables_match_torch(seed, T, Hkv, D, cell, leaf_order):
    k = _keys(seed, T, Hkv, D)
    cfg = _cfg(k, cell, leaf_order=leaf_order)
    got, prefix = fsb_forests.row_forests(k, cfg)
    ref, ref_prefix = torch_fsb.build_row_forests(k.float(), cfg, outward=True)
    assert torch.equal(prefix, ref_prefix)
    assert torch.equal(got.base, ref.base) and torch.equal(got.segment_scale, ref.segment_scale)
    assert got.max_height >= 5, "the trees are too short for the test to bite"
    _assert_tables_close(got, ref)


def _leaf_distances(table) -> list:
    """Per (height h, level l >= 1) of `table` (a NodeTable of B 1): (rad [Hkv, nodes], the float64
    max over each node's leaves of |leaf - mu|), from the table itself (level 0 holds the leaves)."""
    out = []
    base = table.base.tolist()
    mu = table.mu[0].double()
    for h in range(table.max_height + 1):
        nodes = (2 << h) - 1
        n_trees = (base[h + 1] - base[h]) // nodes
        trees = mu[:, base[h] : base[h + 1]].reshape(mu.shape[0], n_trees, nodes, -1)
        rads = table.rad[0, :, base[h] : base[h + 1]].reshape(mu.shape[0], n_trees, nodes)
        leaves = trees[:, :, : 1 << h]  # level 0
        for lvl in range(1, h + 1):
            off = (2 << h) - (2 << (h - lvl))
            node_mu = trees[:, :, off : off + (1 << (h - lvl))]  # (Hkv, trees, nodes at lvl, D)
            grouped = leaves.reshape(*leaves.shape[:2], 1 << (h - lvl), 1 << lvl, -1)
            dist = torch.linalg.vector_norm(grouped - node_mu[:, :, :, None], dim=-1).amax(-1)
            out.append((rads[:, :, off : off + (1 << (h - lvl))].double(), dist))
    return out


@pytest.mark.parametrize("leaf_block", [None, 4])
def test_radii_cover_their_leaves(monkeypatch, leaf_block):
    if leaf_block is not None:  # levels > 2 through the upper-level kernels
        monkeypatch.setattr(fsb_forests, "LEAF_BLOCK", leaf_block)
    k = _keys(5, 260, 2, 16) * 3.0
    cfg = _cfg(k, 4)
    kbar, a, _, _ = fsb_forests.row_cell_stats(k, cfg.cell)
    codes = torch.arange(a.shape[-1], device=a.device).flip(0).expand(a.shape) % 5  # leaves out of position order
    tables = fsb_forests.cells_node_table(kbar, a, None, codes.contiguous(), a.shape[-1], cfg, outward=True)
    pairs = _leaf_distances(tables)
    assert len(pairs) >= 20
    for rad, dist in pairs:
        assert (rad >= dist).all(), float((dist - rad).max())
        assert (rad <= dist * (1 + 1e-5) + 1e-6).all(), "a radius far above its leaves' distance"


def test_upper_level_kernel_gives_the_same_tables(monkeypatch):
    k = _keys(6, 300, 2, 16)
    cfg = _cfg(k, 4)
    whole, _ = fsb_forests.row_forests(k, cfg)
    monkeypatch.setattr(fsb_forests, "LEAF_BLOCK", 2)
    upper, _ = fsb_forests.row_forests(k, cfg)
    assert whole.max_height >= 5
    for name in ("mu", "A", "e", "cell"):  # float64 sums of exact values: the same bits in any order
        assert torch.equal(getattr(upper, name), getattr(whole, name)), name
    torch.testing.assert_close(upper.rad, whole.rad, rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize(
    "seed, T, Hq, Hkv, kw",
    [
        (0, 47, 2, 1, dict(leaf_order="content", radius_weight=1.0)),
        (1, 41, 4, 2, dict(beam=4, leaf_order="position", radius_weight=0.5, top_k=4)),
    ],
)
def test_search_on_triton_forests_equals_oracle(monkeypatch, seed, T, Hq, Hkv, kw):
    monkeypatch.setenv(fsb_search.FORESTS_ENV, "triton")
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, T, Hq, 8)), rng.standard_normal((1, T, Hkv, 8))
    q = q.astype(np.float32).astype(np.float64)
    k = k.astype(np.float32).astype(np.float64)
    kt = torch.tensor(k, dtype=torch.float32, device=DEVICE)
    cfg = _cfg(kt.permute(0, 2, 1, 3), 4, **kw)
    idx = fsb_search.fsb_select_cells(torch.tensor(q, dtype=torch.float32, device=DEVICE), kt, cfg)
    assert (idx >= 0).sum() > 2 * T, "too few selections: the test would not bite"
    np.testing.assert_array_equal(idx.cpu().numpy(), select_cells_fsb(q, k, cfg))


@pytest.mark.parametrize("leaf_order", ["content", "position"])
def test_prefix_trees_do_not_see_later_cells(leaf_order):
    """L10's "node statistics use prefix cells only" for the Triton build: the trees of a prefix of the
    keys are bitwise the same trees when later keys exist (and the later keys change), in both forests."""
    k = _keys(8, 520, 2, 16)
    cfg = _cfg(k, 4, leaf_order=leaf_order)
    T1 = 300
    short, prefix_short = fsb_forests.row_forests(k[:, :, :T1].contiguous(), cfg)
    other = k.clone()
    other[:, :, T1:] = _keys(9, 520 - T1, 2, 16)
    for keys in (k, other):
        long, prefix_long = fsb_forests.row_forests(keys, cfg)
        C1 = T1 // cfg.cell
        assert torch.equal(prefix_long[:, :, : C1 + 1], prefix_short)
        compared = 0
        for f in range(2):  # all cells, high-norm cells (per kv head: its own number of high cells)
            for g in range(k.shape[1]):
                M = C1 if f == 0 else int(prefix_short[0, g, C1])
                for h in range(M.bit_length()):
                    nodes = (M >> h) * ((2 << h) - 1)  # the complete trees of height h over the prefix's elements
                    s0, l0 = int(short.base[f, h]), int(long.base[f, h])
                    for name in torch_fsb.TREE_FIELDS:
                        a = getattr(short, name)[0, g, s0 : s0 + nodes]
                        b = getattr(long, name)[0, g, l0 : l0 + nodes]
                        assert torch.equal(a, b), (f, g, h, name)
                    compared += nodes
        assert compared > 500, "too few prefix nodes compared: the test would not bite"


def test_joined_tables_equal_concatenated_ones():
    """`forest_tables` writes both forests into one joined table (slices of it): the same bits as each
    forest built alone and concatenated (the torch `SearchTables` path), node ids shifted alike."""
    k = _keys(7, 333, 2, 16)
    cfg = _cfg(k, 4)
    kbar, a, _, a64 = fsb_forests.row_cell_stats(k, cfg.cell)
    codes = torch.arange(a.shape[-1], device=a.device).expand(a.shape).contiguous() % 7
    hc = torch.sort((a64 <= a64.median()).to(torch.int8), dim=-1, stable=True).indices[:, :, :40]
    forests = [(None, codes, a.shape[-1]), (hc, torch.gather(codes, 2, hc), 40)]
    joined = fsb_forests.forest_tables(kbar, a, forests, cfg, True)
    alone = torch_fsb.SearchTables([fsb_forests.cells_node_table(kbar, a, c, co, M, cfg, True) for c, co, M in forests])
    assert torch.equal(joined.base, alone.base) and torch.equal(joined.segment_scale, alone.segment_scale)
    for name in torch_fsb.TREE_FIELDS:
        assert torch.equal(getattr(joined, name), getattr(alone, name)), name


def test_refuses_bad_input(monkeypatch):
    k = _keys(0, 64, 2, 16)
    cfg = _cfg(k, 4)
    with pytest.raises(ValueError, match="one row"):
        fsb_forests.row_forests(torch.cat([k, k]), cfg)
    with pytest.raises(ValueError, match="float16 / bfloat16 / float32"):
        fsb_forests.row_cell_stats(k.to(torch.int32), 4)
    kbar, a, _, _ = fsb_forests.row_cell_stats(k, 4)
    codes = torch.zeros_like(a, dtype=torch.int64)
    with pytest.raises(ValueError, match="outward"):
        fsb_forests.cells_node_table(kbar, a, None, codes, a.shape[-1], cfg, outward=False)
    with pytest.raises(ValueError, match="float32"):
        fsb_forests.cells_node_table(kbar.double(), a, None, codes, a.shape[-1], cfg, outward=True)
    wrong = fsb_forests._empty_fields(2, 5, 16, k.device)  # not this table's node count
    with pytest.raises(ValueError, match="nodes a kv head"):
        fsb_forests.cells_node_table(kbar, a, None, codes, a.shape[-1], cfg, outward=True, out=wrong)
    with pytest.raises(ValueError, match="joined fields"):
        torch_fsb.SearchTables([fsb_forests.cells_node_table(kbar, a, None, codes, a.shape[-1], cfg, True)], joined=wrong)
    monkeypatch.setenv(fsb_search.FORESTS_ENV, "numpy")
    with pytest.raises(ValueError, match="FREESOLO_TRITON_FSB_FORESTS"):
        fsb_search.forests_mode()
    monkeypatch.delenv(fsb_search.FORESTS_ENV)
    assert fsb_search.forests_mode() == fsb_search.FORESTS_DEFAULT == "triton"


@CUDA_ONLY
def test_cuda_paper_size_tables_match_torch():
    """Default config, T = 65536, H 4, D 64, bf16: the statistics bitwise where float64 makes them
    exact (kbar64, a64: CUDA's float64 sqrt is correctly rounded), the tables within float32 rounding."""
    k = _keys(0, 65536, 4, 64, device="cuda")
    cfg = _cfg(k, 32, window=512, block=128, beam=16, top_k=4, hash_bits=16)
    stats = fsb_forests.row_cell_stats(k, cfg.cell)
    ref_stats = torch_fsb.row_cell_stats(k.float(), cfg.cell)
    assert torch.equal(stats[2], ref_stats[2]) and torch.equal(stats[3], ref_stats[3])
    _assert_fp32_stats_close(stats[0], stats[1], ref_stats[0], ref_stats[1], k)
    got, prefix = fsb_forests.row_forests(k, cfg)
    ref, ref_prefix = torch_fsb.build_row_forests(k.float(), cfg, outward=True)
    assert torch.equal(prefix, ref_prefix) and got.max_height >= 10
    _assert_tables_close(got, ref)


@CUDA_ONLY
def test_cuda_forests_differ_at_near_ties_only(monkeypatch):
    """Default config, T = 16384, GQA 4, bf16: the selection on the Triton forests equals the one on
    the torch forests except at float32 near-ties (float64 margins of `near_tie_audit` below 1e-3)."""
    torch.manual_seed(0)
    T, Hq, Hkv, D = 16384, 8, 2, 64
    q = torch.randn(1, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    cfg = FreeSoloConfig(variant="fsb", tau=float(D**0.5) * 1.4)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(fsb_search.FORESTS_ENV, mode)
        runs[mode] = fsb_search.fsb_select_cells(q, k, cfg)
    assert (runs["triton"][:, cfg.block :] >= 0).all(), "every query past the first block selects top_k cells"
    differ = (runs["triton"] != runs["torch"]).any(-1)
    assert differ.float().mean().item() <= 0.002, f"{differ.float().mean().item():.4%} of the selections differ"
    entries = [tuple(int(x) for x in e) for e in differ.nonzero()[:32].tolist()]
    wide = [r for r in near_tie_audit(q, k, cfg, entries) if r["margin"] > 1e-3]
    assert not wide, f"the Triton forests' selection differs at entries with wide float64 margins: {wide[:4]}"


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freesolo.backends.triton import fsb_forests as ff

def compile_sm90(kernel, pointers, constants, floats=(), int64=()):
    names = kernel.arg_names
    signature = {n: pointers[n] if n in pointers else "constexpr" if n in constants else "fp32" if n in floats
                 else "i64" if n in int64 else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

compile_sm90(ff._row_stats_kernel, {"K": "*bf16", "KBAR": "*fp32", "A": "*fp32", "KBAR64": "*fp64", "A64": "*fp64"},
             dict(CELL=32, CELL_P=32, CB=ff.STATS_CELLS, BLOCK_D=64))
table = {"MU": "*fp32", "RAD": "*fp32", "AN": "*fp32", "E": "*i64", "CELLID": "*i64"}
stats = {"KBAR": "*fp32", "A": "*fp32", "LEAF": "*i64"}
log_r = ff.LEAF_BLOCK.bit_length() - 1
for h in (None, 1):  # Triton makes an int argument equal to 1 a constexpr (s41 call3 failed only there)
    extra = {} if h is None else {"h": h}
    for store in (False, True):
        compile_sm90(ff._levels_kernel, {**stats, **table, "SUMS": "*fp64"},
                     dict(R=ff.LEAF_BLOCK, LOG_R=log_r, STORE_SUMS=store, BLOCK_D=64, **extra), int64=("base",))
    compile_sm90(ff._radius_kernel, {**stats, **table}, dict(R=ff.LEAF_BLOCK, LOG_R=log_r, BLOCK_D=64, **extra),
                 floats=("outward",), int64=("base",))
compile_sm90(ff._upper_mu_kernel, {**table, "SUMS_IN": "*fp64", "SUMS_OUT": "*fp64"}, dict(NB=ff.UPPER_NODES, BLOCK_D=64),
             int64=("base",))
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """The interpreter runs what the compiler may refuse (s41: a constexpr assigned in an unrolled loop
    failed only on the GPU, where h = 1 specialized to a constexpr): the kernels compile ahead of
    time for sm_90 with Triton's own ptxas, in a process without TRITON_INTERPRET, at the paper sizes
    (D 64, cell 32), the levels kernel also with h = 1."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _AOT], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
