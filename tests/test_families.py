"""The 2026 families against transformers, from tiny random configs: Gemma 3 (sliding + global layers, sandwich
norms, GeGLU, scaled embeddings), Qwen3-MoE and Mixtral (sparse experts). Each is loaded from a saved HF dir and
from the same weights written as llama.cpp writes GGUF, and compared on logits at every position of a prompt
longer than Gemma's window, fed in uneven chunks, and on 64 greedy tokens against ``generate``."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import run_chunks, tiny_hf_model
from safetensors.torch import load_file

from specserve.config import CheckpointError
from specserve.model.attention import TorchAttention, build_metadata
from specserve.model.checkpoint.loader import load_checkpoint, read_arch
from specserve.model.decoder import DecoderModel

FAMILIES = ["gemma3", "qwen3_moe", "mixtral", "olmoe"]
TOL = 1e-4
NEAR_TIE = 1e-4


def hf_model(family: str, layers: int = 3, **over):
    model = tiny_hf_model(family, layers=layers, **over)
    with torch.no_grad():  # routers with a real spread, so expert choice matters
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0, 0.5)
    return model


def ours(path: str) -> DecoderModel:
    ckpt = load_checkpoint(path)
    model = DecoderModel(ckpt.arch, torch.float32, torch.device("cpu"), TorchAttention(), 512)
    model.load_weights(ckpt.state_dict)
    return model


def prompt(n: int = 50, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def greedy(model: DecoderModel, tokens: list[int], n: int, block_size: int = 4) -> list[int]:
    """n greedy tokens through the paged cache: prefill, then one decode step per token."""
    kv = [torch.zeros(model.kv_cache_shape(64, block_size)) for _ in range(model.arch.num_layers)]
    table = list(range(64))
    out, seq = [], list(tokens)
    new = seq
    for _ in range(n):
        meta = build_metadata([len(new)], [len(seq)], [table], block_size)
        h = model(torch.tensor(new), torch.arange(len(seq) - len(new), len(seq)), kv, meta)
        tok = int(model.compute_logits(h[-1:])[0].argmax())
        out.append(tok)
        seq.append(tok)
        new = [tok]
    return out


def assert_greedy_matches_generate(hf, model: DecoderModel, tokens: list[int], n: int = 64) -> None:
    with torch.no_grad():
        ref = hf.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(tokens):]
    got = greedy(model, tokens, n)
    for i, (a, b) in enumerate(zip(ref.tolist(), got)):
        if a != b:  # allowed only where the reference itself nearly ties (fp32 summation order)
            top = hf_logits(hf, tokens + ref[:i].tolist())[-1].topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"token {i}: {b} != {a}"
            return
    assert len(got) == n


@pytest.mark.parametrize("family", [*FAMILIES, "mistral", "qwen3"])
def test_hf_dir_logits_and_greedy_match_transformers(tmp_path, family):
    """Mistral with a 16-token window: every layer slides, and the prompt is three windows long."""
    hf = hf_model(family, **({"sliding_window": 16} if family == "mistral" else {}))
    hf.save_pretrained(tmp_path)
    model = ours(str(tmp_path))
    assert model.arch.architecture == family
    assert model.arch.window(0) == (16 if family in ("mistral", "gemma3") else None)
    tokens = prompt()
    got = run_chunks(model, tokens, [17, 1, 5, 20, 7])
    assert (got - hf_logits(hf, tokens)).abs().max().item() < TOL
    assert_greedy_matches_generate(hf, model, tokens[:20])


def test_gemma3_arch_from_config(tmp_path):
    hf = hf_model("gemma3", layers=4)
    hf.save_pretrained(tmp_path)
    a = read_arch(str(tmp_path))
    assert a.sliding_window == 16 and a.sliding_layers == (True, True, True, False)
    assert [a.window(i) for i in range(4)] == [16, 16, 16, None]
    assert a.qk_norm and a.sandwich_norms and a.hidden_act == "gelu_tanh" and a.tie_word_embeddings
    assert a.embed_scale == pytest.approx(8.0) and a.attn_scale == pytest.approx(24 ** -0.5)
    assert (a.rope_theta, a.rope_local_theta) == (1e6, 1e4)


def test_gemma3_sliding_window_matters(tmp_path):
    """The window changes the logits past it: a model told the window is the whole context disagrees."""
    hf = hf_model("gemma3")
    hf.save_pretrained(tmp_path)
    model = ours(str(tmp_path))
    tokens = prompt()
    windowed = run_chunks(model, tokens, [50])
    for layer in model.decoder_layers:
        layer.attn.window = None
    full = run_chunks(model, tokens, [50])
    assert (windowed[:16] - full[:16]).abs().max() < 1e-5  # inside the window: the same
    assert (windowed[20:] - full[20:]).abs().max() > 1e-3


def test_moe_arch_from_config(tmp_path):
    hf = hf_model("qwen3_moe", mlp_only_layers=[1])
    hf.save_pretrained(tmp_path)
    a = read_arch(str(tmp_path))
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.norm_topk_prob) == (8, 2, 64, True)
    assert a.dense_layers == (1,) and [a.is_moe(i) for i in range(3)] == [True, False, True]
    assert ours(str(tmp_path)).decoder_layers[1].mlp.__class__.__name__ == "GatedMLP"


def test_moe_missing_expert_tensor_names_it(tmp_path):
    from safetensors.torch import save_file

    hf_model("mixtral").save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        load_checkpoint(str(tmp_path))


# ---------------------------------------------------------------------------------------------- GGUF

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_BLOCK = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight"}
_QWEN_EXPERTS = ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                 "mlp.experts.{e}.down_proj.weight")
_EXPERTS = {"olmoe": _QWEN_EXPERTS, "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                          "mlp.experts.{e}.down_proj.weight"),
            "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                        "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")}
STRUCTURE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "sliding_window", "sliding_layers",
             "qk_norm", "qk_norm_full", "sandwich_norms", "hidden_act", "embed_scale", "attn_scale", "rope_local_theta",
             "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
GGUF_ARCH = {"gemma3": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}


def write_gguf(path: Path, hf_dir: Path, family: str, drop_key: str | None = None,
               expert_qtypes: tuple[gguf.GGMLQuantizationType, ...] = ()) -> None:
    """The saved HF weights as llama.cpp's converter writes them (F32): its tensor names, Gemma norms as 1 + w,
    Llama-layout q/k rows permuted, experts stacked [experts, rows, cols]."""
    cfg = __import__("json").loads((hf_dir / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
          "embedding_length": hidden, "feed_forward_length": cfg["intermediate_size"],
          "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
          "attention.value_length": head_dim, "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"]}
    if family == "gemma3":
        kv |= {"rope.freq_base": cfg["rope_parameters"]["full_attention"]["rope_theta"],
               "attention.sliding_window": cfg["sliding_window"]}
    else:
        kv |= {"rope.freq_base": cfg["rope_parameters"]["rope_theta"], "expert_count": 8, "expert_used_count": 2}
    if family == "qwen3_moe":
        kv["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    for key, value in kv.items():
        if key == drop_key:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    block = {**_BLOCK, **_GEMMA_BLOCK} if family == "gemma3" else _BLOCK
    experts = _EXPERTS.get(family)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if experts is not None:
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd.pop(p + experts[0]))
            for j, (gguf_name, pattern) in enumerate(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                                                        experts[1:])):
                stacked = np.stack([sd.pop(p + pattern.format(e=e)) for e in range(8)])
                if expert_qtypes:  # (gate, up, down): llama.cpp's quantized MoE files mix widths
                    qtype = expert_qtypes[j]
                    w.add_tensor(f"blk.{i}.{gguf_name}.weight", gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
                else:
                    w.add_tensor(f"blk.{i}.{gguf_name}.weight", stacked)
    for name, t in sd.items():
        if name in _TOP:
            out = _TOP[name]
        else:
            module, kind = name.rsplit(".", 1)
            i, rest = module.split(".", 3)[2:]
            out = f"blk.{i}.{block[rest]}.{kind}"
        if family == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0
        if family == "mixtral" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_ready_model(family: str, tmp_path: Path, **over):
    # llama.cpp knows Gemma 3's layout only as data: every 6th layer global, query_pre_attn_scalar = head_dim.
    if family == "gemma3":
        over |= dict(layers=6, layer_types=None, query_pre_attn_scalar=16)
    hf = hf_model(family, **over)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    return hf, hf_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_and_greedy_match_transformers(tmp_path, family):
    hf, hf_dir = gguf_ready_model(family, tmp_path)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf_dir, family)
    model = ours(str(path))
    assert model.arch.architecture == family
    hf_arch = read_arch(str(hf_dir))
    for field in STRUCTURE:
        assert getattr(model.arch, field) == pytest.approx(getattr(hf_arch, field)), field
    tokens = prompt()
    got = run_chunks(model, tokens, [17, 1, 5, 20, 7])
    assert (got - hf_logits(hf, tokens)).abs().max().item() < TOL
    assert_greedy_matches_generate(hf, model, tokens[:20])


def test_quantized_gguf_experts_stay_quantized(tmp_path):
    """Under ``--quantization auto`` a GGUF's stacked Q8_0 / Q4_0 experts run packed, one quantized matmul pair per
    active expert (the torch MoE path), and agree with the same file dequantized to fp32."""
    from specserve.model.quant import CpuQuantWeight
    from specserve.platform import detect
    from specserve.worker.model_runner import build_model

    platform = detect("cpu")
    if platform.quant_kernels != "cpu":
        pytest.skip("no CPU quantized kernels here")
    _, hf_dir = gguf_ready_model("qwen3_moe", tmp_path)
    path = tmp_path / "q.gguf"
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    write_gguf(path, hf_dir, "qwen3_moe", expert_qtypes=(q8, q8, q4))  # gate, up, down
    packed = build_model(load_checkpoint(str(path), keep_quantized=True), platform, torch.float32, 512, "auto")
    plain = build_model(load_checkpoint(str(path)), platform, torch.float32, 512, "none")
    experts = packed.decoder_layers[0].mlp.packed
    assert experts is not None and len(experts) == 8
    assert [type(w).__name__ for w in experts[0]] == ["CpuQuantWeight"] * 2
    assert {w.bits for pair in experts for w in pair if isinstance(w, CpuQuantWeight)} == {4, 8}
    tokens = prompt()
    a, b = run_chunks(packed, tokens, [17, 1, 5, 20, 7]), run_chunks(plain, tokens, [50])
    assert (a - b).abs().max().item() < 2e-3  # int16 activations in the kernels: the only difference
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("family,key", [("gemma3", "attention.sliding_window"), ("qwen3_moe", "expert_count"),
                                        ("qwen3_moe", "expert_feed_forward_length")])
def test_gguf_missing_metadata_key_names_it(tmp_path, family, key):
    _, hf_dir = gguf_ready_model(family, tmp_path)
    path = tmp_path / "bad.gguf"
    write_gguf(path, hf_dir, family, drop_key=key)
    for reader in (read_arch, load_checkpoint):
        with pytest.raises(CheckpointError) as e:
            reader(str(path))
        assert str(path) in str(e.value) and f"{GGUF_ARCH[family]}.{key}" in str(e.value)
        assert "\n" not in str(e.value)


def test_unknown_architecture_lists_the_families(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Phi3ForCausalLM"], "hidden_size": 8}')
    with pytest.raises(CheckpointError, match="unknown architecture Phi3ForCausalLM; supported: .*Gemma3ForCausalLM"):
        read_arch(str(tmp_path))
