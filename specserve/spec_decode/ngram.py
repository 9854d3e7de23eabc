"""Prompt-lookup proposer (Saxena 2023, "prompt lookup decoding"; vLLM's ``[ngram]``).

Find the longest suffix of the request's tokens (n from ``max_n`` down to ``min_n``) that occurred
earlier in prompt + output, and propose the k tokens that followed its most recent earlier occurrence.
Vectorised with numpy sliding windows: one pass per n over the whole history.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.spec_decode.proposer import Draft, ProposeRequest


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


class NgramProposer:
    writes_kv = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, reqs: list[ProposeRequest]) -> list[Draft]:
        return [Draft(lookup(np.asarray(r.token_ids, dtype=np.int64), r.k, self.min_n, self.max_n))
                for r in reqs]

    def drop(self, req_id: str) -> None:
        pass

    def source(self, req: ProposeRequest, max_k: int) -> str:
        return ""
