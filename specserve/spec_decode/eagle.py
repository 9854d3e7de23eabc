"""EAGLE proposer (Li et al. 2024, arXiv 2401.15077): a one-layer head drafts from the target's own features.

Head entry ``p`` = (embedding of ``t_p``, target feature ``h_{p-1}``) -> predicted ``h_p`` -> target norm + LM
head -> draft for ``t_{p+1}`` (see ``model/eagle_head.py``). With ``L`` known tokens the target has verified
KV (and features) for positions ``< L - 1``, so each proposal:

1. catches up: runs the head over the *true* entries ``valid .. L - 1`` (real tokens, the target's features
   handed over by the worker in ``ProposeRequest.features``); the last of them (``t_{L-1}``, ``h_{L-2}``)
   yields the first draft;
2. drafts: entry ``L - 1 + j`` = (draft ``j``, the head's own predicted feature) yields draft ``j + 1``.

The head's KV therefore holds true entries below ``L`` after a proposal (``DraftState.head_valid``); the draft entries above
are overwritten by the next catch-up, whatever was accepted (they were computed from predicted features).

Draft trees (``--speculative-eagle-topk b`` > 1; EAGLE-2, Li et al. 2024, arXiv 2406.16858): the root's b most
likely tokens are depth 1; each later depth feeds the b nodes of the previous depth with the highest
cumulative draft log-probability to the head *as a tree* (one forward; each entry attends to the context and
its own expanded ancestors, ``model/attention_metadata.TREE_DOC``; entry e of a proposal sits in head slot
``L + e``) and adds their b best children. The controller (``SpecController.choose_tree_sizes``: measured
step costs against the calibrated path probabilities) then keeps the best nodes, which go to verification
ordered by depth, parents first. Requests whose logits processing depends on the drafts before a row
(penalties, grammars, an unmet ``min_tokens``) draft chains. A batch of greedy chains without logits
processing (``plain_greedy``) drafts the argmax of each step's logits over the head's reduced draft
vocabulary, without building [B, vocab] logits or running the draft sampler; a grammar row whose argmax its
grammar forbids takes the best allowed token, as the draft sampler would.
A feature the worker never saw (position 0, or the last position of a prefix-cache hit) is zeros, and a
prefix-cached block written by a request that did not speculate holds stale head entries: both only cost
acceptance, never exactness -- verification decides every emitted token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.sample.sampler import RequestSamplingState, argmax_rows, row_argmax
from specserve.spec_decode.draft_model import DraftSampler, draft_chain
from specserve.spec_decode.proposer import Chains, Draft, ProposeRequest
from specserve.spec_decode.state import Source

if TYPE_CHECKING:
    from specserve.spec_decode.controller import SpecController


@dataclass(frozen=True, slots=True)
class EagleSteps:
    """The head's forward, built by the worker (``worker/draft_steps.eagle_steps``), by what a proposal reads
    from it. Each takes (tokens per request, features h_{p-1} per request [n_i, hidden] (or one [B, hidden]
    tensor), first position per request, block ids) and returns (its result, [B, hidden] the head's predicted
    feature at each request's last entry)."""

    # -> [B, vocab] logits
    logits: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # -> ([B, M] logits over the head's draft vocabulary, its [M] token ids; None for the full vocabulary)
    vocab_logits: Callable[..., tuple[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor]]
    # (..., tree rows or None, b) -> ([T, b] log-probabilities, [T, b] token ids) of the b most likely tokens;
    # with tree rows (``worker/input_batch.RowTree``) at every entry (T entries), else at each request's last.
    top: Callable[..., tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]


def tree_eligible(state: RequestSamplingState) -> bool:
    """Whether a request's logits processing is the same at every row whatever the drafts before it (no
    penalties, no grammar, min_tokens met): a tree's rows are then processed like a chain's."""
    p = state.params
    return state.grammar is None and not p.uses_penalties and len(state.output_token_ids) >= (p.min_tokens or 0)


def plain_greedy(state: RequestSamplingState) -> bool:
    """Whether a request's draft is the argmax of the head's raw logits, where its grammar (if any) allows
    it: greedy, no bias or penalties, min_tokens met."""
    p = state.params
    return (p.greedy and not p.logit_bias and not p.uses_penalties
            and len(state.output_token_ids) >= (p.min_tokens or 0))


class EagleProposer:
    writes_kv = True

    def __init__(self, steps: EagleSteps, feature_size: int, vocab_size: int, topk: int = 1, max_nodes: int = 0,
                 controller: SpecController | None = None, grammar: bool = True) -> None:
        self.steps = steps
        self.feature_size = feature_size  # the target's feature per position: n feature layers x hidden
        self.sampler = DraftSampler(vocab_size, grammar)
        self.topk, self.max_nodes = topk, max_nodes
        self.controller = controller  # sizes the trees (None: every ranked node within max_nodes)

    def source(self, req: ProposeRequest, max_k: int) -> Source:
        return Source.METHOD

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        tree = [i for i, r in enumerate(reqs) if self.topk > 1 and tree_eligible(r.state)]
        greedy = not tree and all(plain_greedy(r.state) for r in reqs)
        toks, feats, starts = [], [], []
        for r in reqs:
            n = len(r.token_ids)
            first, f = r.features if r.features is not None else (n - 1, None)
            valid = r.spec.draft.head_valid
            start = min(first if valid is None else valid, n - 1)
            toks.append(r.token_ids[start:])
            feats.append(self._features(f, first, start - 1, n - 1))
            starts.append(start)
        blocks = [r.block_ids for r in reqs]
        if greedy:
            head_out, pred = self.steps.vocab_logits(toks, feats, starts, blocks)  # draft-vocabulary logits
        elif len(tree) == len(reqs):
            best, pred = self.steps.top(toks, feats, starts, blocks, None, self.topk)  # ([B, b], [B, b]), [B, hidden]
        else:
            logits, pred = self.steps.logits(toks, feats, starts, blocks)  # [B, V], [B, hidden]
        for r in reqs:
            r.spec.draft.head_valid = len(r.token_ids)
        if greedy:
            return self._greedy_chains(reqs, head_out, pred)
        if len(tree) == len(reqs):
            return self._trees(reqs, best, pred, other_rows)
        if not tree:  # chains only: no row selection (a copy of the [B, V] logits)
            return self._chains(reqs, logits, pred)
        in_tree = set(tree)
        chain = [i for i in range(len(reqs)) if i not in in_tree]
        out: list[Draft] = [Draft([])] * len(reqs)
        root = torch.log_softmax(logits[tree].float(), dim=-1).topk(self.topk, dim=-1)
        for part, drafts in ((chain, self._chains([reqs[i] for i in chain], logits[chain], pred[chain])),
                             (tree, self._trees([reqs[i] for i in tree], (root.values, root.indices), pred[tree],
                                              other_rows))):
            for i, d in zip(part, drafts):
                out[i] = d
        return out

    def _chains(self, reqs: list[ProposeRequest], logits: torch.Tensor, pred: torch.Tensor) -> list[Draft]:
        blocks = [r.block_ids for r in reqs]
        state = {"pred": pred}

        def advance(rows: list[int], active: list[int], last: list[int], pos: list[int]) -> torch.Tensor:
            logits, state["pred"] = self.steps.logits([[t] for t in last], list(state["pred"][rows].unsqueeze(1)),
                                                      pos, [blocks[i] for i in active])
            return logits

        return draft_chain(reqs, logits, self.sampler, advance)

    def _greedy_chains(self, reqs: list[ProposeRequest], out: tuple[torch.Tensor, torch.Tensor | None],
                       pred: torch.Tensor) -> list[Draft]:
        """Chains for greedy requests without logits processing (``plain_greedy``) from the head's first
        ``vocab_logits`` step ``out``: each draft is the argmax over the head's draft vocabulary
        (``_greedy_tokens``); a request with ``stop`` ends its chain where it stops paying (``ChainStop``)."""
        chains = Chains(reqs)
        drafts = chains.drafts
        active = list(range(len(reqs)))
        while True:
            toks, conf = self._greedy_tokens([reqs[i] for i in active], [drafts[i] for i in active], out)
            keep = [j for j, i in enumerate(active) if chains.add(i, toks[j], conf[j])]
            if len(keep) < len(active):
                active, pred = [active[j] for j in keep], pred[keep]
            if not active:
                break
            out, pred = self.steps.vocab_logits([[drafts[i][-1]] for i in active], pred,
                                                [len(reqs[i].token_ids) + len(drafts[i]) - 1 for i in active],
                                                [reqs[i].block_ids for i in active])
        return [Draft(d, confs=chains.confs_of(i)) for i, d in enumerate(drafts)]

    def _greedy_tokens(self, reqs: list[ProposeRequest], drafts: list[list[int]],
                       out: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[list[int], list[float | None]]:
        """Each row's greedy draft from a ``vocab_logits`` step (logits over the draft vocabulary and its ids), and
        its probability there (the draft's confidence, where a request has a ``stop``): the argmax, or for a
        grammar row whose grammar forbids it after the row's drafts (with grammar-aware drafting on), the best
        token the grammar allows (``DraftSampler`` masks the same distribution)."""
        logits, vocab = out
        best = argmax_rows(logits)
        toks = (best if vocab is None else vocab[best]).tolist()
        want = any(r.stop is not None for r in reqs)  # confidences only where a chain may stop on them
        confs: list[float | None] = torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist() if want \
            else [None] * len(reqs)
        for j, r in enumerate(reqs):
            grammar = r.state.grammar
            if grammar is None or not self.sampler.grammar or \
                    grammar.valid_prefix([*drafts[j], toks[j]]) == len(drafts[j]) + 1:
                continue
            full = logits.new_full((1, self.sampler.vocab_size), float("-inf"))
            full[0, slice(None) if vocab is None else vocab] = logits[j]
            masked = DraftSampler.masked(full, [r], [drafts[j]])
            toks[j] = row_argmax(masked)[0]
            if want:
                confs[j] = float(torch.softmax(masked.float(), dim=-1).amax())
        return toks, confs

    def _trees(self, reqs: list[ProposeRequest], top: tuple[torch.Tensor, torch.Tensor], pred: torch.Tensor,
               other_rows: int) -> list[Draft]:
        """Dynamic draft trees of depth ``r.k`` (module docstring); the b most likely tokens at each request's
        root (log-probabilities and ids, [B, b] each) and its [B, hidden] predicted feature."""
        b = self.topk
        trees = [_Tree() for _ in reqs]
        vals, ids = top
        for t, v, x, h in zip(trees, vals.tolist(), ids.tolist(), pred):
            t.frontier = [t.add(tok, -1, s, h) for tok, s in zip(x, v)]
        for depth in range(2, max(r.k for r in reqs) + 1):
            active = []
            rows, toks, feats, starts, rts = [], [], [], [], []
            for i, r in enumerate(reqs):
                t, n = trees[i], len(r.token_ids)
                front = t.frontier[:max(0, r.slots - t.expanded)] if r.k >= depth else []  # entries in its blocks
                if not front:
                    continue
                active.append(i)
                masks = []
                for j, node in enumerate(front):
                    t.slot[node] = t.expanded + j
                    par = t.parents[node]
                    masks.append((t.mask[par] if par >= 0 else 0) | (1 << t.slot[node]))
                    t.mask[node] = masks[-1]
                    rows.append((i, node))
                toks.append([t.tokens[node] for node in front])
                feats.append(torch.stack([t.feature[node] for node in front]))
                starts.append(n + t.expanded)  # head slots n + e for the proposal's entries e
                rts.append((n, masks))
                t.expanded += len(front)
            if not active:
                break
            (vals, ids), pred = self.steps.top(toks, feats, starts, [reqs[i].block_ids for i in active], rts, b)
            new: dict[int, list[int]] = {i: [] for i in active}
            for (i, node), v, x, h in zip(rows, vals.tolist(), ids.tolist(), pred):
                t = trees[i]
                new[i] += [t.add(tok, node, t.scores[node] + s, h) for tok, s in zip(x, v)]
            for i in active:
                t = trees[i]
                t.frontier = sorted(new[i], key=lambda node: -t.scores[node])[:b]
        ranked = [sorted(range(len(t.tokens)), key=lambda node: (-t.scores[node], t.depth[node]))
                  [:min(self.max_nodes, r.slots)] for t, r in zip(trees, reqs)]
        probs = [[math.exp(trees[i].scores[node]) for node in r] for i, r in enumerate(ranked)]
        sizes = self.controller.choose_tree_sizes(probs, other_rows) if self.controller is not None \
            else [len(r) for r in ranked]
        return [t.draft(r[:n], sum(p[:n])) for t, r, p, n in zip(trees, ranked, probs, sizes)]

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


class _Tree:
    """One request's draft tree while it grows: candidate nodes (token, parent, cumulative log-probability,
    the head's feature that predicts the node's children), and which nodes the head expanded where."""

    __slots__ = ("tokens", "parents", "scores", "depth", "feature", "slot", "mask", "frontier", "expanded")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depth: list[int] = []
        self.feature: list[torch.Tensor] = []  # the predicted feature of the entry that proposed the node
        self.slot: dict[int, int] = {}  # expanded node -> its proposal entry (head slot L + entry)
        self.mask: dict[int, int] = {}  # expanded node -> bits of its expanded path's entries
        self.frontier: list[int] = []
        self.expanded = 0

    def add(self, token: int, parent: int, score: float, feature: torch.Tensor) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 1)
        self.feature.append(feature)
        return len(self.tokens) - 1

    def draft(self, nodes: list[int], predicted: float) -> Draft:
        """The chosen nodes (closed under parents) as a draft tree, by depth then score."""
        order = sorted(nodes, key=lambda node: (self.depth[node], -self.scores[node]))
        index = {node: j for j, node in enumerate(order)}
        return Draft([self.tokens[node] for node in order], None,
                     [index[self.parents[node]] if self.parents[node] >= 0 else -1 for node in order], predicted)
