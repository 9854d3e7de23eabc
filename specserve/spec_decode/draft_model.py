"""Draft-model proposer: a small model (or the target's first layers) drafts k tokens autoregressively.

The draft shares the target's block tables. A separate draft model has its own KV tensors and its own
notion of "computed": after verification its cache holds KV for drafts that may have been rejected, and
none for the recovered/bonus token, so each proposal first feeds the tokens the draft has not seen
(docs/architecture.md). Layer-skip self-drafting writes into the target's own cache for its
first L layers: those values equal what the target computes for the same tokens, so the draft's valid
prefix is simply the target's ``num_computed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from specserve.sample.grammar import apply_grammar, bitmask_words
from specserve.sample.sampler import argmax_rows, process_logits, row_argmax
from specserve.spec_decode.proposer import Chains, Draft, ProposeRequest
from specserve.spec_decode.state import Source

# (tokens to feed per request, start position per request, block ids per request, each request's extra
# vocabulary rows or None) -> [B, vocab] logits at each request's last fed token. Built by the worker, so spec/
# never imports worker/.
DraftStep = Callable[[list[list[int]], list[int], list[tuple[int, ...]], list[Any] | None], torch.Tensor]


# The most tokens a draft model reads for one request in one step of a batch before it drafts for it
# (``DraftModelProposer.propose``): about 25 ms of a 0.5B model's prefill on 2 CPU cores.
CATCH_UP_CHUNK = 32


class DraftModelProposer:
    writes_kv = True

    def __init__(self, step: DraftStep, shares_target_kv: bool, vocab_size: int, grammar: bool = True,
                 vocab_extra: Callable[[list[int]], Any] | None = None) -> None:
        self.step = step
        self.shares_target_kv = shares_target_kv
        self.sampler = DraftSampler(vocab_size, grammar)
        # A reduced draft vocabulary (worker/draft_vocab.py): a request's prompt tokens -> its own extra rows,
        # made once per request and handed to every step it drafts in.
        self.vocab_extra = vocab_extra

    def _extras(self, reqs: list[ProposeRequest]) -> list[Any] | None:
        if self.vocab_extra is None:
            return None
        out = []
        for r in reqs:
            d = r.spec.draft
            if d.vocab_extra is None:
                d.vocab_extra = (self.vocab_extra(r.token_ids),)
            out.append(d.vocab_extra[0])
        return out

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        return Source.METHOD

    def backlog(self, r: ProposeRequest, max_k: int) -> float:
        """Tokens the draft reads before drafting beyond the one a proposal always feeds, as the controller
        prices them (``SpecController.choose_ks``' ``backlog``). A request the draft has never read (its prompt:
        a one-off catch-up that lets it draft for the rest of the request) is charged the share of it one step
        covers, at most ``max_k + 1`` of the ``room + 1`` tokens left; a backlog gathered while prompt lookup
        drafted recurs, and is charged whole."""
        if self.shares_target_kv:
            return 0.0
        n = max(len(r.token_ids) - self._valid_prefix(r) - 1, 0)
        if r.spec.draft.fed is None or r.spec.draft.reading:
            return n * min(1.0, (max_k + 1) / (max(r.room, 0) + 1))  # room -1: no room left at all
        return float(n)

    def _valid_prefix(self, r: ProposeRequest) -> int:
        """Positions below this hold draft KV of the request's actual tokens."""
        if self.shares_target_kv:
            return r.num_computed
        if r.spec.draft.fed is None:
            return 0
        base, fed = r.spec.draft.fed  # what the draft cache holds past the history
        valid = base
        for tok in fed:
            if valid >= len(r.token_ids) or r.token_ids[valid] != tok:
                break
            valid += 1
        return min(valid, len(r.token_ids) - 1)

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        starts = [self._valid_prefix(r) for r in reqs]
        ends = [len(r.token_ids) for r in reqs]
        if len(reqs) + other_rows > 1 and not self.shares_target_kv:
            # In a batch, a request more than a chunk behind (its prompt, after its first token) reads one chunk
            # this step and drafts nothing: a whole prompt read in one step would hold back every other request's
            # tokens, and the first token of any request arriving meanwhile, by the draft's prefill time. A seeded
            # sampled request reads its prompt at once: its random stream follows its drafts, which must not
            # depend on the batch.
            ends = [min(e, s + CATCH_UP_CHUNK) if e - s > CATCH_UP_CHUNK + 1 and not _seeded(r) else e
                    for r, s, e in zip(reqs, starts, ends, strict=True)]
        blocks = [r.block_ids for r in reqs]
        extras = self._extras(reqs)
        logits = self.step([r.token_ids[s:e] for r, s, e in zip(reqs, starts, ends, strict=True)], starts, blocks,
                           extras)  # [B, V]
        ready = [i for i, (r, e) in enumerate(zip(reqs, ends, strict=True)) if e == len(r.token_ids)]
        drafts = [Draft([]) for _ in reqs]
        for r, e in zip(reqs, ends, strict=True):
            if e < len(r.token_ids):
                r.spec.draft.fed, r.spec.draft.reading = (e, []), True  # the next proposal reads on from e
        if not ready:
            return drafts
        if len(ready) < len(reqs):
            logits = logits[ready]

        def advance(rows: list[int], active: list[int], last: list[int], pos: list[int]) -> torch.Tensor:
            return self.step([[t] for t in last], pos, [blocks[ready[i]] for i in active],
                             None if extras is None else [extras[ready[i]] for i in active])

        for i, d in zip(ready, draft_chain([reqs[i] for i in ready], logits, self.sampler, advance), strict=True):
            drafts[i] = d
            reqs[i].spec.draft.fed = (len(reqs[i].token_ids), d.token_ids[:-1])  # the last draft was never fed
            reqs[i].spec.draft.reading = False
        return drafts


def _seeded(r: ProposeRequest) -> bool:
    return r.state.params.seed is not None and not r.state.params.greedy


# (rows of the previous logits kept, still-active request indices, their last draft token, its position)
# -> [len(active), V] logits after feeding those tokens.
Advance = Callable[[list[int], list[int], list[int], list[int]], torch.Tensor]


def draft_chain(reqs: list[ProposeRequest], logits: torch.Tensor, sampler: DraftSampler,
                advance: Advance) -> list[Draft]:
    """Autoregressive drafting shared by the draft-model and EAGLE proposers: sample a draft per request
    from ``logits`` [B, V], feed it back through ``advance``, until each request has its ``k`` drafts, or (a
    greedy request with ``stop``) until its chain is no longer worth a row (``ChainStop``)."""
    chains = Chains(reqs)
    drafts = chains.drafts
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]
    want = any(r.stop is not None and r.state.params.greedy for r in reqs)
    active = list(range(len(reqs)))
    while True:
        toks, q, conf = sampler.sample_with_confidence(logits, [reqs[i] for i in active],
                                                       [drafts[i] for i in active], want)
        rows = []
        for j, i in enumerate(active):
            greedy = reqs[i].state.params.greedy
            go = chains.add(i, toks[j], conf[j] if conf is not None and greedy else None)
            if q is not None and not greedy:  # (a draft without a confidence was not dropped)
                probs[i].append(q[j])
            if go:
                rows.append(j)
        active = [active[j] for j in rows]
        if not active:
            break
        logits = advance(rows, active, [drafts[i][-1] for i in active],
                         [len(reqs[i].token_ids) + len(drafts[i]) - 1 for i in active])
    return [Draft(d, torch.stack(p) if p else None, confs=chains.confs_of(i))
            for i, (d, p) in enumerate(zip(drafts, probs, strict=True))]


class DraftSampler:
    """Draft token per request: argmax for greedy requests, a sample from the draft's processed
    distribution q otherwise (q is returned for exact rejection sampling). Seeded requests draw from their
    own generator (seed + 0x5EED), so a seeded request drafts the same alone or in any batch.

    ``grammar``: a structured-output request's draft distribution is masked by its grammar after the drafts
    so far (grammar-aware drafting), so the draft proposes its best token the grammar allows instead of one
    the drafter would cut; q is the masked distribution, which keeps rejection sampling exact."""

    def __init__(self, vocab_size: int, grammar: bool = True) -> None:
        self.vocab_size = vocab_size
        self.grammar = grammar

    def sample(self, logits: torch.Tensor, reqs: list[ProposeRequest], drafts: list[list[int]]
               ) -> tuple[list[int], torch.Tensor | None]:
        toks, q, _ = self.sample_with_confidence(logits, reqs, drafts, False)
        return toks, q

    def sample_with_confidence(self, logits: torch.Tensor, reqs: list[ProposeRequest], drafts: list[list[int]],
                               confidence: bool) -> tuple[list[int], torch.Tensor | None, list[float] | None]:
        """(draft tokens, q or None, with ``confidence`` each row's probability of its token under its processed
        distribution -- meaningful for greedy rows, whose token is that distribution's argmax)."""
        logits = logits[:, :self.vocab_size]
        # The draft's q: the request's processing (bias, min_tokens, penalties over output + drafts so far);
        # the grammar is applied below, at the state after the drafts so far (q may be anything: exact).
        states = [replace(r.state, output_token_ids=r.state.output_token_ids + d, generator=None, grammar=None)
                  for r, d in zip(reqs, drafts, strict=True)]
        processed = process_logits(logits, states, [1] * len(reqs), [[] for _ in reqs])  # [B, V]
        if self.grammar and any(r.state.grammar is not None for r in reqs):
            processed = self.masked(processed, reqs, drafts)
        if all(r.state.params.greedy for r in reqs):
            conf = torch.softmax(processed.float(), dim=-1).amax(dim=-1).tolist() if confidence else None
            return row_argmax(processed), None, conf
        q = torch.softmax(processed, dim=-1)
        noise = torch.empty_like(q)
        for j, r in enumerate(reqs):
            noise[j].exponential_(generator=self._generator(r, q.device))
        sampled = (q / noise).argmax(dim=-1)  # exponential race: an exact sample from q
        greedy = torch.tensor([r.state.params.greedy for r in reqs], device=q.device)
        toks = torch.where(greedy, argmax_rows(processed), sampled)
        return toks.tolist(), q, q.amax(dim=-1).tolist() if confidence else None

    @staticmethod
    def masked(processed: torch.Tensor, reqs: list[ProposeRequest], drafts: list[list[int]]) -> torch.Tensor:
        """``processed`` with grammar requests' rows masked by their grammar after their drafts so far (a
        copy where a row is masked: ``process_logits`` may return its input). A greedy row whose argmax the
        grammar allows is left as it is (its draft is the same; filling a mask costs tens of microseconds)."""
        masked = []
        best = row_argmax(processed)
        for j, r in enumerate(reqs):
            grammar = r.state.grammar
            if grammar is None:
                continue
            if r.state.params.greedy and grammar.valid_prefix([*drafts[j], best[j]]) == len(drafts[j]) + 1:
                continue
            masked.append(j)
        if not masked:
            return processed
        bitmask = torch.full((len(masked), bitmask_words(processed.shape[1])), -1, dtype=torch.int32)
        for row, j in enumerate(masked):
            grammar = reqs[j].state.grammar
            assert grammar is not None
            grammar.fill_after(bitmask, row, drafts[j])
        processed = processed.clone()
        apply_grammar(processed, masked, bitmask)
        return processed

    def _generator(self, r: ProposeRequest, device: torch.device) -> torch.Generator | None:
        seed = r.state.params.seed
        if seed is None:
            return None
        draft = r.spec.draft
        if draft.generator is None:
            draft.generator = torch.Generator(device=device)
            draft.generator.manual_seed(seed + 0x5EED)
        return draft.generator
