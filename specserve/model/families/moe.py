"""Sparse mixture-of-experts decoders: Qwen3-MoE (``qwen3moe`` in GGUF), OLMoE (``olmoe``; q/k norms over the
whole projection) and Mixtral (GGUF ``llama`` with expert tensors, see ``families/llama.py``). Attention is Qwen3's or Llama's; the MLP of every sparse layer is
a routed set of gated experts (``model/sparse_moe.py``)."""

from __future__ import annotations

from typing import Any

from specserve.config import CheckpointError
from specserve.model.families import ConfigView, Family, MoeNames, register
from specserve.model.families.llama import _qwen_hf, _unpermute_qk


def _qwen3_moe_hf(cfg: ConfigView) -> dict[str, Any]:
    n, step = int(cfg.req("num_hidden_layers")), int(cfg.get("decoder_sparse_step", 1))
    only = {int(i) for i in cfg.get("mlp_only_layers", [])}
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return _qwen_hf(cfg) | {
        "qk_norm": True, "num_experts": int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
        "num_experts_per_tok": int(cfg.req("num_experts_per_tok")),
        "moe_intermediate_size": int(cfg.req("moe_intermediate_size")),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "dense_layers": dense}


def _qwen3_moe_gguf(cfg: ConfigView) -> dict[str, Any]:
    # llama.cpp renormalises Qwen3-MoE's top-k weights unconditionally (every release sets norm_topk_prob).
    return {"qk_norm": True, "num_experts": int(cfg.req("expert_count")),
            "num_experts_per_tok": int(cfg.req("expert_used_count")),
            "moe_intermediate_size": int(cfg.req("expert_feed_forward_length")), "norm_topk_prob": True}


_QWEN_EXPERTS = MoeNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                         "mlp.experts.{e}.down_proj.weight")
register(Family("qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
                gguf_architecture="qwen3moe", hf_config=_qwen3_moe_hf, gguf_config=_qwen3_moe_gguf,
                moe=_QWEN_EXPERTS))


def _mixtral_hf(cfg: ConfigView) -> dict[str, Any]:
    return {"num_experts": int(cfg.req("num_local_experts")), "num_experts_per_tok": int(cfg.req("num_experts_per_tok")),
            "moe_intermediate_size": int(cfg.req("intermediate_size")), "norm_topk_prob": True,
            "sliding_window": cfg.get("sliding_window"), "max_position_embeddings": cfg.get(
                "max_position_embeddings", 32768)}


register(Family("mixtral", hf_architectures=("MixtralForCausalLM",), hf_model_types=("mixtral",),
                hf_config=_mixtral_hf, gguf_weights=_unpermute_qk,
                moe=MoeNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                             "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")))


def _olmoe_hf(cfg: ConfigView) -> dict[str, Any]:
    if cfg.get("clip_qkv") is not None:
        raise CheckpointError(f"{cfg.file}: clip_qkv is not supported")
    return {"qk_norm": True, "qk_norm_full": True, "num_experts": int(cfg.req("num_experts")),
            "num_experts_per_tok": int(cfg.req("num_experts_per_tok")),
            "moe_intermediate_size": int(cfg.req("intermediate_size")),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "max_position_embeddings": cfg.get("max_position_embeddings", 4096)}


def _olmoe_gguf(cfg: ConfigView) -> dict[str, Any]:
    # llama.cpp runs OLMoE's router without renormalising the top-k weights, as OLMoE's configs say.
    return {"qk_norm": True, "qk_norm_full": True, "num_experts": int(cfg.req("expert_count")),
            "num_experts_per_tok": int(cfg.req("expert_used_count")),
            "moe_intermediate_size": int(cfg.req("feed_forward_length")), "norm_topk_prob": False}


register(Family("olmoe", hf_architectures=("OlmoeForCausalLM",), hf_model_types=("olmoe",),
                gguf_architecture="olmoe", hf_config=_olmoe_hf, gguf_config=_olmoe_gguf, moe=_QWEN_EXPERTS))
