"""Prompt lookup first, a model proposer elsewhere (``--prompt-lookup-first``).

The two kinds of proposer win on different steps: where the output copies the context (code that repeats a
docstring's examples, an edit that repeats the input) a long n-gram match predicts several tokens at no model
cost, while the draft model or EAGLE head predicts the target everywhere else. So, per request and step: when
the last ``min_n`` or more tokens occurred earlier in prompt + output, draft what followed them; otherwise ask
the model proposer.

The model proposer catches up lazily: a request drafted by lookup is simply not passed to it, and its next
proposal feeds every token since its last one (both model proposers already catch up from their own valid
prefix). EAGLE also needs the target's features for those positions: the request's ``SpecState`` keeps its
features buffered while its drafts come from lookup (``source`` is asked first) and hands them
all over with the next model proposal.

**Routing by expected gain.** A match does not always win: a 3-token repeat in chat often continues
differently. With the controller's measured costs (``SpecController.best_rate``), each step compares, for the request alone,
the predicted tokens/s of
- lookup: its drafts priced by acceptance per draft position *for this match length* (kept here, over all
  requests, from the verifications of earlier lookup drafts), no draft-model step;
- the model: its acceptance per position for this request (``SpecController.gains``), plus the draft
  steps and the catch-up on the tokens it has not read yet (the request's ``SpecState.features``);
and drafts from the better one. Before costs are measured (or with a fixed k) any match goes to lookup.
With ``grammar_cut`` (grammar-aware drafting) a structured-output request's lookup drafts are first cut
where its grammar stops allowing them, so a continuation the grammar forbids leaves the step to the model.

**Lookup from the suffix index** (``--prompt-lookup-source suffix``): the lookup side drafts by suffix
decoding (``spec_decode/suffix.py``): from the request's own history *and* earlier requests of the same
``user``, when the matched context is at least ``min_n`` tokens long.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.spec_decode.controller import PRIOR_ALPHA, PRIOR_WEIGHT, gains_over_prior
from specserve.spec_decode.ngram import ngram_match
from specserve.spec_decode.proposer import Draft, Proposer, ProposeRequest
from specserve.spec_decode.proposer import backlog as proposer_backlog
from specserve.spec_decode.state import Acceptance, Source, SpecState
from specserve.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from specserve.spec_decode.controller import SpecController


class LookupFirstProposer:
    tracked_positions = 16  # draft positions whose acceptance is tracked per match length

    def __init__(self, model: Proposer, min_n: int, max_n: int, controller: SpecController | None = None,
                 suffix: SuffixProposer | None = None, grammar_cut: bool = False) -> None:
        self.model = model
        self.grammar_cut = grammar_cut
        self.suffix = suffix
        self.writes_kv = model.writes_kv
        self.min_n, self.max_n = min_n, max_n
        # The controller's measured costs and the model's acceptance per request route a match (None: lookup).
        self.controller = controller
        self._by_n: dict[int, Acceptance] = {}  # match length -> acceptance per draft position (all requests)
        self.num_lookup = 0  # proposals (request-steps) drafted by lookup / by the model proposer
        self.num_model = 0

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        return self._lookup(req, max_k)[2]

    def lookup_gains(self, n: int, k: int) -> list[float]:
        """m_j = c_1 ... c_j for j <= k: expected tokens lookup draft j adds after a match of length n (the
        controller's prior acceptance at every position where this match length has not been measured)."""
        return gains_over_prior(self._by_n.get(n), [PRIOR_ALPHA] * k, PRIOR_WEIGHT)

    def observe(self, spec: SpecState, source: Source | None, num_draft: int, num_accepted: int) -> None:
        """A verification of this request's drafts (from ``source``): lookup's acceptance by match length."""
        n, spec.draft.match_in_flight = spec.draft.match_in_flight, 0
        if source == Source.LOOKUP and n and num_draft:
            self._by_n.setdefault(n, Acceptance(self.tracked_positions)).observe(num_draft, num_accepted, decay=0.95)

    def _lookup(self, r: ProposeRequest, k: int) -> tuple[list[int], int, Source]:
        """(lookup drafts up to k, match length, route) for this history, remembered from ``source`` for
        ``propose``."""
        token_ids = r.token_ids
        hit = r.spec.draft.routed
        if hit is not None and hit[0] == len(token_ids) and hit[1] >= k:
            return hit[2][:k], hit[3], hit[4]
        if self.suffix is not None:
            toks, n = self.suffix.lookup(r, k)
            if n < self.min_n:
                toks, n = [], 0
            n = min(n, self.tracked_positions)  # acceptance is kept per match length up to this
        else:
            toks, n = ngram_match(r.spec.draft, token_ids, k, self.min_n, self.max_n)
        if toks and self.grammar_cut and r.state.grammar is not None:
            toks = toks[:r.state.grammar.valid_prefix(toks)]
        route = self._route(r, toks, n) if toks else Source.MODEL
        r.spec.draft.routed = (len(token_ids), k, toks, n, route)
        return toks, n, route

    def _route(self, r: ProposeRequest, toks: list[int], n: int) -> Source:
        if self.controller is None:
            return Source.LOOKUP
        by_lookup = self.controller.best_rate(self.lookup_gains(n, len(toks)), True, 0)
        # the model's drafts first catch up on what it has not read (an EAGLE head's features, a draft's tokens)
        by_model = self.controller.best_rate(self.controller.gains(r.req_id, Source.MODEL), False,
                                             self.backlog(r, self.controller.max_k))
        if by_lookup is None or by_model is None:
            return Source.LOOKUP
        return Source.LOOKUP if by_lookup >= by_model else Source.MODEL

    def backlog(self, r: ProposeRequest, max_k: int) -> float:
        return proposer_backlog(self.model, r, max_k)

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        out: list[Draft | None] = []
        rest: list[ProposeRequest] = []
        for r in reqs:
            toks, n, route = self._lookup(r, r.k)
            use = route == Source.LOOKUP and bool(toks)
            out.append(Draft(toks) if use else None)
            if use:
                r.spec.draft.match_in_flight = n
            else:
                rest.append(r)
        self.num_lookup += len(reqs) - len(rest)
        self.num_model += len(rest)
        model_drafts = iter(self.model.propose(rest, other_rows) if rest else [])
        return [d if d is not None else next(model_drafts) for d in out]
