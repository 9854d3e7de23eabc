"""API fuzzing (schemathesis over the server's own /openapi.json), bounded for CI.

The server runs a tiny random Llama over the demo model's real tokenizer and chat template (the HTTP layer
sees exactly what it sees in production; a step costs milliseconds) with ``max_model_len=128`` (which bounds
what a fuzzed ``max_tokens`` can cost), n-gram
speculation and an API key; every example is sent with the key, without it and with a wrong one. The longer
run (the demo model, hundreds of examples) is benchmarks/fuzz_api.py.
"""

from __future__ import annotations

import os

import pytest

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.server.api import create_app
from tests.reliability_helpers import load_benchmark, save_tiny_with_demo_tokenizer, wait_engine_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

API_KEY = "sk-fuzz-key"
MAX_EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "25"))  # per operation and mode


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory, demo_tokenizer):
    path = save_tiny_with_demo_tokenizer(str(tmp_path_factory.mktemp("fuzz-model")), demo_tokenizer)
    return Engine(EngineConfig.from_kwargs(path, max_model_len=128, speculative_method="ngram",
                                           num_speculative_tokens=3))


@pytest.fixture(scope="module")
def fuzz_server(fuzz_engine, start_server):
    srv = start_server(create_app(fuzz_engine, api_key=API_KEY, max_queue=64))
    yield srv
    srv.stop()


def test_fuzz_openapi_no_5xx_and_healthy_after(fuzz_server, fuzz_engine):
    fz = load_benchmark("fuzz_api")
    report = fz.fuzz(fuzz_server.url, API_KEY, MAX_EXAMPLES, seed=1234)
    print(report.summary())
    for p in report.problems:
        print("PROBLEM:", p)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
            "GET /metrics"} <= set(report.operations), report.operations
    assert not report.problems, report.problems[:10]
    # Exercised for real: successes and 4xx with the key, 401 without.
    assert report.by_status[200] > 0 and report.by_status[400] > 0 and report.by_status[401] > 0, report.by_status
    assert not fz.check_healthy_after(fuzz_server.url, API_KEY)
    wait_engine_idle(fuzz_engine)
