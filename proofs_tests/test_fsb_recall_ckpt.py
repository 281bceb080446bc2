"""benchmarks/fsb_recall.py --ckpt: the FS-B recall study on a checkpoint's keys (issue 14, item 6).

A tiny FS checkpoint (random weights, `save_model` + `write_task_json`, as `freesolo train` writes
it) is studied at T = 1024. With beam >= the available cells (64 here) the beam search keeps every
cell (L5), so FS-B's top-4 must be the exhaustive rho top-4: recall@4 exactly 1.0. That fails if
the captured q / k, the per-kv-head split, the availability or the reference disagree with the
FS-B path.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

ROOT = pathlib.Path(__file__).resolve().parents[1]
T, CELL, BLOCK = 1024, 16, 32
BEAMS = (4, T // CELL)  # 64 >= the available cells of any query: exhaustive
RADIUS_WEIGHTS = (0.0, 1.0)
LEAF_ORDERS = ("content", "position")
N_LAYERS, N_HEADS, N_KV = 2, 4, 2


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("fsb_recall_bench", ROOT / "benchmarks" / "fsb_recall.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from freesolo.retrieval.data import Mixture
    from freesolo.retrieval.modelio import build_model, save_model
    from freesolo.retrieval.taskfile import task_json, write_task_json
    from freesolo.retrieval.vocab import VOCAB

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("ckpt") / "tiny_fs"
    fs = dict(window=64, cell=CELL, block=BLOCK, pool=8, recent=2)
    model = build_model("fs", VOCAB.vocab_size, 64, N_LAYERS, N_HEADS, N_KV, fs)
    with torch.no_grad():  # q / k larger than at init: rho far from flat, so a narrow beam can miss
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(10.0)
            layer.self_attn.k_proj.weight.mul_(10.0)
    save_model(model, str(folder))
    mix = Mixture(tasks=("s-niah-2", "mk-niah"), lengths=(128,), batch_tokens=1024)
    write_task_json(str(folder), task_json(128, mix.to_json()))
    return folder


@pytest.fixture(scope="module")
def study(tiny_ckpt, tmp_path_factory):
    bench = _load_benchmark()
    out = tmp_path_factory.mktemp("out") / "fsb_recall_model.json"
    argv = ["--ckpt", str(tiny_ckpt), "--lengths", str(T), "--queries", "12", "--seeds", "2", "--device", "cpu"]
    argv += ["--beams", *map(str, BEAMS), "--radius-weights", *map(str, RADIUS_WEIGHTS), "--out", str(out)]
    bench.main(argv)
    return json.loads(out.read_text()), out


def test_records_cover_every_layer_kv_head_and_setting(study):
    data, out = study
    fsb = [r for r in data["results"] if r["method"] == "FS-B"]
    keys = {(r["T"], r["layer"], r["kv_head"], r["beam"], r["radius_weight"], r["leaf_order"]) for r in fsb}
    want = {
        (T, layer, g, b, rw, lo)
        for layer in range(N_LAYERS)
        for g in range(N_KV)
        for b in BEAMS
        for rw in RADIUS_WEIGHTS
        for lo in LEAF_ORDERS
    }
    assert keys == want and len(fsb) == len(want)
    assert {(r["layer"], r["kv_head"]) for r in data["results"] if r["method"].startswith("FS (")} == {
        (layer, g) for layer in range(N_LAYERS) for g in range(N_KV)
    }
    for r in data["results"]:
        assert 0.0 <= r["recall@4"] <= 1.0 and 0.0 <= r["recall@4 answer"] <= 1.0
        # 2 samples x (their random positions + answer positions) x 2 query heads per kv head
        assert r["n_queries"] == 2 * sum(s["queries"] for s in data["meta"]["samples"])
        assert r["n answer"] > 0 and r["n sample"] > 0
    assert len(data["meta"]["tau"]) == N_LAYERS and all(len(t) == N_KV for t in data["meta"]["tau"])
    env = data["meta"]["env"]
    assert env["device"] and env["torch"] == torch.__version__ and env["git_commit"] and env["ckpt"]
    assert out.with_suffix(".md").exists() and f"T = {T}" in out.with_suffix(".md").read_text()
    assert data["summary"][0]["T"] == T


def test_exhaustive_beam_recall_is_exactly_one(study):
    data, _ = study
    wide = [r for r in data["results"] if r["method"] == "FS-B" and r["beam"] == max(BEAMS)]
    assert wide
    for r in wide:
        assert r["recall@4"] == 1.0, r
        assert r["top-1 hit"] == 1.0, r
        assert r["rho-mass ratio"] == pytest.approx(1.0), r


def test_narrow_beam_misses_something(study):
    """The reference is not the search itself: at beam 4 (8 cells of 64 reranked) some query misses."""
    data, _ = study
    narrow = [r["recall@4"] for r in data["results"] if r["method"] == "FS-B" and r["beam"] == min(BEAMS)]
    assert min(narrow) < 1.0
