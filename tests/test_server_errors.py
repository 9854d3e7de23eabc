"""Errors in OpenAI's shape, auth, the queue limit, and AsyncEngine's threading contract.

The AsyncEngine tests use a fake engine (fast, no model). The HTTP tests run the real server on the demo
model; every error case checks the status code AND the error body.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from specserve.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError, QueueFullError
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.api import create_app

MODEL = "SmolLM2-135M-Instruct"


# -- AsyncEngine over a fake engine --------------------------------------------------------------------------
class FakeEngine:
    """Each request emits one token per step until max_tokens; records which threads touched it."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.fail_next_step = False

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, speculative=True, grammar=None):
        self.threads.add(threading.get_ident())
        if not prompt and not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.left[request_id], self.done[request_id] = params.max_tokens, 0
        return request_id

    def abort(self, request_id):
        self.threads.add(threading.get_ident())
        if self.left.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        self.threads.add(threading.get_ident())
        time.sleep(0.005)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.done[rid] += 1
            k, finished = self.done[rid], self.left[rid] == 0
            comp = CompletionOutput(0, "x" * k, [7] * k, "length" if finished else None)
            outs.append(RequestOutput(rid, None, [1, 2], [comp], finished))
            if finished:
                del self.left[rid]
        return outs

    def get_metrics(self):
        return {"num_running": len(self.left), "num_waiting": 0}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_async_engine_streams_on_one_thread():
    fake = FakeEngine()
    ae = AsyncEngine(fake)  # type: ignore[arg-type]

    async def main():
        outs = [o async for o in ae.generate("a", "hi", SamplingParams(max_tokens=5))]
        assert outs[-1].finished and outs[-1].outputs[0].text == "xxxxx"
        assert all(not o.finished for o in outs[:-1])
        # Two at once, interleaved.
        async def collect(rid: str, n: int) -> str:
            return [o async for o in ae.generate(rid, "hi", SamplingParams(max_tokens=n))][-1].outputs[0].text

        return tuple(await asyncio.gather(collect("b", 3), collect("c", 6)))

    try:
        assert _run(main()) == ("xxx", "xxxxxx")
        assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads
        assert ae.num_requests == 0
    finally:
        ae.shutdown()


def test_async_engine_errors_and_abort():
    fake = FakeEngine()
    ae = AsyncEngine(fake, max_queue=2)  # type: ignore[arg-type]

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("bad", "", SamplingParams())
        long1 = await ae.add_request("l1", "hi", SamplingParams(max_tokens=10_000))
        long2 = await ae.add_request("l2", "hi", SamplingParams(max_tokens=10_000))
        with pytest.raises(QueueFullError):
            await ae.add_request("l3", "hi", SamplingParams())
        await long1.__anext__()
        long1.abort()  # the loop thread aborts it before its next step
        for _ in range(200):
            if "l1" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "l1" in fake.aborted
        # An engine step that raises fails the requests in flight, and the loop goes on.
        fake.fail_next_step = True
        with pytest.raises(EngineStepError, match="injected"):
            async for _ in long2:
                pass
        outs = [o async for o in ae.generate("after", "hi", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
        # Leaving a generate() early aborts the request.
        async for _ in ae.generate("early", "hi", SamplingParams(max_tokens=10_000)):
            break
        for _ in range(200):
            if "early" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "early" in fake.aborted
        pending = await ae.add_request("pending", "hi", SamplingParams(max_tokens=10_000))
        assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads  # only the loop thread
        await asyncio.to_thread(ae.shutdown)  # (after the loop thread has stopped, shutdown aborts the rest)
        with pytest.raises(EngineClosedError):
            async for _ in pending:
                pass
        with pytest.raises(EngineClosedError):
            await ae.add_request("late", "hi", SamplingParams())

    _run(main())
    assert ae.num_step_errors == 1 and not ae.is_running and not fake.has_unfinished()


# -- HTTP errors ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def aengine(server_engine):
    ae = AsyncEngine(server_engine, max_queue=64)
    ae.start()
    yield ae
    ae.shutdown()


@pytest.fixture(scope="module")
def server(aengine, start_server):
    srv = start_server(create_app(aengine))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth_server(aengine, start_server):
    """A second app over the same AsyncEngine (one loop owns the Engine), with an API key."""
    srv = start_server(create_app(aengine, api_key="sk-test-key"))
    yield srv
    srv.stop()


def _post(server, path: str, body=None, content: bytes | None = None, **kw) -> httpx.Response:
    if content is not None:
        return httpx.post(f"{server.url}{path}", content=content, timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def _error(r: httpx.Response, status: int, type_: str = "invalid_request_error", param=None, code=None,
           contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == type_ and err["param"] == param and err["code"] == code, err
    assert contains.lower() in err["message"].lower(), err
    return err


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CASES = [
    ("unknown param", "/v1/completions", {"prompt": "hi", "foo": 1}, "foo", "foo"),
    ("unknown chat param", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "frobnicate": []}, "frobnicate", "frobnicate"),
    ("temperature -1", "/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "non-negative"),
    ("top_p 2", "/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p", "top_p"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    ("chat max_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens", "at least 1"),
    ("n 0", "/v1/completions", {"prompt": "hi", "n": 0}, "n", "n must be"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, "empty"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, "prompt", "prompt"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, "prompt", "missing"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages", "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "text"),
    ("top_logprobs alone", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("logit_bias key", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias", "token ids"),
    ("logit_bias value", "/v1/completions", {"prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias", "-100, 100"),
    ("logit_bias vocab", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias",
     "vocabulary size"),
    ("response_format type", "/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format", "not supported"),
    ("response_format no schema", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format", "json_schema"),
    ("invalid JSON schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "invalid JSON schema"),
    ("invalid regex", "/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a("}},
     "structured_outputs", "invalid regex"),
    ("invalid EBNF", "/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= foo"}, "guided_grammar",
     "invalid EBNF"),
    ("two constraints", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format", "give one"),
    ("unknown structured_outputs field", "/v1/completions", {"prompt": "hi", "structured_outputs": {"xml": "a"}},
     "structured_outputs", "unknown field"),
    ("streaming, still before the stream", "/v1/completions",
     {"prompt": "hi", "stream": True, "temperature": -1}, "temperature", "temperature"),
    ("over context (ids)", "/v1/completions", {"prompt": [42] * 1020, "max_tokens": 16}, "prompt", "context length"),
    ("over context (text)", "/v1/completions", {"prompt": "hello " * 1100}, "prompt", "context length"),
    ("token id out of vocab", "/v1/completions", {"prompt": [10**9]}, "prompt", "token ids"),
    ("tokenize nothing", "/tokenize", {"add_special_tokens": False}, None, "either prompt or messages"),
    ("tokenize both", "/tokenize", {"prompt": "hi", **CHAT}, None, "either prompt or messages"),
    ("tokenize unknown field", "/tokenize", {"prompt": "hi", "text": "x"}, "text", "text"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [1, 10**9]}, "tokens", "token ids"),
    ("detokenize not ids", "/detokenize", {"tokens": ["a"]}, "tokens", "tokens"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,path,body,param,contains", CASES, ids=[c[0] for c in CASES])
def test_400s(server, name, path, body, param, contains):
    _error(_post(server, path, body), 400, param=param, contains=contains)


@pytest.mark.slow
def test_invalid_json(server):
    headers = {"content-type": "application/json"}
    _error(_post(server, "/v1/completions", content=b'{"prompt": "hi",', headers=headers), 400,
           contains="invalid json")
    _error(_post(server, "/v1/chat/completions", content=b"not json", headers=headers), 400,
           contains="invalid json")
    _error(_post(server, "/v1/completions", content=b'{"prompt": "hi"}'), 400, contains="json")  # no type
    _error(_post(server, "/v1/completions", content=b"[1, 2]", headers=headers), 400)


@pytest.mark.slow
def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"bogus": True})


@pytest.mark.slow
def test_wrong_model_and_route(server):
    for path, body in (("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})):
        _error(_post(server, path, body), 404, param="model", code="model_not_found", contains="gpt-4")
    _error(httpx.get(f"{server.url}/v1/nothing-here"), 404, contains="not found")
    _error(httpx.get(f"{server.url}/v1/completions"), 405)


@pytest.mark.slow
def test_auth(auth_server):
    url = f"{auth_server.url}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    _error(httpx.post(url, json=body), 401, code="invalid_api_key")
    _error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _error(httpx.post(url, json=body, headers={"Authorization": "sk-test-key"}), 401, code="invalid_api_key")
    _error(httpx.get(f"{auth_server.url}/v1/models"), 401, code="invalid_api_key")
    _error(httpx.post(f"{auth_server.url}/tokenize", json={"prompt": "hi"}), 401, code="invalid_api_key")
    _error(httpx.get(f"{auth_server.url}/tokenizer_info"), 401, code="invalid_api_key")
    key = {"Authorization": "Bearer sk-test-key"}
    assert httpx.post(f"{auth_server.url}/tokenize", json={"prompt": "hi"}, headers=key).json()["count"] >= 1
    assert httpx.get(f"{auth_server.url}/health").status_code == 200
    ok = openai.OpenAI(base_url=f"{auth_server.url}/v1", api_key="sk-test-key", max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{auth_server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _wait_kv_free(engine, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.kv.num_free_blocks != engine.kv.pool.num_blocks:
        assert time.monotonic() < deadline, "KV blocks not freed"
        time.sleep(0.05)


@pytest.mark.slow
def test_queue_full_429(server, aengine, server_engine):
    body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    aengine.max_queue = 1
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # NOTE: keep a reference: a discarded iterator closes the connection
            assert next(line for line in lines if line.startswith("data: "))
            assert aengine.num_requests == 1
            _error(_post(server, "/v1/completions", {"prompt": "hi"}), 429, "rate_limit_exceeded",
                   code="rate_limit_exceeded", contains="capacity")
    finally:
        aengine.max_queue = 64
    _wait_kv_free(server_engine)
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_500s_keep_the_server_alive(server, server_engine, monkeypatch):
    def broken_template(*a, **kw):
        raise RuntimeError("template machinery exploded")

    with monkeypatch.context() as m:
        m.setattr(server_engine.tokenizer, "apply_chat_template", broken_template)
        _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}), 500,
               "server_error", code="internal_error", contains="exploded")

    real_step = server_engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    with monkeypatch.context() as m:
        m.setattr(server_engine, "step", flaky_step)
        _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4}), 500, "server_error",
               code="internal_error", contains="injected step failure")
    calls["n"] = 0
    with monkeypatch.context() as m:  # after the stream started: an error event, then [DONE]
        m.setattr(server_engine, "step", flaky_step)
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert "injected step failure" in events[-2] and '"error"' in events[-2] and events[-1] == "[DONE]"
    _wait_kv_free(server_engine)
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200
