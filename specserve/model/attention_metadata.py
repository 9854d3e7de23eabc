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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)


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
