"""SchedulerOutput rows -> flat input_ids / positions / attention metadata tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model.attention import AttentionMetadata, build_metadata


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata


def flat_batch(token_ids: list[list[int]] | list[tuple[int, ...]], starts: list[int],
               block_ids: list[tuple[int, ...]] | list[list[int]], block_size: int,
               device: torch.device) -> FlatBatch:
    """Request r computes ``token_ids[r]`` at positions ``starts[r] ..``; its KV lives in ``block_ids[r]``."""
    q_lens = [len(t) for t in token_ids]
    seq_lens = [s + q for s, q in zip(starts, q_lens)]
    ids: list[int] = []
    pos: list[int] = []
    for toks, s in zip(token_ids, starts):
        ids.extend(toks)
        pos.extend(range(s, s + len(toks)))
    meta = build_metadata(q_lens, seq_lens, [list(b) for b in block_ids], block_size, device)
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.tensor(pos, dtype=torch.int64).to(device, non_blocking=True),
        meta=meta,
    )
