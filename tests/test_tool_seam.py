"""bench, distill and the benchmarks reach speculation's controller, its drafts and the target model through
``LLM`` methods made for them (``spec_controller``, ``reset_spec_controller``, ``target_model``,
``set_feature_layers``, ``observe_features``, ``observe_drafts``, ``graph_buckets``), not through the engine's
internals."""

from __future__ import annotations

import ast
import pathlib

import pytest

from specserve import SamplingParams
from specserve.llm import LLM
from tests.helpers import save_tiny_checkpoint

PKG = pathlib.Path(__file__).parents[1] / "specserve"
BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
TOOLS = [PKG / "bench" / "offline.py", PKG / "distill" / "evaluate.py", PKG / "distill" / "command.py",
         PKG / "distill" / "data.py"] + [BENCHMARKS / f"{name}.py" for name in (
             "fixed_costs", "gpu_check", "quant_accuracy", "tensor_parallel", "grammar_overhead")]


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_tools_do_not_reach_into_the_runner(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    reached = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("runner", "drafter")]
    assert not reached, f"{path.name} reaches the engine's runner / drafter at lines {reached}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    return LLM(path, speculative_method="ngram", num_speculative_tokens=4, max_num_seqs=2, dtype="float32",
               num_blocks=64)


def test_spec_controller_and_reset(llm):
    before = llm.spec_controller()
    assert before is not None and before.max_k == 4
    seen: list[str] = []
    before.cost_observers.append(lambda kind, n, s: seen.append(kind))
    llm.reset_spec_controller(adaptive=False, max_k=2)
    after = llm.spec_controller()
    assert after is not before and after.max_k == 2 and not after.adaptive
    llm.generate(["ab ab ab ab ab ab"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert "target" in seen  # the observers moved to the fresh controller
    llm.reset_spec_controller()
    assert llm.spec_controller().max_k == 4 and not llm.spec_controller().adaptive


def test_target_model_and_features(llm):
    model = llm.target_model()
    assert model.arch.num_layers >= 1
    got: list[tuple[str, int]] = []
    llm.set_feature_layers((1,))
    try:
        with llm.observe_features(lambda req_id, pos, h, owned: got.append((req_id, h.shape[-1]))):
            llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), speculative=False)
    finally:
        llm.set_feature_layers(None)
    assert got and all(width == model.arch.hidden_size for _, width in got)


def test_observe_drafts(llm):
    from specserve.spec_decode.state import Source

    llm.reset_spec_controller(adaptive=False)  # a fixed k: drafts every step
    seen: list[tuple[Source | None, int]] = []
    with llm.observe_drafts(lambda drafts: seen.extend((s, len(d.token_ids)) for s, d in drafts)):
        llm.generate(["ab ab ab ab ab ab ab ab"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert seen and all(s is not None and n >= 1 for s, n in seen)
    n = len(seen)
    llm.generate(["ab ab ab ab ab ab ab ab"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) == n  # no longer observed after the block
    assert llm.graph_buckets() == []  # no graphs on the CPU


def test_no_controller_without_speculation(tmp_path):
    llm = LLM(save_tiny_checkpoint(tmp_path), dtype="float32", num_blocks=16)
    assert llm.spec_controller() is None
    llm.reset_spec_controller(adaptive=False)  # nothing to reset: no error
    with llm.observe_drafts(lambda drafts: None):  # nothing to observe: no error
        pass
