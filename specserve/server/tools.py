"""Tool calling for /v1/chat/completions: the tool list rendered by the chat template, ``tool_choice``
enforced by a grammar, the model's text parsed into ``message.tool_calls``.

- ``none``: the tools are not shown and nothing is parsed.
- ``auto`` (the default when tools are given): the tools go into the prompt through the checkpoint's chat
  template (``tools=`` of ``apply_chat_template``; a template that ignores tools gets them in a system
  message instead), and the output is parsed by the ``--tool-call-parser``: ``hermes`` (Hermes / Qwen2.5 /
  Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks) or ``llama3_json`` (Llama 3.x:
  ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, after an optional ``<|python_tag|>``);
  ``auto`` picks one from the template.
- ``required``: a JSON-schema grammar forces a JSON array of one or more ``{"name", "parameters"}`` calls (one
  when ``parallel_tool_calls`` is false), each ``parameters`` valid under its function's schema (a function
  without ``parameters`` takes none: ``{}``). An output that repeats an earlier call exactly is ended before
  the repeat (``ToolPlan.repeat_cut``), so the array ends when the model has nothing new to call.
- a named function: the grammar forces that function's arguments object.

A parsed output ends with ``finish_reason: "tool_calls"``. Cut by ``max_tokens`` (``"length"``), the calls
that are complete are returned and the cut one is dropped; the call syntax never becomes content. Streamed:
the text before the calls as content deltas, and each call whole (id, name, arguments) once it is complete,
so that streamed and non-streamed answers carry the same calls (a piece of a call that ``max_tokens`` then
cuts could not be taken back). The ``arguments`` string is the arguments object's text as the model wrote it.
A call the final parse does not accept (text after it that is not JSON) cannot be taken back: it stays, and
the rest of the output follows as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specserve.sample.grammar import json_union_ebnf
from specserve.sampling_params import StructuredOutputsParams
from specserve.server.errors import APIError
from specserve.server.tool_parsers import (
    _HERMES_CLOSE,
    _HERMES_OPEN,
    _PYTHON_TAG,
    PARSERS,
    PartialCall,
    ToolCall,
    _call_from,
    _new_call,
    _skip_ws,
    detect_parser,
    parse_hermes,
    parse_llama3_json,
    scan_call,
)

__all__ = ["PARSERS", "ToolCall", "ToolPlan", "detect_parser", "make_plan", "parse_hermes", "parse_llama3_json",
           "tool_plan", "with_tools"]


@dataclass
class ToolPlan:
    """One request's tools and what to do with them."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool dicts {"type", "function"}
    parser: str = "hermes"
    named: str | None = None
    parallel: bool = True
    # per choice, the calls streamed so far: [id, the arguments text sent]
    _streamed: dict[int, list[list[str]]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether the output is parsed into tool calls."""
        return self.mode != "none" and bool(self.tools)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.active else None

    def constraint(self, fmt: StructuredOutputsParams | None = None, union: bool = False
                   ) -> StructuredOutputsParams | None:
        """The grammar on the output, given the request's own constraint ``fmt``: a ``required`` or named
        choice forces calls (a ``response_format`` shapes text answers, and there is none in this turn);
        ``auto`` with a JSON ``response_format`` (``union``) allows one tool call or the format's object, as
        OpenAI allows tools with ``response_format``; otherwise ``fmt`` alone (e.g. vLLM's
        ``structured_outputs``, which spell out the whole output)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named or ""))
        if self.mode == "required":
            calls = [self._call_schema(f["function"]["name"], "parameters") for f in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        if fmt is None or not self.active or not union or fmt.kind not in ("json", "json_object"):
            return fmt
        answer = {"type": "object"} if fmt.json_object else \
            (json.loads(fmt.json) if isinstance(fmt.json, str) else fmt.json)
        key = "arguments" if self.parser == "hermes" else "parameters"
        call = {"anyOf": [self._call_schema(f["function"]["name"], key) for f in self.tools]}
        prefix, suffix = (f"{_HERMES_OPEN}\n", f"\n{_HERMES_CLOSE}") if self.parser == "hermes" else ("", "")
        return StructuredOutputsParams(grammar=json_union_ebnf([(prefix, call, suffix), ("", answer or {}, "")]))

    def _call_schema(self, name: str, key: str) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": name}, key: self._parameters(name)},
                "required": ["name", key], "additionalProperties": False}

    def _parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        params = fn.get("parameters")
        if params is None:  # OpenAI: a function without parameters takes no arguments
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return params if params else {"type": "object"}

    def parse(self, text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(message content, tool calls) of an output; no calls -> the text is the content. ``truncated``: the
        output was cut (``max_tokens``; also an output still running): the calls that are complete, never the
        cut one, and never the call syntax as content."""
        if not self.active:
            return text, []
        if self.mode == "named":  # the output is the arguments object
            args = text.strip()
            if truncated and not _is_json(args):
                return None, []
            return None, [_new_call(self.named or "", args)]
        if self.mode == "required":  # [{"name": ..., "parameters": {...}}, ...]: the complete items
            if not text.lstrip().startswith("["):
                return text, []
            calls: list[ToolCall] = []
            for call in self.scan_calls(text):
                if call.end is None:
                    break
                try:
                    calls.append(_call_from(text, call.start))
                except (ValueError, TypeError, KeyError):
                    break
            return None, calls
        if self.parser == "hermes":
            return parse_hermes(text, truncated)
        return parse_llama3_json(text, truncated)

    def repeat_cut(self, text: str) -> int | None:
        """Where to end an ``auto`` or ``required`` output whose latest complete call repeats an earlier one
        exactly (same name, same arguments): after the call before it. A model that has nothing new to call
        tends to write the same call again until ``max_tokens``; a grammar cannot forbid a repeat (it would
        depend on the output), so the server ends the output there instead."""
        if self.mode not in ("auto", "required") or not self.active:
            return None
        seen: set[tuple[str, str]] = set()
        complete = [c for c in self.scan_calls(text) if c.end is not None and c.name is not None]
        for k, call in enumerate(complete):
            args = text[call.args_start:call.args_end] if call.args_start is not None else "{}"
            try:
                key = (call.name or "", json.dumps(json.loads(args), sort_keys=True))
            except ValueError:
                return None
            if key in seen:
                if self.mode == "required" or self.parser != "hermes":
                    return complete[k - 1].end
                return len(text[:text.rfind(_HERMES_OPEN, 0, call.start)].rstrip())
            seen.add(key)
        return None

    def stream_content(self, text: str) -> str:
        """The part of the output so far that is certainly message content (streamed as it comes); the rest
        may become a tool call and waits for the end. Hermes: trailing blanks wait too, as the content before a
        call is sent without them (``parse_hermes`` strips it)."""
        if not self.active:
            return text
        if self.mode in ("required", "named"):
            return ""
        if self.parser == "hermes":
            at = text.find(_HERMES_OPEN)
            if at >= 0:
                return text[:at].rstrip()
            keep = next((n for n in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1)
                         if _HERMES_OPEN.startswith(text[-n:])), 0)  # a tag may be starting
            return text[:len(text) - keep].rstrip()
        head = text.lstrip()
        if not head or head.startswith(("{", "[")) or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]):
            return ""
        return text

    def scan_calls(self, text: str) -> list[PartialCall]:
        """The calls of an ``auto`` or ``required`` output so far, in order (offsets into ``text``)."""
        calls: list[PartialCall] = []
        if self.mode == "required":  # [{"name": ..., "parameters": {...}}, ...]
            j = _skip_ws(text, 0)
            if j >= len(text) or text[j] != "[":
                return calls
            j = _skip_ws(text, j + 1)
            sep = ","
        elif self.parser == "hermes":  # <tool_call>{...}</tool_call> blocks
            at = 0
            while (k := text.find(_HERMES_OPEN, at)) >= 0:
                j = _skip_ws(text, k + len(_HERMES_OPEN))
                if j >= len(text) or text[j] != "{":
                    break
                calls.append(scan_call(text, j))
                end = calls[-1].end
                if end is None:
                    break
                at = end
            return calls
        else:  # llama3_json: [<|python_tag|>]{...}; {...}
            j = _skip_ws(text, 0)
            if text.startswith(_PYTHON_TAG, j):
                j = _skip_ws(text, j + len(_PYTHON_TAG))
            sep = ";"
        while j < len(text) and text[j] == "{":
            calls.append(scan_call(text, j))
            end = calls[-1].end
            if end is None:
                break
            j = _skip_ws(text, end, sep)
        return calls

    def stream_calls(self, choice: int, text: str) -> list[dict[str, Any]]:
        """``delta.tool_calls`` entries for choice ``choice`` with output ``text`` so far: each call whole (id,
        name and arguments) once it is complete. NOTE: not in pieces: a call cut by ``max_tokens`` is dropped
        (``parse(truncated=True)``), and a streamed piece could not be taken back."""
        state = self._streamed.setdefault(choice, [])
        calls = self.parse(text, truncated=True)[1]
        pieces: list[dict[str, Any]] = []
        for k in range(len(state), len(calls)):
            state.append([calls[k].id, calls[k].arguments])
            pieces.append(calls[k].as_dict(k))
        return pieces

    def finish_calls(self, choice: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries that complete choice ``choice``'s streamed calls: the rest of the
        arguments of those already announced, and the calls not yet announced whole."""
        state = self._streamed.get(choice, [])
        pieces: list[dict[str, Any]] = []
        for k, call in enumerate(calls):
            if k >= len(state):
                pieces.append(call.as_dict(k))
            elif call.arguments.startswith(state[k][1]) and len(call.arguments) > len(state[k][1]):
                pieces.append({"index": k, "function": {"arguments": call.arguments[len(state[k][1]):]}})
        return pieces

    def num_streamed(self, choice: int) -> int:
        return len(self._streamed.get(choice, []))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def make_plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, parser: str
              ) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` (ValueError starting with the parameter's name)."""
    tools = tools or []
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name is required (a non-empty string)")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError("tools has two functions with the same name")
    clean = [{"type": "function", "function": t["function"]} for t in tools]
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return ToolPlan(choice, clean, parser, None, parallel is not False)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                         "'function': {'name': ...}}")
    if name not in names:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools ({names})")
    return ToolPlan("named", clean, parser, name, parallel is not False)


def tools_system_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    """For a chat template that ignores ``tools``: the functions described in a system message (Hermes'
    wording and format, so that ``hermes`` parses the answer)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return {"role": "system", "content": (
        "You may call one or more functions to assist with the user query. The functions:\n<tools>\n"
        f"{listing}\n</tools>\nFor each call, return a JSON object with the function name and arguments "
        'within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>")}


def tool_plan(body: Any, parser: str) -> ToolPlan:
    """The plan of a chat request (``tools``, ``tool_choice``, ``parallel_tool_calls``); a 400 naming the
    parameter when they are invalid."""
    try:
        return make_plan(body.tools, body.tool_choice, body.parallel_tool_calls, parser)
    except ValueError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise APIError(400, str(e), param=param) from None


def with_tools(chat_template: str | None, messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The messages to render: unchanged when the template shows ``tools`` itself (or there are none to
    show), else with the tools described in the system message."""
    if plan.template_tools is None or "tools" in (chat_template or ""):
        return messages
    note = tools_system_message(plan.tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note['content']}"}, *messages[1:]]
    return [note, *messages]
