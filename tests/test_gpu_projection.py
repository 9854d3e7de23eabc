"""benchmarks/gpu_projection.py (issue 43, point 6): the projection arithmetic on hand-computed inputs, the
refusal to project from the placeholder acceptance file, and a CPU smoke of the measuring code (tiny shapes,
the graph path simulated with the rerun capture backend)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest


def _load_script():  # noqa: ANN202 - benchmarks/ is not a package; works under `pytest` and `python -m pytest`
    name = "_bench_gpu_projection"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                            "gpu_projection.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules[name]


gp = _load_script()


def test_expected_tokens_and_speedup_by_hand():
    acc = [0.8, 0.6, 0.3]
    assert gp.expected_tokens(acc, 1) == pytest.approx(1.8)
    assert gp.expected_tokens(acc, 3) == pytest.approx(2.7)
    # E(2) = 1 + 0.8 + 0.6 = 2.4 tokens per pass; a pass costs 12 + 2 * 1 = 14 ms against 10 ms per plain token
    assert gp.projected_speedup(acc, 2, t_decode=10.0, t_verify=12.0, t_draft=1.0) == pytest.approx(24 / 14)
    with pytest.raises(ValueError, match="k = 4"):
        gp.expected_tokens(acc, 4)


def _costs() -> dict:
    """Hand-made step costs: one format, batches 1 and 8, k_max 2."""
    def steps(ms: dict) -> dict:
        return {b: {q: {"wall_ms": v} for q, v in row.items()} for b, row in ms.items()}

    fmt = {"dtype": "bfloat16", "graphs": "test",
           "target": steps({"1": {"1": 10.0, "2": 11.0, "3": 12.0}, "8": {"1": 20.0, "2": 30.0, "3": 40.0}}),
           "target_prenorm": steps({"1": {"1": 10.5, "2": 11.5, "3": 12.5}, "8": {"1": 21.0, "2": 31.0, "3": 41.0}}),
           "draft": {"1": {"wall_ms": 2.0}, "8": {"wall_ms": 4.0}},
           "head": {"1": {"wall_ms": 0.5}, "8": {"wall_ms": 1.0}},
           "head_first": {"1": {"wall_ms": 0.6}, "8": {"wall_ms": 1.2}}}
    return {"device": "test", "platform": {"platform": "cpu"}, "context": 512, "batches": [1, 8], "k_max": 2,
            "formats": {"none": fmt}}


def test_project_combines_costs_and_acceptance():
    proj = gp.project(_costs(), {"draft_model": [0.8, 0.6], "eagle_head": [0.5]})["none"]
    # draft model, k = 2, B = 1: 2.4 * 10 / (12 + 2 * 2) = 1.5; B = 8: 2.4 * 20 / (40 + 2 * 4) = 1.0
    assert proj["draft_model"]["2"] == {"1": 1.5, "8": 1.0}
    # k = 1, B = 8: 1.8 * 20 / (30 + 4) = 1.0588
    assert proj["draft_model"]["1"]["8"] == pytest.approx(1.059)
    # the head verifies with its features returned (target_prenorm); only k = 1 has acceptance given
    assert proj["eagle_head"] == {"1": {"1": round(1.5 * 10 / (11.5 + 0.5), 3), "8": round(1.5 * 20 / 32, 3)}}
    assert gp.project(_costs(), {"eagle_head": [0.5, 0.5]}, basis="device_ms")["none"]["eagle_head"] == \
        {"1": {}, "2": {}}  # no device figures on a CPU: nothing projected, nothing invented


def test_shipped_acceptance_is_measured():
    acc = gp.load_acceptance(gp.DEFAULT_ACCEPTANCE)
    assert set(acc) == {"draft_model", "eagle_head"} and all(len(v) == 5 for v in acc.values())


def test_placeholder_acceptance_is_refused(tmp_path, capsys):
    placeholder = tmp_path / "placeholder.json"
    placeholder.write_text(json.dumps({"_status": "PLACEHOLDER", "configurations": {
        name: {"acceptance_per_position": [None] * 5} for name in ("draft_model", "eagle_head")}}))
    with pytest.raises(gp.AcceptanceMissing, match="draft_model, eagle_head is null"):
        gp.load_acceptance(str(placeholder))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"costs": _costs()}))
    out = tmp_path / "out.json"
    assert gp.main(["--costs", str(costs), "--acceptance", str(placeholder), "--out", str(out)]) == 2
    doc = json.loads(out.read_text())
    assert doc["projection"] is None and "placeholder" in doc["refused"]
    assert "projection refused" in capsys.readouterr().err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"configurations": {"draft_model": {"acceptance_per_position": [0.9, None]}}}))
    with pytest.raises(gp.AcceptanceMissing):
        gp.load_acceptance(str(partial))


@pytest.mark.parametrize("values,match", [([0.5, 0.7], "cannot grow"), ([1.2], r"\[0, 1\]")])
def test_malformed_acceptance(tmp_path, values, match):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"configurations": {"draft_model": {"acceptance_per_position": values}}}))
    with pytest.raises(ValueError, match=match):
        gp.load_acceptance(str(f))


def test_cpu_smoke_measures_and_projects(tmp_path, monkeypatch, capsys):
    """The measuring code end to end on CPU with tiny shapes: target at q = 1..k+1, draft model and head steps,
    bf16 and int8 (the CPU kernels), graphs simulated (rerun capture); then a projection from filled values."""
    from specserve.worker.graphs import CAPTURE_ENV

    monkeypatch.setenv(CAPTURE_ENV, "rerun")
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"configurations": {"draft_model": {"acceptance_per_position": [0.8, 0.6, 0.5]},
                                                  "eagle_head": {"acceptance_per_position": [0.7, 0.5, 0.4]}}}))
    out = tmp_path / "res"
    assert gp.main(["--device", "cpu", "--small", "--quantizations", "none,int8", "--batches", "1,2",
                    "--max-k", "3", "--context", "40", "--iters", "1", "--warmup", "0",
                    "--acceptance", str(acc), "--out", str(out)]) == 0
    doc = json.loads((out / "gpu_projection.json").read_text())
    costs = doc["costs"]
    assert costs["shapes"]["target"]["num_layers"] == 2 and costs["batches"] == [1, 2]
    for fmt in ("none", "int8"):
        m = costs["formats"][fmt]
        assert m["graph_captures"] == 2 * 4 * 2 + 2  # (B, q, prenorm) target graphs + the draft's two
        for kind in ("target", "target_prenorm"):
            assert all(m[kind][b][str(q)]["wall_ms"] > 0 for b in ("1", "2") for q in range(1, 5))
        assert all(m[kind][b]["wall_ms"] > 0 for kind in ("draft", "head", "head_first") for b in ("1", "2"))
    proj = doc["projection"]["speedup"]
    assert set(proj) == {"none", "int8"}
    for fmt in proj:
        for name in ("draft_model", "eagle_head"):
            assert set(proj[fmt][name]) == {"1", "2", "3"}
            assert all(v > 0 for row in proj[fmt][name].values() for v in row.values())
    # the projection is recomputable from the written costs alone
    assert gp.project(costs, doc["acceptance"]) == proj
    printed = capsys.readouterr().out
    assert "projected speedup" in printed and "not a measurement" in printed
