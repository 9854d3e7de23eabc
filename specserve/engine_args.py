"""The engine's command-line flags (vLLM's names), shared by `generate`, `serve`, `bench offline` and
`distill`, and their mapping onto ``LLM(**kwargs)`` / ``EngineConfig.from_kwargs``.

A flag is declared once, on its config dataclass field (``config.flag`` metadata: help, choices, spelling);
the argparse options and the keyword list are derived here."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineFlag:
    kw: str  # the LLM(**kwargs) / EngineConfig.from_kwargs keyword
    options: tuple[str, ...]  # the CLI spellings (a boolean's "--no-..." form is ``negative``)
    kind: type  # str, int, float or bool
    default: Any  # the config's default (shown in --help; the CLI itself passes None for "not given")
    help: str
    choices: tuple[str, ...] | None
    group: str  # "engine" or "speculative decoding"
    negative: str | None = None
    positive: bool = True


def engine_flags() -> list[EngineFlag]:
    """Every engine flag, read from the config dataclasses' field metadata."""
    from specserve import config

    out = []
    for cls, group in ((config.ModelConfig, "engine"), (config.CacheConfig, "engine"),
                       (config.SchedulerConfig, "engine"), (config.ParallelConfig, "engine"),
                       (config.SpeculativeConfig, "speculative decoding")):
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("flag")
            if meta is None:
                continue
            kw = config.flag_keyword(f)
            options = (meta["cli"] or "--" + kw.replace("_", "-"),) + ((meta["short"],) if meta["short"] else ())
            choices = meta["choices"]
            if choices == "devices":
                from specserve.platform import DEVICE_CHOICES  # platform imports config: resolved here

                choices = tuple(DEVICE_CHOICES)
            out.append(EngineFlag(kw, options, config.flag_type(f), f.default, meta["help"], choices, group,
                                  meta["negative"], meta["positive"]))
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine and speculative flags on ``p``. Every value defaults to None ("not given"): the config
    dataclass's own default then applies."""
    groups = {"engine": p.add_argument_group("engine"),
              "speculative decoding": p.add_argument_group("speculative decoding")}
    groups["engine"].add_argument("--model", dest="model_flag", default=None,
                                  help="HF dir, .gguf file, or Hugging Face hub id: org/name, org/name:QUANT "
                                       "(a GGUF repo's file with that tag), org/name/file.gguf (default: the "
                                       "embedded SmolLM2-135M-Instruct)")
    for fl in engine_flags():
        g = groups[fl.group]
        if fl.kind is bool:
            if fl.positive:
                g.add_argument(*fl.options, dest=fl.kw, action="store_true", default=None, help=fl.help)
            if fl.negative:
                g.add_argument(fl.negative, dest=fl.kw, action="store_false", default=None,
                               help="turn off: " + fl.help if not fl.positive else None)
            continue
        shown = "" if fl.default is None or "default" in fl.help else f" (default: {fl.default})"
        g.add_argument(*fl.options, dest=fl.kw, type=fl.kind, default=None, choices=fl.choices,
                       help=fl.help + shown)
    groups["speculative decoding"].add_argument(
        "--speculative-config", default=None,
        help='vLLM V1 JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as ``LLM(**kwargs)`` keywords."""
    keys = [fl.kw for fl in engine_flags()] + ["speculative_config"]
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def model_arg(args: argparse.Namespace) -> str | None:
    return getattr(args, "model_pos", None) or getattr(args, "model_flag", None)
