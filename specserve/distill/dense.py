"""Dense, differentiable forwards for training drafts: whole padded sequences [B, S], causal SDPA, no KV cache.

They read the same parameters as the serving forwards (``DecoderModel``, ``EagleHead``), so what is trained is
exactly what is served; ``tests/test_eagle.py`` checks the head's dense forward against the engine's drafts.
Right padding is harmless under a causal mask: real positions never attend to later (padded) ones.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from specserve.model.decoder import Attention, DecoderLayer, DecoderModel
from specserve.model.eagle_head import EagleHead
from specserve.model.layers import RotaryEmbedding


def qkv(attn: Attention, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., S, hidden], positions: [S] -> q [..., heads, S, D], k and v [..., heads, S, D] (GQA expanded)."""
    shape = x.shape[:-1]
    out = F.linear(x, attn.qkv, attn.qkv_bias)
    q, k, v = out.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    if attn.q_norm is not None and attn.k_norm is not None and attn.qk_norm_full:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = q.view(*shape, attn.num_heads, attn.head_dim)
    k = k.view(*shape, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None and not attn.qk_norm_full:
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = v.view(*shape, attn.num_kv_heads, attn.head_dim)
    q, k = rope(positions, q, k)  # cos/sin [S, 1, D] broadcast over the batch
    group = attn.num_heads // attn.num_kv_heads
    q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    return q, k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)


def attention(attn: Attention, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """x: [B, S, hidden], positions: [S] -> [B, S, hidden] (causal, within the layer's sliding window)."""
    b, s, _ = x.shape
    q, k, v = qkv(attn, x, rope, positions)  # [B, heads, S, D]
    if attn.window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    else:
        gap = positions[:, None] - positions[None, :]  # query - key
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=(gap >= 0) & (gap < attn.window), scale=attn.scale)
    return F.linear(o.transpose(1, 2).reshape(b, s, attn.q_size), attn.o)


def layer_forward(layer: DecoderLayer, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,
                  input_norm: bool = True) -> torch.Tensor:
    a = attention(layer.attn, layer.input_norm(x) if input_norm else x, rope, positions)
    h = x + (a if layer.attn_out_norm is None else layer.attn_out_norm(a))
    m = layer.mlp(layer.post_norm(h).flatten(0, -2)).view_as(h)
    return h + (m if layer.mlp_out_norm is None else layer.mlp_out_norm(m))


def model_features(model: DecoderModel, ids: torch.Tensor, num_layers: int | None = None,
                   taps: tuple[int, ...] | None = None) -> torch.Tensor:
    """ids [B, S] -> the last (or ``num_layers``-th) layer's output before the final norm [B, S, hidden]; with
    ``taps``, the outputs of those layers (1-based) concatenated [B, S, len(taps) * hidden]."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    h = model.embed_tokens(ids)
    kept = []
    for i, (layer, rope) in enumerate(zip(list(model.layers)[:num_layers], model.layer_ropes), start=1):
        h = layer_forward(cast(DecoderLayer, layer), h, rope, positions)
        if taps and i in taps:
            kept.append(h)
    return torch.cat(kept, dim=-1) if taps else h


def logits(model: DecoderModel, features: torch.Tensor) -> torch.Tensor:
    """Pre-norm features [..., hidden] -> [..., vocab] through the model's final norm and LM head."""
    return F.linear(model.norm(features), model.lm_head).float()


def head_forward(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """EAGLE head over whole sequences: entry p = (embedding of t_p [B, S, H], feature h_{p-1} [B, S, H])
    -> predicted h_p [B, S, H] (teacher forcing: every entry reads the target's feature)."""
    positions = torch.arange(embeds.shape[1], device=embeds.device)
    return layer_forward(head.layer, head.fuse(embeds, features), head.rope, positions)


def head_second_step(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, pred: torch.Tensor,
                     rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Training-time test of the second draft step (as served): entry p = (t_p, the head's own prediction
    ĥ_{p-1}) attending to the true entries j < p and to itself. Computed only at the loss positions
    (``rows``, ``pos``: [N] batch row and position, p >= 1) -> predicted h_p [N, hidden].

    embeds, features (the head's teacher-forced inputs h_{p-1}), pred (its step-1 output): [B, S, hidden].
    """
    layer, attn = head.layer, head.layer.attn
    positions = torch.arange(embeds.shape[1], device=embeds.device)
    _, k1, v1 = qkv(attn, layer.input_norm(head.fuse(embeds, features)), head.rope, positions)  # [B, H, S, D]
    x2 = head.fuse(embeds[rows, pos], pred[rows, pos - 1])  # [N, hidden]
    q2, k2, v2 = F.linear(layer.input_norm(x2), attn.qkv, attn.qkv_bias).split(
        [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    group = attn.num_heads // attn.num_kv_heads
    q2, k2 = head.rope(pos, q2.view(-1, attn.num_heads, attn.head_dim),
                       k2.view(-1, attn.num_kv_heads, attn.head_dim))  # [N, heads, D], [N, kv heads, D]
    k2 = k2.repeat_interleave(group, dim=1)
    v2 = v2.view(-1, attn.num_kv_heads, attn.head_dim).repeat_interleave(group, dim=1)
    o = torch.empty_like(q2)
    for b in rows.unique().tolist():  # per sequence: its queries against its own step-1 keys
        sel = (rows == b).nonzero().squeeze(1)
        p = pos[sel]
        keys = torch.cat([k1[b], k2[sel].transpose(0, 1)], dim=1)  # [heads, S + n, D]
        vals = torch.cat([v1[b], v2[sel].transpose(0, 1)], dim=1)
        n = sel.shape[0]
        mask = torch.cat([positions[None, :] < p[:, None],  # true entries before p
                          torch.eye(n, dtype=torch.bool, device=p.device)], dim=1)  # [n, S + n]: and itself
        o[sel] = F.scaled_dot_product_attention(q2[sel].transpose(0, 1), keys, vals, attn_mask=mask,
                                                scale=attn.scale).transpose(0, 1).to(o.dtype)  # autocast
    h = x2 + F.linear(o.reshape(o.shape[0], attn.q_size), attn.o)
    return h + layer.mlp(layer.post_norm(h))


def shift_features(features: torch.Tensor) -> torch.Tensor:
    """[B, S, H] h_0.. -> [B, S, H] h_{-1}.. (zeros first): the feature input of each head entry."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
