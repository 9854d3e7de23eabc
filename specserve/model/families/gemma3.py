"""Gemma 3 (text): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms, sandwich norms around attention and
the MLP, per-head q/k norms, a GeGLU MLP, ``query_pre_attn_scalar``, and interleaved sliding-window and
global layers with their own rope bases (rope scaling on the global layers only)."""

from __future__ import annotations

import math
from typing import Any

from specserve.config import CheckpointError
from specserve.model.families import ConfigView, Family, layer_types, norms_plus_one, register

_LOCAL_THETA = 10000.0  # llama.cpp's constant for Gemma 3's sliding layers; HF's rope_local_base_freq default
_PATTERN = 6  # every 6th layer is global (HF sliding_window_pattern; llama.cpp's swa pattern for gemma3)


# Gemma's turns: <start_of_turn>{user|model}\n...<end_of_turn>\n; a system message opens the first user turn.
_CHAT = (
    "{{ bos_token }}"
    "{%- set sys = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for m in (messages[1:] if sys else messages) -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (sys if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _common(hidden: int) -> dict[str, Any]:
    return {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh", "embed_scale": math.sqrt(hidden),
            "tie_word_embeddings": True}


def _hf(cfg: ConfigView) -> dict[str, Any]:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise CheckpointError(f"{cfg.file}: {key} is not supported")
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{cfg.file}: unsupported hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
    n = int(cfg.req("num_hidden_layers"))
    # transformers >= 5: rope_parameters per layer type; older configs: rope_theta, rope_local_base_freq and
    # rope_scaling (which applies to the global layers).
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = {k: v for k, v in full.items() if k != "rope_theta"} or cfg.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return _common(int(cfg.req("hidden_size"))) | {
        "rope_theta": float(full.get("rope_theta", cfg.get("rope_theta", 1000000.0))),
        "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))),
        "rope_scaling": scaling if scaling and scaling["rope_type"] != "default" else None,
        "sliding_window": int(cfg.req("sliding_window")),
        "sliding_layers": layer_types(cfg, n, _PATTERN),
        "attn_scale": float(cfg.get("query_pre_attn_scalar", cfg.req("head_dim"))) ** -0.5,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 131072)),
    }


def _gguf(cfg: ConfigView) -> dict[str, Any]:
    hidden, heads, n = int(cfg.req("embedding_length")), int(cfg.req("attention.head_count")), \
        int(cfg.req("block_count"))
    head_dim = int(cfg.get("attention.key_length", hidden // heads))
    # llama.cpp: query_pre_attn_scalar is hidden / heads for the 27B model (62 layers), head_dim otherwise.
    scalar = hidden // heads if n == 62 else head_dim
    pattern = cfg.get("attention.sliding_window_pattern")
    slides = tuple(bool(x) for x in pattern) if isinstance(pattern, list | tuple) else \
        tuple(bool((i + 1) % _PATTERN) for i in range(n))
    return _common(hidden) | {"sliding_window": int(cfg.req("attention.sliding_window")), "sliding_layers": slides,
                              "rope_local_theta": _LOCAL_THETA, "attn_scale": scalar ** -0.5}


register(Family(
    "gemma3", hf_architectures=("Gemma3ForCausalLM",), hf_model_types=("gemma3_text",), gguf_architecture="gemma3",
    hf_config=_hf, gguf_config=_gguf,
    gguf_block_names={"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"},
    hf_weights=norms_plus_one,  # GGUF norms already hold 1 + w
    chat_template=_CHAT))
