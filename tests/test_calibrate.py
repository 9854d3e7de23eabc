"""Start-up calibration (worker/calibrate.py): timed target and draft steps on placeholder tokens seed the
speculation controller's cost tables before the first request, and change no output."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams
from specserve.llm import LLM
from specserve.model.checkpoint.loader import load_checkpoint
from specserve.platform import detect
from specserve.spec_decode.controller import SpecController
from specserve.worker.calibrate import CATCH_UP, MAX_TOKENS, calibrate, draft_batches, target_counts
from specserve.worker.model_runner import build_model
from tests.helpers import save_tiny_checkpoint, save_tiny_eagle_head


def test_counts_start_with_one_request_and_stay_within_bounds():
    counts = target_counts(5, 256)
    assert counts[:6] == [1, 2, 3, 4, 5, 6]  # a decode and every verification of one request first
    assert {12, 24, 48} <= set(counts) and max(counts) <= MAX_TOKENS and len(set(counts)) == len(counts)
    assert target_counts(3, 1) == [1, 2, 3, 4]  # one sequence: no batches
    assert draft_batches(256) == [1, 2, 4, 8, 16] and draft_batches(3) == [1, 2]


class Recorder:
    """A step that records its calls' shapes."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[int], list[tuple[int, ...]]]] = []

    def __call__(self, toks, starts, blocks):
        self.calls.append((toks, starts, blocks))


def test_placeholder_rows_fit_their_blocks_and_the_vocabulary():
    target, draft = Recorder(), Recorder()
    cal = calibrate(target, draft, max_k=4, max_seqs=8, num_blocks=40, block_size=16, max_model_len=300,
                    vocab_size=100, budget_s=60.0)
    counts = target_counts(4, 8)
    # every count twice, as the budget allows: one request's decode and verifications first, both times
    assert [n for n, _ in cal.target] == counts[:5] * 2 + counts[5:] * 2
    assert [b for b, _ in cal.draft] == [1, 2, 4, 8] * 2
    assert [n for n, _ in cal.catch_up] == [n for n in CATCH_UP if n <= 300]
    assert all(s >= 0 for _, s in cal.target + cal.draft + cal.catch_up)
    for toks, starts, blocks in target.calls + draft.calls:
        assert len(toks) == len(starts) == len(blocks)
        for t, s, b in zip(toks, starts, blocks):
            assert all(0 <= x < 100 for x in t)
            assert len(b) * 16 >= s + len(t) and all(0 <= x < 40 for x in b)  # every position has a slot
            assert s + len(t) <= 300
    # a target row is a decode or a verification of at most k + 1 tokens; the draft's are decodes or catch-ups
    assert all(len(t) <= 5 for toks, _, _ in target.calls for t in toks)
    assert all(len(toks) == 1 or max(map(len, toks)) == 1 for toks, _, _ in draft.calls)
    # one warm-up call per step kind, then one call per sample
    assert len(target.calls) == 1 + len(cal.target)
    assert len(draft.calls) == 1 + len(cal.draft) + len(cal.catch_up)


def test_budget_zero_takes_no_samples_and_a_capture_is_repeated():
    target = Recorder()
    assert not calibrate(target, None, max_k=3, max_seqs=4, num_blocks=8, block_size=16, max_model_len=64,
                         vocab_size=50, budget_s=0.0).target
    captured = iter([0, 1, 1, 1] + [1] * 200)  # the first timed call captures a graph: it is run again
    target = Recorder()
    cal = calibrate(target, None, max_k=1, max_seqs=1, num_blocks=8, block_size=16, max_model_len=64,
                    vocab_size=50, budget_s=60.0, captures=lambda: next(captured))
    assert [n for n, _ in cal.target] == [1, 2, 1, 2]
    assert len(target.calls) == 1 + 1 + 4  # the warm-up, the capturing call, then the four samples


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cal")
    target = save_tiny_checkpoint(root / "target")
    draft = save_tiny_checkpoint(root / "draft", seed=1)
    model = build_model(load_checkpoint(target), detect("cpu"), torch.float32, 1024)
    head = save_tiny_eagle_head(model, str(root / "head"), torch.Generator().manual_seed(0))
    return target, draft, head


@pytest.mark.parametrize("method", ["draft", "eagle", "layer_skip", "ngram"])
def test_the_engine_starts_with_measured_costs(paths, method):
    target, draft, head = paths
    extra = {"draft": dict(speculative_model=draft), "eagle": dict(speculative_model=head),
             "layer_skip": dict(speculative_method="layer_skip"), "ngram": dict(speculative_method="ngram")}[method]
    llm = LLM(target, num_speculative_tokens=3, max_num_seqs=4, dtype="float32", num_blocks=96, **extra)
    drafter = llm.engine.runner.drafter
    controller: SpecController = drafter.controller
    assert controller.target_cost.distinct() >= 4
    assert (controller.draft_cost.distinct() > 0) == (method != "ngram")
    # a reset keeps the calibration (a fresh controller is not a cold one)
    fresh = drafter.reset_controller()
    assert fresh is not controller and fresh.target_cost.distinct() == controller.target_cost.distinct()
    llm.close()


def test_calibration_changes_no_output(paths):
    """The placeholder KV in blocks the pool later hands out is written over before it is read: greedy
    outputs with calibration equal those without, and equal speculation off."""
    target, draft, _ = paths
    prompts = ["ab ab ab ab ab ab ab", "hello world, hello", "0123456789"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for seconds in (5.0, 0.0):
        llm = LLM(target, speculative_model=draft, num_speculative_tokens=3, max_num_seqs=4, dtype="float32",
                  num_blocks=48, speculative_calibration_seconds=seconds)
        assert (llm.engine.runner.drafter.calibration is not None) == (seconds > 0)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, speculative=False)])
        llm.close()
    assert all(o == outs[0] for o in outs)


def test_without_costs_one_request_probes():
    """No calibration (tensor parallel, or 0 seconds): after a step without drafts the request with the least
    to catch up on drafts max_k, and the others none."""
    c = SpecController(4)
    assert c.choose_ks(["a", "b", "c"], backlog=[10.0, 2.0, 5.0]) == [0, 0, 0]
    assert c.choose_ks(["a", "b", "c"], backlog=[10.0, 2.0, 5.0]) == [0, 4, 0]
    assert c.choose_ks(["a", "b", "c"], backlog=[10.0, 2.0, 5.0]) == [0, 0, 0]
