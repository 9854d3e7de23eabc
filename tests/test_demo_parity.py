"""The embedded demo model (SmolLM2-135M-Instruct GGUF) vs HF transformers loading the same file (fp32)."""

import os

import pytest
import torch

from specserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model(demo_model_path):
    from transformers import AutoModelForCausalLM

    d, f = os.path.dirname(demo_model_path), os.path.basename(demo_model_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    from specserve.llm import LLM

    # Parity with HF in fp32 over the same dequantized weights: HF dequantizes the GGUF at load, and the CPU
    # default (quantization auto) would keep it 4-bit; tests/test_quant.py checks that path against this one.
    return LLM(None, num_blocks=256, dtype="float32", quantization="none")


@pytest.mark.slow
def test_last_position_logits_match_hf(llm, hf_model):
    from specserve.model.attention import build_metadata

    model = llm.engine.runner.model
    kv = [torch.zeros(model.kv_cache_shape(64, 16)) for _ in range(model.arch.num_layers)]
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        meta = build_metadata([len(ids)], [len(ids)], [list(range(8))], 16)
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)[-1:])[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - ref).abs().max().item() < 1e-4, prompt


@pytest.mark.slow
def test_greedy_64_tokens_identical_to_hf_generate(llm, hf_model):
    # Both stop at EOS (HF's min_new_tokens would mask EOS, ignore_eos does not): compare whole outputs.
    sp = SamplingParams(temperature=0, max_tokens=64)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(None, sp, prompt_token_ids=ids)
    checked = 0
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=64, do_sample=False)[0, len(prompt_ids):].tolist()
        assert out.outputs[0].token_ids == ref
        checked += len(ref)
    assert checked > 5 * 20  # most prompts run long, not one-token answers
