"""What one forward's attention needs to know about the flat batch: ``AttentionMetadata`` (built once per
step by ``build_metadata`` and shared by every layer) and the ``AttentionBackend`` protocol every backend
implements. The layout it describes is in ``model/attention.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


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
    # Draft trees (None when no row of the step holds one; see ``TREE_DOC``): per new token, the chain
    # position where its request's tree region starts and the bitmask of the tree-region keys it sees
    # (0: an ordinary token), as device tensors and as host pairs.
    tree_base: torch.Tensor | None = None  # [num_tokens] int64
    tree_mask: torch.Tensor | None = None  # [num_tokens] int64
    tree_host: list[tuple[int, int]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


TREE_DOC = """Tree tokens. A row's new tokens occupy consecutive KV slots (chain positions) as always, but a
*tree token* sees only part of them: with tree base ``b`` and mask ``m``, it attends to the keys at chain
positions ``0 .. b - 1`` (the verified context) and to ``b + j`` for each bit ``j`` of ``m`` (its ancestors in
the draft tree and itself, ``j < MAX_TREE_SLOTS``), in that order; its logical position (rope, sliding window)
is ``b + popcount(m) - 1``. So a tree token computes exactly what the same token computes when its path is
decoded as a chain: same keys, same order. In a row, tree tokens follow its ordinary tokens."""

MAX_TREE_SLOTS = 63  # bits of a non-negative int64 mask


def tree_positions(base: int, mask: int) -> list[int]:
    """The chain positions a tree token sees past its context: ``base + j`` for each bit j of ``mask``."""
    out, j = [], 0
    while mask:
        if mask & 1:
            out.append(base + j)
        mask >>= 1
        j += 1
    return out


class AttentionBackend(Protocol):
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
        """Attention of each new token over its keys; with ``window``, a token at position ``i`` sees only keys
        ``i - window < j <= i`` (sliding window; None: full causal attention)."""
        ...


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
