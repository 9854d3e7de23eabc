"""What clients written for OpenAI send, end to end on the demo model through the openai client (issue 44):
tool calls that survive ``max_tokens``, the fields of OpenAI's and vLLM's chat / completions schemas,
``GET /v1/models/{id}`` and ``/v1/embeddings``."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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
