"""Helpers of the reliability tests (fuzz, limits, soak, KV exhaustion, shutdown)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module (benchmarks/ is not a package)."""
    mod_name = f"_bench_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def serve_processes(logs: Any, args: dict[str, list[str]], timeout: float = 300.0) -> Iterator[dict[str, Any]]:
    """`specserve serve` processes started side by side (name -> its CLI args; logs in ``logs/<name>.log``),
    yielded once all are healthy; any still running at the end is killed."""
    soak = load_benchmark("soak")
    procs = {name: soak.ServerProcess(a, str(logs / f"{name}.log")) for name, a in args.items()}
    try:
        for p in procs.values():
            p.wait_healthy(timeout=timeout)
        yield procs
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(30)


def save_tiny_with_demo_tokenizer(path: str, demo_tokenizer: Any, layers: int = 1) -> str:
    """A tiny random Llama (hidden 64) over the demo model's real tokenizer and chat template: the HTTP
    layer sees the real vocabulary and template, and a step costs milliseconds instead of the demo's ~100."""
    from tests.helpers import tiny_hf_model

    hf_tok = demo_tokenizer.hf_tokenizer
    eos = sorted(demo_tokenizer.eos_token_ids)
    model = tiny_hf_model("llama", seed=0, layers=layers, vocab=len(hf_tok), tie_word_embeddings=True,
                          bos_token_id=hf_tok.bos_token_id, eos_token_id=eos[0] if eos else None,
                          max_position_embeddings=2048)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return str(path)


def wait_engine_idle(engine: Any, timeout: float = 30.0) -> None:
    """Until the engine has nothing running or waiting and every KV block is free."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.kv.num_free_blocks != engine.kv.pool.num_blocks:
        assert time.monotonic() < deadline, (
            f"engine not idle: unfinished={engine.has_unfinished()} free={engine.kv.num_free_blocks}/"
            f"{engine.kv.pool.num_blocks}")
        time.sleep(0.05)


def assert_openai_error(r: httpx.Response, status: int, contains: str = "", param: Any = ...,
                        type_: str | None = None) -> dict:
    """``r`` is an OpenAI-shaped error with this status; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    if type_ is not None:
        assert err["type"] == type_, err
    if param is not ...:
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err
