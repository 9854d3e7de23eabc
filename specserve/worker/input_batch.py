"""SchedulerOutput rows -> flat input_ids / positions / attention metadata tensors.

A batch is packed on the host into three int tensors (``HostBatch``) and reaches the device with one copy
each; on a GPU through pinned memory and non-blocking copies (``platform.to_device``), so building a batch
never waits for the GPU. The graph runner (``worker/graphs.py``) copies the same packed tensors into its
static buffers instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.model.attention import AttentionMetadata
from specserve.platform import to_device


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata


@dataclass(slots=True)
class HostBatch:
    """A flat batch of B requests and T tokens on the host (CPU tensors)."""

    tokens: torch.Tensor  # [3 * T] int64: input ids | positions | slot mapping
    reqs: torch.Tensor  # [2 * B + 1] int32: query_start_loc (B + 1) | seq_lens (B)
    tables: torch.Tensor  # [B, W] int32 block tables, W = the widest row, padded with block 0
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    tree: torch.Tensor | None = None  # [2 * T] int64: tree base | tree mask per token (None: no tree rows)
    tree_host: list[tuple[int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


RowTree = tuple[int, Sequence[int]]  # (tree base, mask per token of the row; 0 = an ordinary token)


def pack_batch(token_ids: Sequence[Sequence[int]], starts: list[int],
               block_ids: Sequence[Sequence[int]], block_size: int, pad_to: int = 0,
               pad_block: int = 0, trees: Sequence[RowTree | None] | None = None) -> HostBatch:
    """Request r computes ``token_ids[r]`` at positions ``starts[r] ..``; its KV lives in ``block_ids[r]``.

    ``trees[r]`` (draft trees, ``model/attention_metadata.TREE_DOC``): row r's tree base and per-token masks;
    a tree token's position is ``base + popcount(mask) - 1`` (its KV slot stays its chain position's).

    ``pad_to`` > number of requests appends padding rows (for a graph bucket): each computes
    q = ``len(token_ids[0])`` tokens (id 0) at positions 0 .. q - 1 of ``pad_block``, a scratch block that
    no request owns, so padding never reads or writes a real request's KV.
    """
    q_lens = [len(t) for t in token_ids]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    tables = [list(b) for b in block_ids]
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    for toks, s, table in zip(token_ids, starts, tables):
        ids.extend(toks)
        for p in range(s, s + len(toks)):
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    tree_host = None
    if trees is not None and any(t is not None for t in trees):
        tree_host = []
        i = 0
        for toks, t in zip(token_ids, trees):
            for j in range(len(toks)):
                base, mask = (t[0], t[1][j]) if t is not None else (0, 0)
                if mask:
                    pos[i] = base + mask.bit_count() - 1
                tree_host.append((base, mask) if mask else (0, 0))
                i += 1
    width = max((len(t) for t in tables), default=1) or 1
    num_pad = max(0, pad_to - len(q_lens))
    if num_pad:
        q = q_lens[0]
        q_lens += [q] * num_pad
        seq_lens += [q] * num_pad
        tables += [[pad_block] * width] * num_pad
        ids += [0] * (q * num_pad)
        pos += list(range(q)) * num_pad
        slots += [pad_block * block_size + p % block_size for p in range(q)] * num_pad
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    return HostBatch(
        tokens=torch.tensor(ids + pos + slots, dtype=torch.int64),
        reqs=torch.tensor(qsl + seq_lens, dtype=torch.int32),
        tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(-1, width),
        query_lens=q_lens,
        seq_lens=seq_lens,
        block_size=block_size,
        tree=None if tree_host is None else torch.tensor([b for b, _ in tree_host] + [m for _, m in tree_host],
                                                         dtype=torch.int64),
        tree_host=tree_host,
    )


def batch_views(hb: HostBatch, tokens: torch.Tensor, reqs: torch.Tensor, tables: torch.Tensor,
                tree: torch.Tensor | None = None) -> FlatBatch:
    """The flat batch over packed ``tokens`` / ``reqs`` / ``tables`` (/ ``tree``) laid out like ``hb`` (views,
    no copy)."""
    t, b = hb.num_tokens, hb.num_reqs
    meta = AttentionMetadata(
        slot_mapping=tokens[2 * t:3 * t],
        query_start_loc=reqs[:b + 1],
        seq_lens=reqs[b + 1:2 * b + 1],
        block_tables=tables,
        max_query_len=max(hb.query_lens, default=0),
        max_seq_len=max(hb.seq_lens, default=0),
        query_lens_host=list(hb.query_lens),
        seq_lens_host=list(hb.seq_lens),
        block_size=hb.block_size,
        tree_base=tree[:t] if tree is not None else None,
        tree_mask=tree[t:] if tree is not None else None,
        tree_host=hb.tree_host,
    )
    return FlatBatch(input_ids=tokens[:t], positions=tokens[t:2 * t], meta=meta)


def upload(hb: HostBatch, device: torch.device) -> FlatBatch:
    """Three copies (pinned, non-blocking on a GPU); the CPU path uses the host tensors as they are."""
    return batch_views(hb, to_device(hb.tokens, device), to_device(hb.reqs, device),
                       to_device(hb.tables, device), to_device(hb.tree, device) if hb.tree is not None else None)


def flat_batch(token_ids: Sequence[Sequence[int]], starts: list[int],
               block_ids: Sequence[Sequence[int]], block_size: int,
               device: torch.device, trees: Sequence[RowTree | None] | None = None) -> FlatBatch:
    """Request r computes ``token_ids[r]`` at positions ``starts[r] ..``; its KV lives in ``block_ids[r]``."""
    return upload(pack_batch(token_ids, starts, block_ids, block_size, trees=trees), device)
