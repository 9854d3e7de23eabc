"""Per-request speculation state: one ``SpecState`` per speculating request, in one ``SpecStates`` registry.

Everything speculation keeps about a request lives here -- the controller's acceptance counts per draft
source, the source and predicted worth of the drafts in flight, the target features an EAGLE head has not
read yet, and the proposer's own state (``DraftState``: where the draft's KV is valid, its sampler's
generator, the prompt-lookup indexes and routing). ``SpecStates.of`` creates a request's state and
``SpecStates.drop`` forgets it; nothing else holds per-request speculation state, so a finished or aborted
request leaves nothing behind. A preempted request keeps its acceptance and features but loses its draft KV:
``SpecStates.forget_kv`` resets its ``DraftState``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class Source(str, Enum):
    """Where a request's drafts come from in a step. The controller keeps acceptance per source, and drafts of
    ``FREE_SOURCES`` cost no draft-model step."""

    METHOD = "method"  # the one proposer of --speculative-method (reported under the method's name)
    MODEL = "model"  # the draft model or head inside --prompt-lookup-first
    LOOKUP = "lookup"  # prompt lookup inside --prompt-lookup-first
    GRAMMAR = "grammar"  # tokens a structured output's grammar forces (worker/drafter.py)

    def label(self, method: str) -> str:
        """The name a request's metrics give the source (``metrics["speculative_sources"]``)."""
        return method if self is Source.METHOD else self.value


FREE_SOURCES = frozenset({Source.LOOKUP, Source.GRAMMAR})  # drafts that cost no draft-model step


class Acceptance:
    """Decayed counts of (accepted, tried) per draft position 1..K -> conditional acceptance c_j."""

    __slots__ = ("acc", "tried", "last")

    def __init__(self, k: int) -> None:
        self.acc = [0.0] * k
        self.tried = [0.0] * k
        self.last = [0] * k  # per position, the controller's step of its last observation (``step``)

    def observe(self, num_draft: int, num_accepted: int, decay: float, step: int = 0) -> None:
        """Drafts 1..num_accepted were accepted; draft num_accepted + 1 (if drafted) was rejected."""
        for j in range(min(num_draft, num_accepted + 1, len(self.acc))):
            self.acc[j] = decay * self.acc[j] + (1.0 if j < num_accepted else 0.0)
            self.tried[j] = decay * self.tried[j] + 1.0
            self.last[j] = step


class ConfidenceBins:
    """Decayed counts of (accepted, tried) by the draft's own probability of its token (its confidence), for
    greedy chains: ``rate(p)`` = P(a draft of confidence p is accepted | the drafts before it were), each bin's
    counts over the raw confidence as prior (``weight`` pseudo-observations). A head or draft model that is
    sure of a token is accepted far more often than one that is not (the Qwen2.5-Coder head: 0.15 below 0.3,
    0.92 above 0.95), which a chain's length can follow (``ChainStop``)."""

    __slots__ = ("acc", "tried")
    EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # upper bounds of all bins but the last

    def __init__(self) -> None:
        self.acc = [0.0] * (len(self.EDGES) + 1)
        self.tried = [0.0] * (len(self.EDGES) + 1)

    @classmethod
    def bin(cls, p: float) -> int:
        return bisect.bisect_right(cls.EDGES, p)

    def observe(self, confs: list[float], num_accepted: int, decay: float) -> None:
        """A verified chain of drafts with these confidences: 1..num_accepted accepted, the next rejected."""
        for j, p in enumerate(confs[:num_accepted + 1]):
            b = self.bin(p)
            self.acc[b] = decay * self.acc[b] + (1.0 if j < num_accepted else 0.0)
            self.tried[b] = decay * self.tried[b] + 1.0

    def rate(self, p: float, weight: float) -> float:
        b = self.bin(p)
        return (self.acc[b] + weight * p) / (self.tried[b] + weight)


class FeatureBuffer:
    """One request's target features since its last model proposal: contiguous positions ``first .. first +
    count``. The count is kept, not summed over the chunks: a request that does not draft for a while gathers
    a chunk per step, and the controller reads every buffer's length every step.

    Chunks that are views of a step's copy (``worker/features.sink_features``) are kept as they are; they keep
    that copy (all the step's rows) alive, so every ``COMPACT_AT`` of them are joined into one chunk of the
    buffer's own."""

    __slots__ = ("first", "chunks", "count", "views")
    COMPACT_AT = 8

    def __init__(self) -> None:
        self.first = 0
        self.chunks: list[torch.Tensor] = []
        self.count = 0
        self.views = 0  # the last chunks that are views of a step's copy

    def add(self, pos: int, h: torch.Tensor, owned: bool = False) -> None:
        if not self.chunks or pos != self.first + self.count:  # first chunk, or a restart (preemption, prefix hit)
            self.first, self.chunks, self.count, self.views = pos, [], 0, 0
        if not owned:  # NOTE: a view of the forward's output is not ours to keep
            h = h.clone()
            self.views = 0
        self.chunks.append(h)
        self.count += h.shape[0]
        if owned:
            self.views += 1
            if self.views >= self.COMPACT_AT:
                self.chunks[-self.views:] = [torch.cat(self.chunks[-self.views:])]
                self.views = 0

    def __len__(self) -> int:
        return self.count

    def take(self) -> tuple[int, torch.Tensor] | None:
        if not self.chunks:
            return None
        out = (self.first, torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0])
        self.first += out[1].shape[0]
        self.chunks, self.count, self.views = [], 0, 0
        return out


@dataclass(slots=True, eq=False)
class DraftState:
    """The proposer's state of one request: valid while the request's draft KV is (reset on preemption)."""

    # EAGLE (spec_decode/eagle.py): the head's KV holds true entries for positions below this.
    head_valid: int | None = None
    # Draft model (spec_decode/draft_model.py): (L, drafts fed at positions L, L+1, ...), what the draft cache
    # holds past the history.
    fed: tuple[int, list[int]] | None = None
    # ... while it reads the prompt a chunk per step (in a batch): priced as a first read, not a recurring backlog.
    reading: bool = False
    # Draft model with a reduced vocabulary: (the rows its prompt adds,) once computed (worker/draft_vocab.py).
    vocab_extra: tuple[Any] | None = None
    # DraftSampler: the seeded request's own generator (seed + 0x5EED).
    generator: torch.Generator | None = None
    # Prompt lookup over the request's history (spec_decode/ngram.NgramIndex) and suffix decoding's index of
    # it (spec_decode/suffix._Indexed).
    ngram: Any = None
    suffix: Any = None
    # --prompt-lookup-first: (history length, k, lookup drafts, match length, route) remembered from ``source``
    # for ``propose``, and the match length of its lookup drafts being verified (0: none).
    routed: tuple[int, int, list[int], int, Source] | None = None
    match_in_flight: int = 0


@dataclass(slots=True, eq=False)
class SpecState:
    """Everything speculation keeps about one request (module docstring)."""

    acceptance: dict[Source, Acceptance] = field(default_factory=dict)  # the controller's counts per source
    source: Source | None = None  # the source of its drafts in flight
    tree_predicted: float | None = None  # a tree in flight: the sum of its nodes' draft path probabilities
    confs: list[float] | None = None  # a greedy chain in flight: its drafts' confidences (``ConfidenceBins``)
    features: FeatureBuffer = field(default_factory=FeatureBuffer)  # target features an EAGLE head has not read
    draft: DraftState = field(default_factory=DraftState)


class SpecStates:
    """The ``SpecState`` of every request speculation has seen, by request id."""

    def __init__(self) -> None:
        self._by_req: dict[str, SpecState] = {}

    def of(self, req_id: str) -> SpecState:
        """The request's state, created on first use."""
        state = self._by_req.get(req_id)
        if state is None:
            state = self._by_req[req_id] = SpecState()
        return state

    def get(self, req_id: str) -> SpecState | None:
        return self._by_req.get(req_id)

    def drop(self, req_id: str) -> None:
        """A finished or aborted request: everything speculation kept about it."""
        self._by_req.pop(req_id, None)

    def forget_kv(self, req_id: str) -> None:
        """A preempted request resumes: its draft KV was freed with its blocks, so its proposer state goes."""
        state = self._by_req.get(req_id)
        if state is not None:
            state.draft = DraftState()

    def acceptance(self, req_id: str, source: Source) -> Acceptance | None:
        state = self._by_req.get(req_id)
        return state.acceptance.get(source) if state is not None else None

    def forget_acceptance(self) -> None:
        """Every request's acceptance counts (a fresh controller starts without history)."""
        for state in self._by_req.values():
            state.acceptance.clear()

    def __len__(self) -> int:
        return len(self._by_req)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_req)
