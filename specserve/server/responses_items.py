"""The Responses API's shapes (``/v1/responses``, ``server/responses.py``): the request model, its input items
and tools read as a chat request, the output items and response object built from a chat answer, and the
bounded in-memory store behind ``previous_response_id``.

A request becomes a ``ChatCompletionRequest`` (so templates, tools, grammars, speculation and limits are the
chat route's): ``instructions`` is a system message ahead of the input; input items are messages
(``input_text`` / ``output_text`` / ``refusal`` parts joined with newlines), ``function_call`` items are an
assistant turn's ``tool_calls`` and ``function_call_output`` items ``tool`` messages; ``reasoning`` items are
dropped. Function tools are flat (``{"type": "function", "name", "parameters"}``); hosted tools (web search,
file search, computer use, code interpreter, MCP, ...) are a 400.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError, field_validator

from specserve.server.errors import APIError
from specserve.server.protocol import ChatCompletionRequest, _Strict

MAX_STORED_RESPONSES = 1024  # per server, least recently used dropped first
MAX_STORED_CHARS = 64 << 20  # and at most this much JSON text in all
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(_Strict):
    """OpenAI's ``responses.create`` parameters (those without a meaning here are accepted and ignored, those
    asking for what this server lacks are a 400), and vLLM's sampling extras."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    truncation: str | None = None
    user: str | None = None
    include: list[str] | None = None
    # ignored: OpenAI's infrastructure hints
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None
    image: Any = None
    # refused when given: background runs, stored conversations, prompt templates
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM's sampling extras and ours
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    speculative: bool | None = True

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _refused(cls, v: Any, info: Any) -> Any:
        if v:
            what = {"background": "background responses", "conversation": "the Conversations API",
                    "prompt": "stored prompt templates"}[info.field_name]
            raise ValueError(f"{info.field_name}: {what} are not available on this server")
        return v


IGNORED = ("include", "truncation", "top_logprobs", "stream_options", "service_tier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "context_management", "moderation",
           "access_programs", "background_options", "image")


def ignored_fields(body: ResponsesRequest) -> list[str]:
    """The fields given that change nothing on this server (for a debug log line)."""
    return [name for name in IGNORED if getattr(body, name) not in (None, [], {})]


def _text(content: Any, param: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{param}: content must be a string or a list of parts", param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"{param}: only text content parts are supported, got type {kind!r}", param="input")
        out.append(str(part.get("text", part.get("refusal", "")) or ""))
    return "\n".join(out)


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``input`` as chat messages (consecutive function calls are one assistant turn)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str):
                raise APIError(400, f"{where}: a function_call needs call_id and name", param="input")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs call_id", param="input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (messages, "
                                "function_call and function_call_output are)", param="input")
    return out


def chat_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """Function tools and ``tool_choice`` in chat's shape; a hosted tool is a 400."""
    out = None
    if tools is not None:
        out = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise APIError(400, f"tools[{i}]: {kind!r} is a hosted tool, which this server does not have; "
                                    "only function tools are supported", param="tools")
            out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise APIError(400, f"tool_choice {tool_choice!r}: only 'none', 'auto', 'required' or "
                                "{'type': 'function', 'name': ...} are supported", param="tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return out, tool_choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object ({'type': 'text' | 'json_object' | 'json_schema'})",
                       param="text")
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return dict(fmt)


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                 list[dict[str, Any]]]:
    """(the chat request, the conversation to keep for a later ``previous_response_id``: history + input,
    without ``instructions``, which OpenAI does not carry over)."""
    conversation = history + input_messages(body.input)
    if not conversation:
        raise APIError(400, "input is required (a string or a list of items)", param="input")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    tools, tool_choice = chat_tools(body.tools, body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": False if body.max_tool_calls == 1 else body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "response_format": response_format(body.text),
        "reasoning_effort": (body.reasoning or {}).get("effort"), "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None, "metadata": body.metadata}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos",
                 "user", "chat_template_kwargs", "speculative"):
        fields[name] = getattr(body, name)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None}), conversation
    except ValidationError as e:  # the first error's message
        errors = e.errors()
        msg = str(errors[0].get("msg", e)).removeprefix("Value error, ") if errors else str(e)
        raise APIError(400, msg, param="input") from None


# -- output -----------------------------------------------------------------------------------------------------
def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": content}


def call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text, then its calls."""
    items = [message_item(message["content"])] if message.get("content") else []
    return items + [call_item(c) for c in message.get("tool_calls") or []]


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat message that a later turn's history holds."""
    text = "\n".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def response_object(body: ResponsesRequest, rid: str, created: int, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, model: str, finish_reason: str | None = None) -> dict[str, Any]:
    """OpenAI's response object (``error`` left out: it is only ever null here); ``usage`` is chat's (with
    ``speculative``), renamed."""
    incomplete = status == "completed" and finish_reason == "length"
    out_usage = None
    if usage is not None:
        out_usage = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": usage["total_tokens"], "speculative": usage.get("speculative")}
    return {"id": rid, "object": "response", "created_at": created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store is not False, "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": out_usage, "user": body.user, "metadata": body.metadata or {}}


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: per API key (a hash of the
    bearer token; responses under one key are invisible under another), at most ``capacity`` responses and
    ``max_chars`` characters of JSON in all, the least recently used dropped first. In memory: gone on
    restart."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[tuple[str, str], tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.num_chars = 0

    @staticmethod
    def owner(authorization: str | None) -> str:
        return hashlib.sha256((authorization or "").encode("utf-8", "backslashreplace")).hexdigest()

    def put(self, owner: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        key = (owner, response["id"])
        kept = conversation + assistant_turn(response["output"])
        size = len(json.dumps(kept, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_chars:
            return  # larger than the whole store: not kept
        self._items[key] = (kept, response)
        self.num_chars += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._items.move_to_end(key)
        while len(self._items) > self.capacity or self.num_chars > self.max_chars:
            old, _ = self._items.popitem(last=False)
            self.num_chars -= self._sizes.pop(old)

    def get(self, owner: str, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the conversation so far, the response object); a 404 in OpenAI's shape when not kept."""
        found = self._items.get((owner, rid))
        if found is None:
            raise APIError(404, f"Previous response with id '{rid}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        self._items.move_to_end((owner, rid))
        return found


def new_id() -> tuple[str, int]:
    return f"resp_{uuid.uuid4().hex}", int(time.time())
