"""SamplingParams: defaults, normalisation, every validation error, context check, helpers."""

from __future__ import annotations

import re

import pytest

from specserve.sampling_params import SamplingParams


def test_defaults_match_vllm_names() -> None:
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (1, 1.0, 1.0, -1, 0.0, None)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.logprobs is None and not sp.ignore_eos and not sp.include_stop_str_in_output
    assert sp.skip_special_tokens
    assert not sp.greedy and not sp.uses_penalties and not sp.top_k_enabled


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]


def test_greedy_and_flags() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5).greedy  # top-k/p ignored when greedy
    assert not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(top_k=0).top_k_enabled is False
    assert SamplingParams(top_k=3).top_k_enabled
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be in [1, 16], got 0"),
        ({"n": 17}, "n must be in [1, 16], got 17"),
        ({"n": 1.5}, "n must be an integer, got 1.5"),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 (disable), 0 (disable) or at least 1, got -2"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"seed": "x"}, "seed must be an integer, got 'x'"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than 0, got 0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be greater than 0, got -1.0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer, got 2.0"),
        ({"min_tokens": -1}, "min_tokens must be non-negative, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be less than or equal to max_tokens=10, got 20"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"stop": ["x"] * 65}, "stop may contain at most 64 strings, got 65"),
        ({"stop": ["ok", ""]}, "stop must not contain an empty string"),
        ({"stop": ["a" * 257]}, "stop strings must be at most 256 characters, got one of 257"),
        ({"stop": [3]}, "stop must contain strings, got 3"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers, got -1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be non-negative integers, got 'a'"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 16}, {"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": 1},
        {"min_p": 0.0}, {"min_p": 1.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3}, {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16},
        {"logprobs": 0}, {"logprobs": 20}, {"stop": ["x"] * 64}, {"stop": ["a" * 256]}, {"seed": 0},
        {"max_tokens": None, "min_tokens": 100},
    ],
)
def test_boundaries_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_check_context() -> None:
    assert SamplingParams(max_tokens=10).check_context(prompt_len=20, max_model_len=30) == 10
    assert SamplingParams(max_tokens=None).check_context(prompt_len=20, max_model_len=30) == 10
    with pytest.raises(ValueError, match=re.escape(
            "prompt (25 tokens) + max_tokens (10) exceeds the model's context length (30)")):
        SamplingParams(max_tokens=10).check_context(prompt_len=25, max_model_len=30)
    with pytest.raises(ValueError, match=re.escape(
            "prompt (30 tokens) + max_tokens (at least 1) exceeds the model's context length (30)")):
        SamplingParams(max_tokens=None).check_context(prompt_len=30, max_model_len=30)


def test_clone_and_children() -> None:
    sp = SamplingParams(n=3, seed=7, stop=["a"], temperature=0.5)
    c = sp.clone()
    assert c == sp and c is not sp and c.stop is not sp.stop
    assert sp.with_seed(11).seed == 11 and sp.seed == 7
    kids = [sp.for_child(i) for i in range(3)]
    assert [k.seed for k in kids] == [7, 8, 9] and all(k.n == 1 and k.temperature == 0.5 for k in kids)
    kids[0].stop.append("b")
    assert sp.stop == ["a"]  # children do not share mutable lists with the parent
    assert SamplingParams(n=2).for_child(1).seed is None
    with pytest.raises(ValueError, match="seed must be an integer"):
        sp.with_seed("bad")  # type: ignore[arg-type]
