"""Target features for EAGLE drafting (and for `specserve distill`): the last decoder layer's output before
the final norm, per request, for the positions whose KV the step verified.

A *feature sink* receives ``(req_id, first position, [n, hidden])`` for every row of a step: all computed
tokens of a prefill chunk, and for a sampling row its real token(s) plus the accepted drafts (the rejected
drafts' features are as stale as their KV and are dropped here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specserve.model.eagle_head import EagleHead
from specserve.model.llama import LlamaModel
from specserve.outputs import ScheduledRequest
from specserve.spec_decode.eagle import EagleStep
from specserve.worker.input_batch import RowTree, flat_batch

# (req_id, first position, [n, hidden] features, whether they are views of the step's own copy)
FeatureSink = Callable[[str, int, torch.Tensor, bool], None]


# A step of at most this many rows is copied once and its sinks get views of the copy; a larger one (a prefill
# chunk) is handed over as views of the forward's own output, copied per row by the sink that keeps it.
SHARED_COPY_ROWS = 256


def sink_features(rows: list[ScheduledRequest], sampled: dict[str, list[int]], prenorm: torch.Tensor,
                  sink: FeatureSink) -> None:
    """prenorm: [T, hidden] for the step's flat tokens (rows in order). A sink that keeps a row's features
    beyond the call must own them: ``FeatureBuffer.add`` copies them unless they are views of this step's
    copy (``owned``: a decode or verification step's rows share one copy instead of one per request)."""
    owned = prenorm.shape[0] <= SHARED_COPY_ROWS
    if owned:
        prenorm = prenorm.clone()  # the forward's output may be a buffer the next step reuses (graphs)
    off = 0
    for r in rows:
        valid = r.num_tokens
        if r.req_id in sampled:  # drop the rejected drafts
            valid = r.num_tokens - r.num_spec_tokens + len(sampled[r.req_id]) - 1
        if valid > 0:
            sink(r.req_id, r.num_computed_tokens, prenorm[off:off + valid], owned)
        off += r.num_tokens


class FeatureBuffer:
    """One request's features since its last proposal: contiguous positions ``first .. first + count``. The
    count is kept, not summed over the chunks: a request that does not draft for a while gathers a chunk per
    step, and the controller reads every buffer's length every step.

    Chunks that are views of a step's copy (``sink_features``) are kept as they are; they keep that copy (all
    the step's rows) alive, so every ``COMPACT_AT`` of them are joined into one chunk of the buffer's own."""

    __slots__ = ("first", "chunks", "count", "views")
    COMPACT_AT = 8

    def __init__(self) -> None:
        self.first = 0
        self.chunks: list[torch.Tensor] = []
        self.count = 0
        self.views = 0  # the last chunks that are views of a step's copy

    def add(self, pos: int, h: torch.Tensor, owned: bool = False) -> None:
        if not self.chunks or pos != self.first + self.count:  # first chunk, or a restart (preemption, prefix hit)
            self.first, self.chunks, self.count, self.views = pos, [], 0, 0
        if not owned:  # NOTE: a view of the forward's output is not ours to keep
            h = h.clone()
            self.views = 0
        self.chunks.append(h)
        self.count += h.shape[0]
        if owned:
            self.views += 1
            if self.views >= self.COMPACT_AT:
                self.chunks[-self.views:] = [torch.cat(self.chunks[-self.views:])]
                self.views = 0

    def __len__(self) -> int:
        return self.count

    def take(self) -> tuple[int, torch.Tensor] | None:
        if not self.chunks:
            return None
        out = (self.first, torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0])
        self.first += out[1].shape[0]
        self.chunks, self.count, self.views = [], 0, 0
        return out


def eagle_step(target: LlamaModel, head: EagleHead, kv: torch.Tensor, block_size: int,
               device: torch.device) -> EagleStep:
    """The head's forward over a flat batch of entries, with the target's embedding, final norm and LM head:
    logits and predicted features at each request's last entry; with ``trees`` (a draft tree's expansion,
    ``input_batch.pack_batch``) at every entry. ``top`` = b > 1: ([B, b] log-probabilities, [B, b] token ids)
    of the b most likely tokens instead of the logits; ``top`` = -1: ([B, M] logits over the head's draft
    vocabulary, its [M] token ids; None for the full vocabulary). Neither builds [B, vocab] logits where the
    head has a draft vocabulary."""
    vocab = head.cfg.vocab_size

    def step(token_ids: list[list[int]], feats: list[torch.Tensor] | torch.Tensor, starts: list[int],
             block_ids: list[tuple[int, ...]], trees: list[RowTree | None] | None = None, top: int = 0
             ) -> tuple[Any, torch.Tensor]:
        fb = flat_batch(token_ids, starts, block_ids, block_size, device, trees)
        with torch.inference_mode():
            embeds = target.embed_tokens(fb.input_ids)  # [T, hidden]
            f = feats if isinstance(feats, torch.Tensor) else torch.cat(feats)
            pred = head(embeds, f.to(device=device, dtype=embeds.dtype), fb.positions, kv, fb.meta)  # [T, hidden]
            if trees is not None or fb.meta.max_query_len == 1:
                last = pred
            else:
                last = pred[fb.meta.query_start_loc[1:].long() - 1]  # [B, hidden]
            normed = target.ops.add_norm(last, None, target.norm)[1]
            if top == 0:
                return head.draft_logits(normed, target.compute_logits), last
            reduced = head.reduced_logits(normed)
            logits, ids = reduced if reduced is not None else (target.compute_logits(normed)[:, :vocab].float(), None)
            if top == -1:
                return (logits, ids), last
            vals, idx = torch.log_softmax(logits, dim=-1).topk(top, dim=-1)
            return (vals, idx if ids is None else ids[idx]), last
    return step
