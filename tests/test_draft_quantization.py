"""A draft model's weights, its LM head included: 4-bit by default where the target runs on quantized kernels
(a draft only proposes), as given by --speculative-quantization otherwise; greedy output is the target's
either way."""

import pytest

from specserve.llm import LLM
from specserve.model.quant import PackedWeight
from specserve.platform import detect
from specserve.sampling_params import SamplingParams
from tests.helpers import save_tiny_checkpoint

PROMPTS = ["hello world, this is", "def add(a, b): return", "abc abc abc", "The quick brown fox"]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_blocks=128)

pytestmark = pytest.mark.skipif(detect("cpu").quant_kernels != "cpu", reason="needs the CPU weight-only kernels")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_quant")
    # hidden 64 (groups of 32); the draft a 1-layer model of the same vocabulary
    target = save_tiny_checkpoint(root / "t", seed=0, layers=2, hidden_size=64, intermediate_size=128)
    draft = save_tiny_checkpoint(root / "d", seed=1, layers=1, hidden_size=64, intermediate_size=128)
    return target, draft


def _bits(llm: LLM) -> set[int]:
    model = llm.engine.runner.drafter.model
    return {m.bits for m in model.modules() if isinstance(m, PackedWeight)}  # the LM head included


def test_draft_is_4bit_under_a_quantized_target_and_exact(pair):
    target, draft = pair
    sp = SamplingParams(temperature=0, max_tokens=16)
    ref = [o.outputs[0].token_ids for o in LLM(target, quantization="int8", **ENGINE).generate(PROMPTS, sp)]
    llm = LLM(target, quantization="int8", speculative_model=draft, num_speculative_tokens=3,
              speculative_adaptive=False, **ENGINE)
    assert _bits(llm) == {4}
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == ref
    kept = LLM(target, quantization="int8", speculative_model=draft, num_speculative_tokens=3,
               speculative_quantization="int8", **ENGINE)
    assert _bits(kept) == {8}


def test_float_target_keeps_a_float_draft_and_bad_mode_is_refused(pair):
    target, draft = pair
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=2, **ENGINE)
    assert _bits(llm) == set()
    with pytest.raises(ValueError, match="speculative quantization"):
        LLM(target, speculative_model=draft, num_speculative_tokens=2, speculative_quantization="int3", **ENGINE)
