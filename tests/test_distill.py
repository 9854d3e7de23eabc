"""`specserve distill` on a tiny random target: both draft kinds come out loadable, `--resume` continues the
checkpoint, and speculation with the distilled drafts keeps greedy output exact (batch 1 and 4)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import SamplingParams
from specserve.cli import main
from specserve.config import SpecserveError
from specserve.llm import LLM
from specserve.model.loader import load_checkpoint
from tests.helpers import save_tiny_checkpoint

PROMPTS = ["hello world, this is a test", "The quick brown fox jumps over the lazy dog.",
           "def add(a, b): return a + b", "Once upon a time there was a king", "for i in range(10): print(i)",
           "abc abc abc abc", "Summarize: rain fell all day and the river rose.", "User: Say hi. Assistant:"]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_blocks=256)
FAST = ["--tokens", "240", "--max-tokens", "24", "--batch", "8", "--batch-tokens", "256", "--eval-prompts", "2",
        "--eval-max-tokens", "8", "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = os.environ.get("SPECSERVE_NUM_THREADS")
    os.environ["SPECSERVE_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("SPECSERVE_NUM_THREADS", None)
    else:
        os.environ["SPECSERVE_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = save_tiny_checkpoint(root / "target", "llama", seed=0, layers=2, initializer_range=0.1)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"root": root, "target": target, "prompts": str(prompts)}


def _distill(setup, out: str, *extra: str) -> None:
    argv = ["distill", "--target", setup["target"], "--out", out, "--dataset", setup["prompts"], *FAST, *extra]
    assert main(argv) == 0


def _greedy_equal(target: str, batch: int, **spec) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=20)
    ref = [o.outputs[0].token_ids for o in LLM(target, max_num_seqs=batch, **ENGINE).generate(PROMPTS, sp)]
    llm = LLM(target, num_speculative_tokens=3, speculative_adaptive=False, max_num_seqs=batch, **ENGINE, **spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == ref
    metrics = llm.get_metrics()["speculative"]
    assert metrics["draft_tokens"] > 0, metrics
    return metrics


def test_head_distill_resume_and_exactness(setup):
    out = str(setup["root"] / "head")
    _distill(setup, out, "--kind", "head", "--steps", "3")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["specserve_draft"] == "eagle"
    ck = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ck["step"] == 3 and [h["step"] for h in ck["history"]] == [1, 2, 3]
    report = json.load(open(os.path.join(out, "distill.json")))
    assert [r["k"] for r in report["evaluation"]["by_k"]] == [1, 2, 3, 4, 5]
    assert all(r["exact"] for r in report["evaluation"]["by_k"])

    _distill(setup, out, "--kind", "head", "--steps", "5", "--resume")
    ck2 = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ck2["step"] == 5
    assert [h["step"] for h in ck2["history"]] == [1, 2, 3, 4, 5]
    assert ck2["history"][:3] == ck["history"]  # continued, not restarted
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in ck2["history"])
    for batch in (1, 4):
        _greedy_equal(setup["target"], batch, speculative_method="eagle", speculative_model=out)


def test_model_distill_is_a_normal_hf_draft(setup, tmp_path):
    out = str(setup["root"] / "model")
    _distill(setup, out, "--kind", "model", "--layers", "1", "--steps", "2")
    ck = load_checkpoint(out)
    target = load_checkpoint(setup["target"])
    assert ck.arch.num_layers == 1 and ck.arch.vocab_size == target.arch.vocab_size
    assert torch.equal(ck.state_dict["model.embed_tokens.weight"].float(),
                       target.state_dict["model.embed_tokens.weight"].half().float())  # the target's, copied
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    for batch in (1, 4):
        _greedy_equal(setup["target"], batch, speculative_model=out)
    other = save_tiny_checkpoint(tmp_path / "other", "llama", seed=1, layers=1, vocab=300)
    with pytest.raises(SpecserveError, match="vocabulary of 260 tokens but the target has 300"):
        LLM(other, speculative_model=out, num_speculative_tokens=2, **ENGINE)
