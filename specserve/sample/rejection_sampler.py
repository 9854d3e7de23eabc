"""Exact verification of draft tokens: speculative sampling with a greedy fast path.

One function, :func:`verify`, serves ordinary decoding (k = 0: one token sampled from p) and speculation
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", arXiv 2302.01318):

* greedy requests: accept draft j while it equals argmax of target row j; the first mismatch is replaced by
  that argmax; when all k match, the argmax of row k is the bonus token;
* sampled requests: accept draft x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection
  emit a sample of norm(max(p_j - q_j, 0)); when all k are accepted, emit a bonus sample of p_k. p and q are
  the *processed* target and draft distributions. A proposer without probabilities (n-gram, greedy drafting)
  has q_j = one-hot(x_j): accept with probability p_j(x_j), else sample p_j with x_j removed.
  The emitted tokens are then distributed exactly as sampling from p token by token.

Sampling uses the exponential race: argmax(w / E) with E_v ~ Exponential(1) i.i.d. picks v with probability
w_v / sum(w) (the minimum of Exp(w_v)-rate clocks), so the residual never needs normalising and there is no
cumsum / multinomial / host sync.

Randomness: unseeded requests share the default generator (one batched draw); a seeded request draws from its
own generator, always exactly ``k`` uniforms then ``V`` exponentials, whatever else is in the batch, so it is
reproducible alone or in any batch. Generators should live on the logits' device (else the draws are copied).
The whole function syncs with the host once: the final ``.tolist()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.platform import to_device
from specserve.sample.sampler import RequestSamplingState, argmax_rows, row_argmax, row_starts


@dataclass(slots=True)
class _Layout:
    """Padded per-request views of the flat batch; K = max drafts in the batch (possibly a subset's)."""

    draft_ids: torch.Tensor  # [B, K + 1] long, padded with 0 (the extra column simplifies indexing)
    valid: torch.Tensor  # [B, K] bool: j < k_i
    row_idx: torch.Tensor  # [B, K + 1] long: flat row of (i, min(j, k_i))
    num_drafts: list[int]  # host copy of k_i

    @staticmethod
    def build(row_counts: list[int], drafts: list[list[int]], device: torch.device) -> _Layout:
        k_max = max(map(len, drafts))
        starts = row_starts(row_counts)
        ids = [d + [0] * (k_max + 1 - len(d)) for d in drafts]
        rows = [[s + min(j, len(d)) for j in range(k_max + 1)] for s, d in zip(starts, drafts, strict=True)]
        ks = [len(d) for d in drafts]
        valid = torch.arange(k_max, device=device) < to_device(ks, device).unsqueeze(1)
        return _Layout(to_device(ids, device, torch.long), valid,
                       to_device(rows, device, torch.long), ks)

    def select(self, idx: list[int]) -> _Layout:
        if len(idx) == len(self.num_drafts):
            return self
        t = to_device(idx, self.draft_ids.device, torch.long)
        return _Layout(self.draft_ids[t], self.valid[t], self.row_idx[t], [self.num_drafts[i] for i in idx])


def verify(processed_logits: torch.Tensor, states: list[RequestSamplingState], row_counts: list[int],
           drafts: list[list[int]], draft_probs: list[torch.Tensor | None]) -> list[list[int]]:
    """Emitted tokens per request: the accepted draft prefix + one recovered or bonus token (1..k_i + 1).

    processed_logits: [N, V] output of ``process_logits`` (N = sum(row_counts), row_counts[i] = k_i + 1).
    draft_probs[i]: None (one-hot q of the draft tokens) or [k_i, V] processed draft probabilities.
    """
    _check_inputs(processed_logits, states, row_counts, drafts, draft_probs)
    if not states:
        return []
    if all(s.params.greedy for s in states):  # the common case: one argmax per row, compared on the host
        return accept_greedy(row_argmax(processed_logits), row_counts, drafts)
    logits = processed_logits.float()  # [N, V]
    layout = _Layout.build(row_counts, drafts, logits.device)
    greedy = [i for i, s in enumerate(states) if s.params.greedy]
    sampled = [i for i, s in enumerate(states) if not s.params.greedy]
    k_max = layout.draft_ids.shape[1] - 1
    if not sampled:  # common fast path: one argmax, no softmax, no randomness
        tokens, num_acc = _verify_greedy(logits, layout)
    elif not greedy:
        tokens, num_acc = _verify_sampled(logits, layout, states, draft_probs)
    else:  # mixed batch: each half on its own rows, merged by request index
        tokens = torch.empty(len(states), k_max + 1, dtype=torch.long, device=logits.device)  # [B, K + 1]
        num_acc = torch.empty(len(states), dtype=torch.long, device=logits.device)  # [B]
        parts = [(greedy, _verify_greedy(logits, layout.select(greedy))),
                 (sampled, _verify_sampled(logits, layout.select(sampled), [states[i] for i in sampled],
                                           [draft_probs[i] for i in sampled]))]
        for idx, (sub_tokens, sub_acc) in parts:
            t = to_device(idx, logits.device, torch.long)
            tokens[t], num_acc[t] = sub_tokens, sub_acc
    rows = torch.cat([tokens, num_acc.unsqueeze(1)], dim=1).tolist()  # the one host sync
    return [row[: row[-1] + 1] for row in rows]


def accept_greedy(best: list[int], row_counts: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Greedy chains from each row's target token ``best`` (the argmax of its processed logits): the drafts
    that equal it, then the target's token at the first that does not."""
    emitted = []
    for start, d in zip(row_starts(row_counts), drafts, strict=True):
        n = 0
        while n < len(d) and d[n] == best[start + n]:
            n += 1
        emitted.append([*d[:n], best[start + n]])
    return emitted


def _verify_greedy(logits: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ([B, K + 1] target argmaxes, [B] number of accepted drafts).

    Accepted drafts equal the argmax at their row, so the emitted tokens are argmax[:num_acc + 1].
    """
    k_max = layout.valid.shape[1]
    argmax = argmax_rows(logits)[layout.row_idx]  # [B, K + 1]
    match = (layout.draft_ids[:, :k_max] == argmax[:, :k_max]) & layout.valid  # [B, K]
    return argmax, _num_accepted(match)


def _verify_sampled(logits: torch.Tensor, layout: _Layout, states: list[RequestSamplingState],
                    draft_probs: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a batch of sampled requests: ([B, K + 1] tokens, [B] accepted counts).

    Column j < num_acc holds the accepted draft, column num_acc the recovered / bonus token.
    """
    num_reqs, k_max = layout.valid.shape
    vocab, dev = logits.shape[1], logits.device
    ar = torch.arange(num_reqs, device=dev)
    drafts = layout.draft_ids[:, :k_max]  # [B, K]
    # p_j(x_j) from the log-partition of each row, without materialising softmax of every row.
    lse = torch.logsumexp(logits, dim=-1)  # [N]
    d_rows = layout.row_idx[:, :k_max]  # [B, K]
    p_x = torch.exp(logits[d_rows, drafts] - lse[d_rows])  # [B, K]
    q = _DraftQ.build(draft_probs, layout.num_drafts, vocab, dev, k_max)
    q_x = q.prob_of(drafts)  # [B, K]
    uniforms, noise = _draw(states, layout.num_drafts, k_max, vocab, dev)  # [B, K], [B, V]
    num_acc = _num_accepted(_accept(uniforms, p_x, q_x) & layout.valid)  # [B]

    last_rows = layout.row_idx[ar, num_acc]  # [B]: row num_acc (== k_i when everything was accepted)
    p_last = torch.softmax(logits[last_rows], dim=-1)  # [B, V]
    rejected = num_acc < to_device(layout.num_drafts, dev)  # [B]
    weights = _residual(p_last, q.rows_at(num_acc, layout.draft_ids, rejected))  # [B, V], unnormalised
    final = (weights / noise).argmax(dim=-1)  # [B]: exponential race = one categorical draw per request
    tokens = layout.draft_ids.clone()  # [B, K + 1]
    tokens[ar, num_acc] = final
    return tokens, num_acc


def _num_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """[B, K] bool → [B] length of the all-True prefix."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _accept(uniforms: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """u < min(1, p/q), written u * q < p: no division, q = 0 < p accepts, p = 0 always rejects."""
    return uniforms * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) [B, V], unnormalised; p where it is all zero (p == q up to rounding)."""
    res = (p - q).clamp_min_(0.0)
    empty = res.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    return torch.where(empty, p, res)


@dataclass(slots=True)
class _DraftQ:
    """Draft distributions of a batch: dense rows for proposers with probabilities, implicit one-hots else."""

    dense: torch.Tensor  # [D + 1, V]: all [k_i, V] draft_probs stacked, then one zero row
    dense_row: torch.Tensor  # [B, K + 1] long: row of (i, j) in ``dense``; the zero row when j >= k_i or one-hot
    one_hot: torch.Tensor  # [B] bool: request i has no probabilities (q = one-hot of its draft tokens)

    @staticmethod
    def build(draft_probs: list[torch.Tensor | None], num_drafts: list[int], vocab: int,
              device: torch.device, k_max: int | None = None) -> _DraftQ:
        # NOTE: the layout's K, not this subset's max: a mixed batch's sampled half keeps the whole batch's K
        # (its max k may be smaller), and a narrower dense_row made prob_of fail the whole engine step.
        k_max = max(num_drafts) if k_max is None else k_max
        pieces = [p.to(device=device, dtype=torch.float32) for p in draft_probs if p is not None and p.shape[0]]
        total = sum(p.shape[0] for p in pieces)
        dense = torch.cat([*pieces, torch.zeros(1, vocab, device=device)])  # [D + 1, V]
        rows, start = [], 0
        for p, k in zip(draft_probs, num_drafts, strict=True):
            has = p is not None
            rows.append([start + j if has and j < k else total for j in range(k_max + 1)])
            start += k if has else 0
        one_hot = to_device([p is None for p in draft_probs], device)
        return _DraftQ(dense, to_device(rows, device, torch.long), one_hot)

    def prob_of(self, drafts: torch.Tensor) -> torch.Tensor:
        """q_j(x_j) [B, K] for draft tokens ``drafts`` [B, K]."""
        k_max = drafts.shape[1]
        dense_x = self.dense[self.dense_row[:, :k_max], drafts]  # [B, K]
        return torch.where(self.one_hot.unsqueeze(1), torch.ones_like(dense_x), dense_x)

    def rows_at(self, pos: torch.Tensor, draft_ids: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """q at position ``pos`` [B] as dense rows [B, V]; zero where nothing was rejected (bonus: sample p)."""
        ar = torch.arange(len(pos), device=pos.device)
        q = self.dense[self.dense_row[ar, pos]].clone()  # [B, V]; the zero row for pos == k_i and one-hots
        hot = (self.one_hot & rejected).to(q.dtype)  # [B]
        q[ar, draft_ids[ar, pos]] += hot  # one-hot requests: q = e_{x_pos} at the rejected position
        return q


def _draw(states: list[RequestSamplingState], num_drafts: list[int], k_max: int, vocab: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, K] for the accept tests and Exponential(1) noise [B, V] for the final draw.

    Unseeded requests: one batched draw from the default generator. Seeded requests: k_i uniforms then V
    exponentials from their own generator, so the stream depends only on the request itself.
    """
    uniforms = torch.zeros(len(states), k_max, device=device)  # [B, K]
    noise = torch.empty(len(states), vocab, device=device)  # [B, V]
    unseeded = [i for i, s in enumerate(states) if s.generator is None]
    if len(unseeded) == len(states):
        uniforms.uniform_()
        noise.exponential_()
    elif unseeded:
        t = to_device(unseeded, device, torch.long)
        uniforms[t] = torch.rand(len(unseeded), k_max, device=device)
        noise[t] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, s in enumerate(states):
        gen = s.generator
        if gen is None:
            continue
        uniforms[i, : num_drafts[i]] = torch.rand(num_drafts[i], generator=gen, device=gen.device)
        noise[i] = torch.empty(vocab, device=gen.device).exponential_(generator=gen)
    # E = 0 is possible in float; clamp so p = 0 tokens give 0 / tiny = 0, never 0 / 0 = nan (argmax picks nan).
    return uniforms, noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _check_inputs(logits: torch.Tensor, states: list[RequestSamplingState], row_counts: list[int],
                  drafts: list[list[int]], draft_probs: list[torch.Tensor | None]) -> None:
    n_rows, vocab = logits.shape
    if not len(states) == len(row_counts) == len(drafts) == len(draft_probs):
        raise ValueError(f"batch lists differ in length: {len(states)} states, {len(row_counts)} row_counts, "
                         f"{len(drafts)} drafts, {len(draft_probs)} draft_probs")
    if sum(row_counts) != n_rows:
        raise ValueError(f"sum(row_counts)={sum(row_counts)} but processed_logits has {n_rows} rows")
    for i, (c, d, q) in enumerate(zip(row_counts, drafts, draft_probs, strict=True)):
        if c != len(d) + 1:
            raise ValueError(f"request {i}: row_counts={c} but it has {len(d)} drafts (need drafts + 1 rows)")
        if q is not None and tuple(q.shape) != (len(d), vocab):
            raise ValueError(f"request {i}: draft_probs shape {tuple(q.shape)}, expected ({len(d)}, {vocab})")
        if any(not 0 <= t < vocab for t in d):
            raise ValueError(f"request {i}: draft token out of range [0, {vocab}): {d}")


# -- draft trees ---------------------------------------------------------------------------------------------
def tree_children(parents: list[int]) -> list[list[int]]:
    """Children of each tree row (row 0 = the root, row i + 1 = node i), in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def verify_tree(processed_logits: torch.Tensor, state: RequestSamplingState, tokens: list[int],
                parents: list[int]) -> tuple[list[int], list[int]]:
    """One request's draft tree: (emitted tokens, accepted node indices along the path).

    ``processed_logits`` [N + 1, V]: row 0 the root's, row i + 1 node i's (each processed as after its
    ancestors); ``tokens[i]`` node i's token, ``parents[i]`` its parent's node index (-1: the root), every
    parent before its children. Greedy: follow the child that equals the target's argmax while one does,
    then emit the argmax. Sampled: ``tree_walk`` (multi-draft rejection, exact; docs/speculative_decoding.md).
    """
    n = len(tokens)
    if processed_logits.shape[0] != n + 1 or len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"bad tree: {processed_logits.shape[0]} rows for {n} nodes, parents {parents}")
    kids = tree_children(parents)
    if state.params.greedy:
        best = row_argmax(processed_logits)
        row = 0
        emitted: list[int] = []
        path: list[int] = []
        while True:
            tok = best[row]
            emitted.append(tok)
            nxt = next((c for c in kids[row] if tokens[c] == tok), None)
            if nxt is None:
                return emitted, path
            path.append(nxt)
            row = nxt + 1
    logits = processed_logits.float()
    dev, vocab = logits.device, logits.shape[1]
    gen = state.generator
    if gen is None:
        uniforms = torch.rand(1, n, device=dev)
        noise = torch.empty(1, vocab, device=dev).exponential_()
    else:
        uniforms = torch.rand(1, n, generator=gen, device=gen.device).to(dev)
        noise = torch.empty(1, vocab, device=gen.device).exponential_(generator=gen).to(dev)
    emitted_t, path_t = tree_walk(torch.softmax(logits, dim=-1), to_device(tokens, dev, torch.long),
                                  _children_table(kids, dev), uniforms, noise)
    em, pa = emitted_t[0].tolist(), path_t[0].tolist()
    return [t for t in em if t >= 0], [p for p in pa if p >= 0]


def _children_table(kids: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, kids)))
    return to_device([k + [-1] * (width - len(k)) for k in kids], device, torch.long)


def tree_walk(probs: torch.Tensor, tokens: torch.Tensor, children: torch.Tensor, uniforms: torch.Tensor,
              noise: torch.Tensor, zero_rejected: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-draft rejection sampling down a tree, for D independent draws at once.

    probs [R, V] target distributions per tree row; tokens [N] node tokens; children [R, C] node indices
    (-1 padded) in a fixed order; uniforms [D, N] (one per node); noise [D, V] Exponential(1).
    At a row with distribution p and children x_1 .. x_m (distinct tokens, chosen without looking at the
    target's randomness), keep weights w = p: for each child in order, accept it with probability
    w(x_j) / sum(w) and move to it; else set w(x_j) = 0 (the residual). When every child is rejected (or
    there are none), emit a sample of w / sum(w). Then P(emit x_j) = p(x_j) for every token, candidate or
    not, so the emitted sequence is distributed as sampling the target token by token.
    ``zero_rejected=False`` is the deliberately broken sampler the statistical test must catch.
    Returns ([D, depth + 1] emitted tokens, [D, depth] accepted node indices), -1 padded.
    """
    d_draws, vocab = noise.shape
    dev = probs.device
    ar = torch.arange(d_draws, device=dev)
    row = torch.zeros(d_draws, dtype=torch.long, device=dev)
    live = torch.ones(d_draws, dtype=torch.bool, device=dev)
    emitted, path = [], []
    while bool(live.any()):
        w = probs[row].clone()  # [D, V]
        moved = torch.zeros(d_draws, dtype=torch.bool, device=dev)
        nxt = torch.full((d_draws,), -1, dtype=torch.long, device=dev)
        for j in range(children.shape[1]):
            c = children[row, j]  # [D]
            try_ = live & ~moved & (c >= 0)
            cc = c.clamp_min(0)
            x = tokens[cc]
            acc = try_ & (uniforms[ar, cc] * w.sum(dim=-1) < w[ar, x])
            nxt = torch.where(acc, c, nxt)
            moved |= acc
            if zero_rejected:
                w[ar, x] = torch.where(try_ & ~acc, torch.zeros_like(w[ar, x]), w[ar, x])
        final = (w / noise).argmax(dim=-1)  # exponential race over the residual
        tok = torch.where(moved, tokens[nxt.clamp_min(0)], final)
        emitted.append(torch.where(live, tok, torch.full_like(tok, -1)))
        path.append(torch.where(live & moved, nxt, torch.full_like(nxt, -1)))
        live = live & moved
        row = torch.where(moved, nxt + 1, row)
    return torch.stack(emitted, dim=1), torch.stack(path, dim=1)[:, :-1]
