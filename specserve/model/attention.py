"""Paged attention over a flat token batch: the interface, and the pure-torch reference backend.

A step's batch is a flat list of new tokens from several requests. Request ``r`` owns the new tokens
``query_start_loc[r] : query_start_loc[r + 1]``; they sit at the *end* of its context of ``seq_lens[r]``
tokens, so new token ``i`` of request ``r`` has position ``seq_lens[r] - query_len[r] + i`` and attends to
keys ``0 .. that position`` (causal inside the new tokens). The same metadata covers prefill chunks,
single decode tokens and k+1 verification tokens, in any mix.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Token at position ``p`` of request ``r`` lives in block ``block_tables[r, p // block_size]`` at offset
``p % block_size``; ``slot_mapping`` holds ``block * block_size + offset`` for each new token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

# Requests with at most this many new tokens go through one padded, batched attention call.
_BATCHED_MAX_QUERY = 16


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step's new tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies (no device sync needed to plan the reference path).
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(Protocol):
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor: ...


class TorchAttention:
    """Reference backend (the CPU path and the oracle for the Triton kernels)."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # key/value: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> out: same shape
        out = torch.empty_like(query)
        short = [r for r, q in enumerate(meta.query_lens_host) if 0 < q <= _BATCHED_MAX_QUERY]
        if short:
            _attend_batched(query, kv_cache, meta, scale, short, out)
        starts = meta.query_start_loc.tolist() if len(short) < meta.num_reqs else []
        for r, q_len in enumerate(meta.query_lens_host):
            if q_len > _BATCHED_MAX_QUERY:
                s = starts[r]
                out[s:s + q_len] = _attend_one(query[s:s + q_len], kv_cache, meta.block_tables[r],
                                               meta.seq_lens_host[r], scale)
        return out


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[2, ..., seq_len, num_kv_heads, head_dim] for one request's (or a batch of) block table(s)."""
    block_size = kv_cache.shape[2]
    nblk = -(-seq_len // block_size)
    kv = kv_cache[:, block_table[..., :nblk].long()]  # [2, (B,) nblk, block_size, Hkv, D]
    kv = kv.flatten(-4, -3)  # [2, (B,) nblk * block_size, Hkv, D]
    return kv[..., :seq_len, :, :]


def _attend_one(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                scale: float) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    k, v = _gather_kv(kv_cache, block_table, seq_len)  # [seq_len, Hkv, D]
    group = num_heads // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    ctx = seq_len - q_len
    qpos = torch.arange(q_len, device=q.device)[:, None] + ctx
    mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos  # [q_len, seq_len]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _attend_batched(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    reqs: list[int], out: torch.Tensor) -> None:
    device = query.device
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    idx = torch.tensor(reqs, device=device)
    q_lens = torch.tensor([meta.query_lens_host[r] for r in reqs], device=device)
    s_lens = torch.tensor([meta.seq_lens_host[r] for r in reqs], device=device)
    max_q = int(max(meta.query_lens_host[r] for r in reqs))
    max_s = int(max(meta.seq_lens_host[r] for r in reqs))
    b = len(reqs)
    # Padded query gather: [B, max_q] token indices into the flat batch.
    qi = torch.arange(max_q, device=device)
    valid_q = qi[None, :] < q_lens[:, None]  # [B, max_q]
    tok = (meta.query_start_loc[idx].long()[:, None] + qi[None, :]).clamp(max=query.shape[0] - 1)
    q = query[tok]  # [B, max_q, H, D]
    k, v = _gather_kv(kv_cache, meta.block_tables[idx], max_s)  # [B, S, Hkv, D]
    k = k.to(query.dtype).permute(0, 2, 1, 3)  # [B, Hkv, S, D]
    v = v.to(query.dtype).permute(0, 2, 1, 3)
    # GQA without copying K/V: fold the query heads of a group into the query-length axis.
    q = q.view(b, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(b, num_kv_heads, group * max_q, head_dim)
    qpos = (s_lens - q_lens)[:, None] + qi[None, :]  # [B, max_q]
    mask = torch.arange(max_s, device=device)[None, None, :] <= qpos[:, :, None]  # [B, max_q, S]
    mask = mask.repeat(1, group, 1)[:, None]  # [B, 1, group * max_q, S]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.view(b, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(b, max_q, num_heads, head_dim)
    out[tok[valid_q]] = o[valid_q]


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for a flat batch (used by the model runner and by tests)."""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


def make_backend(name: str) -> AttentionBackend:
    """Chosen once at start-up from ``platform.attention_backend``."""
    if name == "triton":
        from specserve.model.triton_attention import TritonAttention

        return TritonAttention()
    return TorchAttention()
