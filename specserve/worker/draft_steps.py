"""The model calls of drafting, one function per kind of result: the draft model's and layer skip's logits
(``logits_step``), and the EAGLE head's logits, draft-vocabulary logits and top-b tokens (``eagle_steps``).
The proposers in spec_decode/ call them through the types they declare (``DraftStep``, ``EagleSteps``)."""

from __future__ import annotations

import torch

from specserve.model.decoder import DecoderModel
from specserve.model.eagle_head import EagleHead
from specserve.spec_decode.draft_model import DraftStep
from specserve.spec_decode.eagle import EagleSteps
from specserve.worker.draft_vocab import Extra, ReducedVocab
from specserve.worker.graphs import GraphPlan, ModelStep
from specserve.worker.input_batch import RowTree, flat_batch

Feats = list[torch.Tensor] | torch.Tensor  # per request [n_i, feature size], or one [B, feature size]


def logits_step(model: DecoderModel, kv: list[torch.Tensor], block_size: int, device: torch.device,
                layers: int | None, plan: GraphPlan | None, vocab: ReducedVocab | None = None) -> DraftStep:
    """A draft model's forward (or the target's first ``layers``: layer skip): [B, vocab] logits at each
    request's last fed token; with ``vocab``, its head rows only (and each request's ``Extra``)."""
    forward = ModelStep(model, kv, block_size, device, layers, plan)

    def step(token_ids: list[list[int]], starts: list[int], block_ids: list[tuple[int, ...]],
             extras: list[Extra | None] | None = None) -> torch.Tensor:
        hidden = forward(token_ids, starts, block_ids).last_hidden()
        if vocab is not None:
            return vocab.logits(hidden, extras)
        return model.compute_logits(hidden)  # [B, V]
    return step


def eagle_steps(target: DecoderModel, head: EagleHead, kv: torch.Tensor, block_size: int,
                device: torch.device) -> EagleSteps:
    """The head's forward over a flat batch of entries, with the target's embedding, final norm and LM head,
    read three ways (``EagleSteps``). Neither ``vocab_logits`` nor ``top`` builds [B, vocab] logits where the
    head has a draft vocabulary."""
    vocab = head.cfg.vocab_size

    def forward(token_ids: list[list[int]], feats: Feats, starts: list[int], block_ids: list[tuple[int, ...]],
                trees: list[RowTree | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed predicted features, the raw ones [B, hidden]) at each request's last entry; with
        ``trees`` (a draft tree's expansion, ``input_batch.pack_batch``) at every entry."""
        fb = flat_batch(token_ids, starts, block_ids, block_size, device, trees)
        embeds = target.embed_tokens(fb.input_ids)  # [T, hidden]
        f = feats if isinstance(feats, torch.Tensor) else torch.cat(feats)
        pred = head(embeds, f.to(device=device, dtype=embeds.dtype), fb.positions, kv, fb.meta)  # [T, hidden]
        if trees is not None or fb.meta.max_query_len == 1:
            last = pred
        else:
            last = pred[fb.meta.query_start_loc[1:].long() - 1]  # [B, hidden]
        return target.ops.add_norm(last, None, target.norm)[1], last

    def reduced(normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = head.reduced_logits(normed)
        return out if out is not None else (target.compute_logits(normed)[:, :vocab].float(), None)

    def logits(token_ids: list[list[int]], feats: Feats, starts: list[int], block_ids: list[tuple[int, ...]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            normed, last = forward(token_ids, feats, starts, block_ids, None)
            return head.draft_logits(normed, target.compute_logits), last

    def vocab_logits(token_ids: list[list[int]], feats: Feats, starts: list[int], block_ids: list[tuple[int, ...]]
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        with torch.inference_mode():
            normed, last = forward(token_ids, feats, starts, block_ids, None)
            return reduced(normed), last

    def top(token_ids: list[list[int]], feats: Feats, starts: list[int], block_ids: list[tuple[int, ...]],
            trees: list[RowTree | None] | None, b: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        with torch.inference_mode():
            normed, last = forward(token_ids, feats, starts, block_ids, trees)
            scores, ids = reduced(normed)
            vals, idx = torch.log_softmax(scores, dim=-1).topk(b, dim=-1)
            return (vals, idx if ids is None else ids[idx]), last

    return EagleSteps(logits, vocab_logits, top)
