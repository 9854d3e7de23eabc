"""Fast regression tests for the bugs the reliability work (soak, API fuzzing, checkpoint fuzzing) found."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.config import CheckpointError
from specserve.sample.rejection_sampler import verify
from specserve.sample.sampler import RequestSamplingState
from specserve.sampling_params import SamplingParams


@pytest.mark.parametrize("with_probs", [False, True])
def test_mixed_batch_sampled_half_with_fewer_drafts(with_probs):
    """Soak: a greedy request with 3 drafts next to a sampled one with 1 failed the whole engine step
    (IndexError in the draft-q lookup: the sampled half's K was its own max, not the batch's)."""
    vocab = 11
    torch.manual_seed(0)
    states = [RequestSamplingState.create(SamplingParams(temperature=0), [1]),
              RequestSamplingState.create(SamplingParams(temperature=1.0, seed=3), [1]),
              RequestSamplingState.create(SamplingParams(temperature=0.7), [1])]
    drafts = [[4, 5, 6], [7], []]
    counts = [len(d) + 1 for d in drafts]
    logits = torch.randn(sum(counts), vocab)
    probs = [None, torch.softmax(torch.randn(1, vocab), -1) if with_probs else None, None]
    out = verify(logits, states, counts, drafts, probs)
    assert [1 <= len(o) <= len(d) + 1 for o, d in zip(out, drafts, strict=True)] == [True] * 3
    greedy_alone = verify(logits[:4], states[:1], counts[:1], drafts[:1], probs[:1])
    assert out[0] == greedy_alone[0]


def test_seed_beyond_64_bits_is_a_validation_error():
    """API fuzzing: seed 2**64 passed validation and then failed torch's manual_seed inside the engine step
    (a 500 for every request in flight)."""
    for bad in (2**64, 2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must be a 64-bit"):
            SamplingParams(seed=bad)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))


def test_implausible_config_is_refused_before_building_shapes(tmp_path):
    """Checkpoint fuzzing: num_hidden_layers (or a GGUF block_count) of 10**7+ made the loader build a
    shape table of billions of entries (the OOM killer ended it)."""
    from specserve.model.checkpoint.loader import load_checkpoint, read_arch
    from tests.helpers import tiny_hf_model

    tiny_hf_model("llama", seed=0, layers=1, vocab=64).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in [("num_hidden_layers", 10**9), ("vocab_size", 2**40), ("hidden_size", 2**31),
                       ("max_position_embeddings", 2**40)]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        for fn in (read_arch, load_checkpoint):
            with pytest.raises(CheckpointError, match="implausible"):
                fn(str(tmp_path))
