"""Llama-like dense decoders: Llama (and Mixtral's GGUF, which llama.cpp writes as "llama" with expert
tensors), Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

from typing import Any

import torch

from specserve.config import ModelArch
from specserve.model.families import ConfigView, Family, StateDict, layer_types, register
from specserve.model.quant import QuantizedTensor


def _unpermute_qk(sd: StateDict, arch: ModelArch) -> None:
    """Undo llama.cpp's rotary permutation of Llama q/k rows (convert_hf_to_gguf.py DecoderModel.permute)."""
    for i in range(arch.num_layers):
        for proj, n_head in (("q_proj", arch.num_heads), ("k_proj", arch.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            w = sd[name]
            d = w.shape[0]
            # The converter did w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2); this reverses it.
            if isinstance(w, QuantizedTensor):  # the same reordering of whole rows of blocks
                order = torch.arange(d).reshape(n_head, d // n_head // 2, 2).transpose(1, 2).reshape(d)
                sd[name] = w.rows(order)
            else:
                sd[name] = w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(
                    w.shape).contiguous()


def _llama_gguf(cfg: ConfigView) -> dict[str, Any]:
    if "expert_count" not in cfg:
        return {}
    return {"architecture": "mixtral", "num_experts": int(cfg.req("expert_count")),
            "num_experts_per_tok": int(cfg.req("expert_used_count")),
            "moe_intermediate_size": int(cfg.req("feed_forward_length")), "norm_topk_prob": True}


register(Family("llama", hf_architectures=("LlamaForCausalLM",), hf_model_types=("llama",),
                gguf_architecture="llama", gguf_config=_llama_gguf, gguf_weights=_unpermute_qk))


def _mistral_hf(cfg: ConfigView) -> dict[str, Any]:
    return {"sliding_window": cfg.get("sliding_window"), "max_position_embeddings": cfg.get(
        "max_position_embeddings", 32768)}


register(Family("mistral", hf_architectures=("MistralForCausalLM",), hf_model_types=("mistral",),
                hf_config=_mistral_hf))


def _qwen_hf(cfg: ConfigView) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_position_embeddings": cfg.get("max_position_embeddings", 32768)}
    if cfg.get("use_sliding_window", False) and cfg.get("sliding_window"):
        n = int(cfg.req("num_hidden_layers"))
        first = int(cfg.get("max_window_layers", n))
        slides = layer_types(cfg, n, None) or tuple(i >= first for i in range(n))
        fields |= {"sliding_window": int(cfg.req("sliding_window")), "sliding_layers": slides}
    return fields


register(Family("qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                gguf_architecture="qwen2", hf_config=lambda cfg: _qwen_hf(cfg) | {"attention_bias": True},
                gguf_config=lambda cfg: {"attention_bias": True}))

register(Family("qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                gguf_architecture="qwen3", hf_config=lambda cfg: _qwen_hf(cfg) | {"qk_norm": True},
                gguf_config=lambda cfg: {"qk_norm": True}))
