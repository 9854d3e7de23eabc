"""Write a trained standalone draft as a normal HF model dir (config.json + model.safetensors + tokenizer)."""

from __future__ import annotations

import json
import os
from typing import Any, cast

import torch

from specserve.model.decoder import DecoderLayer, DecoderModel

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def hf_state_dict(model: DecoderModel) -> dict[str, torch.Tensor]:
    """HF parameter names, q/k/v and gate/up unfused (the inverse of ``DecoderModel.load_weights``)."""
    sd = {"model.embed_tokens.weight": model.embed.detach(), "model.norm.weight": model.norm.weight.detach()}
    if not model.arch.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.detach()
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        p, a, m = f"model.layers.{i}.", layer.attn, layer.mlp
        q, k, v = a.qkv.detach().split([a.q_size, a.kv_size, a.kv_size])
        sd |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
               p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": a.o.detach()}
        if a.qkv_bias is not None:
            qb, kb, vb = a.qkv_bias.detach().split([a.q_size, a.kv_size, a.kv_size])
            sd |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
        gate, up = m.gate_up.detach().split(m.inter)
        sd |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": m.down.detach(),
               p + "input_layernorm.weight": layer.input_norm.weight.detach(),
               p + "post_attention_layernorm.weight": layer.post_norm.weight.detach()}
    return sd


def save_hf_model(model: DecoderModel, out_dir: str, hf_tokenizer: Any, extra: dict[str, Any] | None = None,
                  dtype: torch.dtype = torch.float16) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    a = model.arch
    eos = list(a.eos_token_ids)
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASS[a.architecture]], "model_type": a.architecture, "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings, "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": a.attention_bias, "bos_token_id": a.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "torch_dtype": str(dtype).removeprefix("torch."),
        **(extra or {}),
    }
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tensors = {n: t.to(dtype).contiguous().cpu() for n, t in hf_state_dict(model).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_tokenizer.save_pretrained(out_dir)
