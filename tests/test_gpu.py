"""GPU-only checks (run by benchmarks/gpu_check.sh on a lent machine; skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown",
           "List three colors: red, green,", "Once upon a time"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equality_with_speculation_on_gpu(dtype):
    """Speculation on vs off, greedy: equal, or diverging only at a near-tie of the reference (the rule of
    docs/speculative_decoding.md). bf16 logits are coarser: a near-tie there is one bf16 step at |logit| in [16, 32)."""
    from specserve.llm import LLM
    from tests.test_spec_equality import NEAR_TIE, assert_same

    sp = SamplingParams(temperature=0, max_tokens=48)
    llm = LLM(None, dtype=dtype, speculative_method="ngram", num_speculative_tokens=5,
              speculative_adaptive=False)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    off = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids, speculative=False)]
    on = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids)]
    assert llm.engine.runner.model.backend.__class__.__name__ == "TritonAttention"
    ties = assert_same(f"gpu {dtype}", ids, off, on, llm.engine.runner.model,
                       near_tie=NEAR_TIE if dtype == "float32" else 0.125)
    print(f"{dtype}: near-ties {ties}; spec metrics {llm.get_metrics()['speculative']}")


def test_draft_trees_on_gpu():
    """EAGLE-2 trees through the Triton tree mask, with graphs on for the chain steps: greedy equal to
    speculation off (near-tie rule), trees verified and accepted."""
    import os

    from specserve.llm import LLM
    from tests.test_spec_equality import NEAR_TIE, assert_same

    head = os.path.join(os.path.dirname(__file__), os.pardir, "specserve", "data", "drafts", "smollm2-135m-eagle")
    sp = SamplingParams(temperature=0, max_tokens=48)
    llm = LLM(None, dtype="float32", speculative_model=head, num_speculative_tokens=4, speculative_eagle_topk=3,
              speculative_num_draft_tokens=10, speculative_adaptive=False, max_num_seqs=4)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    off = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids, speculative=False)]
    on = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids)]
    ties = assert_same("gpu trees", ids, off, on, llm.engine.runner.model, near_tie=NEAR_TIE)
    spec = llm.get_metrics()["speculative"]
    assert spec["accepted_tokens"] > 0
    print(f"trees: near-ties {ties}; spec metrics {spec}")


def test_graphs_match_eager_on_gpu():
    """Graphs (decode and verification buckets, padded batches) vs --enforce-eager: fp32 greedy token ids."""
    import gc

    from specserve.llm import LLM

    sp = SamplingParams(temperature=0, max_tokens=32)
    outs = {}
    for eager in (True, False):
        llm = LLM(None, dtype="float32", enforce_eager=eager, speculative_method="ngram", num_speculative_tokens=3,
                  speculative_adaptive=False, max_num_seqs=8, kv_cache_memory=float(1 << 30))
        outs[eager] = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sp, speculative=False)]
                       + [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)])
        runner = llm.engine.runner
        if not eager:
            assert runner.graph_plan is not None and runner.graph_plan.capture.num_captures > 0
            print(f"graph buckets (batch, q, prenorm): {sorted(runner.target_step.static.graphs)}")
        else:
            assert runner.graph_plan is None
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_new_families_on_gpu(tmp_path, family):
    """Tiny Gemma 3 (sliding layers in the Triton kernel) and Qwen3-MoE (the grouped Triton experts), graphs on:
    greedy with n-gram speculation equals speculation off, and the first tokens equal transformers' on the GPU."""
    from specserve.llm import LLM
    from tests.helpers import write_char_tokenizer
    from tests.test_spec_equality import PROMPTS, assert_same, make_target

    hf = make_target(family, seed=3)
    hf.save_pretrained(tmp_path)
    write_char_tokenizer(str(tmp_path), hf.config.vocab_size)
    llm = LLM(str(tmp_path), dtype="float32", speculative_method="ngram", num_speculative_tokens=4,
              speculative_adaptive=False, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=32)
    ids = PROMPTS[:16]
    off = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids, speculative=False)]
    on = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=ids)]
    model = llm.engine.runner.model
    assert model.backend.__class__.__name__ == "TritonAttention"
    assert_same(f"gpu {family}", ids, off, on, model)
    hf = hf.cuda()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids[0]], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(ids[0]):]
    assert ref.tolist() == off[0][:8]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_on_two_gpus(tmp_path):
    """TP=2 over NCCL (RCCL on ROCm) with n-gram speculation: greedy output equals TP=1's, fp32 near-tie rule."""
    from specserve.llm import LLM
    from tests.helpers import save_tiny_checkpoint
    from tests.test_engine import assert_same_or_near_tie
    from tests.test_tensor_parallel import _random_prompts

    path = save_tiny_checkpoint(tmp_path / "m", "qwen2", seed=5, layers=2, vocab=261)
    kw = dict(dtype="float32", num_blocks=256, speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False)
    prompts = _random_prompts(8, 261)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref_llm = LLM(path, **kw)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(None, sp, prompt_token_ids=prompts)]
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert llm.engine.runner.comm.backend == "nccl"
        got = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]
    ties: list[tuple] = []
    for p, g, r in zip(prompts, got, ref):
        assert_same_or_near_tie(ref_llm, p, g, r, ties)
