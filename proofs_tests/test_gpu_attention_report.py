"""`benchmarks/gpu_attention.py`'s report (CPU, no timing): issue 10's bars as same-run ratios, and the merge
of several runs' result files (one GPU) into one payload."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_attention", ROOT / "benchmarks" / "gpu_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rec(provider, T, ms, peak=1.0, status="ok", mode="fwd", shape="H16-D64"):
    return dict(shape=shape, Hq=16, Hkv=16, D=64, T=T, provider=provider, mode=mode, ms=ms, peak_gib=peak, status=status)


def _payload(results, gpu="GPU X"):
    return {"env": {"gpu": gpu, "torch": "t", "triton": "tr"}, "dtype": "bfloat16", "shapes": {"H16-D64": {}}, "results": results}


def test_issue10_bars_are_same_run_ratios(report):
    results = [
        _rec("triton_fsl", 65536, 1.0), _rec("flex_swa512", 65536, 0.5), _rec("sdpa_causal", 65536, 19.0),
        _rec("triton_fsl", 4096, 0.2), _rec("sdpa_causal", 4096, 0.1), _rec("fla_nsa", 65536, 3.0),
        _rec("triton_fs", 65536, 4.0), _rec("flex_fsl", 65536, 12.0), _rec("fla_nsa", 16384, 0.1),
        _rec("triton_fsl", 16384, 0.5), _rec("triton_fsl", 131072, 2.0, peak=1.2), _rec("sdpa_causal", 131072, 60.0, peak=1.0),
        _rec("triton_fs", 4096, 9.0, status="oom"),
    ]  # fmt: skip
    bars = report.issue10_bars(results)
    assert bars["triton_fsl / flex_swa512 fwd 64k"] == {"ratio": 2.0, "bar": "<= 3", "met": True}
    assert bars["sdpa_causal / triton_fsl fwd 64k"]["ratio"] == 19.0 and bars["sdpa_causal / triton_fsl fwd 64k"]["met"] is False
    assert bars["triton_fsl / sdpa_causal fwd 4k"]["met"] is False
    assert bars["triton_fs / sdpa_causal fwd 64k"]["ratio"] == pytest.approx(4 / 19) and bars["triton_fs / sdpa_causal fwd 64k"]["met"]
    assert bars["fla_nsa / triton_fsl fwd 64k"]["met"] is True and bars["fla_nsa / triton_fsl fwd 16k"]["met"] is False
    assert bars["fla_nsa / triton_fsl fwd 128k"] == {"ratio": None, "bar": "> 1", "met": None}  # not measured
    assert bars["flex_fsl / triton_fsl fwd 64k"]["met"] is True
    assert bars["peak triton_fsl / sdpa_causal fwd 128k"]["ratio"] == pytest.approx(1.2)


def test_merge_joins_runs_of_one_gpu_and_refuses_the_rest(report, tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    c = tmp_path / "c.json"
    a.write_text(json.dumps(_payload([_rec("triton_fsl", 65536, 1.0), _rec("sdpa_causal", 65536, 19.0)])))
    b.write_text(json.dumps(_payload([_rec("flex_swa512", 65536, 0.5), _rec("triton_fsl", 1048576, 20.0)])))
    merged = report.merge([str(a), str(b)])
    assert len(merged["results"]) == 4 and merged["lengths"] == [65536, 1048576]
    assert merged["issue10_bars"]["H16-D64"]["triton_fsl / flex_swa512 fwd 64k"]["ratio"] == 2.0
    assert merged["merged_from"] == ["a.json", "b.json"]
    c.write_text(json.dumps(_payload([_rec("triton_fsl", 65536, 1.1)])))
    with pytest.raises(SystemExit, match="timed by an earlier file"):
        report.merge([str(a), str(c)])
    c.write_text(json.dumps(_payload([_rec("fla_nsa", 65536, 3.0)], gpu="GPU Y")))
    with pytest.raises(SystemExit, match="gpu"):
        report.merge([str(a), str(c)])


def test_merge_supersede_replaces_named_re_measures_and_keeps_the_old(report, tmp_path):
    """--supersede: a re-measure's records replace the merged files' records of the same cases (kept in
    "superseded" with the replacing file); other cases stay; the bars use the re-measured figures."""
    a = tmp_path / "a.json"
    r = tmp_path / "r.json"
    a.write_text(json.dumps(_payload([_rec("triton_fsl", 65536, 1.0), _rec("sdpa_causal", 65536, 19.0),
                                      _rec("flex_swa512", 65536, 0.5)])))  # fmt: skip
    r.write_text(json.dumps(_payload([_rec("triton_fsl", 65536, 1.5)])))
    merged = report.merge([str(a)], [str(r)])
    ms = {(x["provider"], x["T"]): x["ms"] for x in merged["results"]}
    assert ms == {("triton_fsl", 65536): 1.5, ("sdpa_causal", 65536): 19.0, ("flex_swa512", 65536): 0.5}
    assert [(x["provider"], x["ms"], x["superseded_by"]) for x in merged["superseded"]] == [("triton_fsl", 1.0, "r.json")]
    assert merged["issue10_bars"]["H16-D64"]["triton_fsl / flex_swa512 fwd 64k"]["ratio"] == 3.0
    assert merged["merged_from"] == ["a.json", "r.json"]
    with pytest.raises(SystemExit, match="re-measured by an earlier --supersede file"):
        report.merge([str(a)], [str(r), str(r)])
    r.write_text(json.dumps(_payload([_rec("triton_fsl", 65536, 1.5)], gpu="GPU Y")))
    with pytest.raises(SystemExit, match="gpu"):
        report.merge([str(a)], [str(r)])
