"""Verification of one step's drafts: ``verify_step`` is the one entry point the model runner calls.

For each sampling row it emits the accepted drafts plus one token from the target's logits (k = 0 is ordinary
decoding): all-greedy chains take the argmax fast path (``sampler.greedy_argmax``, ``accept_greedy``); other
chains go through exact rejection sampling (``rejection_sampler.verify``) and draft trees through multi-draft
rejection (``rejection_sampler.verify_tree``). A tree's accepted path is then *settled*: moved into the slots
right after its root, as if it had been a chain. ``verify_step`` returns those moves -- KV slots, and the rows
of the step's features -- for the runner to apply (the KV move is a mirrored model call); the rest of the tree
is stale, like rejected chain drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.outputs import ScheduledRequest
from specserve.platform import to_device
from specserve.sample.rejection_sampler import accept_greedy, verify, verify_tree
from specserve.sample.sampler import RequestSamplingState, greedy_argmax, process_logits, row_starts


@dataclass(slots=True)
class Verification:
    emitted: list[list[int]]  # per sampling row: its accepted drafts and the target's next token
    paths: dict[int, list[int]] = field(default_factory=dict)  # tree rows (by sampling row): the accepted nodes
    kv_src: list[int] = field(default_factory=list)  # settling trees: KV slots to move ...
    kv_dst: list[int] = field(default_factory=list)  # ... to these slots
    feature_moves: list[tuple[int, int]] = field(default_factory=list)  # (from, to) flat rows of the step


def verify_step(logits: torch.Tensor, rows: list[ScheduledRequest], states: list[RequestSamplingState],
                qs: list[torch.Tensor | None], block_size: int) -> Verification:
    """``logits``: [sum of counts, vocab] at the sampling rows' positions (``rows``: the step's rows, in order;
    ``states`` and ``qs``, the drafts' q or None, per sampling row)."""
    sample_rows = [r for r in rows if r.needs_sample]
    counts = [r.num_spec_tokens + 1 for r in sample_rows]
    drafts = [list(r.token_ids[r.num_tokens - r.num_spec_tokens:]) for r in sample_rows]
    # all-greedy chains with no processing but grammars: argmaxes, masking only rows whose argmax is forbidden
    best = greedy_argmax(logits, states, counts, drafts) \
        if all(r.spec_parents is None for r in sample_rows) else None
    if best is not None:
        return Verification(accept_greedy(best, counts, drafts))
    emitted, paths = _verify_rows(process_logits(logits, states, counts, drafts), sample_rows, states, counts,
                                  drafts, qs)
    out = Verification(emitted, paths)
    if paths:
        _settle_trees(out, rows, sample_rows, block_size)
    return out


def _verify_rows(processed: torch.Tensor, rows: list[ScheduledRequest], states: list[RequestSamplingState],
                 counts: list[int], drafts: list[list[int]], qs: list[torch.Tensor | None]
                 ) -> tuple[list[list[int]], dict[int, list[int]]]:
    """Emitted tokens per sampling row, and the accepted node path of each tree row (by row index)."""
    tree = [i for i, r in enumerate(rows) if r.spec_parents is not None]
    if not tree:
        return verify(processed, states, counts, drafts, qs), {}
    starts = [*row_starts(counts), sum(counts)]
    emitted: list[list[int]] = [[] for _ in rows]
    paths: dict[int, list[int]] = {}
    for i in tree:
        parents = rows[i].spec_parents
        assert parents is not None
        emitted[i], paths[i] = verify_tree(processed[starts[i]:starts[i + 1]], states[i], drafts[i], list(parents))
    chain = [i for i in range(len(rows)) if rows[i].spec_parents is None]
    if chain:
        idx = to_device([j for i in chain for j in range(starts[i], starts[i + 1])], processed.device, torch.long)
        for i, em in zip(chain, verify(processed[idx], [states[i] for i in chain], [counts[i] for i in chain],
                                       [drafts[i] for i in chain], [qs[i] for i in chain])):
            emitted[i] = em
    return emitted, paths


def _settle_trees(out: Verification, rows: list[ScheduledRequest], sample_rows: list[ScheduledRequest],
                  block_size: int) -> None:
    """The moves that put each tree's accepted path into the slots right after its root: KV slots, and the
    flat rows of the step's features."""
    flat_start, off = {}, 0
    for r in rows:
        flat_start[r.req_id] = off
        off += r.num_tokens
    for i, path in out.paths.items():
        r = sample_rows[i]
        first = r.num_tokens - r.num_spec_tokens  # row index of node 0
        moved = [(first + p, first + j) for j, p in enumerate(path) if p != j]
        bs = block_size
        for a, b in moved:
            pa, pb = r.num_computed_tokens + a, r.num_computed_tokens + b
            out.kv_src.append(r.block_ids[pa // bs] * bs + pa % bs)
            out.kv_dst.append(r.block_ids[pb // bs] * bs + pb % bs)
            out.feature_moves.append((flat_start[r.req_id] + a, flat_start[r.req_id] + b))
