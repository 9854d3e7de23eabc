"""Our flat-batch paged model vs HF transformers on tiny random models (fp32, CPU)."""

import pytest
import torch

from tests.helpers import our_model, run_chunks, tiny_hf_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_hf(family):
    hf = tiny_hf_model(family)
    ours = our_model(hf, family)
    tokens = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    # One prefill, and chunked prefill + single-token decodes through the paged cache: same logits.
    for chunks in ([37], [5, 11, 1, 1, 19], [1] * 37):
        got = run_chunks(ours, tokens, chunks)
        assert (got - ref).abs().max().item() < 1e-4, chunks


def test_llama3_rope_scaling_matches_hf():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = tiny_hf_model("llama", rope_scaling=scaling)
    from dataclasses import replace

    from specserve.model.attention import TorchAttention
    from specserve.model.decoder import DecoderModel
    from tests.helpers import arch_of

    arch = replace(arch_of(hf, "llama"), rope_scaling=scaling)
    ours = DecoderModel(arch, torch.float32, torch.device("cpu"), TorchAttention(), 1024)
    ours.load_weights(hf.state_dict())
    tokens = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    got = run_chunks(ours, tokens, [60, 40])
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_saved_checkpoint_through_loader_matches_hf(tmp_path, family):
    from specserve.model.attention import TorchAttention
    from specserve.model.checkpoint.loader import load_checkpoint
    from specserve.model.decoder import DecoderModel

    hf = tiny_hf_model(family, seed=5, tie_word_embeddings=family == "llama")
    hf.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    ours = DecoderModel(ckpt.arch, torch.float32, torch.device("cpu"), TorchAttention(), 1024)
    ours.load_weights(ckpt.state_dict)
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1].float()
    got = run_chunks(ours, tokens, [23])[-1]
    assert (got - ref).abs().max().item() < 1e-4
