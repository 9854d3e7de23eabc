"""Engine flags are declared once, on the config dataclasses (``config.flag``); the CLI options and the
``LLM(**kwargs)`` / ``EngineConfig.from_kwargs`` keywords are derived from that."""

from __future__ import annotations

import dataclasses

from specserve import config
from specserve.cli import build_parser
from specserve.config import EngineConfig, flag
from specserve.engine_args import engine_flags, engine_kwargs


def test_a_new_field_is_a_cli_flag_and_an_engine_keyword(monkeypatch):
    extended = dataclasses.make_dataclass(
        "SchedulerConfig", [("test_budget", int, dataclasses.field(default=3, metadata=flag("a test flag")))],
        bases=(config.SchedulerConfig,), frozen=True)
    monkeypatch.setattr(config, "SchedulerConfig", extended)
    args = build_parser().parse_args(["generate", "--test-budget", "7", "--max-num-seqs", "5"])
    kw = engine_kwargs(args)
    assert kw["test_budget"] == 7
    cfg = EngineConfig.from_kwargs(None, **kw)  # what LLM(**kwargs) and the server build the engine from
    assert cfg.scheduler.test_budget == 7 and cfg.scheduler.max_num_seqs == 5
    assert EngineConfig.from_kwargs(None).scheduler.test_budget == 3


def test_flags_not_given_keep_the_config_defaults():
    kw = engine_kwargs(build_parser().parse_args(["generate"]))
    assert set(kw.values()) == {None}
    assert EngineConfig.from_kwargs(None, **kw) == EngineConfig.from_kwargs(None)
    # every flag's keyword is taken by from_kwargs (none left over as "unknown")
    assert {fl.kw for fl in engine_flags()} >= {"dtype", "quantization", "num_blocks", "speculative_model",
                                               "speculative_adaptive", "prompt_lookup_first"}


def test_boolean_and_renamed_flags():
    parse = build_parser().parse_args
    kw = engine_kwargs(parse(["serve", "--no-prefix-caching", "--no-speculative-adaptive", "--num-kv-blocks",
                              "32", "-q", "none", "--speculative-method", "ngram", "--enforce-eager"]))
    cfg = EngineConfig.from_kwargs(None, **kw)
    assert not cfg.cache.enable_prefix_caching and cfg.cache.num_blocks == 32
    assert cfg.model.quantization == "none" and cfg.model.enforce_eager
    assert cfg.speculative.method == "ngram" and not cfg.speculative.adaptive
    assert cfg.speculative.num_speculative_tokens == 5
