"""Suffix decoding (``--speculative-method suffix``): the frequency walk, the bounded index, per-user isolation
and the cross-request gain through the engine. Exactness (greedy equality at batch 1/8/32, preemption,
quantized targets) is in test_spec_equality's matrix, where suffix is one of the methods."""

from __future__ import annotations

import random

import pytest

from specserve import SamplingParams
from specserve.llm import LLM
from specserve.spec_decode.suffix import SuffixIndex, suffix_draft
from tests.helpers import save_tiny_checkpoint


def test_the_most_frequent_continuation_of_the_longest_match_wins():
    ctx = [9, 1, 2, 3]
    occ = [([7, 2, 3, 5, 6], 3), ([1, 2, 3, 4, 4], 3), ([1, 2, 3, 4, 8], 3), ([0, 2, 3, 5, 5], 3)]
    # matches of length 3 (ending "1 2 3") beat those of length 2; among them 4 twice, then 4 vs 8: a tie
    # goes to the most recent occurrence
    assert suffix_draft(ctx, occ, k=5) == [4, 8]
    assert suffix_draft(ctx, occ, k=1) == [4]


def test_draft_length_scales_with_the_match_and_stops_at_a_split():
    seq = [5, 6, 1, 2, 3, 4, 5, 6, 7, 8]
    assert suffix_draft([0, 5, 6], [(seq, 2)], k=8) == [1, 2, 3, 4]  # match 2 -> at most 4 tokens
    split = [([5, 6, 1, 2], 2), ([5, 6, 3, 4], 2), ([5, 6, 7, 4], 2), ([5, 6, 9, 9], 2)]
    assert suffix_draft([5, 6], split, k=4, min_share=0.3) == []  # four ways at once: below 30 % each
    agree = [([5, 6, 1, 2], 2), ([5, 6, 1, 3], 2), ([5, 6, 1, 4], 2), ([5, 6, 1, 5], 2)]
    assert suffix_draft([5, 6], agree, k=4, min_share=0.3) == [1]  # then four ways: below 30 % each


def test_index_is_bounded_and_evicts_oldest_first():
    index = SuffixIndex(max_tokens=100, key_n=2)
    r = random.Random(0)
    for i in range(30):
        index.add("u", [1000 + i, 1000 + i] + [r.randrange(50) for _ in range(18)])
    assert index.num_tokens <= 100 and index.num_evicted == 25
    assert not index.occurrences("u", (1000, 1000))  # the first sequence is gone
    assert index.occurrences("u", (1029, 1029))  # the newest is kept
    assert not index.occurrences("v", (1029, 1029))  # another partition sees nothing


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("suffix"), "llama", seed=11, layers=2)


def _run(llm: LLM, prompt: list[int], user: str | None, n: int = 32) -> tuple[list[int], dict]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, user=user)
    out = llm.generate(None, sp, prompt_token_ids=[prompt])[0]
    return out.outputs[0].token_ids, out.metrics["speculative"]


def test_drafts_come_from_earlier_requests_of_the_same_user_only(tiny):
    llm = LLM(tiny, speculative_method="suffix", num_speculative_tokens=5, speculative_adaptive=False,
              num_blocks=256, block_size=8, dtype="float32", device="cpu")
    r = random.Random(1)
    prompt = [r.randrange(3, 250) for _ in range(24)]
    out_a1, _ = _run(llm, prompt + [7], "alice")
    out_a2, a2 = _run(llm, prompt + [7], "alice")  # the same request again: alice's first output drafts it
    out_b, b = _run(llm, prompt + [7], "bob")
    assert out_a1 == out_a2 == out_b  # greedy output never depends on the drafts
    assert a2["accepted_tokens"] >= 25, a2  # nearly all 31 drafted positions after the first token
    # bob sees none of alice's outputs: his drafts equal those of a user with an empty index
    _, fresh_b = _run(llm, prompt + [7], "dave")
    assert b["draft_tokens"] == fresh_b["draft_tokens"] and b["accepted_tokens"] == fresh_b["accepted_tokens"]
    assert b["accepted_tokens"] < a2["accepted_tokens"] // 2, (b, a2)


def test_suffix_index_respects_its_bound_in_the_engine(tiny):
    llm = LLM(tiny, speculative_method="suffix", num_speculative_tokens=3, suffix_cache_tokens=200,
              num_blocks=256, block_size=8, dtype="float32", device="cpu")
    r = random.Random(2)
    prompts = [[r.randrange(3, 250) for _ in range(30)] for _ in range(12)]
    llm.generate(None, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), prompt_token_ids=prompts)
    # a request joins the index when the worker learns it finished: with the next step
    llm.generate(None, SamplingParams(temperature=0, max_tokens=1), prompt_token_ids=[[5, 6]])
    index = llm.engine.runner.drafter.proposer.index
    assert 0 < index.num_tokens <= 200 and index.num_evicted >= 8  # 12 requests of 50 tokens
