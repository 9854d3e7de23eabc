"""What clients written for OpenAI send, end to end on the demo model through the openai client (issue 44):
tool calls that survive ``max_tokens``, the fields of OpenAI's and vLLM's chat / completions schemas,
``GET /v1/models/{id}`` and ``/v1/embeddings``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specserve.server.protocol import ChatCompletionRequest, CompletionRequest

slow = pytest.mark.slow
pytestmark = [pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_chat(client: openai.OpenAI, **kw) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat completion, reassembled."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in calls:
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(c) for c in calls.values()], finish


@slow
@pytest.mark.parametrize("max_tokens", [34, None])
def test_required_tool_calls_survive_the_token_limit(client, max_tokens):
    """The issue's example: cut by max_tokens 34, the complete get_weather call comes back in tool_calls (the
    cut second one dropped, no array as content), streamed and not with identical calls; without a limit the
    model's exact repeat of its call ends the array instead of running to max_tokens."""
    kw = dict(messages=PARIS, tools=[GET_WEATHER], tool_choice="required", temperature=0)
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    r = client.chat.completions.create(model=MODEL, **kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert msg.content is None and msg.tool_calls
    calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1])["city"] == "Paris"
    assert len(set(calls)) == len(calls)  # no exact repeats
    assert finish == ("length" if max_tokens is not None else "tool_calls")
    if max_tokens is None:
        assert r.usage.completion_tokens < 120  # ended by the repeat, not by the default limit
    content, streamed, streamed_finish = _streamed_chat(client, **kw)
    assert content is None and streamed == calls and streamed_finish == finish


# -- fields of OpenAI's and vLLM's schemas --------------------------------------------------------------------
def test_every_field_of_openais_schemas_is_a_field():
    """Every parameter the openai client can send to chat / completions is a request field (accepted,
    honoured or ignored), so that none of them is a 400 "Unrecognized request argument"."""
    from openai.types import completion_create_params as legacy
    from openai.types.chat import completion_create_params as chat

    assert set(chat.CompletionCreateParamsBase.__annotations__) <= set(ChatCompletionRequest.model_fields)
    assert set(legacy.CompletionCreateParamsBase.__annotations__) <= set(CompletionRequest.model_fields)


def test_legacy_functions_developer_role_and_parts():
    body = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}],
        functions=[GET_WEATHER["function"]], function_call={"name": "get_weather"})
    assert body.tools == [GET_WEATHER] and body.tool_choice == {"type": "function",
                                                                  "function": {"name": "get_weather"}}
    assert [m.template_dict() for m in body.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\nhi"},
        {"role": "assistant", "content": "No."}]
    for bad, match in [({"functions": [GET_WEATHER["function"]], "tools": [GET_WEATHER]}, "not both"),
                       ({"modalities": ["text", "audio"]}, "only 'text'"),
                       ({"web_search_options": {}}, "hosted tool"),
                       ({"chat_template_kwargs": {"messages": []}}, "set by the server"),
                       ({"metadata": {str(i): "x" for i in range(17)}}, "at most 16"),
                       ({"bogus": 1}, "Extra inputs")]:
        with pytest.raises(ValueError, match=match):
            ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **bad)


def test_template_kwargs_reach_the_chat_template(demo_tokenizer):
    hf = demo_tokenizer.hf_tokenizer
    saved = hf.chat_template
    hf.chat_template = ("{{ reasoning_effort | default('none') }}/{{ enable_thinking | default('unset') }}:"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], reasoning_effort="low",
                                     chat_template_kwargs={"enable_thinking": False})
        ids = demo_tokenizer.apply_chat_template([m.template_dict() for m in body.messages],
                                                 template_kwargs=body.template_kwargs())
        assert demo_tokenizer.decode(ids) == "low/False:x"
    finally:
        hf.chat_template = saved


@slow
def test_openai_and_vllm_fields_are_accepted(server, client):
    """Every field of issue 44's list in one request: 200, metadata echoed; ``developer`` costs what
    ``system`` costs (the template's default system prompt is not added)."""
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True,
             "prompt_cache_key": "k", "safety_identifier": "u1", "verbosity": "low",
             "prediction": {"type": "content", "content": "Hello"}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "Answer in one word."},
                               {"role": "user", "content": "Say hi"}],
        max_tokens=4, temperature=0, store=False, metadata={"run": "44"}, service_tier="auto",
        reasoning_effort="low", modalities=["text"], user="me", extra_body=extra)
    assert r.choices[0].message.content is not None
    assert r.metadata == {"run": "44"}
    as_system = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in one word."},
                               {"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == as_system.usage.prompt_tokens
    assert r.choices[0].message.content == as_system.choices[0].message.content
    legacy = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                       extra_body={"store": True, "metadata": {"a": "b"}})
    assert legacy.model_extra["metadata"] == {"a": "b"}
    parts = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]}).json()["tokens"]
    joined = httpx.post(f"{server.url}/tokenize", json={"messages": [
        {"role": "user", "content": "Say\nhi"}]}).json()["tokens"]
    assert parts == joined


@slow
def test_deprecated_functions_are_tools(client):
    """``functions`` / ``function_call`` run as tools; the answer shows the call both ways (``tool_calls``, and
    ``function_call`` with ``finish_reason: "function_call"`` as the deprecated API did), streamed and not."""
    kw = dict(model=MODEL, messages=PARIS, functions=[GET_WEATHER["function"]], max_tokens=40, temperature=0)
    r = client.chat.completions.create(function_call={"name": "get_weather"}, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    legacy = r.choices[0].message.function_call
    assert (legacy.name, legacy.arguments) == (call.function.name, call.function.arguments)
    assert r.choices[0].finish_reason == "function_call"
    chunks = [c for c in client.chat.completions.create(function_call={"name": "get_weather"}, stream=True, **kw)
              if c.choices]
    streamed = [c.choices[0].delta.function_call for c in chunks if c.choices[0].delta.function_call]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(f.name, f.arguments) for f in streamed] == [(t.function.name, t.function.arguments) for t in calls
                                                         if t.index == 0] == [(legacy.name, legacy.arguments)]
    assert chunks[-1].choices[0].finish_reason == "function_call"


@slow
def test_unsupported_outputs_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="only 'text'"):
        client.chat.completions.create(model=MODEL, messages=PARIS, modalities=["text", "audio"])
    with pytest.raises(openai.BadRequestError, match="hosted tool"):
        client.chat.completions.create(model=MODEL, messages=PARIS, web_search_options={})


WEATHER_REPORT = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "sunny": {"type": "boolean"}},
                  "required": ["city", "sunny"], "additionalProperties": False}


@slow
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tools_with_response_format(client, tool_choice):
    """OpenAI allows both: with ``auto`` the output is a tool call or the format's object (the union of both
    grammars), with ``required`` a tool call (the format shapes a later text answer)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": WEATHER_REPORT, "strict": True}}
    for question in ("What is the weather in Paris?", "Report: Paris is sunny today."):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           tools=[GET_WEATHER], tool_choice=tool_choice, response_format=fmt,
                                           max_tokens=60, temperature=0)
        msg = r.choices[0].message
        if msg.tool_calls:
            assert msg.tool_calls[0].function.name == "get_weather"
            json.loads(msg.tool_calls[0].function.arguments)
        else:
            assert tool_choice == "auto"
            jsonschema.validate(json.loads(msg.content), WEATHER_REPORT)


# -- models and embeddings ------------------------------------------------------------------------------------
@slow
def test_model_lookup(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"


def _greedy_next(client: openai.OpenAI, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text


@slow
def test_embeddings_last_token(client, server_engine):
    """The default (vLLM's for decoder models): the last token's final hidden state, L2-normalised. The LM
    head over it picks the token greedy decoding picks (normalising scales it, which keeps the argmax);
    base64 (the openai client's default) and float agree; usage counts the input tokens."""
    import numpy as np
    import torch

    texts = ["The capital of France is", "def fibonacci(n):"]
    r = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire, decoded by the client
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    tok = server_engine.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts) == floats.usage.prompt_tokens
    model = server_engine.runner.model
    for text, item, plain in zip(texts, r.data, floats.data):
        v = np.array(item.embedding)
        assert v.shape == (model.arch.hidden_size,) and abs(np.linalg.norm(v) - 1) < 1e-4
        assert np.allclose(v, plain.embedding, atol=1e-6)
        hidden = torch.tensor(plain.embedding, dtype=model.dtype)[None]
        best = int(model.compute_logits(hidden).argmax())
        assert tok.decode([best]) == _greedy_next(client, text)
    again = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert np.allclose(again.data[0].embedding, floats.data[0].embedding, atol=1e-5)
    by_ids = client.embeddings.create(model=MODEL, input=tok.encode(texts[0]), encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-5)


@slow
def test_embeddings_do_not_disturb_generation(server, client, server_engine):
    """Embeddings computed while a generation streams: the stream's text is what it is alone, and every KV
    block is free afterwards."""
    kw = dict(model=MODEL, prompt="List the days of the week:", max_tokens=48, temperature=0)
    alone = client.completions.create(**kw).choices[0].text
    pieces = []
    for k, chunk in enumerate(client.completions.create(stream=True, **kw)):
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if k in (2, 6):
            client.embeddings.create(model=MODEL, input=["Paris is the capital of France."] * 2)
    assert "".join(pieces) == alone
    kv = server_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


@slow
def test_embeddings_errors(client):
    for kw, match in [({"input": ""}, "must not be empty"), ({"input": [], }, "must not be empty"),
                      ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": [10 ** 7]}, "token ids"),
                      ({"input": "x " * 3000}, "tokens")]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.embeddings.create(model=MODEL, encoding_format="float", **kw)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


@slow
def test_embeddings_mean_pooling(server_engine, start_server):
    """``--pooler-config '{"pooling_type": "MEAN"}'``: the mean over the input's tokens, normalised; for one
    token, the same as the last token's."""
    import numpy as np

    from specserve.server.api import create_app

    mean_srv = start_server(create_app(server_engine, pooler_config='{"pooling_type": "MEAN"}'))
    last_srv = start_server(create_app(server_engine))
    try:
        mean_c, last_c = (openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=120)
                          for s in (mean_srv, last_srv))
        text = "The quick brown fox jumps over the lazy dog"
        mean = np.array(mean_c.embeddings.create(model=MODEL, input=text).data[0].embedding)
        last = np.array(last_c.embeddings.create(model=MODEL, input=text).data[0].embedding)
        assert abs(np.linalg.norm(mean) - 1) < 1e-4 and not np.allclose(mean, last, atol=1e-2)
        one = [server_engine.tokenizer.encode("Hello")[0]]
        assert np.allclose(mean_c.embeddings.create(model=MODEL, input=one).data[0].embedding,
                           last_c.embeddings.create(model=MODEL, input=one).data[0].embedding, atol=1e-5)
    finally:
        mean_srv.stop()
        last_srv.stop()
    with pytest.raises(ValueError, match="pooling_type"):
        create_app(server_engine, pooler_config='{"pooling_type": "ALL"}')


@slow
@pytest.mark.timeout(600)
def test_embeddings_under_tensor_parallel(server_engine):
    """Two CPU ranks: the embedding is a mirrored call (both ranks run the forward), the same vector as one rank
    (up to the order of the all-reduce's sums), and the borrowed blocks are free again."""
    import numpy as np

    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    ids = server_engine.tokenizer.encode("The capital of France is")
    tp = Engine(EngineConfig.from_kwargs(None, max_model_len=512, num_blocks=64, tensor_parallel_size=2))
    try:
        for pooling in ("LAST", "MEAN"):
            want, got = np.array(server_engine.embed(ids, pooling)), np.array(tp.embed(ids, pooling))
            assert np.abs(want - got).max() <= 1e-3 * np.linalg.norm(want)
        assert tp.kv.num_free_blocks == tp.kv.pool.num_blocks
    finally:
        tp.close()
