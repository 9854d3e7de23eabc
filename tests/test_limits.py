"""Input limits: every one is a 400 in OpenAI's shape with a message naming the limit, and the server stays
healthy. Body size (before JSON parsing), prompt tokens, context, n, logprobs, stop lists, seeds, invalid
UTF-8, control characters and lone surrogates."""

from __future__ import annotations

import json

import httpx
import pytest

from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import DEFAULT_MAX_REQUEST_BYTES, create_app
from tests.reliability_helpers import assert_openai_error, wait_engine_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JSON = {"content-type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def aengine(server_engine):
    ae = AsyncEngine(server_engine, max_queue=64)
    ae.start()
    yield ae
    ae.shutdown()


@pytest.fixture(scope="module")
def server(aengine, start_server):
    """Default limits (1 MiB bodies, prompts bounded by the context only)."""
    srv = start_server(create_app(aengine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small(aengine, start_server):
    """Tight limits: 4096-byte bodies, 32-token prompts."""
    srv = start_server(create_app(aengine, max_request_bytes=4096, max_prompt_tokens=32))
    yield srv
    srv.stop()


def post(srv, path: str, body=None, content=None, headers=None, timeout: float = 120) -> httpx.Response:
    if content is not None:
        return httpx.post(f"{srv.url}{path}", content=content, headers=headers or JSON, timeout=timeout)
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=timeout)


def test_body_size_limit_before_parsing(server, small):
    limit = DEFAULT_MAX_REQUEST_BYTES
    big = b'{"prompt": "' + b"a" * limit + b'"}'
    err = assert_openai_error(post(server, "/v1/completions", content=big), 400, contains=str(limit))
    assert "--max-request-bytes" in err["message"] and err["code"] == "request_too_large"
    # Not even JSON: the size is checked first.
    assert_openai_error(post(server, "/v1/chat/completions", content=b"{" * (limit + 1)), 400,
                        contains="too large")

    def chunks():  # no Content-Length: counted while reading
        for _ in range(20):
            yield b"x" * 65536

    assert_openai_error(post(server, "/v1/completions", content=chunks()), 400, contains="too large")
    # The boundary, on the 4096-byte server: exactly the limit passes the size check.
    body = {"prompt": "hi", "max_tokens": 1, "user": ""}
    pad = 4096 - len(json.dumps(body).encode())
    body["user"] = "u" * pad
    exact = json.dumps(body).encode()
    assert len(exact) == 4096
    assert post(small, "/v1/completions", content=exact).status_code == 200
    body["user"] += "u"
    assert_openai_error(post(small, "/v1/completions", content=json.dumps(body).encode()), 400,
                        contains="the limit is 4096 bytes")


def test_invalid_utf8_and_control_characters(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_error(post(server, path, content=b'{"prompt": "caf\xe9 \xff"}'), 400, contains="UTF-8")
    # A raw control character inside a JSON string is invalid JSON.
    assert_openai_error(post(server, "/v1/completions", content=b'{"prompt": "a\x01b"}'), 400,
                        contains="control character")
    # Escaped control / format characters are fine: they reach the tokenizer and the model.
    weird = "nul\u0000 esc\u001b[31m del\u007f bidi\u202e bom\ufeff tab\t nl\n zwj\u200d"
    r = post(server, "/v1/completions", {"prompt": weird, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": weird}],
                                               "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    # Lone UTF-16 surrogates (valid JSON escapes, invalid Unicode) were a 500 from the tokenizer.
    lone = b'{"prompt": "x \\ud800 y", "max_tokens": 2}'
    assert_openai_error(post(server, "/v1/completions", content=lone), 400, contains="surrogate")
    lone_chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    assert_openai_error(post(server, "/v1/chat/completions", content=lone_chat), 400, contains="surrogate")
    lone_model = b'{"model": "\\ud800", "prompt": "x", "max_tokens": 2}'
    assert_openai_error(post(server, "/v1/completions", content=lone_model), 400, contains="surrogate")
    pair = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # a proper pair is one character
    assert post(server, "/v1/completions", content=pair).status_code == 200


def test_prompt_token_limit(small, server_engine):
    long_text = "The quick brown fox jumps over the lazy dog. " * 8  # ~80 tokens
    err = assert_openai_error(post(small, "/v1/completions", {"prompt": long_text, "max_tokens": 1}), 400,
                              contains="--max-prompt-tokens", param="prompt")
    assert "32" in err["message"]
    assert_openai_error(post(small, "/v1/completions", {"prompt": [42] * 33, "max_tokens": 1}), 400,
                        contains="limit of 32", param="prompt")
    assert post(small, "/v1/completions", {"prompt": [42] * 32, "max_tokens": 1}).status_code == 200
    assert_openai_error(post(small, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}],
                                                             "max_tokens": 1}),
                        400, contains="--max-prompt-tokens", param="messages")
    # A batch is refused whole when one prompt is over.
    assert_openai_error(post(small, "/v1/completions", {"prompt": ["hi", long_text], "max_tokens": 1}), 400,
                        contains="--max-prompt-tokens")
    wait_engine_idle(server_engine)


def test_context_n_logprobs_stop_seed_and_batch_bounds(server, server_engine):
    c = "/v1/completions"
    ctx = server_engine.max_model_len
    cases = [
        (c, {"prompt": [42] * (ctx + 5), "max_tokens": 1}, "prompt", "context length"),
        (c, {"prompt": "hi", "max_tokens": ctx}, "prompt", "context length"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10 * ctx}, "prompt", "context length"),
        (c, {"prompt": "hi", "n": 17}, "n", "n must be in [1, 16]"),
        (c, {"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
        (c, {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
        (c, {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs", "must be in [0, 20]"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "logprobs",
         "[0, 20]"),
        (c, {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
        (c, {"prompt": "hi", "stop": [f"s{i}" for i in range(100_000)]}, "stop", "at most 64"),
        (c, {"prompt": "hi", "stop": "x" * 257}, "stop", "at most 256 characters"),
        (c, {"prompt": "hi", "seed": 2**64}, "seed", "64-bit"),
        (c, {"prompt": "hi", "seed": -(2**63) - 1}, "seed", "64-bit"),
        (c, {"prompt": ["hi"] * 65, "max_tokens": 1}, "prompt", "--max-queue"),
    ]
    for path, body, param, contains in cases:
        r = post(server, path, body)
        err = assert_openai_error(r, 400, contains=contains)
        assert err["param"] in (param, None), err  # param when the message names a top-level field
    # Inside the bounds: all accepted.
    ok = [{"prompt": "hi", "n": 16, "max_tokens": 1, "seed": 2**63 - 17},
          {"prompt": "hi", "logprobs": 20, "max_tokens": 1},
          {"prompt": "hi", "logprobs": 20, "echo": True, "prompt_logprobs": 20, "max_tokens": 1},
          {"prompt": "hi", "stop": [f"s{i}" for i in range(64)], "max_tokens": 1},
          {"prompt": [42] * (ctx - 1), "max_tokens": 1}]
    for body in ok:
        r = post(server, c, body)
        assert r.status_code == 200, r.text
    wait_engine_idle(server_engine)


def test_bad_seed_does_not_fail_requests_in_flight(server, server_engine):
    """A seed torch cannot take used to fail the whole engine step: every request in flight got a 500."""
    body = {"prompt": "Count: one, two, three,", "max_tokens": 24, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "seed": 2**70}), 400,
                            contains="seed")
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest), rest[-3:]
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_engine_idle(server_engine)
