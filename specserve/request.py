"""Request: the single mutable per-request state, owned by the scheduler."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.spec_decode.state import Source


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True)
class SpecStats:
    """Speculation counters (vLLM names): drafts = verification passes with >= 1 draft token. The one type
    that records, sums and reports them (per request, per engine, per API response, per benchmark run);
    ``as_dict`` keys are the field names plus the derived rates."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        per = self.accepted_per_position
        per.extend([0] * (len(other.accepted_per_position) - len(per)))
        for i, n in enumerate(other.accepted_per_position):
            per[i] += n

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecStats:
        """The counters of an ``as_dict`` (e.g. a ``RequestOutput.metrics["speculative"]``); missing: 0."""
        return cls(int(d.get("num_drafts", 0)), int(d.get("draft_tokens", 0)), int(d.get("accepted_tokens", 0)),
                   list(d.get("accepted_per_position") or []))

    @classmethod
    def total(cls, dicts: Iterable[dict[str, Any]]) -> SpecStats:
        out = cls()
        for d in dicts:
            out.merge(cls.from_dict(d))
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # effective (validated against the context)
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # NOTE: the only source of truth for what is in the KV cache: positions < num_computed_tokens.
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_parents: list[int] | None = None  # a draft tree's parents (outputs.ScheduledRequest.spec_parents)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    resumed: bool = False  # scheduled again after preemption (the worker drops draft state)
    spec_enabled: bool = True  # per-request switch (e.g. the API's `speculative: false`)
    stop_reason: int | str | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    spec_source_stats: dict[Source, SpecStats] = field(default_factory=dict)  # the same, per draft source
    group_id: str | None = None  # n > 1: siblings share the prompt (scheduled after the first prefill)
    grammar: Any = None  # the compiled grammar of params.structured_outputs
    # The prompt's logprobs are wanted (``prompt_logprobs``) and not all computed yet: every prompt position is
    # computed (no prefix-cache hit) and scored (outputs.ScheduledRequest.score_prompt).
    score_prompt: bool = False

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """The tokens ``min_tokens`` keeps from being sampled: EOS (unless ignore_eos) and stop_token_ids."""
        return self.stop_ids if self.sampling_params.min_tokens else ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end the request when sampled: EOS (unless ignore_eos) and stop_token_ids."""
        params = self.sampling_params
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return tuple(sorted(set(eos) | set(params.stop_token_ids)))

    def record_verification(self, num_draft: int, num_accepted: int, source: Source | None) -> None:
        """One verification pass of this request's drafts: the one place speculation counters are counted."""
        self.spec_stats.record(num_draft, num_accepted)
        if source is not None and num_draft:
            self.spec_source_stats.setdefault(source, SpecStats()).record(num_draft, num_accepted)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
