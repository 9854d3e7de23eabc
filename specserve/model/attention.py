"""Paged attention over a flat token batch: the interface, and the pure-torch reference backend.

A step's batch is a flat list of new tokens from several requests. Request ``r`` owns the new tokens
``query_start_loc[r] : query_start_loc[r + 1]``; they sit at the *end* of its context of ``seq_lens[r]``
tokens, so new token ``i`` of request ``r`` has position ``seq_lens[r] - query_len[r] + i`` and attends to
keys ``0 .. that position`` (causal inside the new tokens), or with a sliding ``window`` (an argument of
``attend``, per layer) to the last ``window`` of them: keys ``position - window + 1 .. position``. The same
metadata covers prefill chunks, single decode tokens and k+1 verification tokens, in any mix.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Token at position ``p`` of request ``r`` lives in block ``block_tables[r, p // block_size]`` at offset
``p % block_size``; ``slot_mapping`` holds ``block * block_size + offset`` for each new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.model.attention_metadata import (
    AttentionBackend,
    AttentionMetadata,
    build_metadata,
    tree_positions,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "CpuKernelAttention", "TorchAttention", "build_metadata",
           "make_backend"]


# Query rows are attended in aligned groups: the rows of positions 8g .. 8g+7 of one request form group g,
# always padded to _GROUP rows, with keys 0 .. _bucket(g) - 1 (the group's last position + 1 rounded up to a
# multiple of _KEY_PAD; later keys masked). A row's call shape then depends only on its own position, never
# on the batch, the chunking of the prompt, the number of drafts or the prefix cache.
# NOTE: torch's CPU SDPA rounds a query row differently depending on how many query rows share its call
# and on the key length, but identically for a fixed row count and key length whatever the other rows
# and the batch size (measured, torch 2.13: 0 of 727 rows differ; 1-3 of 655 when the key length varies).
# With Platform.linear's row-invariant bf16 matmuls this makes bf16 inference on CPU batch-invariant, and
# greedy speculation bit-exact there (tests/test_spec_equality.py::test_bf16_*).
_GROUP = 8
_KEY_PAD = 64


def _bucket(group: int) -> int:
    return -(-(group + 1) * _GROUP // _KEY_PAD) * _KEY_PAD


@dataclass(slots=True)
class _GroupPlan:
    """The groups of one key-length bucket: gather indices and mask, built once per forward."""

    tok: torch.Tensor  # [n, _GROUP] flat token index of each padded query row (0 where not a new token)
    valid: torch.Tensor  # [n, _GROUP] bool: the row is one of this step's new tokens
    slots: torch.Tensor  # [n, S] flat KV slot of each key position of each group's request
    mask: torch.Tensor  # [n, 1, heads_per_kv * _GROUP, S] bool: key visible to query row
    out_tok: torch.Tensor  # [num valid] flat token index of each valid query row


class TorchAttention:
    """Reference backend (the CPU path and the oracle for the Triton kernels).

    Query rows go in aligned groups of 8 (see ``_GROUP``), one SDPA call per key-length bucket; gather
    indices and masks are planned once per forward and window (``meta.plan``: window -> plans) and shared by
    all layers. A window only narrows the mask: the call shapes, hence a row's rounding, stay the same.
    """

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # key/value: [num_tokens, num_kv_heads, head_dim]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> out: same shape
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = kv_cache.shape[3]
        per_kv = num_heads // num_kv_heads
        if not isinstance(meta.plan, dict):
            meta.plan = {}
        window = window or None
        plans = meta.plan.get(window)
        if plans is None:
            plans = meta.plan[window] = _make_plan(meta, kv_cache.shape[2], per_kv, window)
        out = torch.empty_like(query)
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        for gp in plans:
            n = gp.tok.shape[0]
            q = _rows(query, gp.tok)  # [n, G, H, D]
            # GQA without copying K/V: fold the query heads of a KV head into the query-row axis.
            q = q.view(n, _GROUP, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
            q = q.reshape(n, num_kv_heads, per_kv * _GROUP, head_dim)
            k = _rows(k_flat, gp.slots).to(query.dtype).transpose(1, 2)  # [n, Hkv, S, D]
            v = _rows(v_flat, gp.slots).to(query.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=gp.mask, scale=scale)
            o = o.view(n, num_kv_heads, per_kv, _GROUP, head_dim).permute(0, 3, 1, 2, 4)
            out[gp.out_tok] = o.reshape(n, _GROUP, num_heads, head_dim)[gp.valid]
        return out


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an integer index of any shape, as one row copy.

    NOTE: CPU advanced indexing copies element by element; gathering 300 KV rows that way took ~430 us per
    layer inside a forward (a third of a 135M model's decode step), ``index_select`` ~80 us.
    """
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _key_slots(table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[..., seq_len] flat KV slot of every key position of (a batch of) block table(s).

    Positions past the table's last block repeat its last block (padding; the caller masks them)."""
    pos = torch.arange(seq_len, device=table.device)
    blocks = table[..., (pos // block_size).clamp(max=table.shape[-1] - 1)].long()
    return blocks * block_size + pos % block_size


def _make_plan(meta: AttentionMetadata, block_size: int, per_kv: int, window: int | None) -> list[_GroupPlan]:
    """One _GroupPlan per key-length bucket, over every request's groups of new tokens; then the tree tokens'."""
    trees = meta.tree_host
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    # One past each request's last ordinary token (its tree tokens, which come last, are planned apart).
    ends = list(meta.seq_lens_host)
    if trees is not None:
        for r in range(meta.num_reqs):
            ends[r] -= sum(1 for t in range(starts[r], starts[r + 1]) if trees[t][1])
    buckets: dict[int, list[tuple[int, int]]] = {}  # key length -> (request, group)
    for r, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        first = s_len - q_len
        if ends[r] > first:
            for g in range(first // _GROUP, (ends[r] - 1) // _GROUP + 1):
                buckets.setdefault(_bucket(g), []).append((r, g))
    plans = [_group_plan(meta, starts, ends, groups, keys, block_size, per_kv, window)
             for keys, groups in buckets.items()]
    if trees is not None:
        plans += _tree_plans(meta, starts, block_size, per_kv, window)
    return plans


def _group_plan(meta: AttentionMetadata, req_starts: list[int], ends: list[int], groups: list[tuple[int, int]],
                keys: int, block_size: int, per_kv: int, window: int | None) -> _GroupPlan:
    device = meta.block_tables.device
    reqs = [r for r, _ in groups]
    starts = [req_starts[r] for r in reqs]  # flat index of each group's request's new token 0
    first = [meta.seq_lens_host[r] - meta.query_lens_host[r] for r in reqs]  # position of new token 0
    last = [ends[r] for r in reqs]  # one past the last (ordinary) new token
    to_t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
    pos = to_t([g * _GROUP for _, g in groups])[:, None] + torch.arange(_GROUP, device=device)  # [n, G]
    valid = (pos >= to_t(first)[:, None]) & (pos < to_t(last)[:, None])
    tok = torch.where(valid, to_t(starts)[:, None] + pos - to_t(first)[:, None], torch.zeros_like(pos))
    kpos = torch.arange(keys, device=device)
    slots = _key_slots(meta.block_tables[to_t(reqs)], keys, block_size)
    slots = torch.where(kpos[None, :] < to_t(last)[:, None], slots, torch.zeros_like(slots))
    return _finish_plan(tok, valid, slots, pos, kpos, per_kv, window)


def _finish_plan(tok: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 kpos: torch.Tensor, per_kv: int, window: int | None) -> _GroupPlan:
    mask = kpos[None, None, :] <= pos[:, :, None]  # [n, G, S]
    if window is not None:
        mask &= kpos[None, None, :] > pos[:, :, None] - window
    mask = mask.repeat(1, per_kv, 1)[:, None]  # [n, 1, per_kv * G, S]
    return _GroupPlan(tok, valid, slots, mask, tok[valid])


def _tree_plans(meta: AttentionMetadata, req_starts: list[int], block_size: int, per_kv: int,
                window: int | None) -> list[_GroupPlan]:
    """Tree tokens (``attention_metadata.TREE_DOC``): each is the one valid row of its own group, the group
    its logical position would have in a chain, with that chain's keys (context, then its ancestors' slots).
    Its call shape and keys are then those of the same token decoded as a chain: the same rounding."""
    assert meta.tree_host is not None
    device = meta.block_tables.device
    tables = meta.block_tables.tolist()
    buckets: dict[int, list[tuple[int, int, list[int]]]] = {}  # key length -> (flat token, position, key slots)
    for r in range(meta.num_reqs):
        table = tables[r]
        for t in range(req_starts[r], req_starts[r + 1]):
            base, mask = meta.tree_host[t]
            if not mask:
                continue
            chain = list(range(base)) + tree_positions(base, mask)
            p = len(chain) - 1
            keys = _bucket(p // _GROUP)
            slot = [table[c // block_size] * block_size + c % block_size for c in chain]
            buckets.setdefault(keys, []).append((t, p, slot + [0] * (keys - len(slot))))
    plans = []
    for keys, items in buckets.items():
        to_t = lambda xs: torch.tensor(xs, device=device)  # noqa: E731
        at = to_t([x[1] for x in items])
        pos = (at // _GROUP * _GROUP)[:, None] + torch.arange(_GROUP, device=device)  # [n, G]
        valid = pos == at[:, None]
        tok = torch.where(valid, to_t([x[0] for x in items])[:, None], torch.zeros_like(pos))
        plans.append(_finish_plan(tok, valid, to_t([x[2] for x in items]), pos, torch.arange(keys, device=device),
                                  per_kv, window))
    return plans


class CpuKernelAttention(TorchAttention):
    """CPU: the C++ paged attention of ``kernels/cpu_kernels.cpp``. It reads K/V rows in place through the
    block tables (no gather, no padding, no per-forward plan) and sums each query row in key order, so a row's
    output is the same in any batch; fp32 or bf16 caches, head_dim a multiple of 8 (others: the reference).
    ``TorchAttention`` is its reference."""

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> out: same shape
        if query.shape[-1] % 8:
            return super().attend(query, kv_cache, meta, scale, window)
        return torch.ops.specserve_cpu.paged_attention(query, kv_cache, meta.block_tables, meta.query_start_loc,
                                                       meta.seq_lens, scale, window or 0, meta.tree_base,
                                                       meta.tree_mask)


def make_backend(name: str) -> AttentionBackend:
    """Chosen once at start-up from ``platform.attention_backend``."""
    if name == "triton":
        from specserve.model.kernels.triton_attention import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from specserve.model.kernels.cpu import load_cpu_kernels

        if load_cpu_kernels():
            return CpuKernelAttention()
    return TorchAttention()
