"""The engine's command-line flags (vLLM's names), shared by `generate`, `serve`, `bench offline` and
`distill`, and their mapping onto ``LLM(**kwargs)`` / ``EngineConfig.from_kwargs``."""

from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine and speculative flags, vLLM-style names (shared by generate, serve and bench)."""
    from specserve.platform import DEVICE_CHOICES
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", default=None,
                   help="HF dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    g.add_argument("--quantization", "-q", default=None, choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization: auto (default) keeps a Q4_0/Q4_1/Q8_0 GGUF in its blocks and "
                        "float checkpoints float; none dequantizes; int8/int4 quantize every layer weight "
                        "(groups of 32)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size: bytes (> 1) or a fraction of free memory (<= 1)")
    g.add_argument("--num-kv-blocks", dest="num_blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="GPU: fraction of the free device memory (after the weights) for the KV cache, in "
                        "(0, 1], default 0.9; --kv-cache-memory and --num-kv-blocks take precedence")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never capture GPU graphs (used on GPUs for decode and verify steps)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-model", default=None, help="draft checkpoint (HF dir or .gguf)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, help="k: drafts per step (max)")
    s.add_argument("--speculative-method", default=None, choices=["draft", "ngram", "layer_skip", "eagle"])
    s.add_argument("--speculative-config", default=None,
                   help='vLLM V1 JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    s.add_argument("--draft-layers", type=int, default=None, help="layer_skip: target layers the draft uses")
    s.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="shortest repeated suffix prompt lookup drafts from (ngram: 1; --prompt-lookup-first: 3)")
    s.add_argument("--prompt-lookup-max", type=int, default=None)
    s.add_argument("--speculative-adaptive", dest="speculative_adaptive", action="store_true", default=True,
                   help="choose k per step from measured acceptance and cost (default)")
    s.add_argument("--prompt-lookup-first", action="store_true", default=None,
                   help="with a draft model, EAGLE head or layer_skip: draft by prompt lookup whenever the context "
                        "repeats its last --prompt-lookup-min tokens, by the model otherwise")
    s.add_argument("--no-speculative-adaptive", dest="speculative_adaptive", action="store_false")


ENGINE_KEYS = ("dtype", "device", "quantization", "max_model_len", "block_size", "kv_cache_memory", "num_blocks",
               "gpu_memory_utilization", "enforce_eager", "enable_prefix_caching", "max_num_batched_tokens",
               "max_num_seqs", "speculative_model", "num_speculative_tokens", "speculative_method",
               "speculative_config", "draft_layers", "prompt_lookup_min", "prompt_lookup_max",
               "speculative_adaptive", "prompt_lookup_first")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_KEYS if hasattr(args, k)}


def model_arg(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_pos", None) or getattr(args, "model_flag", None)
