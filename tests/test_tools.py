"""Tool calling: the parsers, tool_choice's grammars, the chat template's tool rendering, and the round trip
through the HTTP API with the openai client (tools -> tool_calls -> a role "tool" message -> an answer) on a
tiny random model with a Qwen2-style template, both parsers, streamed and not; the demo model with
tool_choice "required" returns arguments that validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.server.api import create_app
from specserve.server.tools import detect_parser, make_plan, parse_hermes, parse_llama3_json
from tests.helpers import save_tiny_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                 "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}

QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}{%- for tool in tools %}{{ tool | tojson }}"
    "{{ '\\n' }}{%- endfor %}{{ '</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "(c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
MODEL_ARGS = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False,
                  dtype="float32", num_blocks=256)


# -- units ---------------------------------------------------------------------------------------------------
def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_hermes("no tools here") == ("no tools here", [])
    assert parse_hermes("<tool_call>{broken</tool_call>")[1] == []  # malformed: the text stays content
    # the stop token ended the output before the closing tag
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}')[1][0].name == "f"


def test_llama3_json_parser():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome", "unit": "c"}
    assert parse_llama3_json("It is sunny.") == ("It is sunny.", [])


def test_parser_detection():
    assert detect_parser(QWEN_STYLE_TEMPLATE) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}{{ 'ipython' }}") == "llama3_json"
    assert detect_parser(None) == "hermes"


def test_stream_content_holds_back_a_starting_tag():
    plan = make_plan([WEATHER], "auto", None, "hermes")
    assert plan.stream_content("Hello <tool") == "Hello"
    assert plan.stream_content("Hello <tool_call>{") == "Hello"
    assert plan.stream_content("Hello there") == "Hello there"
    assert plan.stream_content("Hello there \n") == "Hello there"  # blanks wait: a call may follow
    plan3 = make_plan([WEATHER], "auto", None, "llama3_json")
    assert plan3.stream_content('  {"name"') == "" and plan3.stream_content("Sure, it is") == "Sure, it is"


def _stream(plan, text: str, step: int = 3, finish: str = "stop") -> tuple[str, dict, int]:
    """The server's deltas for ``text`` released ``step`` characters at a time, then finished (``finish``),
    reassembled as a client does: (content, {index: [id, name, arguments]}, tool-call entries sent)."""
    from types import SimpleNamespace

    from specserve.server.serving import _tool_deltas

    content, calls, entries, sent = "", {}, 0, {}
    for n in [*range(0, len(text), step), len(text)]:
        comp = SimpleNamespace(index=0, text=text[:n] if n < len(text) else text, finished=n == len(text),
                               finish_reason=finish if n == len(text) else None)
        for d in _tool_deltas(plan, comp, n, sent)[0]:
            content += d.get("content", "")
            for t in d.get("tool_calls", []):
                entries += 1
                if t["index"] not in calls:  # OpenAI's shape: id, type and name first, then argument pieces
                    assert t["id"].startswith("call_") and t["type"] == "function" and t["function"]["name"]
                    calls[t["index"]] = [t["id"], t["function"]["name"], t["function"]["arguments"]]
                else:
                    assert "id" not in t and "name" not in t["function"]
                    calls[t["index"]][2] += t["function"]["arguments"]
    return content, calls, entries


@pytest.mark.parametrize(("parser", "choice", "text"), [
    ("hermes", "auto", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris",'
                       ' "unit":"c", "x": [1, {"y": "}"}]}}\n</tool_call>\n<tool_call>{"arguments": {"zone": '
                       '"CET"}, "name": "get_time"}</tool_call>'),
    ("llama3_json", "auto", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                            '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}'),
    ("hermes", "required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", '
                           '"parameters": {"city": "Rome",  "unit": "c"}}]'),
])
def test_streamed_tool_calls_add_up_to_the_parsed_ones(parser, choice, text):
    """Streamed, each call comes whole (id, name and the model's own text of the arguments object) once it is
    complete, identical to the non-streamed ``arguments``, and the content before the calls streams as
    content."""
    final_content, final_calls = make_plan([WEATHER, TIME], choice, None, parser).parse(text)
    plan = make_plan([WEATHER, TIME], choice, None, parser)
    content, calls, entries = _stream(plan, text)
    assert (content or None) == final_content
    assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in final_calls]
    assert entries == len(final_calls)  # one entry per call, sent once it is complete
    assert all(json.loads(c.arguments) for c in final_calls)
    assert '"Pa\\"ris"' in final_calls[0].arguments or parser != "hermes" or choice != "auto"


def test_streamed_content_without_calls_is_the_whole_text():
    text = "Sure.\n\nIt is sunny in <b>Paris</b> today. \n"  # blanks held back mid-stream arrive at the end
    for parser in ("hermes", "llama3_json"):
        assert _stream(make_plan([WEATHER, TIME], "auto", None, parser), text)[:2] == (text, {})


def test_a_streamed_call_that_turns_out_malformed_ends_as_content():
    plan = make_plan([WEATHER, TIME], "auto", None, "hermes")
    text = 'Hi <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}, oops</tool_call>'
    assert plan.parse(text) == (text, [])
    content, calls, _ = _stream(plan, text)
    assert content == text  # the text before the call, then the rest when the parse fails
    assert calls == {}  # the call never completed: nothing was announced


_WEATHER_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'


@pytest.mark.parametrize(("parser", "choice", "text", "content"), [
    ("hermes", "required", f'[{_WEATHER_CALL}, {{"name": "get_weather", "parameters": {{"ci', None),
    ("hermes", "required", f'[{_WEATHER_CALL}, {{"na', None),
    ("hermes", "auto", 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                       '</tool_call>\n<tool_call>{"name": "get_time", "argu', "Checking."),
    ("llama3_json", "auto", f'{_WEATHER_CALL}; {{"name": "get_time", "parameters": {{"zo', None),
    ("hermes", {"type": "function", "function": {"name": "get_weather"}}, '{"city": "Par', None),
])
def test_a_call_cut_by_max_tokens_is_dropped(parser, choice, text, content):
    """Cut by max_tokens, the complete calls are the answer (none for a named choice cut inside its object)
    and the cut call is dropped, never returned as content; streamed, the same calls."""
    plan = make_plan([WEATHER, TIME], choice, None, parser)
    final_content, calls = plan.parse(text, truncated=True)
    want = [] if isinstance(choice, dict) else [("get_weather", {"city": "Paris", "unit": "c"})]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert final_content == content
    streamed_content, streamed, _ = _stream(make_plan([WEATHER, TIME], choice, None, parser), text,
                                            finish="length")
    assert (streamed_content or None) == content
    assert [(name, args) for _, name, args in streamed.values()] == [(c.name, c.arguments) for c in calls]


def test_a_repeated_call_ends_the_output():
    """An exact repeat of an earlier call (whitespace aside) ends the output after the call before it."""
    plan = make_plan([WEATHER, TIME], "required", None, "hermes")
    head = f'[{_WEATHER_CALL}, {{"name": "get_time", "parameters": {{"zone": "UTC"}}}}'
    text = head + ', {"name": "get_weather", "parameters": {"city":"Paris","unit": "c"}}'
    assert plan.repeat_cut(text) == len(head)
    assert plan.repeat_cut(text[:-1]) is None  # not complete yet: it may still differ
    assert plan.repeat_cut(head + ', {"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}') is None
    assert [c.name for c in plan.parse(text[:len(head)])[1]] == ["get_weather", "get_time"]
    hermes = make_plan([WEATHER, TIME], "auto", None, "hermes")
    block = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert hermes.repeat_cut(f"Sure.{block}\n{block}") == len(f"Sure.{block}")
    assert make_plan([WEATHER], "none", None, "hermes").repeat_cut(f"{block}{block}") is None


def test_a_function_without_parameters_takes_none():
    plan = make_plan([{"type": "function", "function": {"name": "now"}}],
                     {"type": "function", "function": {"name": "now"}}, None, "hermes")
    constraint = plan.constraint()
    assert constraint is not None
    assert constraint.json == {"type": "object", "properties": {}, "additionalProperties": False}


def test_tool_choice_grammars():
    required = make_plan([WEATHER, TIME], "required", False, "hermes").constraint()
    assert required is not None and isinstance(required.json, dict)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    named = make_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None,
                      "hermes").constraint()
    assert named is not None and named.json == SCHEMAS["get_time"]
    assert make_plan([WEATHER], "auto", None, "hermes").constraint() is None
    assert not make_plan([WEATHER], "none", None, "hermes").active


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ([{"type": "function", "function": {"description": "x"}}], "auto", "name is required"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    ([], "required", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER, WEATHER], "auto", "same name"),
])
def test_bad_tools(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        make_plan(tools, choice, None, "hermes")


# -- end to end on a tiny model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tools"), family="qwen2", seed=7,
                                max_position_embeddings=4096)
    cfg_file = f"{path}/tokenizer_config.json"
    with open(cfg_file, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = QWEN_STYLE_TEMPLATE
    with open(cfg_file, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return path


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    return Engine(EngineConfig.from_kwargs(tiny_path, **MODEL_ARGS))


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def client(request, tiny_engine, start_server):
    srv = start_server(create_app(tiny_engine, tool_call_parser=request.param))
    yield request.param, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()


def test_template_renders_tools_and_history(tiny_engine):
    tok = tiny_engine.tokenizer
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    text = tok.decode(tok.apply_chat_template(messages, tools=[WEATHER]), skip_special_tokens=False)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in text
    assert "<tool_response>\nrain\n</tool_response>" in text


def _tool_args(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(client, stream):
    parser, c = client
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _chat(c, stream, messages=messages, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80)
    assert first["finish_reason"] == "tool_calls" and first["content"] is None
    if stream:  # the call comes whole, once complete
        assert first["pieces"] == 1
    (call,) = first["tool_calls"]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _tool_args(call)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = _chat(c, stream, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8)
    assert final["tool_calls"] is None and final["finish_reason"] in ("stop", "length")
    assert final["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_call(client, stream):
    """The model's output in the parser's format (forced here by a regex, since the model is random) comes
    back as tool_calls, the text before it as content."""
    parser, c = client
    if parser == "hermes":
        out = 'OK.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    else:
        out = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    regex = "".join("\\" + ch if ch in '.{}[]()*+?|^$\\' else ch for ch in out)
    res = _chat(c, stream, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME], max_tokens=90,
                extra_body={"structured_outputs": {"regex": regex}})
    assert res["finish_reason"] == "tool_calls"
    assert [(t.function.name, _tool_args(t)) for t in res["tool_calls"]] == [("get_time", {"zone": "UTC"})]
    assert res["content"] == ("OK." if parser == "hermes" else None)
    if stream:  # the call whole, once complete
        assert res["pieces"] == 1


def test_required_single_call(client):
    _, c = client
    res = _chat(c, False, messages=[{"role": "user", "content": "anything"}], tools=[WEATHER, TIME],
                tool_choice="required", parallel_tool_calls=False, max_tokens=160)
    assert res["finish_reason"] == "tool_calls" and len(res["tool_calls"]) == 1
    _tool_args(res["tool_calls"][0])


def test_tool_errors_are_400s(client):
    _, c = client
    msg = [{"role": "user", "content": "hi"}]
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="name is required") as e:
        c.chat.completions.create(model=model, messages=msg, tools=[{"type": "function", "function": {}}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="not in tools") as e:
        c.chat.completions.create(model=model, messages=msg, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.body["param"] == "tool_choice"


def _chat(c: openai.OpenAI, stream: bool, **kw) -> dict:
    """One chat completion's content, tool calls and finish reason; a stream is reassembled."""
    model = c.models.list().data[0].id
    if not stream:
        r = c.chat.completions.create(model=model, temperature=0, **kw)
        ch = r.choices[0]
        return {"content": ch.message.content, "tool_calls": ch.message.tool_calls, "finish_reason": ch.finish_reason}
    content, calls, finish, pieces = "", {}, None, 0
    for chunk in c.chat.completions.create(model=model, temperature=0, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:  # OpenAI's shape: id and name first, then pieces of the arguments
            pieces += 1
            if t.index not in calls:
                assert t.id and t.function.name
                calls[t.index] = t
            else:
                assert t.id is None and not t.function.name
                calls[t.index].function.arguments += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "tool_calls": list(calls.values()) or None, "finish_reason": finish,
            "pieces": pieces}


# -- the demo model --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_model_required_arguments_validate(server_engine, start_server):
    srv = start_server(create_app(server_engine))
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        for question in ("What's the weather like in Paris today?", "What time is it in Tokyo?"):
            res = _chat(c, False, messages=[{"role": "user", "content": question}], tools=[WEATHER, TIME],
                        tool_choice="required", max_tokens=120)
            assert res["finish_reason"] == "tool_calls" and res["tool_calls"]
            for call in res["tool_calls"]:
                _tool_args(call)
    finally:
        srv.stop()
