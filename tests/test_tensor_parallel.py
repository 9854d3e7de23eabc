"""Tensor parallel (``--tensor-parallel-size``): 2 CPU ranks over gloo give the output of 1 rank.

Sharding arithmetic is checked in-process; everything else starts real worker processes (the mp executor),
so each engine here costs a few seconds of start-up. Greedy output at TP=2 is compared with TP=1 under the
near-tie rule (docs/speculative_decoding.md): identical, or diverging only where the reference's top-2 gap < 1e-4
(the ranks add partial sums in another order than one rank does).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from specserve import SamplingParams
from specserve.config import ModelArch, SpecserveError
from specserve.llm import LLM
from specserve.model.checkpoint.loader import default_model_path
from specserve.model.sharding import check_tensor_parallel, local_arch, shard_spec
from tests.helpers import save_tiny_checkpoint
from tests.test_engine import assert_same_or_near_tie

SHIPPED_HEAD = "specserve/data/drafts/smollm2-135m-eagle"


def _arch(heads: int, kv: int, vocab: int = 100, inter: int = 128) -> ModelArch:
    return ModelArch("llama", vocab, 64, inter, 2, heads, kv, 16)


# -- the slices ----------------------------------------------------------------------------------------------
def test_shard_spec_uneven_kv_groups():
    arch = _arch(9, 3, vocab=49152, inter=1536)  # SmolLM2-135M's heads over 2 ranks: 2 + 1 KV groups
    a, b = shard_spec(arch, 0, 2), shard_spec(arch, 1, 2)
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert a.ffn == (0, 768) and b.ffn == (768, 1536)  # whole 32-column groups
    assert local_arch(arch, a).num_heads == 6 and local_arch(arch, b).num_kv_heads == 1


def test_shard_spec_replicates_kv_heads_and_pads_the_vocabulary():
    arch = _arch(4, 1, vocab=101)
    specs = [shard_spec(arch, r, 4) for r in range(4)]
    assert [s.kv_heads for s in specs] == [(0, 1)] * 4  # one KV head, on every rank
    assert [s.q_heads for s in specs] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [s.vocab for s in specs] == [(0, 26), (26, 52), (52, 78), (78, 104)]  # 3 padding rows on the last


@pytest.mark.parametrize("heads,kv,size,match", [
    (4, 2, 8, "larger than the target's 4 attention heads"),
    (6, 2, 3, "multiple of the target's 2 KV heads"),
    (4, 4, 5, "larger than the target's 4 attention heads"),
])
def test_impossible_splits_are_clear_errors(heads, kv, size, match):
    with pytest.raises(SpecserveError, match=match):
        check_tensor_parallel(_arch(heads, kv), size, "the target")


def test_bad_sizes_fail_before_any_worker_starts(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m", "llama", layers=1)  # 4 heads
    with pytest.raises(SpecserveError, match="larger than the target's 4 attention heads"):
        LLM(path, tensor_parallel_size=8, num_blocks=64, device="cpu")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or"):
        LLM(path, tensor_parallel_size=2, speculative_model=path, draft_tensor_parallel_size=3)


def test_ray_backend_without_ray_installed_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    path = save_tiny_checkpoint(tmp_path / "m", "llama", layers=1)
    with pytest.raises(SpecserveError, match=r"needs Ray: pip install 'specserve\[ray\]'"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", num_blocks=64, device="cpu")


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    from specserve import platform as plat

    gpu = plat.Platform("cuda", torch.device("cuda", 0), torch.bfloat16, "triton", True, "nccl")
    monkeypatch.setattr(plat, "visible_gpus", lambda: 2)
    plat.check_tensor_parallel_devices(gpu, 2)
    with pytest.raises(SpecserveError, match="needs 4 GPUs, but 2 are visible"):
        plat.check_tensor_parallel_devices(gpu, 4)


def test_ray_backend_without_a_cluster_is_a_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there
    path = save_tiny_checkpoint(tmp_path / "m", "llama", layers=1)
    with pytest.raises(SpecserveError, match="no Ray cluster reachable"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", num_blocks=64, device="cpu")


# -- tiny models: replication, odd vocabulary, qkv bias, experts ------------------------------------------------
def _random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(r.randint(2, 40))] for _ in range(n)]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 16, speculative: bool = True) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts, speculative=speculative)]


def _assert_matches(ref_llm: LLM, prompts: list[list[int]], got: list[list[int]], ref: list[list[int]]) -> None:
    ties: list[tuple] = []
    for p, g, r in zip(prompts, got, ref):
        assert_same_or_near_tie(ref_llm, p, g, r, ties)
    assert len(ties) <= max(1, len(prompts) // 8), ties


@pytest.mark.parametrize("family,over,comm", [
    ("llama", dict(num_key_value_heads=1), "shm"),  # fewer KV heads than ranks: replicated
    ("llama", dict(num_key_value_heads=1), "gloo"),  # the same over gloo (SPECSERVE_TP_COMM=gloo)
    ("qwen2", dict(num_key_value_heads=2), "shm"),  # q/k/v biases, sliced with their rows
    ("qwen3_moe", {}, "shm"),  # per-head q/k norms; every expert sliced, the router replicated
])
def test_tiny_models_match_one_rank(tmp_path, monkeypatch, family, over, comm):
    monkeypatch.setenv("SPECSERVE_TP_COMM", comm)
    vocab = 261  # odd: the vocabulary rows do not split evenly
    path = save_tiny_checkpoint(tmp_path / family, family, seed=5, layers=2, vocab=vocab, **over)
    kw: dict[str, Any] = dict(num_blocks=256, block_size=8, device="cpu", dtype="float32")
    prompts = _random_prompts(8, vocab)
    ref_llm = LLM(path, **kw)
    ref = _greedy(ref_llm, prompts)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=2)  # the prompt's logprobs: a mirrored LM head too

    def scores(llm: LLM) -> list[float]:
        return [e["logprob"] for o in llm.generate(None, scoring, prompt_token_ids=prompts[:2])
                for e in o.prompt_logprobs or [] if e is not None]

    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert llm.engine.runner.model.local.num_heads == 2  # half of the 4 heads
        assert llm.engine.runner.comm.backend == comm
        got = _greedy(llm, prompts)
        got_alone = [_greedy(llm, [p])[0] for p in prompts[:3]]
        got_scores = scores(llm)
    assert got_scores and got_scores == pytest.approx(scores(ref_llm), abs=1e-4)
    _assert_matches(ref_llm, prompts, got, ref)
    _assert_matches(ref_llm, prompts[:3], got_alone, ref[:3])


def test_chi2_sampled_with_a_split_draft_at_tp2(tmp_path):
    """As ``test_spec_equality.test_chi2_moe_target_sampled_with_a_draft`` at TP=1: seeded requests of one
    prompt at temperature 1, top-k 4, a draft split over both ranks at k = 1; tokens 0 and 1 are plain
    sampling, token 2 comes from verifying drafts. All follow the target's distribution, computed at TP=1."""
    from tests.test_rejection import chi2_pvalue, position
    from tests.test_spec_equality import top_k_target_probs

    target = save_tiny_checkpoint(tmp_path / "t", "llama", seed=7, layers=2)
    draft = save_tiny_checkpoint(tmp_path / "d", "llama", seed=8, layers=1)
    prompt, top_k, n = [5, 17, 42, 99, 3, 250], 4, 3000
    kw: dict[str, Any] = dict(num_blocks=2048, block_size=16, device="cpu", dtype="float32", max_num_seqs=256)
    with LLM(target, tensor_parallel_size=2, speculative_model=draft, num_speculative_tokens=1,
             speculative_adaptive=False, **kw) as llm:
        params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True, seed=i)
                  for i in range(n)]
        outs = [o.outputs[0].token_ids for o in llm.generate(None, params, prompt_token_ids=[prompt] * n)]
        spec = llm.get_metrics()["speculative"]
    p = top_k_target_probs(LLM(target, **kw).engine.runner.model, prompt, top_k)
    pv = [chi2_pvalue(position(outs, j), p[j]) for j in range(3)]
    print(f"TP=2 chi2 p-values: tokens 0, 1 {pv[0]:.3g} {pv[1]:.3g}, token 2 (verified drafts) {pv[2]:.3g}")
    assert min(pv) > 0.01
    assert spec["draft_tokens"] >= n // 2 and 0 < spec["accepted_tokens"] < spec["draft_tokens"]


# -- the demo model -------------------------------------------------------------------------------------------
DEMO_PROMPTS = [
    "Write a Python function that reverses a list.", "The capital of France is", "def fib(n):\n    ",
    "List three colors:", "Explain what a hash map is in one sentence.", "import os\nimport sys\n\ndef main():",
    "Once upon a time", "The quick brown fox", "SELECT name FROM users WHERE", "Translate 'good morning' to French:",
    "1, 2, 3, 4, 5,", "class Stack:\n    def __init__(self):", "The speed of light is", "Q: What is 2 + 2?\nA:",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n", "My favourite programming language is",
]


@pytest.fixture(scope="module")
def demo_reference():
    """TP=1 greedy outputs of the demo model (the reference, and the near-tie oracle)."""
    llm = LLM(None, num_blocks=512, device="cpu", max_num_seqs=8)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in DEMO_PROMPTS]
    return llm, prompts, _greedy(llm, prompts, 24, speculative=False)


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [
    ("ngram", dict(speculative_method="ngram", num_speculative_tokens=4)),
    ("layer_skip", dict(speculative_method="layer_skip", num_speculative_tokens=3)),
    ("draft at draft TP 1", dict(speculative_model="<demo>", num_speculative_tokens=3, draft_tensor_parallel_size=1)),
    ("draft at draft TP 2", dict(speculative_model="<demo>", num_speculative_tokens=3)),
    ("eagle + lookup first", dict(speculative_model=SHIPPED_HEAD, num_speculative_tokens=3, prompt_lookup_first=True)),
    ("eagle trees", dict(speculative_model=SHIPPED_HEAD, num_speculative_tokens=3, speculative_eagle_topk=3,
                         speculative_num_draft_tokens=8)),
])
def test_demo_model_tp2_equals_tp1(demo_reference, name, kw):
    """16 prompts x 24 tokens at batch 8 and at batch 1, speculation on (fixed k, so every step drafts) and off,
    against TP=1 without speculation."""
    ref_llm, prompts, ref = demo_reference
    kw = {k: (default_model_path() if v == "<demo>" else v) for k, v in kw.items()}
    with LLM(None, tensor_parallel_size=2, num_blocks=512, device="cpu", max_num_seqs=8,
             speculative_adaptive=False, **kw) as llm:
        spec_on = _greedy(llm, prompts, 24)
        alone = [_greedy(llm, [p], 24)[0] for p in prompts]
        spec_off = _greedy(llm, prompts, 24, speculative=False)
        # speculation off at batch 1 too (once: it does not depend on the proposer)
        off_alone = [_greedy(llm, [p], 24, speculative=False)[0] for p in prompts] if name == "ngram" else []
        metrics = llm.get_metrics()
    assert metrics["speculative"]["draft_tokens"] > 0, name
    _assert_matches(ref_llm, prompts, spec_on, ref)
    _assert_matches(ref_llm, prompts, alone, ref)
    _assert_matches(ref_llm, prompts, spec_off, ref)
    if off_alone:
        _assert_matches(ref_llm, prompts, off_alone, ref)
    assert metrics["kv_free_blocks"] == metrics["kv_num_blocks"]


@pytest.mark.slow
def test_each_rank_holds_half_the_weights():
    """Weight bytes per rank at TP=2 against TP=1 (the demo GGUF, kept quantized)."""
    from specserve.model.quant import weight_bytes

    one = weight_bytes(LLM(None, num_blocks=64, device="cpu").engine.runner.model)
    with LLM(None, tensor_parallel_size=2, num_blocks=64, device="cpu") as llm:
        rank0 = weight_bytes(llm.engine.runner.model)
    print(f"weights: TP=1 {one / 2**20:.1f} MiB, TP=2 rank 0 {rank0 / 2**20:.1f} MiB ({rank0 / one:.2f}x)")
    assert 0.45 < rank0 / one < 0.6  # norms are replicated; the 9 heads split 6 + 3
