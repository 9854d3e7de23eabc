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
from typing import Any, Protocol

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
    block_size: int = 16
    # Backend-private precomputation shared by all layers of one forward (e.g. gather indices, masks).
    plan: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(Protocol):
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor: ...


@dataclass(slots=True)
class _BatchedPlan:
    """Gather indices and mask for the requests with short queries, built once per forward."""

    tok: torch.Tensor  # [B, max_q] flat token index of each padded query (clamped)
    valid: torch.Tensor  # [B, max_q] bool
    slots: torch.Tensor  # [B, max_s] flat KV slot of each key position (clamped to 0 past the end)
    mask: torch.Tensor  # [B, 1, group * max_q, max_s] bool: key visible to query
    out_tok: torch.Tensor  # [num valid] flat token index of each valid padded query
    max_q: int


@dataclass(slots=True)
class _Plan:
    batched: _BatchedPlan | None
    long_reqs: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (start, q_len, slots [S], mask [q, S])


class TorchAttention:
    """Reference backend (the CPU path and the oracle for the Triton kernels).

    Requests with few new tokens (decode, verification) are padded into one SDPA call; longer ones
    (prefill chunks) get one call each. Gather indices and masks are planned once per forward.
    """

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # key/value: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> out: same shape
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        plan = meta.plan
        if not isinstance(plan, _Plan):
            plan = meta.plan = _make_plan(meta, kv_cache.shape[2], group, query.shape[0])
        out = torch.empty_like(query)
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        if plan.batched is not None:
            bp = plan.batched
            b, max_q = bp.tok.shape
            q = _rows(query, bp.tok)  # [B, max_q, H, D]
            # GQA without copying K/V: fold the query heads of a group into the query-length axis.
            q = q.view(b, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
            q = q.reshape(b, num_kv_heads, group * max_q, head_dim)
            k = _rows(k_flat, bp.slots).to(query.dtype).transpose(1, 2)  # [B, Hkv, S, D]
            v = _rows(v_flat, bp.slots).to(query.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bp.mask, scale=scale)
            o = o.view(b, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
            out[bp.out_tok] = o.reshape(b, max_q, num_heads, head_dim)[bp.valid]
        for start, q_len, slots, mask in plan.long_reqs:
            k = _rows(k_flat, slots).to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            v = _rows(v_flat, slots).to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[start:start + q_len] = o.transpose(0, 1)
        return out


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an integer index of any shape, as one row copy.

    NOTE: CPU advanced indexing copies element by element; gathering 300 KV rows that way took ~430 us per
    layer inside a forward (a third of a 135M model's decode step), ``index_select`` ~80 us.
    """
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _key_slots(table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[..., seq_len] flat KV slot of every key position of (a batch of) block table(s)."""
    pos = torch.arange(seq_len, device=table.device)
    blocks = table[..., pos // block_size].long()
    return blocks * block_size + pos % block_size


def _make_plan(meta: AttentionMetadata, block_size: int, group: int, num_tokens: int) -> _Plan:
    device = meta.block_tables.device
    starts = meta.query_start_loc.tolist()
    short = [r for r, q in enumerate(meta.query_lens_host) if 0 < q <= _BATCHED_MAX_QUERY]
    batched = None
    if short:
        idx = torch.tensor(short, device=device)
        q_lens = torch.tensor([meta.query_lens_host[r] for r in short], device=device)
        s_lens = torch.tensor([meta.seq_lens_host[r] for r in short], device=device)
        max_q = max(meta.query_lens_host[r] for r in short)
        max_s = max(meta.seq_lens_host[r] for r in short)
        qi = torch.arange(max_q, device=device)
        valid = qi[None, :] < q_lens[:, None]  # [B, max_q]
        tok = (meta.query_start_loc[idx].long()[:, None] + qi[None, :]).clamp(max=max(num_tokens - 1, 0))
        kpos = torch.arange(max_s, device=device)
        slots = _key_slots(meta.block_tables[idx], max_s, block_size)
        slots = torch.where(kpos[None, :] < s_lens[:, None], slots, torch.zeros_like(slots))
        qpos = (s_lens - q_lens)[:, None] + qi[None, :]  # [B, max_q]
        mask = kpos[None, None, :] <= qpos[:, :, None]  # [B, max_q, S]
        mask = mask.repeat(1, group, 1)[:, None]  # [B, 1, group * max_q, S]
        batched = _BatchedPlan(tok, valid, slots, mask, tok[valid], max_q)
    long_reqs = []
    for r, q_len in enumerate(meta.query_lens_host):
        if q_len > _BATCHED_MAX_QUERY:
            s_len = meta.seq_lens_host[r]
            slots = _key_slots(meta.block_tables[r], s_len, block_size)
            qpos = torch.arange(q_len, device=device)[:, None] + (s_len - q_len)
            mask = torch.arange(s_len, device=device)[None, :] <= qpos  # [q_len, S]
            long_reqs.append((starts[r], q_len, slots, mask))
    return _Plan(batched, long_reqs)


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
