"""``/v1/chat/completions``: messages, the request, the response and its logprobs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.outputs import CompletionOutput
from specserve.server.protocol.common import _SamplingRequest
from specserve.server.protocol.completions import Echo
from specserve.server.protocol.usage import Usage

# Chat default for max_tokens when neither max_tokens nor max_completion_tokens is given: up to the end of
# the context (as vLLM) but at most this many, so that a forgotten limit does not hold a slot for minutes.
CHAT_DEFAULT_MAX_TOKENS = 512


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant turn's "refusal" part

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in ("text", "refusal"):
            raise ValueError(f"only text content parts are supported, got type {v!r}")
        return v


class ChatMessage(BaseModel):
    # Other message fields (refusal, audio, ...) are ignored; role, content, name and the tool fields reach the
    # template.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: ``developer`` (OpenAI's newer name) is ``system``, and text
        parts are joined with newlines (as vLLM joins them)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text or p.refusal or "" for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(c) for c in self.tool_calls]
        return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call as chat templates read it: arguments as an object (templates apply tojson)."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "type": call.get("type", "function"), "function": fn}


# Variables a chat template gets from the server, which ``chat_template_kwargs`` may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "tokenize",
                                      "return_dict", "chat_template", "add_generation_prompt",
                                      "continue_final_message"})


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # The chat template's own variables: ``reasoning_effort`` (OpenAI) and vLLM's ``chat_template_kwargs``
    # (e.g. Qwen3's ``enable_thinking``) reach it as keyword arguments; vLLM's ``add_generation_prompt``.
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # OpenAI's deprecated function calling, read as tools / tool_choice.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's, ignored (IGNORED_FIELDS) or refused where they ask for what a text model cannot do.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _legacy_and_unsupported(self) -> ChatCompletionRequest:
        if self.functions is not None:
            if self.tools is not None:
                raise ValueError("functions: give tools or the deprecated functions, not both")
            self.tools = [{"type": "function", "function": f} for f in self.functions]
        if self.function_call is not None:
            if self.tool_choice is not None:
                raise ValueError("function_call: give tool_choice or the deprecated function_call, not both")
            fc = self.function_call
            self.tool_choice = {"type": "function", "function": fc} if isinstance(fc, dict) else fc
        if self.modalities and set(self.modalities) - {"text"}:
            raise ValueError(f"modalities: only 'text' output is supported, got {self.modalities}")
        if self.web_search_options is not None:
            raise ValueError("web_search_options: web search is a hosted tool, which this server does not have")
        if self.chat_template_kwargs:
            reserved = sorted(set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS)
            if reserved:
                raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is set by the server")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (``chat_template_kwargs``, then ``reasoning_effort``)."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def resolve_max_tokens(self, prompt_len: int, max_model_len: int) -> int | None:
        """max_completion_tokens, else max_tokens, else min(context left, CHAT_DEFAULT_MAX_TOKENS)."""
        explicit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if explicit is not None:
            return explicit
        left = max_model_len - prompt_len
        return min(left, CHAT_DEFAULT_MAX_TOKENS) if left >= 1 else None  # None: the engine says why


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extension (request's own)


def chat_logprobs(decode: Callable[[int], str], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(tok: int, lp: float) -> dict[str, Any]:
        s = decode(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(i, lp) for i, lp in e.get("top", [])]} for e in entries]}


def chat_response(rid: str, created: int, model: str, choices: list[tuple[int, CompletionOutput]],
                  usage: Usage, decode: Callable[[int], str] | None,
                  tool_parse: Callable[[str, bool], tuple[str | None, list[dict[str, Any]]]] | None = None,
                  echo: Echo | None = None) -> dict[str, Any]:
    """The non-streamed /v1/chat/completions body; ``tool_parse``: (text, cut by max_tokens) -> (content, tool
    call dicts);
    ``echo``: the rendered conversation's prompt logprobs (vLLM's ``prompt_logprobs``)."""
    out = []
    for i, c in choices:
        content, calls = tool_parse(c.text, c.finish_reason == "length") if tool_parse is not None else (c.text, [])
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls or None),
                              finish_reason=finish, stop_reason=c.stop_reason,
                              logprobs=chat_logprobs(decode, c.logprobs or []) if decode else None))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=out, usage=usage,
                                  prompt_logprobs=echo.field() if echo is not None else None).model_dump()
