"""`specserve distill` on a tiny random target: both draft kinds come out loadable, `--resume` continues the
checkpoint, and speculation with the distilled drafts keeps greedy output exact (batch 1 and 4)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import SamplingParams
from specserve.cli import main
from specserve.config import SpecserveError
from specserve.distill.data import Sample, load_samples, stdlib_code_chunks
from specserve.distill.train import collate
from specserve.llm import LLM
from specserve.model.checkpoint.loader import load_checkpoint
from tests.helpers import save_tiny_checkpoint

PROMPTS = ["hello world, this is a test", "The quick brown fox jumps over the lazy dog.",
           "def add(a, b): return a + b", "Once upon a time there was a king", "for i in range(10): print(i)",
           "abc abc abc abc", "Summarize: rain fell all day and the river rose.", "User: Say hi. Assistant:"]
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_blocks=256)
FAST = ["--tokens", "240", "--max-tokens", "24", "--batch", "8", "--batch-tokens", "256", "--eval-prompts", "2",
        "--eval-max-tokens", "8", "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = os.environ.get("SPECSERVE_NUM_THREADS")
    os.environ["SPECSERVE_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("SPECSERVE_NUM_THREADS", None)
    else:
        os.environ["SPECSERVE_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = save_tiny_checkpoint(root / "target", "llama", seed=0, layers=2, initializer_range=0.1)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"root": root, "target": target, "prompts": str(prompts)}


def _distill(setup, out: str, *extra: str) -> None:
    argv = ["distill", "--target", setup["target"], "--out", out, "--dataset", setup["prompts"], *FAST, *extra]
    assert main(argv) == 0


def _greedy_equal(target: str, batch: int, **spec) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=20)
    ref = [o.outputs[0].token_ids for o in LLM(target, max_num_seqs=batch, **ENGINE).generate(PROMPTS, sp)]
    llm = LLM(target, num_speculative_tokens=3, speculative_adaptive=False, max_num_seqs=batch, **ENGINE, **spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)] == ref
    metrics = llm.get_metrics()["speculative"]
    assert metrics["draft_tokens"] > 0, metrics
    return metrics


def test_head_distill_resume_and_exactness(setup):
    out = str(setup["root"] / "head")
    _distill(setup, out, "--kind", "head", "--steps", "3", "--text-tokens", "300", "--text-seq-len", "48",
             "--greedy-every", "2")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["specserve_draft"] == "eagle"
    samples, meta = load_samples(os.path.join(out, "samples.pt"))
    text = [s for s in samples if s.prompt_len == 1]
    assert meta["text_tokens"] == 300 and sum(len(s.token_ids) for s in text) >= 300
    for s in samples:  # every position has a soft target: the prompt's (and the text's) included
        assert s.first_target == 0 and s.top_ids.shape[0] == len(s.token_ids) - 1 == s.features.shape[0]
    ck = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ck["step"] == 3 and [h["step"] for h in ck["history"]] == [1, 2, 3]
    report = json.load(open(os.path.join(out, "distill.json")))
    assert [r["k"] for r in report["evaluation"]["by_k"]] == [1, 2, 3, 4, 5]
    assert all(r["exact"] for r in report["evaluation"]["by_k"])

    # --resume asking for more text reads on from where the first collection stopped
    _distill(setup, out, "--kind", "head", "--steps", "5", "--resume", "--text-tokens", "500", "--text-seq-len", "48")
    samples2, meta2 = load_samples(os.path.join(out, "samples.pt"))
    text2 = [s for s in samples2 if s.prompt_len == 1]
    assert meta2["text_tokens"] == 500 and len(samples2) > len(samples)
    assert [s.token_ids for s in text2[:len(text)]] == [s.token_ids for s in text]
    new = text2[len(text):]
    assert sum(len(s.token_ids) for s in new) >= 200
    assert not {tuple(s.token_ids) for s in new} & {tuple(s.token_ids) for s in text}
    ck2 = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ck2["step"] == 5
    assert [h["step"] for h in ck2["history"]] == [1, 2, 3, 4, 5]
    assert ck2["history"][:3] == ck["history"]  # continued, not restarted
    # Extending a finished run restarts the LR schedule (warmup + cosine over the new steps) from step 3.
    assert ck2["config"]["schedule_from"] == 3 and ck2["history"][3]["lr"] == pytest.approx(3e-3 / 20)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in ck2["history"])
    for batch in (1, 4):
        _greedy_equal(setup["target"], batch, speculative_method="eagle", speculative_model=out)


def test_head_distill_reading_several_target_layers(setup):
    """--feature-layers 1,2 (EAGLE-3 style): the collected features hold both layers, the head reads them
    when serving, and greedy output stays exact."""
    out = str(setup["root"] / "head_multi")
    _distill(setup, out, "--kind", "head", "--steps", "2", "--feature-layers", "1,2", "--text-tokens", "100",
             "--text-seq-len", "48", "--eval-prompts", "0", "--train-dtype", "bfloat16")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["feature_layers"] == [1, 2]
    samples, _ = load_samples(os.path.join(out, "samples.pt"))
    hidden = load_checkpoint(setup["target"]).arch.hidden_size
    assert all(s.features.shape[-1] == 2 * hidden for s in samples)  # engine-sampled and teacher-forced alike
    _greedy_equal(setup["target"], 4, speculative_method="eagle", speculative_model=out)
    from specserve.distill.command import feature_layers

    assert feature_layers("eagle3", 30) == (2, 15, 30) and feature_layers("last", 30) is None
    for bad in ("1", "2,1,2", "x"):
        with pytest.raises(ValueError, match="--feature-layers"):
            feature_layers(bad, 2)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_head_distill_for_other_families(tmp_path, family):
    """A head for a Gemma 3 target (sandwich norms, GeGLU, sliding layers, scaled embeddings) and for a Qwen3-MoE
    target: the head's Llama layer starts from what it shares with the target's last layer, training stays
    finite, and serving with it is exact."""
    target = save_tiny_checkpoint(tmp_path / "target", family, seed=1, layers=2, initializer_range=0.1)
    out = str(tmp_path / "head")
    assert main(["distill", "--target", target, "--out", out, "--dataset", _prompts_file(tmp_path), *FAST,
                 "--kind", "head", "--steps", "2", "--text-tokens", "100", "--text-seq-len", "48",
                 "--eval-prompts", "0"]) == 0
    ck = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in ck["history"])
    _greedy_equal(target, 4, speculative_method="eagle", speculative_model=out)


def _prompts_file(root) -> str:
    path = root / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


def test_model_distill_is_a_normal_hf_draft(setup, tmp_path):
    out = str(setup["root"] / "model")
    _distill(setup, out, "--kind", "model", "--layers", "1", "--steps", "2", "--train-dtype", "bfloat16")
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert state["config"]["autocast"] == "torch.bfloat16"  # mixed precision: fp32 master weights
    assert all(v.dtype == torch.float32 for v in state["module"].values() if v.is_floating_point())
    ck = load_checkpoint(out)
    target = load_checkpoint(setup["target"])
    assert ck.arch.num_layers == 1 and ck.arch.vocab_size == target.arch.vocab_size
    assert torch.equal(ck.state_dict["model.embed_tokens.weight"].float(),
                       target.state_dict["model.embed_tokens.weight"].half().float())  # the target's, copied
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    for batch in (1, 4):
        _greedy_equal(setup["target"], batch, speculative_model=out)
    other = save_tiny_checkpoint(tmp_path / "other", "llama", seed=1, layers=1, vocab=300)
    with pytest.raises(SpecserveError, match="vocabulary of 260 tokens but the target has 300"):
        LLM(other, speculative_model=out, num_speculative_tokens=2, **ENGINE)


def test_stdlib_text_skips_the_benchmark_modules():
    from specserve.datasets import CODE_MODULES

    seen: list[str] = []

    class Recorder:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            seen.append(text)
            return list(range(len(text) // 40))

    chunks = stdlib_code_chunks(Recorder(), CODE_MODULES, seq_len=64)
    got = [next(chunks) for _ in range(20)]
    assert all(len(c) == 64 for c in got)
    import heapq
    import textwrap

    for mod in (textwrap, heapq):  # benchmark sources never become training text
        with open(mod.__file__, encoding="utf-8") as f:
            assert f.read() not in seen


def test_collate_over_a_draft_vocabulary_drops_tokens_outside_it():
    s = Sample(token_ids=[5, 6, 7], prompt_len=1, features=torch.zeros(2, 4).half(),
               top_ids=torch.tensor([[3, 9], [8, 9]]), top_logp=torch.tensor([[-0.5, -1.0], [-0.1, -3.0]]).half(),
               target_from=0)
    b = collate([s], [0], torch.device("cpu"), top_k=2, frequent=torch.tensor([]), vocab=torch.tensor([3, 4]))
    assert b.pos.tolist() == [0] and b.rows.tolist() == [0]  # position 1's targets (8, 9) are all outside
    assert b.vocab.tolist() == [3, 4] and b.top_ids.tolist() == [[0, 0]]
    assert b.top_p.tolist() == [[1.0, 0.0]]  # 9 dropped, 3 renormalised


def test_held_out_prompts_written_as_bench_datasets(tmp_path):
    from specserve.datasets import load_dataset
    from specserve.distill.command import _write_held_out

    written = _write_held_out(str(tmp_path), "chat,code,prompts.txt", {"chat-003", "code-010", "code-011"})
    assert written == ["heldout-chat.jsonl", "heldout-code.jsonl"]
    code = load_dataset(str(tmp_path / "heldout-code.jsonl"))
    assert [it.id for it in code] == ["code-010", "code-011"]
    assert code[0].messages == next(it for it in load_dataset("code") if it.id == "code-010").messages


def test_resume_with_a_new_source_appends_its_samples(setup):
    out = str(setup["root"] / "append")
    more = setup["root"] / "more.txt"
    more.write_text("import os\nclass Stack:\nThe weather today is\nx = [i * i for i in range(5)]\n")
    _distill(setup, out, "--kind", "head", "--steps", "2", "--eval-prompts", "0", "--holdout", "0")
    before, meta = load_samples(os.path.join(out, "samples.pt"))
    assert meta["dataset"] == setup["prompts"]
    _distill(setup, out, "--kind", "head", "--steps", "4", "--eval-prompts", "0", "--holdout", "0", "--resume",
             "--dataset", f"{setup['prompts']},{more}", "--tokens", "40")
    after, meta = load_samples(os.path.join(out, "samples.pt"))
    assert meta["dataset"] == f"{setup['prompts']},{more}" and meta["complete"]
    assert [s.token_ids for s in after[:len(before)]] == [s.token_ids for s in before]  # kept, in order
    new = after[len(before):]
    assert new and sum(len(s.token_ids) - s.prompt_len for s in new) >= 40
    assert all(s.token_ids[:s.prompt_len] not in [b.token_ids[:b.prompt_len] for b in before] for s in new)
    ck = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ck["step"] == 4
    _distill(setup, out, "--kind", "head", "--steps", "4", "--eval-prompts", "0", "--holdout", "0", "--resume",
             "--dataset", f"{setup['prompts']},{more}", "--tokens", "40")
    assert len(load_samples(os.path.join(out, "samples.pt"))[0]) == len(after)  # nothing new to add


def test_stdlib_code_prompts_avoid_the_benchmark_modules():
    from specserve.datasets import (
        CODE_MODULES,
        SUMMARIZE_MODULES,
        TRAIN_CODE,
        build_code,
        build_code_train,
    )

    items = build_code_train(limit=80)
    assert len(items) == 80 and len({it.id for it in items}) == 80
    assert all(it.id.startswith(TRAIN_CODE + "-") and it.task == "complete_body" for it in items)
    modules = {it.source["module"] for it in items}
    assert len(modules) >= 40  # round-robin over many modules
    assert not modules & set(CODE_MODULES + SUMMARIZE_MODULES)
    bench = {(it.source["module"], it.source["qualname"]) for it in build_code()}
    assert not bench & {(it.source["module"], it.source["qualname"]) for it in items}


def test_stdlib_json_prompts_carry_the_schema_and_avoid_the_benchmark_modules():
    from specserve.datasets import CODE_MODULES, SUMMARIZE_MODULES, TRAIN_JSON, build_json, build_json_train

    items = build_json_train(limit=60)
    assert len(items) == 60 and len({it.id for it in items}) == 60
    assert all(it.id.startswith(TRAIN_JSON + "-") and it.task == "extract_signature" for it in items)
    bench = build_json()
    assert all(it.response_format == bench[0].response_format for it in items)  # the `json` workload's schema
    modules = {it.source["module"] for it in items}
    assert len(modules) >= 30 and not modules & set(CODE_MODULES + SUMMARIZE_MODULES)


def test_vocab_chat_prompts_are_seeded_everyday_requests():
    from specserve.datasets import VOCAB_CHAT
    from specserve.distill.data import vocab_chat
    from specserve.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(None)  # the demo model's tokenizer (49k tokens)
    a, b = vocab_chat(tok, limit=200), vocab_chat(tok, limit=200)
    assert a == b and len(a) == 200 and len({i for i, _ in a}) == 200
    assert all(i.startswith(VOCAB_CHAT + "-") and m[0]["role"] == "user" for i, m in a)
    assert len({m[0]["content"] for _, m in a}) == 200
    assert vocab_chat(tok, limit=200, seed=1) != a


def test_collection_follows_a_prompts_response_format(setup):
    """A prompt with a ``response_format`` is sampled under its grammar, as serving samples it."""
    from specserve.distill.data import Prompt, collect

    llm = LLM(setup["target"], enable_prefix_caching=False, **ENGINE)  # as distill runs it: every position's feature
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}}}
    tok = llm.tokenizer
    prompts = [Prompt("a", tok.encode("Answer yes or no:"), rf), Prompt("b", tok.encode("Say something:"))]
    samples = collect(llm, prompts, 40, 12, 1.0, 2, seed=0)
    constrained = [s for s in samples if s.token_ids[:s.prompt_len] == prompts[0].token_ids]
    free = [s for s in samples if s.token_ids[:s.prompt_len] == prompts[1].token_ids]
    assert constrained and free
    for s in constrained:
        assert tok.decode(s.token_ids[s.prompt_len:]).strip() in ('"yes"', '"no"')
    assert any(tok.decode(s.token_ids[s.prompt_len:]).strip() not in ('"yes"', '"no"') for s in free)


def test_init_starts_from_an_exported_head(setup, capsys):
    """--init: training starts from that head's weights and keeps its draft vocabulary (lr 0: the export
    equals the init); a head for other feature layers is refused."""
    from safetensors.torch import load_file

    base = str(setup["root"] / "init_base")
    _distill(setup, base, "--kind", "head", "--steps", "2", "--eval-prompts", "0", "--draft-vocab", "64")
    out = str(setup["root"] / "init_tuned")
    _distill(setup, out, "--kind", "head", "--steps", "1", "--eval-prompts", "0", "--lr", "0", "--init", base,
             "--draft-vocab", "100")
    a, b = load_file(os.path.join(base, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys() and a["draft_vocab"].numel() == 64
    assert all(torch.equal(a[k], b[k]) for k in a)
    scratch = str(setup["root"] / "init_none")
    _distill(setup, scratch, "--kind", "head", "--steps", "1", "--eval-prompts", "0", "--lr", "0")
    c = load_file(os.path.join(scratch, "model.safetensors"))
    assert not torch.equal(a["fc.weight"], c["fc.weight"])  # without --init the head starts elsewhere
    capsys.readouterr()
    bad = str(setup["root"] / "init_bad")  # base reads layers 1 and 2 (eagle3 on 2 layers)
    assert main(["distill", "--target", setup["target"], "--out", bad, "--dataset", setup["prompts"], *FAST,
                 "--kind", "head", "--init", base, "--feature-layers", "last"]) == 2
    assert "--feature-layers" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(bad, "samples.pt"))  # refused before collecting


def test_narrow_head_stored_in_int8_serves_exactly(setup):
    """--head-intermediate narrows the head's MLP (cut from the target's last layer), --head-storage int8
    halves the file; the head loads back to the weights it was trained to (within a per-row int8 step) and
    greedy output stays exact."""
    from safetensors.torch import load_file

    from specserve.model.eagle_head import dequantize_rows, read_eagle_config

    out = str(setup["root"] / "head_narrow")
    _distill(setup, out, "--kind", "head", "--steps", "2", "--eval-prompts", "0", "--head-intermediate", "32",
             "--head-storage", "int8")
    assert read_eagle_config(out).intermediate_size == 32
    raw = load_file(os.path.join(out, "model.safetensors"))
    assert raw["layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert raw["layers.0.mlp.down_proj.weight"].shape[1] == 32
    assert raw["fc.weight.row_scale"].shape == (raw["fc.weight"].shape[0],)
    sd = dequantize_rows(raw, out)
    assert sd["fc.weight"].dtype == torch.float32 and not any(k.endswith(".row_scale") for k in sd)
    _greedy_equal(setup["target"], 4, speculative_method="eagle", speculative_model=out)


def test_narrowed_mlp_keeps_the_strongest_channels():
    from specserve.distill.train import narrowed_mlp

    inter, hidden = 6, 4
    gate_up = torch.ones(2 * inter, hidden)
    down = torch.ones(hidden, inter)
    down[:, 1] *= 5
    down[:, 4] *= 3
    out = narrowed_mlp({"mlp.gate_up": gate_up, "mlp.down": down, "x": torch.zeros(1)}, 2)
    assert torch.equal(out["mlp.down"], down[:, [1, 4]]) and out["mlp.gate_up"].shape == (4, hidden)
    assert narrowed_mlp({"mlp.gate_up": gate_up, "mlp.down": down}, 8)["mlp.down"] is down
