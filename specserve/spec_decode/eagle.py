"""EAGLE proposer (Li et al. 2024, arXiv 2401.15077): a one-layer head drafts from the target's own features.

Head entry ``p`` = (embedding of ``t_p``, target feature ``h_{p-1}``) -> predicted ``h_p`` -> target norm + LM
head -> draft for ``t_{p+1}`` (see ``model/eagle_head.py``). With ``L`` known tokens the target has verified
KV (and features) for positions ``< L - 1``, so each proposal:

1. catches up: runs the head over the *true* entries ``valid .. L - 1`` (real tokens, the target's features
   handed over by the worker in ``ProposeRequest.features``); the last of them (``t_{L-1}``, ``h_{L-2}``)
   yields the first draft;
2. drafts: entry ``L - 1 + j`` = (draft ``j``, the head's own predicted feature) yields draft ``j + 1``.

The head's KV therefore holds true entries below ``L`` after a proposal (``_valid``); the draft entries above
are overwritten by the next catch-up, whatever was accepted (they were computed from predicted features).
A feature the worker never saw (position 0, or the last position of a prefix-cache hit) is zeros, and a
prefix-cached block written by a request that did not speculate holds stale head entries: both only cost
acceptance, never exactness -- verification decides every emitted token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.spec_decode.draft_model import DraftSampler, draft_chain
from specserve.spec_decode.proposer import Draft, ProposeRequest

# (tokens per request, features h_{p-1} per request [n_i, hidden], first position per request, block ids)
# -> ([B, vocab] logits at each request's last entry, [B, hidden] the head's predicted feature there).
EagleStep = Callable[[list[list[int]], list[torch.Tensor], list[int], list[tuple[int, ...]]],
                     tuple[torch.Tensor, torch.Tensor]]


class EagleProposer:
    writes_kv = True

    def __init__(self, step: EagleStep, feature_size: int, vocab_size: int) -> None:
        self.step = step
        self.feature_size = feature_size  # the target's feature per position: n feature layers x hidden
        self.sampler = DraftSampler(vocab_size)
        self._valid: dict[str, int] = {}  # req_id -> head KV holds true entries for positions below this

    def drop(self, req_id: str) -> None:
        self._valid.pop(req_id, None)
        self.sampler.drop(req_id)

    def source(self, req_id: str, token_ids: list[int], max_k: int) -> str:
        return ""

    def propose(self, reqs: list[ProposeRequest]) -> list[Draft]:
        toks, feats, starts = [], [], []
        for r in reqs:
            n = len(r.token_ids)
            first, f = r.features if r.features is not None else (n - 1, None)
            start = min(self._valid.get(r.req_id, first), n - 1)
            toks.append(r.token_ids[start:])
            feats.append(self._features(f, first, start - 1, n - 1))
            starts.append(start)
        blocks = [r.block_ids for r in reqs]
        logits, pred = self.step(toks, feats, starts, blocks)  # [B, V], [B, hidden]
        state = {"pred": pred}

        def advance(rows: list[int], active: list[int], last: list[int], pos: list[int]) -> torch.Tensor:
            logits, state["pred"] = self.step([[t] for t in last], list(state["pred"][rows].unsqueeze(1)),
                                              pos, [blocks[i] for i in active])
            return logits

        drafts = draft_chain(reqs, logits, self.sampler, advance)
        for r in reqs:
            self._valid[r.req_id] = len(r.token_ids)
        return drafts

    def _features(self, f: torch.Tensor | None, first: int, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, feature size]: the target's features for positions lo .. hi - 1 (``f`` holds positions from
        ``first``); zeros where the worker has none."""
        if f is not None and lo >= first and hi <= first + f.shape[0]:
            return f[lo - first:hi - first]
        ref = f if f is not None else torch.empty(0)
        out = ref.new_zeros(hi - lo, self.feature_size)
        if f is not None:
            a, b = max(lo, first), min(hi, first + f.shape[0])
            if b > a:
                out[a - lo:b - lo] = f[a - first:b - first]
        return out
