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
"""

from __future__ import annotations

import numpy as np

from specserve.spec_decode.controller import LOOKUP_SOURCE
from specserve.spec_decode.ngram import lookup
from specserve.spec_decode.proposer import Draft, Proposer, ProposeRequest


class LookupFirstProposer:
    def __init__(self, model: Proposer, min_n: int, max_n: int) -> None:
        self.model = model
        self.writes_kv = model.writes_kv
        self.min_n, self.max_n = min_n, max_n
        self._routed: dict[str, tuple[int, int, list[int]]] = {}  # req_id -> (history length, k, lookup drafts)
        self.num_lookup = 0  # proposals (request-steps) drafted by lookup / by the model proposer
        self.num_model = 0

    def drop(self, req_id: str) -> None:
        self._routed.pop(req_id, None)
        self.model.drop(req_id)

    def source(self, req_id: str, token_ids: list[int], max_k: int) -> str:
        return LOOKUP_SOURCE if self._lookup(req_id, token_ids, max_k) else "model"

    def _lookup(self, req_id: str, token_ids: list[int], k: int) -> list[int]:
        """The lookup drafts (up to k) for this history, remembered from ``source`` for ``propose``."""
        hit = self._routed.get(req_id)
        if hit is not None and hit[0] == len(token_ids) and hit[1] >= k:
            return hit[2][:k]
        toks = lookup(np.asarray(token_ids, dtype=np.int64), k, self.min_n, self.max_n)
        self._routed[req_id] = (len(token_ids), k, toks)
        return toks

    def propose(self, reqs: list[ProposeRequest]) -> list[Draft]:
        out: list[Draft | None] = []
        rest: list[ProposeRequest] = []
        for r in reqs:
            toks = self._lookup(r.req_id, r.token_ids, r.k)
            out.append(Draft(toks) if toks else None)
            if not toks:
                rest.append(r)
        self.num_lookup += len(reqs) - len(rest)
        self.num_model += len(rest)
        model_drafts = iter(self.model.propose(rest) if rest else [])
        return [d if d is not None else next(model_drafts) for d in out]
