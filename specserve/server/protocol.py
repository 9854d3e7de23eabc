"""OpenAI-compatible request and response models (pydantic 2).

Requests reject unknown top-level fields (``extra="forbid"``) so that a typo is a 400, not a silently ignored
knob. ``user`` partitions suffix decoding's drafts (spec_decode/suffix.py). Accepted but ignored:
``best_of`` (only when equal to ``n``). Structured outputs:
OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's ``structured_outputs``
(``json`` | ``regex`` | ``choice`` | ``grammar`` | ``json_object``) or its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, on both routes (one of them per request).
Extensions (vLLM names): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``, completions' ``prompt_logprobs`` and
ours, ``speculative`` (default true) and ``stream_options.include_spec_info`` (default false; see
``server/webui.py``). Completions' ``echo`` shows the prompt (and, with ``logprobs``, its tokens' logprobs).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.outputs import CompletionOutput, RequestOutput
from specserve.request import SpecStats
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

# Chat default for max_tokens when neither max_tokens nor max_completion_tokens is given: up to the end of
# the context (as vLLM) but at most this many, so that a forgotten limit does not hold a slot for minutes.
CHAT_DEFAULT_MAX_TOKENS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may spell lone UTF-16 surrogates (``"\\ud800"``); Python keeps them in str, and the tokenizer
        (and any response echoing them) then fails with a 500. Refuse them here, as a 400."""
        bad = _lone_surrogate_path(data, ())
        if bad is not None:
            where = ".".join(str(x) for x in bad) or "body"
            raise ValueError(f"'{where}' contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             f"escape): strings must be valid Unicode")
        return data


def _lone_surrogate_path(x: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if isinstance(x, str):
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            found = _lone_surrogate_path(k, path) if isinstance(k, str) else None
            if found is None:
                found = _lone_surrogate_path(v, (*path, k))
            if found is not None:
                return found
    elif isinstance(x, list):
        for i, v in enumerate(x):
            if (found := _lone_surrogate_path(v, (*path, i))) is not None:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. include_obfuscation: harmless to ignore

    include_usage: bool = False
    include_spec_info: bool = False  # ours: per-token spec_tokens / spec_accepted in chunks (server/webui.py)


# OpenAI fields accepted and ignored: hints to OpenAI's own infrastructure (storage, tiers, caches, safety
# tracking, predicted outputs, verbosity of reasoning models), meaningless for one local model.
IGNORED_FIELDS = frozenset({"store", "service_tier", "prompt_cache_key", "prompt_cache_options",
                            "prompt_cache_retention", "safety_identifier", "verbosity", "prediction",
                            "moderation", "audio"})


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    speculative: bool | None = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs (completions: per choice; chat: in the body)
    # OpenAI's: ``metadata`` is echoed in the response; the others change nothing here (logged at debug level).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return v

    def ignored_fields(self) -> list[str]:
        """The fields given that change nothing on this server (for a debug log line)."""
        return sorted(name for name in IGNORED_FIELDS & self.model_fields_set
                      if getattr(self, name) not in (None, False, [], {}))

    def constraint_param(self) -> str | None:
        """The request field a structured-output constraint came from (None when there is none or several)."""
        try:
            return self.constraint()[1]
        except ValueError:
            return None

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The structured-output constraint and the parameter it came from (None, None: free text).
        Raises ValueError starting with that parameter's name."""
        given = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} both constrain the output; give one")
        if not given:
            return None, None
        name = given[0]
        try:
            if name == "response_format":
                return StructuredOutputsParams.from_response_format(rf or {}), name
            if name == "structured_outputs":
                so = dict(self.structured_outputs or {})
                known = {"json", "regex", "choice", "grammar", "json_object"}
                so = {k: v for k, v in so.items() if v is not None and v is not False}
                unknown = sorted(set(so) - known)
                if unknown:
                    raise ValueError(f"unknown field {unknown[0]!r}; use one of {sorted(known)}")
                return StructuredOutputsParams(**so), name
            field = name.removeprefix("guided_")
            return StructuredOutputsParams(**{field: getattr(self, name)}), name
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: {str(e).removeprefix('structured_outputs ')}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (with SamplingParams' message naming the field) for out-of-range values."""
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise ValueError(f"best_of must equal n ({n}) when given, got {self.best_of}")
        kw: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "logprobs": logprobs,
                              "prompt_logprobs": self.prompt_logprobs}
        if self.logit_bias:
            kw["logit_bias"] = _logit_bias(self.logit_bias)
        constraint, _ = self.constraint()
        if constraint is not None:
            kw["structured_outputs"] = constraint
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                     "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "user"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
        out[token] = value
    return out


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """With ``echo`` and ``logprobs``, the prompt's tokens get logprobs too (``prompt_logprobs``)."""
        params = super().sampling_params(max_tokens, logprobs)
        want = self.prompt_logprobs if self.prompt_logprobs is not None else logprobs if self.echo else None
        return params if want is None else replace(params, prompt_logprobs=want)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


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


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


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


# -- responses ---------------------------------------------------------------------------------------------
class SpeculativeUsage(BaseModel):
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 1.0
    # The same counters per draft source ("model", "lookup", "grammar", or the method), when any drafted.
    sources: dict[str, SpeculativeUsage] | None = None

    @staticmethod
    def merge(stats: list[dict[str, Any]], sources: list[dict[str, dict[str, Any]]] | None = None
              ) -> SpeculativeUsage:
        """The sum of per-request ``metrics["speculative"]`` counters (choices of one response), and of their
        ``metrics["speculative_sources"]``."""
        total = SpecStats.total(stats).as_dict()
        names = sorted({name for s in sources or [] for name in s})
        by_source = {name: SpeculativeUsage.merge([s[name] for s in sources or [] if name in s]) for name in names}
        return SpeculativeUsage(**{k: v for k, v in total.items() if k != "accepted_per_position"},
                                sources=by_source or None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string / token that ended the text
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extension (request's own)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- building responses ----------------------------------------------------------------------------------
class Delta:
    """What one choice has streamed so far. While the choice runs, the last ``hold`` characters (longest stop
    string - 1) are held back: the engine cuts a stop string out of the text only once it is complete, so
    text that may still become part of one must not be sent yet. Streamed pieces then concatenate exactly to
    the final text."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.sent = 0  # characters
        self.tokens = 0
        self.done = False

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token index, end token index), or None once the finish was sent."""
        if self.done:
            return None
        end = len(comp.text) if comp.finished else max(self.sent, len(comp.text) - self.hold)
        text = comp.text[self.sent:end]
        self.sent = max(self.sent, end)
        t0, self.tokens = self.tokens, len(comp.token_ids)
        self.done = comp.finished
        return text, t0, self.tokens


def usage(outputs: list[RequestOutput]) -> Usage:
    """Prompt tokens once per prompt (not per choice); completion tokens over all choices."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    spec_stats = SpeculativeUsage.merge([o.metrics.get("speculative") or {} for o in outputs],
                                        [o.metrics.get("speculative_sources") or {} for o in outputs])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 speculative=spec_stats)


def completion_logprobs(decode: Callable[[int], str], entries: list[dict[str, Any]],
                        offset: int) -> dict[str, Any]:
    """Legacy completions format: parallel lists (tokens, token_logprobs, top_logprobs, text_offset); an entry
    whose ``top`` is None (a prompt's first token) has null alternatives."""
    tokens, chosen, tops, offsets = [], [], [], []
    for e in entries:
        s = decode(e["token_id"])
        tokens.append(s)
        chosen.append(e["logprob"])
        top = e.get("top", [])
        tops.append({decode(i): lp for i, lp in top} if top is not None else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class Echo:
    """A completion choice's prompt as the response shows it: ``text`` echoed before the completion
    (``echo``; None without it), and the prompt's logprobs (``RequestOutput.prompt_logprobs``: None for the
    first token), shown in the choice's ``logprobs`` with ``echo`` and as vLLM's ``prompt_logprobs`` field
    when that was asked for (``field``)."""

    token_ids: list[int]
    text: str | None
    scores: list[dict[str, Any] | None] | None
    show_field: bool
    decode: Callable[[int], str]

    def logprobs(self) -> dict[str, Any]:
        """The prompt tokens in the legacy format (their first token has no logprob and no alternatives)."""
        scores = self.scores or [None] * len(self.token_ids)
        return completion_logprobs(self.decode, [e if e is not None else {"token_id": t, "logprob": None, "top": None}
                                                 for t, e in zip(self.token_ids, scores)], 0)

    def field(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}} for the token
        and its top alternatives (None for the first token)."""
        if not self.show_field or self.scores is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for e in self.scores:
            if e is None:
                out.append(None)
                continue
            item = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"],
                                         "decoded_token": self.decode(e["token_id"])}}
            for rank, (tok, lp) in enumerate(e["top"], start=1):
                item.setdefault(str(tok), {"logprob": lp, "rank": rank, "decoded_token": self.decode(tok)})
            out.append(item)
        return out


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects as one (the second's offsets already count the first's text)."""
    return {k: first[k] + second[k] for k in first}


def chat_logprobs(decode: Callable[[int], str], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def item(tok: int, lp: float) -> dict[str, Any]:
        s = decode(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(i, lp) for i, lp in e.get("top", [])]} for e in entries]}


def _is_union_tag(x: str) -> bool:
    return "[" in x or x in ("str", "int", "float", "bool", "dict", "list", "none")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One OpenAI-style message (and the top-level parameter) for pydantic's errors."""
    if not errors:
        return "invalid request", None
    # A validator's own message (ValueError) says the most; else the first error.
    e = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    raw = [str(x) for x in e.get("loc", ()) if x != "body"]
    path = ".".join(x for x in raw if not _is_union_tag(x))
    param = raw[0] if raw else None
    kind = e.get("type", "")
    if kind == "json_invalid":
        why = str((e.get("ctx") or {}).get("error", e.get("msg", "")))
        where = "" if not raw else f" character {raw[0]}" if why.endswith(" at") else f" at character {raw[0]}"
        return f"Invalid JSON body: {why}{where}", None
    if not raw and isinstance(e.get("input"), bytes | str):  # not parsed: no JSON content type
        return "Invalid JSON body: send a JSON object with Content-Type: application/json", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {path}", param
    if kind == "missing":
        return (f"Missing required parameter: '{path}'" if raw else "The request body is missing"), param
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    tags = [t for x in errors for t in [str(y) for y in x.get("loc", ())][:len(e.get("loc", ())) + 1]
            if _is_union_tag(t)]
    if kind != "value_error" and len(set(tags)) > 1:  # a union: one error per alternative
        expected = ", ".join(dict.fromkeys(tags))
        return f"Invalid value for '{path}': {e.get('input')!r} (expected one of: {expected})", param
    return (f"Invalid value for '{path}': {msg}" if raw else msg), param


def completion_response(rid: str, created: int, model: str, choices: list[tuple[int, CompletionOutput]],
                        usage: Usage, decode: Callable[[int], str] | None,
                        echoes: list[Echo | None] | None = None) -> dict[str, Any]:
    """The non-streamed /v1/completions body; ``decode`` is given when logprobs were asked for; ``echoes[i]``:
    choice i's prompt, echoed before its text (``echo``) and/or scored (``prompt_logprobs``)."""
    out = []
    for i, c in choices:
        echo = echoes[i] if echoes is not None else None
        text, lp = c.text, completion_logprobs(decode, c.logprobs or [], 0) if decode else None
        if echo is not None and echo.text is not None:
            text = echo.text + c.text
            if decode is not None:
                lp = join_logprobs(echo.logprobs(), completion_logprobs(decode, c.logprobs or [], len(echo.text)))
        out.append(CompletionChoice(index=i, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    logprobs=lp, prompt_logprobs=echo.field() if echo is not None else None))
    return CompletionResponse(id=rid, created=created, model=model, choices=out, usage=usage).model_dump()


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
