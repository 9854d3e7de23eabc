"""``/v1/responses`` end to end on the demo model: the openai client's ``responses.create`` (plain, streamed,
with a function tool), ``responses.stream``, input items, ``previous_response_id`` and ``store``, JSON
schema output, hosted tools refused, and an openai-agents ``Agent`` with a ``@function_tool`` on the
library's default (Responses) model."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.timeout(300)]
slow = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PARIS = "What is the weather in Paris?"


@slow
def test_plain_create(client):
    r = client.responses.create(model=MODEL, input="Say hi", instructions="Be brief.", max_output_tokens=16,
                                temperature=0, metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text
    assert r.status in ("completed", "incomplete") and r.metadata == {"k": "v"}
    assert r.usage.output_tokens <= 16 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.model_extra["speculative"]["num_drafts"] >= 0  # the speculation extension, as on chat
    if r.usage.output_tokens == 16:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    off = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=8, extra_body={"speculative": False})
    assert off.usage.model_extra["speculative"]["num_drafts"] == 0  # speculation off for one request, as on chat


@slow
def test_streamed_text_events(client):
    """The semantic events in order, deltas adding up to the final text, which equals the non-streamed one."""
    kw = dict(model=MODEL, input="Count from one to five.", max_output_tokens=24, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == plain.output_text


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_function_tool(client, stream):
    kw = dict(model=MODEL, input=PARIS, tools=[WEATHER], tool_choice="required", temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] == "Paris"
    assert calls[0].call_id.startswith("call_") and r.status == "completed"
    # the round trip: the call and its output as input items, then an answer in text
    follow = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=24, temperature=0, input=[
        {"role": "user", "content": PARIS},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}])
    assert follow.output_text


@slow
def test_named_tool_choice_and_responses_stream(client):
    with client.responses.stream(model=MODEL, input=PARIS, tools=[WEATHER], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and "city" in json.loads(call.arguments)


@slow
def test_previous_response_id_and_store(server, client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens  # the history came
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="someone-else", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # kept per API key
        other_key.responses.create(model=MODEL, input="?", previous_response_id=first.id)
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="?", previous_response_id=unstored.id)


@slow
def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Paris is sunny today. Report it.", temperature=0,
                                text={"format": {"type": "json_schema", "name": "report", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


@slow
@pytest.mark.parametrize(("kw", "param", "match"), [
    ({"tools": [{"type": "web_search"}]}, "tools", "hosted tool"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "hosted tool"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 8, "display_height": 8,
                 "environment": "linux"}]}, "tools", "hosted tool"),
    ({"background": True}, None, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input",
     "only text"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "not supported"),
    ({"bogus": 1}, "bogus", "Unrecognized"),
])
def test_unsupported_is_a_400(server, kw, param, match):
    body = {"model": MODEL, "input": "hi", **kw}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


@slow
def test_openai_agents_agent_calls_a_function_tool(server):
    """openai-agents' default model is the Responses API: with tool_choice "required" the agent receives the
    call and runs the tool, then (tool choice reset to auto, as the library does) answers in text; streamed,
    with ``stop_on_first_tool``, the tool's output is the final output."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    async def main() -> tuple[object, object]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        agents.set_default_openai_client(client, use_for_tracing=False)
        settings = agents.ModelSettings(tool_choice="required", temperature=0, extra_body={"stop": ["\n"]})
        agent = agents.Agent(name="weather", instructions="You answer weather questions.", model=MODEL,
                             tools=[get_weather], model_settings=settings)
        ran = await agents.Runner.run(agent, PARIS, max_turns=4)
        streamed = agents.Runner.run_streamed(agent.clone(tool_use_behavior="stop_on_first_tool"),
                                              "What is the weather in Rome?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return ran.final_output, streamed.final_output

    final, streamed_final = asyncio.run(main())
    assert calls[0] == "Paris" and isinstance(final, str) and final
    assert len(calls) == 2 and streamed_final == f"18 C and sunny in {calls[1]}"


def test_store_is_bounded_and_per_key():
    from specserve.server.responses_items import ResponseStore

    store = ResponseStore(capacity=3, max_chars=2000)
    a, b = store.owner("Bearer a"), store.owner("Bearer b")

    def resp(i: int, text: str = "x") -> dict:
        return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"text": text}]}]}

    for i in range(4):
        store.put(a, resp(i), [{"role": "user", "content": "hi"}])
    with pytest.raises(Exception, match="not found"):
        store.get(a, "resp_0")  # the least recently used went first
    assert store.get(a, "resp_3")[0][-1] == {"role": "assistant", "content": "x"}
    with pytest.raises(Exception, match="not found"):
        store.get(b, "resp_3")
    store.put(a, resp(9, "y" * 800), [])  # ~1,750 characters: the oldest two make room
    assert store.num_chars <= 2000 and len(store._items) == 2 and store.get(a, "resp_9")
    store.put(a, resp(10, "z" * 5000), [])  # larger than the whole store: not kept
    with pytest.raises(Exception, match="not found"):
        store.get(a, "resp_10")
