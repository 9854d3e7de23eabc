"""Per-step contracts between scheduler, worker and engine (immutable), and the user-facing outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.spec_decode.state import Source


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """First time the worker sees a request: what it needs for sampling and proposing."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    spec_enabled: bool
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked until min_tokens outputs exist (sample/sampler.py)
    grammar: Any = None  # a compiled grammar (structured outputs; sample/grammar.py)
    stop_ids: tuple[int, ...] = ()  # sampling one ends the request (EOS unless ignore_eos, stop_token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's row in a step: compute ``token_ids`` at positions starting at ``num_computed_tokens``.
    The last ``num_spec_tokens`` of them are drafts to verify."""

    req_id: str
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_spec_tokens: int
    block_ids: tuple[int, ...]
    needs_sample: bool  # the row reaches the end of the request's known tokens
    resumed: bool  # first step after a preemption (draft KV is gone)
    # A draft tree: the parent of each draft (an index among the drafts; -1: the last known token), every
    # parent before its children. None: the drafts are a chain.
    spec_parents: tuple[int, ...] | None = None
    # The logits of this row's prompt positions score the prompt tokens after them (``prompt_logprobs``).
    score_prompt: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    rows: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_req_ids: list[str]  # finished or aborted since the last step: the worker drops their state
    total_tokens: int
    # No request waits and none will arrive (an offline batch draining): what counts is when the last running
    # request finishes, not tokens per step (the speculation controller then plans for the batch's end).
    draining: bool = False
    # The next step will (most likely) carry a prompt's prefill: a prompt chunked over steps continues, or a
    # waiting request fits the batch and the free KV blocks. A draft model's steps would then sit in series
    # before that request's first token (``ModelRunner._propose``: no draft-model drafts for that step).
    prefill_ahead: bool = False

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled: dict[str, list[int]]  # emitted tokens per sampling row (accepted drafts + 1)
    spec_token_ids: dict[str, list[int]]  # drafts proposed for the next step
    logprobs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    spec_parents: dict[str, list[int]] = field(default_factory=dict)  # the drafts that form a tree
    spec_sources: dict[str, Source] = field(default_factory=dict)  # where the drafts verified this step came from
    # Rows with ``score_prompt``: (the prompt index of the first token scored, one entry per scored token:
    # token_id, logprob, rank, top).
    prompt_logprobs: dict[str, tuple[int, list[dict[str, Any]]]] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[str, Any]] | None = None
    # Per token: True when it was a draft token the target accepted, False when the target produced it
    # (a plain step, a recovered token after a rejection, or the bonus token after a full accept).
    spec_accepted: list[bool] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for the first, which nothing
    # predicts): {token_id, logprob, rank, top: [(token_id, logprob), ...]}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
