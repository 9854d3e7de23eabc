"""Suffix decoding (after Arctic Inference's SuffixDecoding, arXiv 2411.04975): drafts from what followed the
same context in this request *and in earlier requests' prompts and outputs*.

Sources, per request:
- its own prompt + output (like prompt lookup);
- the finished requests of the same partition, kept in a ``SuffixIndex`` bounded to ``max_tokens`` tokens,
  oldest evicted first.
The partition is the request's ``user`` (OpenAI's field; ``SamplingParams.user``), so one tenant's outputs
never draft another's. Requests without a user share the anonymous partition.

Proposal, with every source indexed by its ``key_n``-grams:
1. Find every earlier occurrence of the context's last ``key_n`` tokens, and extend each match backwards
   up to ``max_match`` tokens.
2. Keep the occurrences with the longest match: the node a suffix tree would reach.
3. Walk forward by frequency: at each depth take the token that most of the surviving occurrences
   continue with, ties to the most recent, and keep only the occurrences that agree.
4. Stop at k tokens, at ``2 x`` the match length (a short match earns a short draft), or where the
   leading token's share of the occurrences falls below ``min_share``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from specserve.spec_decode.proposer import Draft, ProposeRequest
from specserve.spec_decode.state import Source

SUFFIX_KEY_N = 2  # the key: the context's last 2 tokens (matches are then extended backwards)
Occurrence = tuple[Sequence[int], int]  # (tokens, index of the token after the matched key)


class _Indexed:
    """A token sequence with positions by key_n-gram (appended to as the sequence grows)."""

    __slots__ = ("tokens", "positions", "done")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.done = 0  # keys ending before this index are indexed

    def update(self, key_n: int, upto: int) -> None:
        """Index the keys that end at positions < ``upto`` (a key ending at the very end has no next token)."""
        toks = self.tokens
        for end in range(max(self.done, key_n), upto):
            self.positions.setdefault(tuple(toks[end - key_n:end]), []).append(end)
        self.done = max(self.done, upto)


class SuffixIndex:
    """Finished requests' token sequences per partition, for lookup by key; at most ``max_tokens`` tokens in
    all, the oldest sequences evicted first."""

    def __init__(self, max_tokens: int, key_n: int) -> None:
        self.max_tokens, self.key_n = max_tokens, key_n
        self._seqs: OrderedDict[int, tuple[Any, _Indexed]] = OrderedDict()  # id -> (partition, sequence)
        self._by_partition: dict[Any, dict[int, _Indexed]] = {}
        self._next = 0
        self.num_tokens = 0
        self.num_evicted = 0

    def add(self, partition: Any, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens:]
        if len(tokens) <= self.key_n:
            return
        seq = _Indexed(tokens)
        seq.update(self.key_n, len(tokens))
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = (partition, seq)
        self._by_partition.setdefault(partition, {})[sid] = seq
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            old, (part, old_seq) = self._seqs.popitem(last=False)
            del self._by_partition[part][old]
            if not self._by_partition[part]:
                del self._by_partition[part]
            self.num_tokens -= len(old_seq.tokens)
            self.num_evicted += 1

    def occurrences(self, partition: Any, key: tuple[int, ...]) -> list[Occurrence]:
        """Oldest first."""
        out: list[Occurrence] = []
        for seq in self._by_partition.get(partition, {}).values():
            for p in seq.positions.get(key, ()):
                out.append((seq.tokens, p))
        return out


def _match_len(ctx: Sequence[int], toks: Sequence[int], p: int, max_match: int) -> int:
    """Tokens ending at ``p`` in ``toks`` that equal the context's last ones (at most ``max_match``)."""
    n, end = 0, len(ctx)
    while n < max_match and n < p and n < end and toks[p - 1 - n] == ctx[end - 1 - n]:
        n += 1
    return n


def suffix_draft(ctx: Sequence[int], occurrences: list[Occurrence], k: int, max_match: int = 32,
                 min_share: float = 0.3) -> list[int]:
    """The draft of up to ``k`` tokens from ``occurrences`` (oldest first) of the context's last key tokens."""
    return suffix_match(ctx, occurrences, k, max_match, min_share)[0]


def suffix_match(ctx: Sequence[int], occurrences: list[Occurrence], k: int, max_match: int = 32,
                 min_share: float = 0.3) -> tuple[list[int], int]:
    """``suffix_draft`` and the length of the matches it followed (0: none)."""
    if not occurrences or k < 1:
        return [], 0
    lens = [_match_len(ctx, toks, p, max_match) for toks, p in occurrences]
    best = max(lens)
    live = [occ for occ, m in zip(occurrences, lens) if m == best]
    limit = min(k, 2 * best)
    out: list[int] = []
    for d in range(limit):
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, (toks, p) in enumerate(live):
            if p + d < len(toks):
                t = toks[p + d]
                counts[t] = counts.get(t, 0) + 1
                last[t] = i
        if not counts:
            break
        tok = max(counts, key=lambda t: (counts[t], last[t]))
        if counts[tok] < min_share * len(live):
            break
        out.append(tok)
        live = [(toks, p) for toks, p in live if p + d < len(toks) and toks[p + d] == tok]
    return out, best


class SuffixProposer:
    """``--speculative-method suffix``: drafts from the request's own history and its partition's finished
    requests (module docstring)."""

    writes_kv = False

    def __init__(self, key_n: int, max_tokens: int, max_match: int = 32) -> None:
        self.key_n, self.max_match = key_n, max_match
        self.index = SuffixIndex(max_tokens, key_n)

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        return Source.METHOD

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        return [Draft(self.lookup(r, r.k)[0]) for r in reqs]

    def lookup(self, r: ProposeRequest, k: int) -> tuple[list[int], int]:
        """(up to k drafts for this request, the length of the matches they follow; 0: none)."""
        own = r.spec.draft.suffix  # its own history, indexed (rebuilt after a preemption)
        if own is None or own.tokens is not r.token_ids:
            own = r.spec.draft.suffix = _Indexed(r.token_ids)
        ctx = r.token_ids
        own.update(self.key_n, len(ctx))  # keys ending before the last token: its continuation is known
        if len(ctx) < self.key_n:
            return [], 0
        key = tuple(ctx[-self.key_n:])
        occ = self.index.occurrences(r.state.params.user, key) + [(ctx, p) for p in own.positions.get(key, ())
                                                                  if p < len(ctx)]
        return suffix_match(ctx, occ, k, self.max_match)

    def finish(self, token_ids: list[int], user: str | None) -> None:
        """A finished request's prompt and output join its user's partition of the index."""
        self.index.add(user, token_ids)
