"""Prompt-lookup proposer (Saxena 2023, "prompt lookup decoding"; vLLM's ``[ngram]``).

Find the longest suffix of the request's tokens (n from ``max_n`` down to ``min_n``) that occurred
earlier in prompt + output, and propose the k tokens that followed its most recent earlier occurrence.
Vectorised with numpy sliding windows: one pass per n over the whole history.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.spec_decode.proposer import Draft, ProposeRequest
from specserve.spec_decode.state import DraftState, Source


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    return lookup_match(tokens, k, min_n, max_n)[0]


def lookup_match(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """(the drafts, the length n of the suffix that matched; 0: no match)."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1 (exclude the suffix itself).
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent earlier occurrence
            return tokens[start:start + k].tolist(), n
    return [], 0


class NgramIndex:
    """``lookup_match`` over one request's growing token list, in O(new tokens) per query instead of a pass
    over the whole history: the last end of every n-gram (min_n <= n <= max_n) seen so far.

    NOTE: the numpy pass cost ~0.1 ms per request per step, every step, drafting or not (the router asks
    every decoding request where its drafts would come from): 3-5 % of a batch-8 step on the demo model."""

    __slots__ = ("tokens", "min_n", "max_n", "done", "last")

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.tokens, self.min_n, self.max_n = tokens, min_n, max_n
        self.done = 0  # n-grams ending before this index are in ``last``
        self.last: dict[tuple[int, ...], int] = {}

    def match(self, k: int) -> tuple[list[int], int]:
        toks = self.tokens
        length = len(toks)
        for end in range(max(self.done, 1), length):  # n-grams ending before the last token's position
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last[tuple(toks[end - n:end])] = end
        self.done = max(self.done, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hit = self.last.get(tuple(toks[length - n:]))
            if hit is not None:
                return toks[hit:hit + k], n
        return [], 0


def ngram_match(draft: DraftState, token_ids: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """``lookup_match`` through the request's ``NgramIndex`` (kept in its ``DraftState``; rebuilt when its token
    list is another one)."""
    idx = draft.ngram
    if idx is None or idx.tokens is not token_ids or idx.done > len(token_ids):
        idx = draft.ngram = NgramIndex(token_ids, min_n, max_n)
    return idx.match(k)


class NgramProposer:
    writes_kv = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        return [Draft(ngram_match(r.spec.draft, r.token_ids, r.k, self.min_n, self.max_n)[0]) for r in reqs]

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        return Source.METHOD
