"""Model families: how one family's checkpoints map onto ``ModelArch`` and onto HF parameter names.

A family is one file in this package that builds a ``Family`` and passes it to ``register``. It declares:

- which checkpoints are its own: ``config.json`` ``architectures`` / ``model_type`` and the GGUF
  ``general.architecture``;
- its config mapping: ``hf_config`` / ``gguf_config`` return the ``ModelArch`` fields that differ from the
  Llama defaults the loader reads itself (sizes, heads, rope, eps, eos);
- its weight names: GGUF block tensor names that differ from Llama's, the MoE expert names, and any
  conversion of the weights into the form the shared layer computes with (``hf_weights`` / ``gguf_weights``);
- optionally its chat format, for checkpoints without a chat template.

The layer itself is shared (``model/decoder.py``): attention, gated MLP (SiLU or GeGLU), sparse MoE, norms and
rope are composed from ``ModelArch`` fields, so a family adds data, not a copy of the decoder.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.config import CheckpointError, ModelArch

StateDict = dict[str, Any]  # HF names -> torch.Tensor | QuantizedTensor


class ConfigView:
    """Read access to one checkpoint's config (``config.json`` or GGUF metadata under ``prefix``) whose
    errors name the file and the key."""

    def __init__(self, values: Mapping[str, Any], file: str, prefix: str = "") -> None:
        self.values, self.file, self.prefix = values, file, prefix

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(self.prefix + key)
        return default if value is None else value

    def req(self, key: str) -> Any:
        if self.values.get(self.prefix + key) is None:
            what = "metadata key" if self.prefix else "config key"
            raise CheckpointError(f"{self.file}: missing {what} {self.prefix + key!r}")
        return self.values[self.prefix + key]

    def __contains__(self, key: str) -> bool:
        return self.values.get(self.prefix + key) is not None


def _no_fields(cfg: ConfigView) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class MoeNames:
    """HF names of a sparse MoE block, relative to ``model.layers.{i}.``; ``{e}`` is the expert index."""

    router: str  # e.g. "mlp.gate.weight"
    gate: str  # e.g. "mlp.experts.{e}.gate_proj.weight"
    up: str
    down: str


@dataclass(frozen=True)
class Family:
    name: str  # ModelArch.architecture
    hf_architectures: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    gguf_architecture: str | None = None
    hf_config: Callable[[ConfigView], dict[str, Any]] = _no_fields
    gguf_config: Callable[[ConfigView], dict[str, Any]] = _no_fields
    gguf_block_names: Mapping[str, str] = field(default_factory=dict)  # GGUF block tensor -> HF, over Llama's
    moe: MoeNames | None = None
    hf_weights: Callable[[StateDict, ModelArch], None] | None = None  # in place, after validation
    gguf_weights: Callable[[StateDict, ModelArch], None] | None = None
    # The family's chat format (jinja), for checkpoints that carry no template (GGUF files often do not).
    chat_template: str | None = None


_BY_NAME: dict[str, Family] = {}
_BY_HF: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}


def register(family: Family) -> Family:
    _BY_NAME[family.name] = family
    for a in family.hf_architectures:
        _BY_HF[a] = family
    if family.gguf_architecture:
        _BY_GGUF[family.gguf_architecture] = family
    return family


def _load_all() -> None:
    if not _BY_NAME:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")


def family(name: str) -> Family:
    _load_all()
    if name not in _BY_NAME:
        raise CheckpointError(f"unknown model family {name!r}; supported: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def hf_family(architectures: list[str], model_type: str | None, file: str) -> Family:
    _load_all()
    found = next((_BY_HF[a] for a in architectures if a in _BY_HF), None)
    if found is None and not architectures:
        found = next((f for f in _BY_NAME.values() if model_type in f.hf_model_types), None)
    if found is None:
        what = ", ".join(architectures) if architectures else f"model_type {model_type!r}"
        raise CheckpointError(f"{file}: unknown architecture {what}; supported: {', '.join(sorted(_BY_HF))}")
    return found


def gguf_family(kind: Any, file: str) -> Family:
    _load_all()
    if kind not in _BY_GGUF:
        raise CheckpointError(f"{file}: unknown architecture {kind!r}; supported GGUF architectures: "
                              f"{', '.join(sorted(_BY_GGUF))}")
    return _BY_GGUF[kind]


def norms_plus_one(sd: StateDict, arch: ModelArch) -> None:
    """Gemma-style RMSNorm weights scale by (1 + w): store 1 + w, computed in fp32, so the shared norm
    multiplies by its weight as Llama's does (llama.cpp's converter writes GGUF norms this way too)."""
    for name, t in sd.items():
        if name.endswith("norm.weight"):
            sd[name] = 1.0 + t.to(torch.float32)


def layer_types(cfg: ConfigView, num_layers: int, default_pattern: int | None) -> tuple[bool, ...]:
    """Per layer, True for sliding-window attention: HF ``layer_types`` when the config lists them, else every
    ``pattern``-th layer is global (Gemma's ``sliding_window_pattern``); () when the config says nothing."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(t == "sliding_attention" for t in types)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", default_pattern))
    if pattern is None:
        return ()
    return tuple(bool((i + 1) % int(pattern)) for i in range(num_layers))
