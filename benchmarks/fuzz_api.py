"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis + hypothesis), with and without the API key.

    .venv/bin/python benchmarks/fuzz_api.py [--max-examples 300] [--model tiny|demo|PATH] [--max-model-len 256]
    .venv/bin/python benchmarks/fuzz_api.py --base-url http://127.0.0.1:8000 --api-key KEY

Without ``--base-url`` it starts ``specserve serve`` on 127.0.0.1 with n-gram speculation, an API key and a
small ``--max-model-len`` (which bounds what a fuzzed ``max_tokens`` costs). ``--model tiny`` (the default)
serves a tiny random Llama over the demo model's real tokenizer and chat template: the HTTP layer sees what it
sees in production and a step costs milliseconds, so hundreds of examples take minutes. ``--model demo``
fuzzes the demo model itself: on 2 CPU cores a schema-valid chat request (n up to 16, up to the context end)
takes up to a minute, so keep ``--max-examples`` small (~30 takes about half an hour). Only loopback
addresses are accepted. The CI version is tests/test_fuzz_api.py (the tiny model, 25 examples per operation
and mode).

Every operation of ``/openapi.json`` is fuzzed with positive (schema-valid) and negative (schema-violating)
examples; each example is sent with the key, and, when the server has one, without it and with a wrong one.
Every response must be: no 5xx; JSON that parses, an OpenAI-shaped ``{"error": {...}}`` for every 4xx; a
well-formed SSE stream (JSON events, the last one ``[DONE]``) for streamed successes; 401 without the key on
/v1 and the tokenizer routes. Afterwards the server must be healthy: /health 200, a normal completion succeeds, nothing runs or waits
and the whole KV pool is free.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from specserve.server.api import TOKENIZER_ROUTES

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class FuzzReport:
    calls: int = 0
    by_status: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    operations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_status.items()))
        return (f"{self.calls} calls over {len(self.operations)} operations in {self.seconds:.0f}s; "
                f"statuses {{{statuses}}}; {len(self.problems)} problem(s)")


def _is_error(obj: Any) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], dict)
            and set(obj["error"]) == ERROR_KEYS and isinstance(obj["error"]["message"], str)
            and isinstance(obj["error"]["type"], str))


def check_response(status: int, content_type: str, body: bytes, path: str, authorized: bool) -> str | None:
    """Why this response breaks the contract, or None."""
    if status >= 500:
        return f"{status} server error: {body[:300]!r}"
    if (path.startswith("/v1") or path in TOKENIZER_ROUTES) and not authorized:
        if status != 401:
            return f"{status} without a valid API key (expected 401)"
    if "application/json" in content_type:
        try:
            obj = json.loads(body)
        except ValueError as e:
            return f"{status}: invalid JSON ({e}): {body[:200]!r}"
        if status >= 400 and not _is_error(obj):
            return f"{status}: error not in OpenAI's shape: {obj!r:.300}"
        if status < 400 and isinstance(obj, dict) and "error" in obj:
            return f"{status} with an error body: {obj!r:.300}"
        return None
    if "text/event-stream" in content_type:
        if status != 200:
            return f"{status} with an event stream"
        events = [line[6:] for line in body.decode("utf-8").splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream does not end with [DONE]: {events[-2:]!r}"
        for event in events[:-1]:
            try:
                obj = json.loads(event)
            except ValueError:
                return f"stream event is not JSON: {event[:200]!r}"
            if "error" in obj and not _is_error(obj):
                return f"stream error event not in OpenAI's shape: {obj!r:.300}"
        return None
    if status >= 400:
        return f"{status} error that is not JSON ({content_type}): {body[:200]!r}"
    return None  # a 2xx page that is not JSON: /metrics (text), / (the web UI)


def fuzz(base_url: str, api_key: str | None, max_examples: int, seed: int = 0,
         timeout: float = 120.0, log: Any = print) -> FuzzReport:
    """Fuzz every operation of ``base_url``/openapi.json; never raises for a bad response (see the report)."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.core.result import Err

    check_loopback(base_url)
    key_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=key_headers, timeout=30)
    report = FuzzReport()
    t0 = time.monotonic()
    variants: list[tuple[dict[str, str], bool]] = [(key_headers, True)]
    if api_key:
        variants += [({}, False), ({"Authorization": "Bearer wrong-key"}, False)]
    modes: list[Any] = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            report.problems.append(f"an operation of /openapi.json is invalid: {result.err()}")
            continue
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        report.operations.append(label)
        for mode in modes:
            n_before = report.calls
            _fuzz_operation(op, label, mode, base_url, variants, max_examples, seed, timeout, report)
            log(f"fuzz: {label} [{mode.value}]: {report.calls - n_before} calls")
    report.seconds = time.monotonic() - t0
    return report


def _fuzz_operation(op: Any, label: str, mode: Any, base_url: str, variants: list[tuple[dict[str, str], bool]],
                    max_examples: int, seed: int, timeout: float, report: FuzzReport) -> None:
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        for headers, authorized in variants:
            try:
                resp = case.call(base_url=base_url, headers=headers, timeout=timeout)
            except Exception as e:  # a dropped connection or a timeout is a finding too
                report.problems.append(f"{label} [{mode.value}]: {type(e).__name__}: {e}")
                continue
            report.calls += 1
            report.by_status[resp.status_code] += 1
            why = check_response(resp.status_code, resp.headers.get("content-type", ""), resp.content, op.path,
                                 authorized)
            if why is not None:
                report.problems.append(f"{label} [{mode.value}] {why}\n    request: "
                                       f"{case.as_curl_command(headers=headers)[:600]}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # e.g. no negative examples exist for an operation without parameters


def check_healthy_after(base_url: str, api_key: str | None, idle_timeout: float = 60.0) -> list[str]:
    """/health 200, a normal completion works, then nothing runs or waits and the KV pool is entirely free."""
    problems = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if (h := httpx.get(f"{base_url}/health", timeout=30)).status_code != 200:
        problems.append(f"/health: {h.status_code} {h.text[:200]}")
    r = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=120,
                   json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    if r.status_code != 200 or r.json()["usage"]["completion_tokens"] < 1:
        problems.append(f"completion after fuzzing: {r.status_code} {r.text[:200]}")
    deadline = time.monotonic() + idle_timeout
    while True:
        m = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=30).text)
        busy = (m.get("specserve:num_requests_running", 0), m.get("specserve:num_requests_waiting", 0))
        used = m.get("specserve:kv_cache_num_blocks", 0) - m.get("specserve:kv_cache_free_blocks", -1)
        if busy == (0, 0) and used == 0:
            return problems
        if time.monotonic() > deadline:
            return [*problems, f"not idle after fuzzing: running/waiting {busy}, {used} KV blocks in use"]
        time.sleep(0.25)


def _soak_module() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import soak

    return soak


def check_loopback(url: str) -> None:
    _soak_module().check_loopback(url)


def parse_metrics(text: str) -> dict[str, float]:
    return dict(_soak_module().parse_metrics(text))


def _tiny_model(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from specserve.tokenizer import Tokenizer
    from tests.reliability_helpers import save_tiny_with_demo_tokenizer

    return save_tiny_with_demo_tokenizer(path, Tokenizer.from_checkpoint(None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="an already running server (loopback only)")
    ap.add_argument("--api-key", default=None, help="with --base-url: the server's key, if any")
    ap.add_argument("--max-examples", type=int, default=300, help="per operation and mode")
    ap.add_argument("--model", default="tiny", help="tiny (default), demo, or a checkpoint path")
    ap.add_argument("--max-model-len", type=int, default=256, help="when starting the server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server we started
    soak = _soak_module()
    server = None
    base_url, api_key = args.base_url, args.api_key
    if base_url is None:
        import tempfile

        api_key = api_key or "sk-fuzz"
        work = tempfile.mkdtemp(prefix="specserve-fuzz-")
        log_path = os.path.join(work, "server.log")
        model = [] if args.model == "demo" else [args.model]
        if args.model == "tiny":
            model = [_tiny_model(os.path.join(work, "tiny-model"))]
        server = soak.ServerProcess([*model, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                                     "--max-model-len", str(args.max_model_len), "--api-key", api_key], log_path)
        print(f"fuzz: starting specserve serve on {server.url} (log: {log_path})")
        server.wait_healthy()
        base_url = server.url
    try:
        report = fuzz(base_url, api_key, args.max_examples, args.seed)
        after = check_healthy_after(base_url, api_key)
    finally:
        code = server.terminate() if server is not None else 0
    print(report.summary())
    for p in report.problems[:50] + after:
        print(f"FAIL: {p}")
    if code != 0:
        print(f"FAIL: server exit code {code}")
    return 1 if report.problems or after or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
