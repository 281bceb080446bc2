"""Retrieval suite (issue 14): generators, exact-match scoring, task.json, `freesolo train` / `eval` smoke run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from freesolo.retrieval.data import Mixture, make_batch
from freesolo.retrieval.scoring import answer_hits, exact_match, score_samples
from freesolo.retrieval.taskfile import read_task_json, task_json, write_task_json
from freesolo.retrieval.tasks import TASK_NAMES, TASKS, depths_for, generate, generate_many, min_length, sample_seed
from freesolo.retrieval.vocab import SPECIALS, VOCAB

T = SPECIALS


def _split(tokens, start, stop, sep):
    """Split tokens[start:stop] at `sep` tokens (lists of ints)."""
    parts, cur = [], []
    for t in tokens[start:stop].tolist():
        if t == sep:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return parts


def solve(tokens: np.ndarray, answer_start: int) -> list:
    """An independent rule-based reader: parse the context and the question, return the answer tokens.

    It only knows the documented formats (tasks.py, format v2): needles `<needle> KEY VALUE .`,
    statements `<var> X = VALUE .` / `<var> X = Y .`, questions `<query> KEY`, `<query> KEYS <is>`
    (several keys) and `<vt-query> VALUE <is>`.
    """
    t = tokens.tolist()
    q = max(i for i in range(answer_start) if t[i] in (T["<query>"], T["<vt-query>"]))
    context = t[:q]
    if t[q] == T["<query>"]:
        keys = t[q + 1 : answer_start]
        if keys[-1] == T["<is>"]:
            keys = keys[:-1]
            assert len(keys) > 1  # only a question of several keys ends with <is>
        found = {}  # key -> values in document order
        i = 0
        while i < len(context):
            if context[i] == T["<needle>"]:
                j = context.index(T["."], i)
                assert T["<is>"] not in context[i:j]
                found.setdefault(context[i + 1], []).append(context[i + 2 : j])
                i = j
            i += 1
        values = found[keys[0]] if len(keys) == 1 else [found[k][0] for k in keys]
        out = []
        for n, v in enumerate(values):
            out += ([T["<sep>"]] if n else []) + v
        return out
    value = t[q + 1 : answer_start - 1]
    assigned, i = [], 0
    statements = []
    while i < len(context):
        if context[i] == T["<var>"]:
            j = context.index(T["."], i)
            statements.append((context[i + 1], context[i + 3 : j]))
            i = j
        i += 1
    for name, rhs in statements:  # in document order: a copy follows its source
        if rhs == value or (len(rhs) == 1 and rhs[0] in assigned):
            assigned.append(name)
    return assigned


LENGTHS = {name: [min_length(name), min_length(name) + 1, 257, 1000] for name in TASK_NAMES}


@pytest.mark.parametrize("task", TASK_NAMES)
def test_generator_deterministic_and_exact_length(task):
    for length in LENGTHS[task]:
        for depth in (0.0, 0.37, 1.0):
            a = generate(task, length, depth, sample_seed(3, task, length, 5))
            b = generate(task, length, depth, sample_seed(3, task, length, 5))
            assert a.tokens.dtype == np.int64 and a.tokens.shape == (length,), (task, length, a.tokens.shape)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            assert (a.answer_start, a.answer_len, a.evidence, a.needles) == (b.answer_start, b.answer_len, b.evidence, b.needles)
            assert a.answer_start + a.answer_len == length
            assert a.tokens[0] == T["<bos>"] and (a.tokens[1:] != T["<bos>"]).all()
            assert (a.tokens >= 0).all() and (a.tokens < VOCAB.vocab_size).all()
    # another seed gives another sample (values and haystack are random)
    a = generate(task, 600, 0.5, sample_seed(0, task, 600, 0))
    c = generate(task, 600, 0.5, sample_seed(0, task, 600, 1))
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_answers_recoverable_and_present_once(task):
    rng = np.random.default_rng(0)
    for i in range(12):
        length = int(rng.integers(min_length(task), 1500))
        depth = float(rng.random()) if i > 1 else float(i)
        s = generate(task, length, depth, sample_seed(1, task, length, i))
        assert solve(s.tokens, s.answer_start) == s.answer.tolist(), (task, length, depth)
        context = s.tokens[: s.answer_start].tolist()
        spec = TASKS[task]
        # every needle span holds a well-formed needle / statement, in the context
        for a, b in s.needles:
            assert b <= s.answer_start and s.tokens[a] in (T["<needle>"], T["<var>"]) and s.tokens[b - 1] == T["."]
        # each answered value occurs exactly once in the context (at its needle)
        if spec.kind != "vt":
            values = _split(s.tokens, s.answer_start, len(s.tokens), T["<sep>"])
            for v, (a, b) in zip(values, s.evidence):
                assert s.tokens[a + 2 : b - 1].tolist() == v
                pattern = v + [T["."]]
                hits = [j for j in range(len(context) - len(pattern) + 1) if context[j : j + len(pattern)] == pattern]
                assert hits == [a + 2], (task, v, hits)
        else:
            names = s.answer.tolist()
            assert len(names) == len(set(names)) == spec.n_hops + 1
            for name, (a, b) in zip(names, s.evidence):
                assert s.tokens[a + 1] == name and context.count(name) == (2 if name != names[-1] else 1)


@pytest.mark.parametrize("task", ["s-niah-1", "s-niah-2", "mk-niah", "vt"])
def test_depth_places_the_asked_needle(task):
    length = 2000
    starts = [generate(task, length, d, sample_seed(0, task, length, 0)).evidence[0][0] for d in np.linspace(0, 1, 11)]
    assert starts[0] == 1, starts  # depth 0: right after <bos>
    assert all(a <= b for a, b in zip(starts, starts[1:])), starts
    s = generate(task, length, 1.0, sample_seed(0, task, length, 0))
    if TASKS[task].kind == "single":  # depth 1: right before the question
        assert s.evidence[0][1] == s.answer_start - 2  # the question is <query> KEY
    assert starts[5] / length == pytest.approx(0.5, abs=0.05)


def test_depths_for_and_errors():
    np.testing.assert_allclose(depths_for(5, 3), [0.0, 0.5, 1.0, 0.0, 0.5])
    np.testing.assert_allclose(depths_for(3, 10), [0.0, 0.5, 1.0])  # fewer samples than depths: still spread
    np.testing.assert_allclose(depths_for(50, 10)[:11], [i / 9 for i in range(10)] + [0.0])
    with pytest.raises(ValueError, match="length=10"):
        generate("mv-niah", 10, 0.5, 0)
    with pytest.raises(ValueError, match="depth=1.5"):
        generate("s-niah-1", 100, 1.5, 0)
    with pytest.raises(ValueError, match="task='nope'"):
        generate("nope", 100, 0.5, 0)
    with pytest.raises(ValueError, match="n_depths=0"):
        depths_for(3, 0)


def _copy_logits(tokens: np.ndarray, wrong_at=None) -> np.ndarray:
    """Logits [B, T, V] whose argmax at p-1 is tokens[p] (a model that copies the answer); optionally
    wrong at the absolute positions in `wrong_at` (predicting p with a shifted token)."""
    B, L = tokens.shape
    logits = np.zeros((B, L, VOCAB.vocab_size), dtype=np.float32)
    nxt = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    np.put_along_axis(logits, nxt[..., None], 1.0, axis=-1)
    for b, p in wrong_at or []:
        logits[b, p - 1, (tokens[b, p] + 1) % VOCAB.vocab_size] = 2.0
    return logits


def test_scoring_exact_match_hand_built():
    samples = generate_many("mq-niah", 300, 4, seed=0, n_depths=4)
    tokens = np.stack([s.tokens for s in samples])
    a0, n = samples[0].answer_start, samples[0].answer_len
    ok = exact_match(_copy_logits(tokens), tokens, a0, n)
    assert ok.tolist() == [True] * 4
    # wrong at one answer token of row 1 (the last one) and row 2 (the first): those rows fail
    bad = _copy_logits(tokens, wrong_at=[(1, a0 + n - 1), (2, a0)])
    assert exact_match(bad, tokens, a0, n).tolist() == [True, False, False, True]
    hits = answer_hits(bad, tokens, a0, n)
    assert hits.shape == (4, n) and hits.sum() == 4 * n - 2
    # wrong only outside the answer span (the question token before it is predicted from p-2): still exact
    outside = _copy_logits(tokens, wrong_at=[(0, a0 - 1), (3, 5)])
    assert exact_match(outside, tokens, a0, n).all()
    # the same through torch tensors
    import torch

    ok_t = exact_match(torch.from_numpy(bad), torch.from_numpy(tokens), a0, n)
    assert ok_t.tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="answer_start=0"):
        exact_match(bad, tokens, 0, n)


def test_score_samples_copy_model_and_random_model():
    samples = generate_many("s-niah-2", 200, 20, seed=0)
    acc_copy = score_samples(lambda tok: _copy_logits(tok), samples, batch_size=3)
    assert acc_copy.dtype == bool and acc_copy.all()
    rng = np.random.default_rng(0)
    acc_rand = score_samples(lambda tok: rng.standard_normal((*tok.shape, VOCAB.vocab_size)), samples, batch_size=7)
    assert acc_rand.mean() <= 0.05
    with pytest.raises(ValueError, match="score one task and length at a time"):
        score_samples(lambda tok: _copy_logits(tok), samples[:1] + generate_many("s-niah-2", 201, 1, seed=0))


def test_eval_first_continues_a_cut_run_exactly():
    """`evaluate(..., first=k)` scores the samples k..n-1 of a full run, and `extend_records` pools
    them with a run over 0..k-1 into the full run's record (accuracy, n, per-depth grid); a record
    that does not continue its predecessor is refused."""
    torch = pytest.importorskip("torch")
    from freesolo.retrieval.evaluate import evaluate, extend_records

    def model(tokens):  # copies the answer, except on samples whose token sum is divisible by 3
        t = tokens.numpy()
        wrong = [(b, t.shape[1] - 2) for b in range(t.shape[0]) if int(t[b].sum()) % 3 == 0]
        return torch.from_numpy(_copy_logits(t, wrong_at=wrong))

    meta = {"model": "copy", "variant": "fs", "train_length": 128}
    common = dict(tasks=["s-niah-1"], lengths=[300], n_depths=4, seed=0, batch_tokens=900, meta=meta, quiet=True)
    full, full_grid = evaluate(model, torch.device("cpu"), n=12, **common)
    head, head_grid = evaluate(model, torch.device("cpu"), n=5, **common)
    tail, tail_grid = evaluate(model, torch.device("cpu"), n=12, first=5, **common)
    assert 0.0 < full[0]["accuracy"] < 1.0, "the fake model must get some samples wrong for this test to bite"
    assert tail[0]["first"] == 5 and tail[0]["n"] == 7
    pooled = extend_records(head, tail)
    assert len(pooled) == 1 and pooled[0]["n"] == 12 and pooled[0]["parts"] == [[0, 5], [5, 12]]
    assert pooled[0]["accuracy"] == pytest.approx(full[0]["accuracy"], abs=1e-12)
    grid = {g["depth"]: g for g in extend_records(head_grid, tail_grid)}
    for g in full_grid:
        assert grid[g["depth"]]["n"] == g["n"] and grid[g["depth"]]["accuracy"] == pytest.approx(g["accuracy"], abs=1e-12)
    # a run cut before it reached every depth (n=50 over 10 depths, cut at 9): its continuation's
    # grid record of the depth it missed is added as it is
    base = {"model": "m", "variant": "fsb", "task": "s-niah-1", "length": 4096}
    old = [{**base, "depth": 0.0, "accuracy": 1.0, "n": 1}]
    new = [{**base, "depth": 0.0, "accuracy": 0.0, "n": 4, "first": 9}, {**base, "depth": 1.0, "accuracy": 0.25, "n": 4, "first": 9}]
    got = {g["depth"]: g for g in extend_records(old, new)}
    assert got[0.0]["n"] == 5 and got[0.0]["accuracy"] == pytest.approx(0.2) and got[1.0]["n"] == 4 and "first" not in got[1.0]
    with pytest.raises(ValueError, match="starts at sample 5"):
        extend_records(full, tail)  # full covers 0..11: the tail does not continue it
    with pytest.raises(ValueError, match="no record covers"):
        extend_records([], tail)
    with pytest.raises(ValueError, match="first=12"):
        evaluate(model, torch.device("cpu"), n=12, first=12, **common)


def test_make_batch_mask_is_the_answer_span():
    mix = Mixture(lengths=(256,), batch_tokens=256 * 8, lm_fraction=0.25)
    tokens, mask = make_batch(mix, np.random.default_rng(2))
    assert tokens.shape == mask.shape == (8, 256)
    for row, m in zip(tokens, mask):
        if not m.any():  # a plain LM row: <bos> then haystack only
            assert row[0] == T["<bos>"] and not np.isin(row, [T["<needle>"], T["<query>"], T["<var>"]]).any()
            continue
        idx = np.flatnonzero(m)
        assert idx[-1] == 255 and (np.diff(idx) == 1).all()  # one contiguous span at the end
        assert row[idx[0] - 1] == T["<is>"] or row[idx[0] - 2] == T["<query>"]  # after <is> or a key
    with pytest.raises(ValueError, match="tasks: 'x'"):
        Mixture(tasks=("x",))


def test_task_json_round_trip(tmp_path):
    mix = Mixture(lengths=(512, 1024))
    data = task_json(1024, mix.to_json(), extra={"train": {"steps": 3}})
    write_task_json(str(tmp_path), data)
    back = read_task_json(str(tmp_path))
    assert back == json.loads(json.dumps(data))
    # regenerate an instance from what task.json says
    spec = back["tasks"]["mk-niah"]
    assert spec["n_needles"] == 4 and back["vocab"]["vocab_size"] == VOCAB.vocab_size
    s = generate("mk-niah", back["train_length"], 0.5, sample_seed(0, "mk-niah", back["train_length"], 0))
    assert len(s.tokens) == 1024
    # a different vocabulary or task definition is refused, naming it
    bad = json.loads(json.dumps(data))
    bad["vocab"]["key_start"] = 40
    write_task_json(str(tmp_path), bad)
    with pytest.raises(ValueError, match="key"):
        read_task_json(str(tmp_path))
    bad = json.loads(json.dumps(data))
    bad["tasks"]["vt"]["n_hops"] = 2
    write_task_json(str(tmp_path), bad)
    with pytest.raises(ValueError, match="task 'vt'"):
        read_task_json(str(tmp_path))


def test_cli_train_then_eval_smoke(tmp_path):
    """20 steps of a tiny FS model through `freesolo train`, then `freesolo eval` on two tasks and lengths
    (torch backend, CPU); the records have the promised fields and a rerun reproduces them exactly."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from freesolo.cli import main

    ckpt = str(tmp_path / "fs_tiny")
    small = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1"]
    fs = ["--window", "32", "--cell", "8", "--block", "32", "--pool", "4", "--recent", "2"]
    rc = main(
        ["train", "--out", ckpt, "--attention", "fs", "--train-length", "128", "--n-lengths", "1", "--steps", "20"]
        + ["--batch-tokens", "256", "--warmup", "5", "--prefetch", "0", "--quiet", "--backend", "torch", "--device", "cpu"]
        + small
        + fs
    )
    assert rc == 0
    for name in ("config.json", "model.safetensors", "task.json", "train_log.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    info = read_task_json(ckpt)
    assert info["train_length"] == 128 and info["train"]["steps"] == 20
    log = json.load(open(os.path.join(ckpt, "train_log.json")))
    assert all(np.isfinite(r["loss"]) for r in log)
    out = str(tmp_path / "res.json")
    args = ["eval", "--ckpt", ckpt, "--task", "s-niah-1", "vt", "--lengths", "128", "256", "--n", "4", "--depths", "2"]
    args += ["--grid", "--quiet", "--backend", "torch", "--device", "cpu", "--out", out]
    assert main(args) == 0
    data = json.load(open(out))
    recs = data["results"]
    assert {(r["task"], r["length"]) for r in recs} == {("s-niah-1", 128), ("s-niah-1", 256), ("vt", 128), ("vt", 256)}
    for r in recs:
        assert {"model", "variant", "task", "train_length", "length", "accuracy", "n"} <= set(r)
        assert r["model"] == "fs_tiny" and r["variant"] == "fs" and r["train_length"] == 128 and r["n"] == 4
        assert 0.0 <= r["accuracy"] <= 1.0
    grid = data["grid"]
    assert sorted((g["length"], g["depth"]) for g in grid) == [(128, 0.0), (128, 1.0), (256, 0.0), (256, 1.0)]
    assert all(g["n"] == 2 and g["task"] == "s-niah-1" for g in grid)
    first = {(r["task"], r["length"]): r["accuracy"] for r in recs}
    assert main(args[:6] + ["--lengths", "128", "256", "--n", "4", "--depths", "2", "--quiet", "--backend", "torch", "--device", "cpu", "--out", out]) == 0
    again = {(r["task"], r["length"]): r["accuracy"] for r in json.load(open(out))["results"]}
    assert again == first  # same seed, same samples, same model: the merged file is unchanged


def test_fsl_candidates_hand_case():
    from freesolo.retrieval.diagnose import _fsl_candidates

    a = np.array([5.0, 1.0, 5.0, 0.5, 9.0, 0.1, 0.2, 0.3])
    # 8 available cells, recent 2 -> {6, 7}; pool 2 of the older [0, 6) by (a, c): 4 (9.0), then 2 (5.0, more recent than 0)
    assert _fsl_candidates(a, 8, pool=2, recent=2) == {4, 2, 6, 7}
    assert _fsl_candidates(a, 3, pool=5, recent=1) == {0, 1, 2}


def test_diagnose_tiny_model_consistent_with_selection():
    """Diagnosis of a random tiny FS-L model: shapes, masses in [0, 1], and FS-L's selection is inside the
    candidate set the diagnosis computes from the spec (a head that reads a needle cell implies the cell is a candidate)."""
    torch = pytest.importorskip("torch")
    from freesolo import FreeSoloConfig
    from freesolo.models import FreeSoloLM, LMConfig
    from freesolo.retrieval.diagnose import diagnose_sample, summarize

    torch.manual_seed(1)  # a seed whose random model reads the needle cell somewhere (checked below)
    cfg = FreeSoloConfig(variant="fsl", window=32, cell=8, block=32, top_k=2, pool=3, recent=2)
    model = FreeSoloLM(LMConfig(vocab_size=VOCAB.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention="fsl", freesolo=cfg, backend="torch"))
    model.eval()
    diags = []
    for i, depth in enumerate((0.0, 0.3, 0.6, 1.0)):
        s = generate("s-niah-2", 400, depth, sample_seed(0, "s-niah-2", 400, i))
        d = diagnose_sample(model, s, torch.device("cpu"))
        assert d["p"] == s.answer_start - 1
        assert len(d["selected"]) == len(d["mass"]) == len(d["in_candidates"]) == len(d["norm_pct"]) == 2
        for layer in range(2):
            assert len(d["selected"][layer]) == 4 and len(d["in_candidates"][layer]) == 2
            for h in range(4):
                m = d["mass"][layer][h]
                assert 0.0 <= m <= 1.0 + 1e-6 and (m == 0.0 or d["selected"][layer][h])
                if d["selected"][layer][h]:
                    assert d["in_candidates"][layer][h // 2], (depth, layer, h)
        if depth == 0.0:
            assert d["available"] and not d["local"]
        if depth == 1.0:
            assert d["local"]
        diags.append({**d, "correct": i % 2 == 0})
    assert any(any(x for row in d["selected"] for x in row) for d in diags)  # the implication was exercised
    summ = summarize(diags)
    assert summ["failed"]["n"] == 2 and summ["correct"]["n"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (bf16 autocast, fused AdamW, triton backend)")
def test_cli_train_then_eval_cuda(tmp_path):
    """The GPU path of `freesolo train` / `eval` (backend auto = triton where it runs, bf16 autocast), tiny sizes."""
    from freesolo.cli import main

    ckpt = str(tmp_path / "fs_cuda")
    rc = main(
        ["train", "--out", ckpt, "--attention", "fs", "--train-length", "256", "--steps", "10", "--batch-tokens", "2048"]
        + ["--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--quiet", "--prefetch", "2"]
        + ["--window", "64", "--cell", "16", "--block", "64", "--pool", "4", "--recent", "2"]
    )
    assert rc == 0 and read_task_json(ckpt)["train"]["device"].startswith("cuda")
    out = str(tmp_path / "r.json")
    for attention in ("fs", "fsl", "fsb"):
        assert main(["eval", "--ckpt", ckpt, "--attention", attention, "--task", "all", "--lengths", "256", "2048"]
                    + ["--n", "3", "--diagnose", "1", "--quiet", "--out", out]) == 0
    data = json.load(open(out))
    assert len(data["results"]) == 3 * 2 * len(TASK_NAMES)
    assert {d["variant"] for d in data["diagnosis"]} == {"fs", "fsl", "fsb"}


def test_drills_are_well_formed():
    from freesolo.retrieval.data import ROW_KINDS, copy_sequence, recall_sequence

    rng = np.random.default_rng(5)
    offsets = set()
    for L in (5, 6, 64, 257, 1024):
        tok, m = copy_sequence(L, rng)
        assert tok.shape == m.shape == (L,) and tok[0] == T["<bos>"] and not m[:5].any()
        # every masked token continues a repeat: the pair (previous, current) occurred earlier,
        # at a distance that varies (no fixed offset predicts the repeats)
        for i in np.flatnonzero(m):
            earlier = [j for j in range(1, i - 1) if tok[j] == tok[i - 1] and tok[j + 1] == tok[i]]
            assert earlier, (L, i)
            offsets.add(i - earlier[-1])
    assert len(offsets) > 10
    for L in (64, 200, 1024, 2048):
        tok, m = recall_sequence(L, rng, "noise" if L % 2 else "text")
        assert tok.shape == m.shape == (L,) and tok[0] == T["<bos>"]
        n = int(np.clip(L // 48, 2, 16))
        needles = np.flatnonzero(tok == T["<needle>"])
        queries = np.flatnonzero(tok == T["<query>"])
        assert len(needles) == n and len(queries) == max(1, n // 2) == m.sum() // 4
        assert len(set(tok[needles + 1].tolist())) == n  # distinct keys
        value_of = {int(tok[p + 1]): tok[p + 2 : p + 6].tolist() for p in needles}
        for q in queries:  # each answer (masked) is the value of the asked key's needle
            assert m[q + 2 : q + 6].all() and not m[q : q + 2].any()
            assert tok[q + 2 : q + 6].tolist() == value_of[int(tok[q + 1])]
    mix = Mixture(lengths=(256,), batch_tokens=256 * 32, lm_fraction=0.1, copy_fraction=0.3, recall_fraction=0.3)
    tokens, mask, kinds = make_batch(mix, np.random.default_rng(3), return_kinds=True)
    assert set(kinds.tolist()) == set(ROW_KINDS.values())
    assert not mask[kinds == ROW_KINDS["lm"]].any() and mask[kinds != ROW_KINDS["lm"]].any(1).all()
    # without drills the stream is the one earlier checkpoints were trained on (same RNG use)
    a = make_batch(Mixture(lengths=(256,), batch_tokens=2048), np.random.default_rng(9))
    b = make_batch(Mixture(lengths=(256,), batch_tokens=2048, copy_fraction=0.0), np.random.default_rng(9), return_kinds=True)
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    with pytest.raises(ValueError, match="must be <= 1"):
        Mixture(lm_fraction=0.5, copy_fraction=0.3, recall_fraction=0.3)
    with pytest.raises(ValueError, match="too short for a recall drill"):
        recall_sequence(20, rng)


def test_loss_fn_accuracy_counts_only_the_marked_answers():
    import torch

    from freesolo.retrieval.train import answer_accuracy, loss_fn

    tokens = torch.tensor([[1, 5, 6, 7, 8], [1, 5, 6, 7, 9]])
    mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    logits = torch.full((2, 5, 16), -10.0)
    logits[:, :-1].scatter_(2, tokens[:, 1:, None], 10.0)  # predicts every next token
    logits[1, 3, 9], logits[1, 3, 4] = -10.0, 20.0  # ... except row 1's last answer token
    assert float(answer_accuracy(logits, tokens, mask)) == 0.75
    row0 = torch.tensor([[True], [False]]).expand_as(mask)
    loss, acc = loss_fn(logits, tokens, mask, 0.1, acc_mask=row0)
    assert float(acc) == 1.0 and torch.isfinite(loss)
    assert torch.isnan(answer_accuracy(logits, tokens, torch.zeros_like(mask)))
