"""EAGLE head in the engine (spec_decode/eagle.py, worker/features.py): exactness, real speculation, plumbing.

- Greedy output with the head equals greedy output without speculation (batch 1 and 4), and drafts were
  proposed and some accepted.
- Plumbing: every draft the engine proposed equals the argmax of the *dense* training forward
  (distill/dense.py) on the same tokens with the target's own features -- this pins feature alignment
  (h_{p-1} with t_p), the head's KV catch-up and the second, self-fed draft step. Near-ties (top-2 logits
  within 1e-4) are tolerated and counted, per docs/speculative_decoding.md.
- A head whose vocabulary or hidden size does not match the target is refused with a clear message.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from specserve import SamplingParams
from specserve.config import SpecserveError, SpeculativeConfig
from specserve.distill import dense
from specserve.llm import LLM
from specserve.model.checkpoint.loader import load_checkpoint
from specserve.model.decoder import DecoderModel
from specserve.model.eagle_head import EagleConfig, EagleHead, save_eagle_head
from specserve.model.kernels.cpu import load_cpu_kernels
from specserve.model.quant import CpuQuantWeight
from specserve.platform import detect
from tests.helpers import save_tiny_checkpoint, save_tiny_eagle_head

PROMPTS = ["hello world, hello world, hello", "def add(a, b):\n    return a + b\n", "abc abc abc abc",
           "The cat sat on the mat. The cat", "for i in range(10):\n    print(i)\n", "Once upon a time",
           "1 2 3 4 5 6 7 8", "User: Say hi.\nAssistant:"]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_blocks=256)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = os.environ.get("SPECSERVE_NUM_THREADS")
    os.environ["SPECSERVE_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("SPECSERVE_NUM_THREADS", None)
    else:
        os.environ["SPECSERVE_NUM_THREADS"] = old


def _target_model(path: str) -> DecoderModel:
    ck = load_checkpoint(path)
    m = DecoderModel(ck.arch, torch.float32, torch.device("cpu"), None, 1024)  # type: ignore[arg-type]
    m.load_weights(ck.state_dict)
    return m


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer target whose second layer writes small residuals, and a head = the target's first layer
    over fc([embedding ; feature]) = embedding + 0.3 R feature: it agrees with the target often (so drafts
    get accepted) and depends on the features (so a misaligned feature changes its drafts)."""
    root = tmp_path_factory.mktemp("eagle")
    target = save_tiny_checkpoint(root / "target", "llama", seed=0, layers=2, initializer_range=0.1)
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(target, "model.safetensors"))
    for n in ("self_attn.o_proj", "mlp.down_proj"):
        sd[f"model.layers.1.{n}.weight"] *= 0.1
    save_file(sd, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    model = _target_model(target)
    gen = torch.Generator().manual_seed(0)
    save_tiny_eagle_head(model, str(root / "head"), gen)
    # An EAGLE-3-style head reading both target layers: fc's slot for layer 1 is random too, so drafts
    # depend on it (a layer tapped wrongly or misaligned shows up in the dense check).
    save_tiny_eagle_head(model, str(root / "head_multi"), gen, feature_layers=(1, 2))
    return {"target": target, "head": str(root / "head"), "head_multi": str(root / "head_multi"), "root": root,
            "model": model}


def _greedy(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    return _greedy(LLM(tiny["target"], **ENGINE))


@pytest.mark.parametrize("head", ["head", "head_multi"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equal_with_eagle_head(tiny, reference, batch, head):
    llm = LLM(tiny["target"], speculative_method="eagle", speculative_model=tiny[head], num_speculative_tokens=3,
              speculative_adaptive=False, max_num_seqs=batch, **ENGINE)
    assert _greedy(llm) == reference
    spec = llm.get_metrics()["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0, spec
    assert spec["accepted_tokens"] < spec["draft_tokens"], spec  # rejections happened too: rollback tested


@pytest.mark.parametrize("head", ["head", "head_multi"])
@pytest.mark.parametrize("batch,topk,nodes", [(1, 3, 8), (4, 2, 5), (4, 4, 16)])
def test_greedy_equal_with_draft_trees(tiny, reference, head, batch, topk, nodes):
    """EAGLE-2 dynamic trees: the accepted path's KV is moved into place, the rest is stale; greedy output
    equals plain decoding, and paths other than the head's first choice get accepted."""
    llm = LLM(tiny["target"], speculative_method="eagle", speculative_model=tiny[head], num_speculative_tokens=3,
              speculative_adaptive=False, max_num_seqs=batch, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=nodes, **ENGINE)
    assert _greedy(llm) == reference
    spec = llm.get_metrics()["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0, spec
    assert llm.engine.runner.drafter.controller.tree_calibration != 1.0  # trees were verified and measured


TREE = dict(speculative_method="eagle", num_speculative_tokens=3, speculative_eagle_topk=3,
            speculative_num_draft_tokens=9)


@pytest.mark.parametrize("case", ["preemption", "chunked_prefill", "prefix_cache", "lookup_first", "lookup_suffix",
                                  "batch_32"])
def test_draft_trees_greedy_equal_across_the_matrix(tiny, reference, case):
    engine = dict(ENGINE, max_num_seqs=8)
    if case == "preemption":  # 16 blocks of 16 tokens for 8 requests: preempted and resumed mid-tree
        engine.update(num_blocks=16)
    elif case == "chunked_prefill":
        engine.update(max_num_batched_tokens=24)
    elif case == "lookup_first":
        engine.update(prompt_lookup_first=True)
    elif case == "lookup_suffix":  # lookup from the suffix index: earlier requests' outputs too
        engine.update(prompt_lookup_first=True, prompt_lookup_source="suffix")
    elif case == "batch_32":
        engine.update(max_num_seqs=32)
    llm = LLM(tiny["target"], speculative_model=tiny["head"], speculative_adaptive=False, **TREE, **engine)
    assert _greedy(llm) == reference
    if case == "prefix_cache":  # the second pass hits the first's cached blocks
        assert _greedy(llm) == reference
        assert llm.get_metrics()["prefix_cache_hits"] > 0
    if case == "preemption":
        assert llm.get_metrics()["num_preemptions"] > 0
    if case.startswith("lookup"):
        assert llm.get_metrics()["speculative_sources"]["lookup"]["accepted_tokens"] > 0


def test_draft_trees_mixed_with_chains_and_stops(tiny, reference):
    """Penalised requests draft chains (their rows depend on the drafts before them) next to tree requests;
    stop strings and max_tokens cut inside an accepted tree path exactly where plain decoding stops."""
    plain = LLM(tiny["target"], max_num_seqs=8, **ENGINE)
    llm = LLM(tiny["target"], speculative_model=tiny["head"], speculative_adaptive=False, max_num_seqs=8, **TREE,
              **ENGINE)
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3 if i % 2 else 1.0,
                             stop=[PROMPTS[i][-2:]] if i % 3 == 0 else None) for i in range(len(PROMPTS))]
    want = [o.outputs[0] for o in plain.generate(PROMPTS, params)]
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                      for o in want]


def test_seeded_tree_sampling_alone_equals_in_batch(tiny):
    llm = LLM(tiny["target"], speculative_model=tiny["head"], speculative_adaptive=False, max_num_seqs=8, **TREE,
              **ENGINE)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16)
    alone = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    batch = llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert alone == batch


def test_tree_flags_are_checked():
    with pytest.raises(ValueError, match="EAGLE head"):
        SpeculativeConfig.from_args(speculative_method="ngram", num_speculative_tokens=3, speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="expands more than"):
        SpeculativeConfig.from_args(speculative_method="eagle", speculative_model="x", num_speculative_tokens=9,
                                    speculative_eagle_topk=8)
    cfg = SpeculativeConfig.from_args(speculative_method="eagle", speculative_model="x", num_speculative_tokens=4,
                                      speculative_eagle_topk=4)
    assert cfg.num_draft_tokens == 10 and cfg.lookahead_slots == 12


def test_speculative_model_alone_selects_eagle(tiny, reference):
    llm = LLM(tiny["target"], speculative_model=tiny["head"], num_speculative_tokens=2, **ENGINE)
    assert llm.engine.config.speculative.method == "eagle"
    assert _greedy(llm) == reference


def test_reduced_draft_vocab(tiny, reference):
    """A head drafting among 96 tokens only: drafts stay inside them, output stays exact."""
    out = str(tiny["root"] / "head_small_vocab")
    head = EagleHead(EagleConfig.from_target(tiny["model"].arch), torch.float32, torch.device("cpu"), None, 1024)
    from safetensors.torch import load_file

    head.load_hf_state_dict(load_file(os.path.join(tiny["head"], "model.safetensors")), "head")
    vocab = torch.arange(32, 128)
    save_eagle_head(head, out, draft_vocab=vocab)
    llm = LLM(tiny["target"], speculative_model=out, num_speculative_tokens=3, speculative_adaptive=False, **ENGINE)
    proposer = llm.engine.runner.drafter.proposer
    drafted: list[int] = []
    original = proposer.propose

    def record(reqs, *rest):
        drafts = original(reqs, *rest)
        drafted.extend(t for d in drafts for t in d.token_ids)
        return drafts

    proposer.propose = record
    assert _greedy(llm) == reference
    assert drafted and all(32 <= t < 128 for t in drafted)
    assert llm.get_metrics()["speculative"]["accepted_tokens"] > 0


@pytest.mark.parametrize("kind", ["head", "head_small_vocab", "grammar"])
def test_greedy_fast_path_drafts_what_the_sampler_drafts(tiny, reference, kind, monkeypatch):
    """Greedy requests without logits processing draft through ``EagleProposer._greedy_chains`` (token ids
    straight from the head's argmax, no [B, vocab] logits); a no-op logit bias sends the same requests through
    the sampler path. Both must draft the same tokens, with and without a reduced draft vocabulary, and under
    a grammar (where the head's argmax is often forbidden and the best allowed token is drafted), batch 4."""
    from specserve.sampling_params import StructuredOutputsParams
    from specserve.spec_decode.draft_model import DraftSampler

    path, structured = tiny["head"], None
    if kind == "head_small_vocab":
        head = EagleHead(EagleConfig.from_target(tiny["model"].arch), torch.float32, torch.device("cpu"), None, 1024)
        from safetensors.torch import load_file

        head.load_hf_state_dict(load_file(os.path.join(tiny["head"], "model.safetensors")), "head")
        path = str(tiny["root"] / "head_fast_vocab")
        save_eagle_head(head, path, draft_vocab=torch.arange(16, 200))
    if kind == "grammar":
        structured = StructuredOutputsParams(regex="[a-m ]{4,40}[.]")
    masked = []
    original_masked = DraftSampler.masked

    def count_masked(*args):
        masked.append(1)
        return original_masked(*args)

    monkeypatch.setattr(DraftSampler, "masked", staticmethod(count_masked))
    runs = []
    for bias in (None, {0: 0.0}):
        llm = LLM(tiny["target"], speculative_model=path, num_speculative_tokens=3, speculative_adaptive=False,
                  max_num_seqs=4, **ENGINE)
        proposer = llm.engine.runner.drafter.proposer
        seen: list[tuple[list[int], list[int]]] = []
        fast = []
        original, chains = proposer.propose, proposer._greedy_chains

        def record(reqs, *rest, original=original, seen=seen):
            drafts = original(reqs, *rest)
            seen.extend((list(r.token_ids), d.token_ids) for r, d in zip(reqs, drafts, strict=True))
            return drafts

        def count(*args, chains=chains, fast=fast):
            fast.append(1)
            return chains(*args)

        proposer.propose, proposer._greedy_chains = record, count
        masked.clear()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logit_bias=bias,
                                                    structured_outputs=structured))
        runs.append(([o.outputs[0].token_ids for o in outs], seen, len(fast), len(masked)))
    (out_fast, plain, num_fast, masked_fast), (out_biased, biased, num_biased, _) = runs
    assert out_fast == out_biased and (structured is not None or out_fast == reference)
    assert num_fast > 10 and num_biased == 0
    assert len(plain) > 20 and plain == biased
    assert (masked_fast > 0) == (structured is not None)


@pytest.mark.skipif(detect("cpu").quant_kernels != "cpu" or not load_cpu_kernels(),
                    reason="the C++ CPU kernels need an x86 CPU with AVX2 and a C++ compiler")
def test_quantized_target_gets_an_8bit_head_and_stays_exact(tiny):
    """With a quantized target on the CPU kernels the head's matmuls go 8-bit: its predictions move by the
    int8 rounding only, and the output still equals plain decoding of the quantized target bit for bit."""
    ref = _greedy(LLM(tiny["target"], quantization="int8", **ENGINE))
    llm = LLM(tiny["target"], quantization="int8", speculative_model=tiny["head_multi"], num_speculative_tokens=3,
              speculative_adaptive=False, **ENGINE)
    head = llm.engine.runner.drafter.model
    assert isinstance(head, EagleHead)
    assert all(isinstance(w, CpuQuantWeight) for w in (head.fc, head.layer.attn.qkv, head.layer.mlp.down))
    assert _greedy(llm) == ref
    assert llm.get_metrics()["speculative"]["accepted_tokens"] > 0
    trees = LLM(tiny["target"], quantization="int8", speculative_model=tiny["head"], speculative_adaptive=False,
                max_num_seqs=4, **TREE, **ENGINE)  # tree steps through the fused decoder_layer kernel
    calls = []
    fused = torch.ops.specserve_cpu.decoder_layer
    # the tree mask: after it come the second q/k/v part's codes, scales and mins, then the activation bits
    torch.ops.specserve_cpu.decoder_layer = lambda *a: calls.append(a[-5] is not None) or fused(*a)
    try:
        assert _greedy(trees) == ref
    finally:
        torch.ops.specserve_cpu.decoder_layer = fused
    assert any(calls)  # some steps carried a tree mask into the fused layer
    dense_head = LLM(tiny["target"], speculative_model=tiny["head_multi"], num_speculative_tokens=3,
                     **ENGINE).engine.runner.drafter.model  # float target: the head stays float
    assert isinstance(dense_head.fc, torch.nn.Parameter)
    gen = torch.Generator().manual_seed(3)
    embeds, feats = torch.randn(5, 64, generator=gen), torch.randn(5, 128, generator=gen) * 20
    want, got = dense_head.fuse(embeds, feats), head.fuse(embeds, feats)
    assert (got - want).abs().max().item() < 0.02 * want.abs().max().item()
    assert not torch.equal(got, want)  # the packed weights are in use
    # Drafting steps 2..k read the head's own prediction of the last layer only: the packed head's shortcut
    # (fc's embedding and last-layer columns) gives the same bits as zeros in the other layers' slots.
    assert head._own is not None
    own = feats[:, -64:]
    fast = head.fuse(embeds, own)
    saved, head._own = head._own, None
    try:
        slow = head.fuse(embeds, own)
    finally:
        head._own = saved
    assert torch.equal(fast, slow)
    sd, ref_sd = head.hf_state_dict(), dense_head.hf_state_dict()  # saving a packed head dequantizes
    assert sd.keys() == ref_sd.keys()
    assert all((sd[n] - ref_sd[n]).abs().max().item() <= 0.01 * ref_sd[n].abs().max().item() + 1e-6 for n in sd)


def test_input_norms_make_the_head_blind_to_feature_scale(tiny):
    """fc reads RMS-normalised inputs: a target whose residual stream is 200x its embeddings' scale (the
    demo model) cannot drown the token out."""
    head = EagleHead(EagleConfig.from_target(tiny["model"].arch), torch.float32, torch.device("cpu"), None, 64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head.fc.normal_(generator=gen)
    e, f = torch.randn(3, head.cfg.hidden_size, generator=gen), torch.randn(3, head.cfg.hidden_size, generator=gen)
    torch.testing.assert_close(head.fuse(e, 200 * f), head.fuse(e, f))
    assert not torch.allclose(head.fuse(e + 1, f), head.fuse(e, f))


def test_head_saved_without_input_norms_still_loads(tiny, reference, tmp_path):
    """Heads saved before the input norms (no ``input_norms`` in config.json, no norm tensors) load as such."""
    import dataclasses

    from safetensors.torch import load_file

    cfg = dataclasses.replace(EagleConfig.from_target(tiny["model"].arch), input_norms=False)
    head = EagleHead(cfg, torch.float32, torch.device("cpu"), None, 1024)
    sd = load_file(os.path.join(tiny["head"], "model.safetensors"))
    head.load_hf_state_dict({k: v for k, v in sd.items() if "_norm.weight" not in k or "layers." in k}, "head")
    out = tmp_path / "old_head"
    save_eagle_head(head, str(out))
    raw = json.loads((out / "config.json").read_text())
    del raw["input_norms"]
    (out / "config.json").write_text(json.dumps(raw))
    assert "embed_norm.weight" not in load_file(str(out / "model.safetensors"))
    llm = LLM(tiny["target"], speculative_model=str(out), num_speculative_tokens=3, **ENGINE)
    assert llm.engine.runner.drafter.model.embed_norm is None
    assert _greedy(llm) == reference


def _dense_logits(model: DecoderModel, head: EagleHead, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """Logits behind each draft, recomputed densely: entries 0 .. L-1 read the target's features (teacher
    forcing), each later entry (draft j, the head's previous prediction) is appended and the whole causal
    sequence re-run -- what the engine computes incrementally through the head's paged KV."""
    n = len(tokens)
    with torch.no_grad():
        feats = dense.model_features(model, torch.tensor([tokens[:-1]]), taps=head.cfg.feature_layers)[0]
        inputs = [torch.zeros_like(feats[0]), *feats]  # entry p reads h_{p-1} (all tapped layers)
        out = []
        for j in range(len(drafts)):
            ids = torch.tensor([tokens + drafts[:j]])
            pred = dense.head_forward(head, F.embedding(ids, model.embed), torch.stack(inputs)[None])[0]
            out.append(dense.logits(model, pred[n - 1 + j]))
            # the next entry reads the head's own prediction, in the last layer's slot (others zero)
            inputs.append(F.pad(pred[n - 1 + j], (feats.shape[-1] - pred.shape[-1], 0)))
    return out


@pytest.mark.parametrize("kind,lookup_first", [("head", False), ("head_multi", False), ("head", True)])
def test_engine_drafts_match_dense_forward(tiny, kind, lookup_first):
    """Every draft (k = 3) of every proposal, with prefill chunks (token budget 24) and batch 4. With
    --prompt-lookup-first the head skips the steps lookup drafts and catches up later: its drafts must still
    equal the dense forward, i.e. the features of the skipped steps reached it in place."""
    llm = LLM(tiny["target"], speculative_method="eagle", speculative_model=tiny[kind], num_speculative_tokens=3,
              speculative_adaptive=False, max_num_seqs=4, max_num_batched_tokens=24, prompt_lookup_first=lookup_first,
              prompt_lookup_min=1, **ENGINE)
    proposer = llm.engine.runner.drafter.proposer
    if lookup_first:
        proposer = proposer.model
    seen: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def record(reqs, *rest):
        drafts = original(reqs, *rest)
        seen.extend((list(r.token_ids), d.token_ids) for r, d in zip(reqs, drafts, strict=True))
        return drafts

    proposer.propose = record
    _greedy(llm, max_tokens=12)
    head = llm.engine.runner.drafter.model
    assert len(seen) > 20
    mismatches, near_ties = 0, 0
    for tokens, drafts in seen:
        for j, logits in enumerate(_dense_logits(tiny["model"], head, tokens, drafts)):
            if int(logits.argmax()) != drafts[j]:
                top2 = logits.topk(2).values
                if float(top2[0] - top2[1]) < 1e-4 and float(logits.max() - logits[drafts[j]]) < 1e-4:
                    near_ties += 1
                else:
                    mismatches += 1
    print(f"[eagle dense check] {len(seen)} proposals, near-ties accepted: {near_ties}")
    assert mismatches == 0
    if lookup_first:
        both = llm.engine.runner.drafter.proposer
        assert both.num_lookup > 10 and both.num_model > 10, (both.num_lookup, both.num_model)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equal_with_lookup_first(tiny, reference, batch):
    llm = LLM(tiny["target"], speculative_method="eagle", speculative_model=tiny["head"], num_speculative_tokens=3,
              speculative_adaptive=False, max_num_seqs=batch, prompt_lookup_first=True, prompt_lookup_min=2,
              **ENGINE)
    assert _greedy(llm) == reference
    proposer = llm.engine.runner.drafter.proposer
    assert proposer.num_lookup > 0 and proposer.num_model > 0
    # the controller heard each verification under the source that drafted it, and counted model steps only
    controller = llm.engine.runner.drafter.controller
    assert all(controller._global_of(s) != [controller.prior_alpha] * 3 for s in ("lookup", "model"))
    assert controller.global_rates == [controller.prior_alpha] * 3  # the default source drafted nothing
    assert controller.draft_cost.distinct() > 0
    spec = llm.get_metrics()["speculative"]
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], spec


def test_mismatched_head_is_refused(tiny, tmp_path):
    other = save_tiny_checkpoint(tmp_path / "other", "llama", seed=1, layers=1, vocab=300)
    with pytest.raises(SpecserveError, match="vocabulary of 260 tokens but the target has 300"):
        LLM(other, speculative_method="eagle", speculative_model=tiny["head"], num_speculative_tokens=2, **ENGINE)
    wide = save_tiny_checkpoint(tmp_path / "wide", "llama", seed=1, layers=1, hidden_size=128)
    with pytest.raises(SpecserveError, match="hidden size is 128"):
        LLM(wide, speculative_method="eagle", speculative_model=tiny["head"], num_speculative_tokens=2, **ENGINE)
    shallow = save_tiny_checkpoint(tmp_path / "shallow", "llama", seed=1, layers=1)
    with pytest.raises(SpecserveError, match=r"reads target layers \[1, 2\].*the target has 1 layers"):
        LLM(shallow, speculative_method="eagle", speculative_model=tiny["head_multi"], num_speculative_tokens=2,
            **ENGINE)
    with pytest.raises(SpecserveError, match="not an EAGLE head"):
        LLM(tiny["target"], speculative_method="eagle", speculative_model=other, num_speculative_tokens=2, **ENGINE)


def test_feature_norm_normalises_each_layer_on_its_own():
    from specserve.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(4, 1e-6, torch.float32, torch.device("cpu"), chunks=2)
    norm.weight.data = torch.randn(8, generator=gen)
    x = torch.randn(3, 8, generator=gen)
    x[:, 4:] *= 1000  # one layer's scale must not squash the other's
    parts = []
    for i in range(2):
        one = RMSNorm(4, 1e-6, torch.float32, torch.device("cpu"))
        one.weight.data = norm.weight.data[4 * i:4 * i + 4]
        parts.append(one(x[:, 4 * i:4 * i + 4]))
    torch.testing.assert_close(norm(x), torch.cat(parts, dim=-1))


def test_bad_feature_layers_in_config_are_refused(tiny, tmp_path):
    import shutil

    from specserve.config import CheckpointError

    out = tmp_path / "bad_head"
    shutil.copytree(tiny["head_multi"], out)
    raw = json.loads((out / "config.json").read_text())
    for bad in ([0, 2], [], "2", [2, 1, 2]):
        (out / "config.json").write_text(json.dumps({**raw, "feature_layers": bad}))
        with pytest.raises(CheckpointError, match="feature_layers"):
            LLM(tiny["target"], speculative_model=str(out), num_speculative_tokens=2, **ENGINE)
