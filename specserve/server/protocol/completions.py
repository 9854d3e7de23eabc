"""``/v1/completions``: the request, the response, and its legacy logprobs and echoed prompt."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from specserve.outputs import CompletionOutput
from specserve.sampling_params import SamplingParams
from specserve.server.protocol.common import _SamplingRequest
from specserve.server.protocol.usage import Usage

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
