"""The Proposer protocol: guess up to k next tokens per request, cheaply.

Chosen once at start-up (``Drafter._make_proposer``, worker/drafter.py); the hot path never branches on the method.
A proposer returns, per request, draft token ids and -- when it sampled them from a distribution -- that
distribution q (``[k, vocab]``), which exact rejection sampling needs. ``probs=None`` means q is one-hot
(prompt lookup, greedy drafting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.sample.sampler import RequestSamplingState
from specserve.spec_decode.state import Source, SpecState


@dataclass(slots=True, frozen=True)
class ChainStop:
    """Where a greedy chain ends before its k drafts (``SpecController.chain_stop``). After each draft the
    proposer multiplies the chain's path estimate by ``accept(confidence)`` (the calibrated acceptance of a
    draft that sure of itself). At ``rate`` tokens/s, draft j is kept while the estimate pays for a
    verification row (``rows[j]`` seconds) and the chain goes on while it would pay for the next row and a
    draft step (``draft`` seconds)."""

    rows: tuple[float, ...]  # seconds a verification row costs when the step's chains are j + 1 drafts deep
    draft: float  # seconds of a draft step
    rate: float  # tokens/s the server makes
    accept: Callable[[float], float]

    def more(self, j: int, path: float, conf: float) -> tuple[float, bool, bool]:
        """Draft j (0-based), of confidence ``conf``, after a chain whose estimate is ``path``: (the estimate
        with it, keep it, draft another)."""
        path *= self.accept(conf)
        last = len(self.rows) - 1
        keep = path >= self.rows[min(j, last)] * self.rate
        return path, keep, keep and path >= (self.rows[min(j + 1, last)] + self.draft) * self.rate


class Chains:
    """The chains of one proposal as they grow: per request its drafts, their confidences and its path estimate
    (``ChainStop``)."""

    def __init__(self, reqs: list[ProposeRequest]) -> None:
        self.reqs = reqs
        self.drafts: list[list[int]] = [[] for _ in reqs]
        self.confs: list[list[float]] = [[] for _ in reqs]
        self.paths = [1.0] * len(reqs)

    def add(self, i: int, tok: int, conf: float | None) -> bool:
        """Request i's next draft (``conf``: its confidence, None where it has none), unless the request's stop
        drops it; whether the chain goes on. A draft without a confidence is never dropped."""
        r, more = self.reqs[i], True
        if conf is not None:
            if r.stop is not None:
                self.paths[i], keep, more = r.stop.more(len(self.drafts[i]), self.paths[i], conf)
                if not keep:
                    return False
            self.confs[i].append(conf)
        self.drafts[i].append(tok)
        return more and len(self.drafts[i]) < r.k

    def confs_of(self, i: int) -> list[float] | None:
        c = self.confs[i]
        return c if c and len(c) == len(self.drafts[i]) else None


@dataclass(slots=True)
class ProposeRequest:
    req_id: str
    token_ids: list[int]  # prompt + output so far (read-only view of the worker's list)
    num_computed: int  # target KV is valid for positions < num_computed (after verification)
    k: int  # how many drafts to propose: the controller's choice, within ``room`` (>= 1 when proposed)
    block_ids: tuple[int, ...]  # KV blocks (draft models share the target's block tables)
    state: RequestSamplingState
    # EAGLE: (first position, [n, hidden]) target features (pre-norm last-layer hidden states) computed since
    # the last proposal, for positions first .. num_computed - 1; None for other proposers.
    features: tuple[int, torch.Tensor] | None = None
    # KV slots past the known tokens that drafting may write and a tree may fill (allocated, within room).
    slots: int = 0
    room: int = 0  # the most drafts the request has room for (max_tokens, context), set by the model runner
    spec: SpecState = field(default_factory=SpecState)  # the request's speculation state (spec_decode/state.py)
    stop: ChainStop | None = None  # a greedy chain may end early (None: exactly k drafts)


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] processed draft distributions
    # A tree (``outputs.ScheduledRequest.spec_parents``): each draft's parent; None: a chain. Tree drafts
    # are candidates, verified by multi-draft rejection (``sample.rejection_sampler.verify_tree``): no q.
    parents: list[int] | None = None
    predicted: float = 0.0  # a tree: the sum of its nodes' draft path probabilities (expected accepted nodes)
    confs: list[float] | None = None  # a greedy chain: each draft's probability under the draft (its confidence)


def backlog(proposer: object, req: ProposeRequest, max_k: int) -> float:
    """Tokens ``proposer`` reads for ``req`` before its model drafts, as the controller prices them: a draft
    model's own answer (``DraftModelProposer.backlog``), else the target features an EAGLE head has not read
    (0 for proposers that read none)."""
    own = getattr(proposer, "backlog", None)
    return float(own(req, max_k)) if own is not None else float(len(req.spec.features))


class Proposer(Protocol):
    # True when proposing writes KV ahead of the request's tokens (the scheduler reserves lookahead slots).
    writes_kv: bool

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        """Where this request's next drafts will come from (asked before k is chosen): the controller keeps
        acceptance per source. One-source proposers answer ``Source.METHOD``; ``--prompt-lookup-first``
        answers ``Source.LOOKUP`` (drafts that cost no model step) or ``Source.MODEL``."""
        ...

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        """Drafts per request; a proposer keeps what it needs of a request in ``req.spec.draft``.
        ``other_rows``: the rows of the step that are not these proposals (draft trees are sized against the
        whole step)."""
        ...
