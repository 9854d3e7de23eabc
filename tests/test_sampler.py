"""Logits processing: masks, penalties on hand-made numbers, draft-aware counts, batching, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.sample.sampler import (
    RequestSamplingState,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    probs_from_logits,
    process_logits,
    row_argmax,
)
from specserve.sampling_params import SamplingParams

INF = float("inf")


def state(prompt: list[int] | None = None, output: list[int] | None = None, **kw: object) -> RequestSamplingState:
    return RequestSamplingState(SamplingParams(**kw), list(prompt or []), list(output or []), None)  # type: ignore[arg-type]


def one(logits: list[float], st: RequestSamplingState, drafts: list[int] | None = None) -> torch.Tensor:
    """Process rows for a single request (rows = len(drafts) + 1)."""
    d = drafts or []
    x = torch.tensor(logits, dtype=torch.float32).reshape(len(d) + 1, -1)
    return process_logits(x, [st], [len(d) + 1], [d])


def test_temperature_only_is_plain_division() -> None:
    out = one([1.0, 2.0, -3.0, 0.5], state(temperature=0.5))
    assert torch.allclose(out, torch.tensor([[2.0, 4.0, -6.0, 1.0]]))


def test_greedy_ignores_temperature_topk_topp_minp() -> None:
    row = [1.0, 2.0, -3.0, 0.5]
    out = one(row, state(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9))
    assert torch.equal(out, torch.tensor([row]))


def test_top_k_mask() -> None:
    out = one([1.0, 4.0, 3.0, -2.0, 0.0], state(top_k=2))
    assert torch.equal(out, torch.tensor([[-INF, 4.0, 3.0, -INF, -INF]]))
    assert torch.equal(one([1.0, 4.0], state(top_k=5)), torch.tensor([[1.0, 4.0]]))  # k >= V: off
    ties = one([1.0, 3.0, 3.0, 0.0], state(top_k=2))  # ties at the k-th value are kept
    assert torch.equal(ties, torch.tensor([[-INF, 3.0, 3.0, -INF]]))


def test_top_p_mask() -> None:
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15])).tolist()
    kept = one(logits, state(top_p=0.85)).isfinite()[0].tolist()
    assert kept == [True, False, True, True]  # 0.5 + 0.3 < 0.85 → need the 0.15 token too
    kept = one(logits, state(top_p=0.75)).isfinite()[0].tolist()
    assert kept == [True, False, True, False]  # 0.5 + 0.3 >= 0.75
    kept = one(logits, state(top_p=0.01)).isfinite()[0].tolist()
    assert kept == [True, False, False, False]  # the top token always survives
    out = one(logits, state(top_p=0.75))
    assert torch.allclose(probs_from_logits(out), torch.tensor([[0.625, 0.0, 0.375, 0.0]]))


def test_top_k_then_top_p_on_renormalised_mass() -> None:
    # After top-3 the mass is [0.5, 0.3, 0.15] / 0.95; top_p = 0.84: 0.8 / 0.95 = 0.842 >= 0.84 → keep 2.
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15])).tolist()
    kept = one(logits, state(top_k=3, top_p=0.84)).isfinite()[0].tolist()
    assert kept == [True, False, True, False]


def test_min_p_mask() -> None:
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15])).tolist()
    kept = one(logits, state(min_p=0.2)).isfinite()[0].tolist()  # threshold 0.1
    assert kept == [True, False, True, True]
    kept = one(logits, state(min_p=0.61)).isfinite()[0].tolist()  # threshold 0.305
    assert kept == [True, False, False, False]


def test_mask_helpers_directly() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(x, torch.tensor([1, 4]), torch.tensor([1.0, 1.0]))
    assert out.isfinite().tolist() == [[False, False, False, True], [True, True, True, True]]
    assert torch.equal(apply_min_p(x, torch.tensor([0.0, 0.0])), x)


def test_repetition_frequency_presence_math() -> None:
    # prompt {1}, output [2, 2]; rp = 2, freq = 0.5, presence = 0.25.
    st = state(prompt=[1], output=[2, 2], temperature=0.0, repetition_penalty=2.0,
               frequency_penalty=0.5, presence_penalty=0.25)
    out = one([2.0, 1.0, -1.0, 0.5], st)
    # token 0: unseen → 2.0; token 1 (prompt, > 0): 1 / 2 = 0.5, no freq/presence (prompt only);
    # token 2 (output x2, < 0): -1 * 2 = -2, - 0.5 * 2 - 0.25 = -3.25; token 3 unseen → 0.5.
    assert torch.allclose(out, torch.tensor([[2.0, 0.5, -3.25, 0.5]]))


def test_penalties_see_drafts_as_generated() -> None:
    st = state(prompt=[1], output=[2, 2], temperature=0.0, repetition_penalty=2.0,
               frequency_penalty=0.5, presence_penalty=0.25)
    row = [2.0, 1.0, -1.0, 0.5]
    out = one(row * 3, st, drafts=[3, 3])
    assert torch.allclose(out[0], torch.tensor([2.0, 0.5, -3.25, 0.5]))  # no drafts seen yet
    # row 1 sees draft 3 once: 0.5 / 2 = 0.25, - 0.5 - 0.25 = -0.5
    assert torch.allclose(out[1], torch.tensor([2.0, 0.5, -3.25, -0.5]))
    # row 2 sees draft 3 twice: 0.25 - 1.0 - 0.25 = -1.0
    assert torch.allclose(out[2], torch.tensor([2.0, 0.5, -3.25, -1.0]))


def test_penalties_then_temperature_and_topk() -> None:
    st = state(output=[0], frequency_penalty=1.0, temperature=2.0, top_k=2)
    out = one([3.0, 2.5, 1.0, 0.0], st)  # token 0: 3 - 1 = 2 → / 2 = 1.0; token 1: 1.25; token 2: 0.5 (drop)
    assert torch.allclose(out, torch.tensor([[1.0, 1.25, -INF, -INF]]))


def test_batch_equals_one_by_one_and_input_untouched() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    states = [
        state(prompt=[1, 2, 3], output=[4, 4, 5], temperature=0.7, top_k=10, repetition_penalty=1.3),
        state(temperature=0.0, frequency_penalty=0.4),
        state(output=[7], temperature=1.1, top_p=0.9, min_p=0.05, presence_penalty=-0.5),
        state(temperature=0.9),
        state(prompt=[9], output=[9, 9], temperature=0.0, repetition_penalty=0.8),
    ]
    drafts = [[4, 6], [1], [], [3, 3, 3], [9, 2]]
    counts = [len(d) + 1 for d in drafts]
    logits = torch.randn(sum(counts), vocab, generator=gen)
    before = logits.clone()
    batched = process_logits(logits, states, counts, drafts)
    assert torch.equal(logits, before)
    assert batched.dtype == torch.float32 and batched.shape == logits.shape
    start = 0
    for st, d, c in zip(states, drafts, counts, strict=True):
        alone = process_logits(logits[start:start + c], [st], [c], [d])
        assert torch.allclose(batched[start:start + c], alone, equal_nan=True)
        start += c


def test_no_penalty_fast_path_keeps_values() -> None:
    x = torch.randn(3, 10, dtype=torch.float64)
    out = process_logits(x, [state(), state(temperature=0.0)], [2, 1], [[1], []])
    assert out.dtype == torch.float32 and torch.equal(out, x.float())


def test_inconsistent_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="inconsistent batch"):
        process_logits(torch.zeros(3, 4), [state()], [2], [[1]])


def test_compute_logprobs() -> None:
    raw = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    lp = compute_logprobs(raw, torch.tensor([2, 2]), top_n=2)
    ref = torch.log_softmax(raw, dim=-1)
    assert torch.allclose(lp.token_logprobs, ref[[0, 1], [2, 2]])
    assert lp.token_ranks.tolist() == [2, 1]
    assert lp.top_ids.tolist() == [[1, 2], [2, 3]]
    assert torch.allclose(lp.top_logprobs, ref.gather(1, lp.top_ids))
    assert math.isclose(float(lp.top_logprobs[0, 0]), float(ref[0, 1]))
    empty = compute_logprobs(raw, torch.tensor([0, 1]), top_n=0)
    assert empty.top_ids.shape == (2, 0) and empty.top_logprobs.shape == (2, 0)


def test_state_create_seeds_generator() -> None:
    a = RequestSamplingState.create(SamplingParams(seed=5), [1, 2])
    b = RequestSamplingState.create(SamplingParams(seed=5), [1, 2])
    assert a.generator is not None and b.generator is not None
    assert torch.equal(torch.rand(4, generator=a.generator), torch.rand(4, generator=b.generator))
    assert RequestSamplingState.create(SamplingParams(), []).generator is None


def test_row_argmax_is_torch_argmax():
    """The fast CPU argmax (numpy's) picks what ``torch.argmax`` picks: the first of tied maxima, index 0 for
    an all -inf row, the same on strided views; other dtypes go through torch."""
    torch.manual_seed(0)
    x = torch.randn(6, 4099)
    x[1, 7] = x[1, 4000] = x[1].max() + 1.0  # a tie: the first index wins
    x[2] = -INF
    x[3] = 0.0
    x[4, 4098] = 1e30
    for t in (x, x[:, ::3], x[::2], x.to(torch.bfloat16), x[:1]):
        assert row_argmax(t) == t.argmax(dim=-1).tolist()


def test_greedy_rows_without_processing_are_not_copied():
    """Greedy rows with nothing to apply come back as they are (no [N, V] copy per step); anything to apply
    works on a copy."""
    logits = torch.randn(3, 50)
    greedy = RequestSamplingState.create(SamplingParams(temperature=0.0), [1, 2])
    assert process_logits(logits, [greedy], [3], [[4, 5]]) is logits
    biased = RequestSamplingState.create(SamplingParams(temperature=0.0, logit_bias={3: 5.0}), [1, 2])
    out = process_logits(logits, [biased], [3], [[4, 5]])
    assert out is not logits and torch.equal(out[:, 3], logits[:, 3] + 5.0)
