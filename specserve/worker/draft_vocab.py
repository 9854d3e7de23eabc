"""A draft's reduced vocabulary: its LM head read at the tokens it is likely to draft, not at all of them.

A small draft model's LM head is a large share of its step: Qwen2.5-Coder-0.5B's is 151,936 x 896, a quarter of
the bytes its step streams at 4 bits. The draft only proposes and the target verifies every token, so which
tokens it may propose cannot change the output: q is the softmax over the rows read (a token outside gets
probability 0), and rejection sampling is exact for any q (docs/speculative_decoding.md).

The rows read (``select_ids``, ``ReducedVocab.extra``):
- the most frequent tokens of the Python standard library's source as this tokenizer splits it (code,
  docstrings and comments: ``corpus_counts``), without the modules the benchmark workloads are built from;
- every added token (chat markers, end of turn);
- per request, every token of its own prompt outside those (the identifiers a code answer copies).
Each logit read is the full head's (the same packed rows, the same kernel).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.datasets import CODE_MODULES, SUMMARIZE_MODULES, stdlib_sources
from specserve.model.quant import CpuQuantWeight, DenseWeight, PackedWeight

log = logging.getLogger(__name__)

# --speculative-draft-vocab-size auto: reduce a vocabulary above AUTO_MIN_VOCAB to AUTO_SIZE tokens (Llama 3's,
# Qwen's and Gemma's: 128k-262k; SmolLM2's 49k stays whole).
AUTO_MIN_VOCAB = 65536
AUTO_SIZE = 32768
CORPUS_FILE_CHARS = 16384  # read at most this much of each stdlib file: every module counts, none dominates
CORPUS_CHARS = 3 * 2**20
# Logits outside the rows read: a finite floor, not -inf, so a row a grammar masks entirely inside the reduced
# vocabulary still has a distribution (uniform over the tokens it allows) instead of NaNs.
FLOOR = -1e30


def auto_size(requested: int | None, vocab_size: int) -> int:
    """The reduced vocabulary's size for ``--speculative-draft-vocab-size`` (None: auto); 0 = the whole one."""
    if requested is None:
        return AUTO_SIZE if vocab_size > AUTO_MIN_VOCAB else 0
    return 0 if requested >= vocab_size else requested


_COUNTS: dict[tuple[str, int, int], torch.Tensor] = {}


def corpus_counts(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """[vocab] int64: how often each token occurs in the stdlib corpus (above) as ``tokenizer`` (an HF tokenizer)
    splits it. About a second for a 150k vocabulary; kept per tokenizer path for the process."""
    key = (str(getattr(tokenizer, "name_or_path", "")), len(tokenizer), vocab_size)
    if key[0] and key in _COUNTS:
        return _COUNTS[key]
    texts, total = [], 0
    for _, path in stdlib_sources(CODE_MODULES + SUMMARIZE_MODULES):
        with open(path, encoding="utf-8", errors="ignore") as f:
            text = f.read(CORPUS_FILE_CHARS)
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        t = torch.tensor(ids, dtype=torch.long)
        counts += torch.bincount(t[(t >= 0) & (t < vocab_size)], minlength=vocab_size)
    if key[0]:
        _COUNTS[key] = counts
    return counts


def select_ids(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties: the lower id, an earlier BPE merge) plus ``always`` (added
    tokens), sorted, padded to a multiple of 16 (the CPU kernels' tile) with the next most frequent."""
    order = torch.argsort(-counts, stable=True)
    keep = torch.zeros(counts.numel(), dtype=torch.bool)
    keep[order[:size]] = True
    keep[torch.tensor([i for i in always if 0 <= i < counts.numel()], dtype=torch.long)] = True
    short = -int(keep.sum()) % 16
    if short:
        keep[order[~keep[order]][:short]] = True
    return keep.nonzero().flatten()


@dataclass(frozen=True, slots=True)
class Extra:
    """One request's rows outside the shared ones: its prompt's tokens, and the head's rows for them."""

    ids: torch.Tensor  # [m] token ids
    head: PackedWeight | torch.Tensor  # [m rounded up to 16, hidden] (the last row repeated)


def takes_rows(head: Any) -> bool:
    """Whether ``head_rows`` can take rows of this LM head (not a GPU kernel's packed weight)."""
    return isinstance(head, (CpuQuantWeight, DenseWeight, torch.Tensor))


def head_rows(head: Any, ids: torch.Tensor) -> PackedWeight | torch.Tensor | None:
    """Rows ``ids`` of an LM head, in the form it runs in (the same codes and scales: the same logits), or None
    where they cannot be taken (``takes_rows``)."""
    if isinstance(head, CpuQuantWeight):
        rows = CpuQuantWeight(head.take_rows(ids), head.scales.device, tiled=head.tiled)
        rows.act_bits = head.act_bits  # the activations' grid the head runs at (--activation-bits)
        return rows
    if isinstance(head, DenseWeight):
        head = head.weight
    if isinstance(head, torch.Tensor):
        return head[ids.to(head.device)].contiguous()
    return None


def _matmul(x: torch.Tensor, w: PackedWeight | torch.Tensor) -> torch.Tensor:
    if isinstance(w, PackedWeight):
        return w(x).float()
    return F.linear(x.to(w.dtype), w).float()


class ReducedVocab:
    """A draft's LM head over ``ids`` (plus a request's ``Extra``): [B, vocab] logits, FLOOR elsewhere."""

    def __init__(self, head: Any, ids: torch.Tensor, vocab_size: int) -> None:
        rows = head_rows(head, ids)
        if rows is None:
            raise ValueError("this LM head's rows cannot be taken")
        self.full_head = head
        self.head = rows
        self.vocab_size = vocab_size
        self.device = head.scales.device if isinstance(head, CpuQuantWeight) else \
            (head.weight if isinstance(head, DenseWeight) else head).device
        self.ids = ids.to(self.device)  # indexes the step's logits, on the model's device
        self.member = torch.zeros(vocab_size, dtype=torch.bool)
        self.member[ids] = True

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def extra(self, token_ids: list[int]) -> Extra | None:
        """A request's own rows: the tokens of ``token_ids`` (its prompt) the shared ones lack; None: none."""
        ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        ids = ids[~self.member[ids]]
        if ids.numel() == 0:
            return None
        # padded to the kernels' tile (the last id repeated) so the rows run in the head's own layout
        rows = head_rows(self.full_head, torch.cat([ids, ids[-1:].expand(-ids.numel() % 16)]))
        assert rows is not None
        return Extra(ids.to(self.device), rows)

    def logits(self, hidden: torch.Tensor, extras: list[Extra | None] | None = None) -> torch.Tensor:
        """[B, hidden] -> [B, vocab] float logits: the head's at the shared rows and each row's ``Extra``."""
        out = torch.full((hidden.shape[0], self.vocab_size), FLOOR, device=hidden.device)
        out[:, self.ids] = _matmul(hidden, self.head)
        for i, e in enumerate(extras or ()):
            if e is not None:
                out[i, e.ids] = _matmul(hidden[i:i + 1], e.head)[0, :e.ids.numel()]
        return out


def reduced_vocab(head: Any, vocab_size: int, size: int, tokenizer: Any) -> ReducedVocab | None:
    """The reduced head of ``size`` rows for a draft whose LM head is ``head``, or None (size 0, no tokenizer,
    or a head whose rows cannot be taken). Logs what it chose and what it took."""
    if size <= 0 or tokenizer is None or not takes_rows(head):
        return None
    t0 = time.perf_counter()
    counts = corpus_counts(tokenizer, vocab_size)
    ids = select_ids(counts, size, list(tokenizer.get_added_vocab().values()))
    vocab = ReducedVocab(head, ids, vocab_size)
    log.info("draft vocabulary: %d of %d tokens (the stdlib corpus' most frequent, the added tokens) + each "
             "request's prompt tokens; chosen in %.1f s", vocab.size, vocab_size, time.perf_counter() - t0)
    return vocab
