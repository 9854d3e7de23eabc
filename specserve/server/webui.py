"""The built-in web page (``GET /``) and the streaming extension it needs to colour speculated tokens.

The page is plain HTML/CSS/JS in ``specserve/server/static/`` (no build step, no CDN): it chats through the
server's own ``/v1/chat/completions`` stream and reads ``/v1/specserve/stats`` for the since-start panel.

Extension (opt in; OpenAI clients that do not ask get standard chunks): a streamed request with
``stream_options: {"include_spec_info": true}`` gets, in every chunk after the chat role chunk,

    chat:        choices[i].delta.spec_tokens   = ["text", ...]   choices[i].delta.spec_accepted = [bool, ...]
    completions: choices[i].spec_tokens         = ["text", ...]   choices[i].spec_accepted       = [bool, ...]

two lists of equal length: one text piece per generated token (in order) and whether that token was an
accepted draft token (true) or produced by the target (false: a plain step, the token resampled after a
rejection, or the bonus token after a full accept). The pieces concatenate exactly to the chunk's
``content`` / ``text``. A piece is the text the token added to the output (the detokenizer's view: a
character split over several byte-level tokens belongs to the token that completes it, so a token may have
an empty piece, as may EOS). Tokens are never dropped: over a whole stream each generated token appears once,
except that a token whose text is cut by the chunk boundary (the server holds back the last characters while
they may still become a stop string) appears in both chunks with its part of the text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from specserve.outputs import CompletionOutput
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

_STATIC = {"webui.css": "text/css; charset=utf-8", "webui.js": "text/javascript; charset=utf-8"}


def _static(name: str) -> str:
    return resources.files("specserve.server").joinpath("static").joinpath(name).read_text(encoding="utf-8")


def make_router(snapshot: Callable[[], dict[str, Any]], model_name: str) -> APIRouter:
    """``GET /`` (the page), ``GET /static/{name}`` (its CSS and JS) and ``GET /v1/specserve/stats``."""
    router = APIRouter()
    started = time.time()

    @router.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(_static("index.html"), headers={"Cache-Control": "no-cache"})

    @router.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in _STATIC:
            return JSONResponse({"error": {"message": f"no static file {name!r}", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=404)
        return Response(_static(name), media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})

    @router.get("/v1/specserve/stats")
    async def stats() -> dict[str, Any]:
        return stats_json(snapshot(), model_name, started)

    return router


def stats_json(m: dict[str, Any], model_name: str, started: float) -> dict[str, Any]:
    """Since-start engine counters (the same numbers as /metrics) with the derived speculation rates."""
    spec_stats = m.get("speculative") or {}
    drafts, proposed, accepted = (int(spec_stats.get(k, 0)) for k in ("num_drafts", "draft_tokens", "accepted_tokens"))
    return {
        "object": "specserve.stats",
        "model": model_name,
        "uptime_s": round(time.time() - started, 3),
        "num_requests_running": int(m.get("num_running", 0)),
        "num_requests_waiting": int(m.get("num_waiting", 0)),
        "kv_cache_usage": float(m.get("kv_usage", 0.0)),
        "prompt_tokens": int(m.get("num_prompt_tokens", 0)),
        "generation_tokens": int(m.get("num_generated_tokens", 0)),
        "speculative": {
            "k": int(m.get("speculative_k", 0)),
            "num_drafts": drafts,
            "draft_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
            "mean_acceptance_length": round(1.0 + accepted / drafts, 4) if drafts else 1.0,
        },
    }


class _Aligner:
    """One choice: where each generated token's text starts and ends in the completion's text.

    It re-runs the engine's incremental detokenization (same prompt context, same special-token setting, so
    the same text) and records the text length after each token."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.detok: IncrementalDetokenizer = tokenizer.incremental(prompt_ids, skip_special_tokens)
        self.ends: list[int] = []  # text length after token j
        self.next = 0  # first token not yet completely sent
        self.flushed = False

    def pieces(self, comp: CompletionOutput, a: int, b: int) -> tuple[list[str], list[bool]]:
        """The tokens covering the characters ``comp.text[a:b]`` just sent (and zero-width ones before b)."""
        for tok in comp.token_ids[len(self.ends):]:
            self.detok.add(tok)
            self.ends.append(len(self.detok.text))
        if comp.finished and self.ends and not self.flushed:
            self.flushed = True
            if not isinstance(comp.stop_reason, str):  # as the engine: flush unless a stop string cut it
                self.detok.flush()
            self.ends[-1] = len(comp.text)  # the last token owns any tail (and nothing past a cut)
        n = len(comp.text)
        texts: list[str] = []
        flags: list[bool] = []
        j = self.next
        while j < len(self.ends):
            start = min(self.ends[j - 1] if j else 0, n)
            end = min(self.ends[j], n)
            if end > b:  # the token goes on past what was sent: its part now, the rest next time
                if start < b:
                    texts.append(comp.text[max(start, a):b])
                    flags.append(bool(comp.spec_accepted[j]) if j < len(comp.spec_accepted) else False)
                break
            texts.append(comp.text[max(start, a):end] if end > a else "")
            flags.append(bool(comp.spec_accepted[j]) if j < len(comp.spec_accepted) else False)
            j += 1
        self.next = j
        return texts, flags


class SpecInfo:
    """Per HTTP request: builds the ``spec_tokens`` / ``spec_accepted`` fields for each streamed chunk."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self._choices: dict[int, _Aligner] = {}

    def fields(self, index: int, prompt_ids: list[int], comp: CompletionOutput, text: str,
               sent: int) -> dict[str, Any]:
        """For choice ``index`` whose chunk carries ``text``, ending at character ``sent`` of ``comp.text``."""
        al = self._choices.get(index)
        if al is None:
            al = self._choices[index] = _Aligner(self.tokenizer, prompt_ids, self.skip)
        texts, flags = al.pieces(comp, sent - len(text), sent)
        return {"spec_tokens": texts, "spec_accepted": flags}


def spec_info_for(body: Any, tokenizer: Tokenizer, params: Any) -> SpecInfo | None:
    """The request's SpecInfo when it streams and asked for ``stream_options.include_spec_info``."""
    opts = getattr(body, "stream_options", None)
    if not (getattr(body, "stream", False) and opts is not None and getattr(opts, "include_spec_info", False)):
        return None
    return SpecInfo(tokenizer, params.skip_special_tokens)
