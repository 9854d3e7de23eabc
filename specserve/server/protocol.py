"""OpenAI-compatible request and response models (pydantic 2).

Requests reject unknown top-level fields (``extra="forbid"``) so that a typo is a 400, not a silently ignored
knob. Accepted but ignored OpenAI fields: ``user``, ``logit_bias`` (only when empty), ``best_of`` (only when
equal to ``n``), ``response_format`` (only ``{"type": "text"}``). Extensions (vLLM names): ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``skip_special_tokens`` and ours, ``speculative`` (default true).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specserve.sampling_params import SamplingParams

# Chat default for max_tokens when neither max_tokens nor max_completion_tokens is given: up to the end of
# the context (as vLLM) but at most this many, so that a forgotten limit does not hold a slot for minutes.
CHAT_DEFAULT_MAX_TOKENS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. include_obfuscation: harmless to ignore

    include_usage: bool = False


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

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (with SamplingParams' message naming the field) for out-of-range values."""
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise ValueError(f"best_of must equal n ({n}) when given, got {self.best_of}")
        kw: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "logprobs": logprobs}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                     "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

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

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only text content parts are supported, got type {v!r}")
        return v


class ChatMessage(BaseModel):
    # Extra message fields (tool_calls, ...) are ignored; only role, content and name reach the template.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise ValueError(f"response_format type {v.get('type')!r} is not supported (only 'text')")
        return v

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

    @staticmethod
    def merge(stats: list[dict[str, Any]]) -> SpeculativeUsage:
        drafts = sum(int(s.get("num_drafts", 0)) for s in stats)
        draft_tokens = sum(int(s.get("draft_tokens", 0)) for s in stats)
        accepted = sum(int(s.get("accepted_tokens", 0)) for s in stats)
        return SpeculativeUsage(
            num_drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
            acceptance_rate=round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
            mean_acceptance_length=round(1.0 + accepted / drafts, 4) if drafts else 1.0)


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


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": ..., "content": ...}; {} on the finishing chunk
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


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
