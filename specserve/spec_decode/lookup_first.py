"""Prompt lookup first, a model proposer elsewhere (``--prompt-lookup-first``).

The two kinds of proposer win on different steps: where the output copies the context (code that repeats a
docstring's examples, an edit that repeats the input) a long n-gram match predicts several tokens at no model
cost, while the draft model or EAGLE head predicts the target everywhere else. So, per request and step: when
the last ``min_n`` or more tokens occurred earlier in prompt + output, draft what followed them; otherwise ask
the model proposer.

The model proposer catches up lazily: a request drafted by lookup is simply not passed to it, and its next
proposal feeds every token since its last one (both model proposers already catch up from their own valid
prefix). EAGLE also needs the target's features for those positions: the drafter (worker/drafter.py) keeps
a request's features buffered while its drafts come from lookup (``source`` is asked first) and hands them
all over with the next model proposal.

**Routing by expected gain.** A match does not always win: a 3-token repeat in chat often continues
differently. With the controller's measured costs (``rate``), each step compares, for the request alone,
the predicted tokens/s of
- lookup: its drafts priced by acceptance per draft position *for this match length* (kept here, over all
  requests, from the verifications of earlier lookup drafts), no draft-model step;
- the model: its acceptance per position for this request (``model_gains``, the controller's), plus the draft
  steps and the catch-up on the tokens it has not read yet (``backlog``);
and drafts from the better one. Before costs are measured (or with a fixed k) any match goes to lookup.
With ``grammar_cut`` (grammar-aware drafting) a structured-output request's lookup drafts are first cut
where its grammar stops allowing them, so a continuation the grammar forbids leaves the step to the model.

**Lookup from the suffix index** (``--prompt-lookup-source suffix``): the lookup side drafts by suffix
decoding (``spec_decode/suffix.py``): from the request's own history *and* earlier requests of the same
``user``, when the matched context is at least ``min_n`` tokens long.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.spec_decode.controller import (
    LOOKUP_SOURCE,
    PRIOR_ALPHA,
    PRIOR_WEIGHT,
    Acceptance,
    gains_over_prior,
)
from specserve.spec_decode.ngram import NgramIndexes
from specserve.spec_decode.proposer import Draft, Proposer, ProposeRequest
from specserve.spec_decode.suffix import SuffixProposer

MODEL_SOURCE = "model"


class LookupFirstProposer:
    max_k = 16  # draft positions whose acceptance is tracked per match length

    def __init__(self, model: Proposer, min_n: int, max_n: int,
                 rate: Callable[[list[float], bool, int], float | None] | None = None,
                 model_gains: Callable[[str], list[float]] | None = None,
                 suffix: SuffixProposer | None = None, grammar_cut: bool = False,
                 backlog: Callable[[str], int] | None = None) -> None:
        self.model = model
        self.backlog = backlog  # tokens the model proposer must catch up on for a request before it drafts
        self.grammar_cut = grammar_cut
        self.suffix = suffix
        self.ngrams = NgramIndexes(min_n, max_n)
        self.writes_kv = model.writes_kv
        self.min_n, self.max_n = min_n, max_n
        self.rate, self.model_gains = rate, model_gains
        # req_id -> (history length, k, lookup drafts, match length, route)
        self._routed: dict[str, tuple[int, int, list[int], int, str]] = {}
        self._by_n: dict[int, Acceptance] = {}  # match length -> acceptance per draft position (all requests)
        self._in_flight: dict[str, int] = {}  # req_id -> match length of its lookup drafts being verified
        self.num_lookup = 0  # proposals (request-steps) drafted by lookup / by the model proposer
        self.num_model = 0

    def drop(self, req_id: str) -> None:
        self._routed.pop(req_id, None)
        self._in_flight.pop(req_id, None)
        self.model.drop(req_id)
        self.ngrams.drop(req_id)
        if self.suffix is not None:
            self.suffix.drop(req_id)

    def source(self, req: ProposeRequest, max_k: int) -> str:
        return self._lookup(req, max_k)[2]

    def lookup_gains(self, n: int, k: int) -> list[float]:
        """m_j = c_1 ... c_j for j <= k: expected tokens lookup draft j adds after a match of length n (the
        controller's prior acceptance at every position where this match length has not been measured)."""
        return gains_over_prior(self._by_n.get(n), [PRIOR_ALPHA] * k, PRIOR_WEIGHT)

    def observe(self, req_id: str, source: str, num_draft: int, num_accepted: int) -> None:
        """A verification of this request's drafts (from ``source``): lookup's acceptance by match length."""
        n = self._in_flight.pop(req_id, 0)
        if source == LOOKUP_SOURCE and n and num_draft:
            self._by_n.setdefault(n, Acceptance(self.max_k)).observe(num_draft, num_accepted, decay=0.95)

    def _lookup(self, r: ProposeRequest, k: int) -> tuple[list[int], int, str]:
        """(lookup drafts up to k, match length, route) for this history, remembered from ``source`` for
        ``propose``."""
        token_ids = r.token_ids
        hit = self._routed.get(r.req_id)
        if hit is not None and hit[0] == len(token_ids) and hit[1] >= k:
            return hit[2][:k], hit[3], hit[4]
        if self.suffix is not None:
            toks, n = self.suffix.lookup(r, k)
            if n < self.min_n:
                toks, n = [], 0
            n = min(n, self.max_k)  # acceptance is kept per match length up to max_k
        else:
            toks, n = self.ngrams.match(r.req_id, token_ids, k)
        if toks and self.grammar_cut and r.state.grammar is not None:
            toks = toks[:r.state.grammar.valid_prefix(toks)]
        route = self._route(r.req_id, toks, n) if toks else MODEL_SOURCE
        self._routed[r.req_id] = (len(token_ids), k, toks, n, route)
        return toks, n, route

    def _route(self, req_id: str, toks: list[int], n: int) -> str:
        if self.rate is None or self.model_gains is None:
            return LOOKUP_SOURCE
        by_lookup = self.rate(self.lookup_gains(n, len(toks)), True, 0)
        by_model = self.rate(self.model_gains(req_id), False, self.backlog(req_id) if self.backlog is not None else 0)
        if by_lookup is None or by_model is None:
            return LOOKUP_SOURCE
        return LOOKUP_SOURCE if by_lookup >= by_model else MODEL_SOURCE

    def propose(self, reqs: list[ProposeRequest]) -> list[Draft]:
        out: list[Draft | None] = []
        rest: list[ProposeRequest] = []
        for r in reqs:
            toks, n, route = self._lookup(r, r.k)
            use = route == LOOKUP_SOURCE and bool(toks)
            out.append(Draft(toks) if use else None)
            if use:
                self._in_flight[r.req_id] = n
            else:
                rest.append(r)
        self.num_lookup += len(reqs) - len(rest)
        self.num_model += len(rest)
        model_drafts = iter(self.model.propose(rest) if rest else [])
        return [d if d is not None else next(model_drafts) for d in out]
