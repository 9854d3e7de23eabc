"""A draft's reduced vocabulary (worker/draft_vocab.py): which rows it reads, and that each logit it gives is the
full LM head's. The engine-level checks (greedy output unchanged, chi-square of sampled output) are in
tests/test_spec_equality.py."""

from __future__ import annotations

import pytest
import torch

from specserve.model.kernels.cpu import load_cpu_kernels
from specserve.model.quant import CpuQuantWeight, quantize
from specserve.worker.draft_vocab import (
    AUTO_SIZE,
    FLOOR,
    ReducedVocab,
    auto_size,
    corpus_counts,
    head_rows,
    select_ids,
    takes_rows,
)
from tests.helpers import byte_tokenizer


def test_auto_size_reduces_only_large_vocabularies():
    assert auto_size(None, 151_936) == AUTO_SIZE
    assert auto_size(None, 49_152) == 0  # SmolLM2's: left whole
    assert auto_size(0, 151_936) == 0
    assert auto_size(1000, 151_936) == 1000
    assert auto_size(300, 256) == 0  # as large as the vocabulary: the whole head


def test_select_ids_keeps_the_most_frequent_and_the_added_tokens():
    counts = torch.zeros(100, dtype=torch.long)
    counts[[5, 7, 9]] = torch.tensor([50, 40, 30])
    counts[60:90] = 1
    ids = select_ids(counts, 20, always=[99, 98])
    assert ids.numel() % 16 == 0 and ids.numel() >= 22
    assert ids.tolist() == sorted(ids.tolist())
    assert {5, 7, 9, 98, 99} <= set(ids.tolist())
    # after the counted tokens, ties go to the lower id (an earlier BPE merge)
    assert set(range(60, 77)) <= set(ids.tolist())


def test_corpus_counts_count_the_stdlib_corpus():
    tok = byte_tokenizer()
    counts = corpus_counts(tok, 260)
    assert counts.shape == (260,) and int(counts.sum()) > 1_000_000
    # in Python source, spaces and 'e' are far more common than '~' or a byte above 127
    assert counts[ord(" ")] > counts[ord("e")] > 10 * counts[ord("~")]
    assert corpus_counts(tok, 260) is counts or torch.equal(corpus_counts(tok, 260), counts)


def _heads() -> list[tuple[str, object]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=gen)
    out: list[tuple[str, object]] = [("float", w)]
    if load_cpu_kernels():
        for bits in (4, 8):
            for tiled in (True, False):
                q = CpuQuantWeight(quantize(w, bits, "head"), torch.device("cpu"), tiled=tiled)
                out.append((f"int{bits} {'tiled' if tiled else 'rows'}", q))
    return out


@pytest.mark.parametrize("name,head", _heads(), ids=[n for n, _ in _heads()])
def test_reduced_logits_are_the_full_heads_at_the_rows_read(name, head):
    ids = torch.arange(0, 256, 5)[:48]  # 48 rows: a multiple of the tile
    vocab = ReducedVocab(head, ids, 256)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    full = head(hidden).float() if not isinstance(head, torch.Tensor) else hidden @ head.t()
    extra = vocab.extra([1, 2, 3, 5, 10, 255, 255])  # 5 and 10 are shared rows already
    assert extra is not None and extra.ids.tolist() == [1, 2, 3, 255]
    assert vocab.extra([0, 5, 10]) is None
    out = vocab.logits(hidden, [None, extra, None])
    assert out.shape == (3, 256)
    tol = 1e-5 if name == "float" else 0.0  # packed heads: the same kernel on the same rows, the same bits
    torch.testing.assert_close(out[:, ids], full[:, ids], rtol=0, atol=tol)
    torch.testing.assert_close(out[1, extra.ids], full[1, extra.ids], rtol=0, atol=tol)
    outside = torch.ones(256, dtype=torch.bool)
    outside[ids] = False
    assert (out[0, outside] == FLOOR).all() and (out[2, outside] == FLOOR).all()
    outside[extra.ids] = False
    assert (out[1, outside] == FLOOR).all()
    # the floor is finite: a row masked to -inf at every row read still has a distribution (no NaN)
    row = out[0].clone()
    row[ids] = float("-inf")
    assert torch.softmax(row, dim=-1).isfinite().all()
    assert float(torch.softmax(out[0], dim=-1)[outside].sum()) == 0.0  # and it gives the rest probability 0


def test_a_head_whose_rows_cannot_be_taken_is_left_whole():
    class Opaque(torch.nn.Module):
        pass

    assert not takes_rows(Opaque()) and head_rows(Opaque(), torch.tensor([0])) is None
