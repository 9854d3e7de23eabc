"""Serving one HTTP request: engine requests per prompt, merged outputs, SSE chunks and final responses.

``api.py`` owns the app, routes and middleware; this module turns engine outputs into OpenAI's completion and
chat shapes (streamed or not). Disconnects abort at once: ``_SSEResponse`` cancels the body generator, whose
``finally`` aborts the engine requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.engine.async_engine import RequestStream, merge_streams
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server import protocol as proto
from specserve.server import webui
from specserve.server.errors import APIError, as_api_error
from specserve.server.metrics import RequestTimer
from specserve.server.protocol import Delta, ErrorResponse
from specserve.server.state import ServerState
from specserve.server.tools import ToolPlan, tool_plan, with_tools

log = logging.getLogger("specserve.server")


class _SSEResponse(StreamingResponse):
    """Streams while listening for the client's disconnect (which cancels the stream, so the generator's
    ``finally`` aborts the request at once, even while it waits for output), then always closes the body."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # uvicorn's ClientDisconnected
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()


def sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> _SSEResponse:
    return _SSEResponse(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- running requests ----------------------------------------------------------------------------------------
async def start(state: ServerState, base_id: str, prompts: list[str | list[int]], params: SamplingParams,
                 speculative: bool) -> list[RequestStream]:
    """Add one engine request per prompt; all or nothing (validation errors raise before any streaming)."""
    streams: list[RequestStream] = []
    if len(prompts) > state.engine.max_queue:  # could never be admitted at once: not a 429 "retry later"
        raise APIError(400, f"Too many prompts in one request ({len(prompts)}); this server takes at most "
                            f"{state.engine.max_queue} (--max-queue).", param="prompt")
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            if isinstance(p, str) and state.max_prompt_tokens is not None:  # count here to apply the limit
                ids = state.tokenizer.encode(p)
                state.check_prompt_tokens(len(ids), "prompt")
                streams.append(await state.engine.add_request(rid, p, params, prompt_token_ids=ids,
                                                              speculative=speculative))
            elif isinstance(p, str):
                streams.append(await state.engine.add_request(rid, p, params, speculative=speculative))
            else:
                state.check_prompt_tokens(len(p), "prompt")
                streams.append(await state.engine.add_request(rid, None, params, prompt_token_ids=p,
                                                              speculative=speculative))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def start_chat(state: ServerState, body: proto.ChatCompletionRequest, rid: str) -> Run:
    """A chat request's run (``/v1/chat/completions``, and ``/v1/responses`` through it): the conversation
    rendered with the chat template (tools, template variables), the tool choice's grammar, the engine request
    started. Raises APIError / ValueError for bad input (before anything is streamed)."""
    state.check_model(body.model)
    plan = tool_plan(body, state.tool_parser)
    if ignored := body.ignored_fields():
        log.debug("chat completion: ignoring %s (no meaning on this server)", ", ".join(ignored))
    messages = with_tools(state.chat_template, [m.template_dict() for m in body.messages], plan)
    ids = state.tokenizer.apply_chat_template(messages, body.add_generation_prompt, plan.template_tools,
                                              body.template_kwargs())
    state.check_prompt_tokens(len(ids), "messages")
    max_tokens = body.resolve_max_tokens(len(ids), state.max_model_len)
    params = body.sampling_params(max_tokens, body.num_logprobs())
    constraint = plan.constraint(params.structured_outputs, body.constraint_param() == "response_format")
    if constraint is not params.structured_outputs:
        params = dataclasses.replace(params, structured_outputs=constraint)
    streams = await start(state, rid, [ids], params, body.speculative is not False)
    return Run(state, rid, streams, params, body.include_usage,
               spec_info=webui.spec_info_for(body, state.tokenizer, params), tool_plan=plan,
               cut=plan.repeat_cut if plan.active and plan.mode in ("auto", "required") else None,
               metadata=body.metadata, legacy_functions=body.functions is not None,
               prompt_field=body.prompt_logprobs is not None)  # non-streamed responses carry prompt logprobs


class Run:
    """One HTTP request's engine requests: merged outputs, per-choice deltas, timing and usage."""

    def __init__(self, state: ServerState, rid: str, streams: list[RequestStream], params: SamplingParams,
                 include_usage: bool, *, spec_info: webui.SpecInfo | None = None, tool_plan: ToolPlan | None = None,
                 cut: Callable[[str], int | None] | None = None, metadata: dict[str, str] | None = None,
                 legacy_functions: bool = False, echo: bool = False, prompt_field: bool = False,
                 prompt_only: bool = False) -> None:
        self.state, self.id, self.streams, self.params = state, rid, streams, params
        self.include_usage = include_usage
        self.model = state.served_name
        self.created = int(time.time())
        self.timer: RequestTimer = state.metrics.timer()
        self.final: list[RequestOutput | None] = [None] * len(streams)
        self.deltas: dict[int, Delta] = {}
        self._num_tokens = 0
        self._hold = max((len(s) for s in params.stop or []), default=1) - 1  # see Delta
        self.spec_info = spec_info  # stream_options.include_spec_info (server/webui.py)
        self.tool_plan = tool_plan  # chat with tools (server/tools.py)
        # Where to end a choice's text early (None: never), e.g. before a repeated tool call; such a choice
        # finishes with "stop" there, and the engine request is aborted once every choice has ended.
        self.cut = cut
        self._cuts: dict[tuple[int, int], CompletionOutput] = {}
        self.metadata = metadata  # OpenAI's request metadata, echoed in the response body
        # the request used the deprecated ``functions``: answer with function_call too
        self.legacy_functions = legacy_functions
        # completions: ``echo`` (the prompt before each choice's text) and vLLM's ``prompt_logprobs`` field;
        # ``prompt_only``: ``echo`` with ``max_tokens`` 0 (the engine samples one token, which is not shown)
        self.echo = echo
        self.prompt_field = prompt_field
        self.prompt_only = prompt_only

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        merged = cast(AsyncGenerator[tuple[int, RequestOutput], None], merge_streams(self.streams))
        async with contextlib.aclosing(merged):
            async for i, out in merged:
                if self.cut is not None:
                    out = self._cut(i, out)
                self.final[i] = out
                total = sum(len(c.token_ids) for o in self.final if o is not None for c in o.outputs)
                self.timer.on_tokens(total - self._num_tokens)
                self._num_tokens = total
                yield i, out
                if out.finished and not self.streams[i].finished:  # every choice was cut: stop computing
                    self.streams[i].abort()
                    if all(s.finished for s in self.streams):
                        return

    def _cut(self, i: int, out: RequestOutput) -> RequestOutput:
        """``out`` with its choices ended where ``self.cut`` says (kept ended in later outputs)."""
        assert self.cut is not None
        comps = []
        for comp in out.outputs:
            done = self._cuts.get((i, comp.index))
            if done is None and not comp.finished and (at := self.cut(comp.text)) is not None:
                done = self._cuts[(i, comp.index)] = dataclasses.replace(
                    comp, text=comp.text[:at], finish_reason="stop", stop_reason=None)
            comps.append(done if done is not None else comp)
        if not self._cuts:
            return out
        return dataclasses.replace(out, outputs=comps, finished=all(c.finished for c in comps))

    def advance(self, index: int, comp: CompletionOutput) -> tuple[str, int, int] | None:
        """The choice's new text and token range, or None when there is nothing worth a chunk."""
        step = self.deltas.setdefault(index, Delta(self._hold)).advance(comp)
        if step is None or (not step[0] and not comp.finished and
                            (self.params.logprobs is None or step[1] == step[2])):
            return None
        return step

    def decode(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id], skip_special_tokens=False)

    def echo_of(self, out: RequestOutput | None) -> proto.Echo | None:
        """How a completion choice of this prompt shows it (``echo`` / ``prompt_logprobs``; None: not at all)."""
        if out is None or not (self.echo or self.prompt_field):
            return None
        text = None
        if self.echo:
            text = out.prompt if out.prompt is not None else \
                self.state.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        return proto.Echo(out.prompt_token_ids, text, out.prompt_logprobs, self.prompt_field, self.decode)

    def finish(self) -> None:
        reasons = [c.finish_reason for o in self.final if o is not None for c in o.outputs]
        reasons += [None] * (len(self.final) * self.params.n - len(reasons))
        self.timer.on_finish(reasons)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    def usage(self) -> proto.Usage:
        u = proto.usage([o for o in self.final if o is not None])
        if self.prompt_only:
            u.completion_tokens, u.total_tokens = 0, u.prompt_tokens
        return u

    def choices(self) -> list[tuple[int, CompletionOutput]]:
        """(choice index, completion) in OpenAI's order: prompt-major, then n."""
        out = []
        for i, o in enumerate(self.final):
            for j in range(self.params.n):
                comp = o.outputs[j] if o is not None else CompletionOutput(j, "", [], "abort")
                if self.prompt_only and comp.finish_reason != "abort":
                    comp = CompletionOutput(j, "", [], "length", logprobs=[])
                out.append((i * self.params.n + j, comp))
        return out


async def collect(run: Run, raw: Request) -> None:
    try:
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for _ in outputs:
                if await raw.is_disconnected():
                    log.info("client gone: aborting %s", run.id)
                    break
    finally:
        run.abort()
        run.finish()


async def events(run: Run, chunks: AsyncGenerator[dict[str, Any], None], obj: str) -> AsyncIterator[str]:
    """SSE body: the route's chunks, the usage chunk when asked, [DONE]; errors as an error event."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if run.include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if run.include_usage:
            yield sse({"id": run.id, "object": obj, "created": run.created, "model": run.model,
                        "choices": [], "usage": run.usage().model_dump()})
        yield sse("[DONE]")
    except Exception as e:
        yield sse(ErrorResponse(error=as_api_error(e).info).model_dump())
        yield sse("[DONE]")
    finally:
        run.abort()  # NOTE: synchronous: safe while this generator is being cancelled by a disconnect
        run.finish()


async def completion_chunks(run: Run) -> AsyncGenerator[dict[str, Any], None]:
    n, want_lp = run.params.n, run.params.logprobs is not None
    echoed: dict[int, int] = {}  # choice -> characters of echoed prompt (sent in its first chunk)
    async for i, out in run.outputs():
        for comp in out.outputs:
            idx = i * n + comp.index
            echo = run.echo_of(out) if idx not in echoed else None
            if echo is not None:  # the prompt first, in a chunk of its own
                echoed[idx] = len(echo.text or "")
                yield {"id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
                       "choices": [{"index": idx, "text": echo.text or "",
                                    "logprobs": echo.logprobs() if want_lp and echo.text is not None else None,
                                    "finish_reason": None, "stop_reason": None,
                                    **({"prompt_logprobs": echo.field()} if echo.show_field else {})}]}
            if run.prompt_only:  # the prompt was the whole answer
                if comp.finished:
                    yield {"id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
                           "choices": [{"index": idx, "text": "", "logprobs": None, "finish_reason": "length",
                                        "stop_reason": None}]}
                continue
            offset = (run.deltas[idx].sent if idx in run.deltas else 0) + echoed.get(idx, 0)
            step = run.advance(idx, comp)
            if step is None:
                continue
            text, t0, t1 = step
            entries = (comp.logprobs or [])[t0:t1]
            lp = proto.completion_logprobs(run.decode, entries, offset) if want_lp else None
            choice = {"index": idx, "text": text, "logprobs": lp,
                      "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
            if run.spec_info is not None:
                choice.update(run.spec_info.fields(idx, out.prompt_token_ids, comp, text, run.deltas[idx].sent))
            yield {"id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
                   "choices": [choice]}


async def chat_chunks(run: Run) -> AsyncGenerator[dict[str, Any], None]:
    want_lp = run.params.logprobs is not None

    def chunk(index: int, delta: dict[str, Any], lp: dict[str, Any] | None = None,
              finish: str | None = None) -> dict[str, Any]:
        return {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": run.model,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    plan = run.tool_plan if run.tool_plan is not None and run.tool_plan.active else None
    content_sent: dict[int, int] = {}  # with tools: characters of content streamed per choice
    for j in range(run.params.n):
        yield chunk(j, {"role": "assistant", "content": ""})
    async for _, out in run.outputs():
        for comp in out.outputs:
            step = run.advance(comp.index, comp)
            if step is None:
                continue
            text, t0, t1 = step
            lp = proto.chat_logprobs(run.decode, (comp.logprobs or [])[t0:t1]) if want_lp else None
            if plan is not None:  # content and tool calls as they come
                deltas, num_calls = _tool_deltas(plan, comp, run.deltas[comp.index].sent, content_sent)
                for d in deltas:
                    yield chunk(comp.index, _with_function_call(d) if run.legacy_functions else d, lp, None)
                    lp = None
                if comp.finished:
                    finish = "tool_calls" if num_calls and comp.finish_reason == "stop" else comp.finish_reason
                    if finish == "tool_calls" and run.legacy_functions:
                        finish = "function_call"
                    yield chunk(comp.index, {}, lp, finish)
                continue
            delta: dict[str, Any] = {"content": text} if text else {}
            if run.spec_info is not None:
                delta.update(run.spec_info.fields(comp.index, out.prompt_token_ids, comp, text,
                                                  run.deltas[comp.index].sent))
            yield chunk(comp.index, delta, lp, comp.finish_reason)


def _tool_deltas(plan: ToolPlan, comp: CompletionOutput, released: int, sent: dict[int, int]
                 ) -> tuple[list[dict[str, Any]], int]:
    """Deltas for a choice of a request with tools, and its number of tool calls so far: content that cannot be
    a tool call (``sent``: characters streamed per choice) as it comes, each call whole once it is complete
    (``ToolPlan.stream_calls``), and at the end the rest of both (a call cut by ``max_tokens`` is dropped)."""
    done = sent.get(comp.index, 0)
    out: list[dict[str, Any]] = []
    if not comp.finished:
        text = comp.text[:released]
        content = plan.stream_content(text)
        sent[comp.index] = max(done, len(content))
        if len(content) > done:
            out.append({"content": content[done:]})
        if pieces := plan.stream_calls(comp.index, text):
            out.append({"tool_calls": pieces})
        return out, plan.num_streamed(comp.index)
    final, calls = plan.parse(comp.text, comp.finish_reason == "length")
    if final and len(final) > done and final.startswith(comp.text[:done]):
        out.append({"content": final[done:]})
    if calls and (pieces := plan.finish_calls(comp.index, calls)):
        out.append({"tool_calls": pieces})
    return out, len(calls)


def completion_response(run: Run) -> dict[str, Any]:
    decode = run.decode if run.params.logprobs is not None else None
    echoes = [run.echo_of(o) for o in run.final for _ in range(run.params.n)]
    body = proto.completion_response(run.id, run.created, run.model, run.choices(), run.usage(), decode, echoes)
    return body if run.metadata is None else {**body, "metadata": run.metadata}


def _with_function_call(message: dict[str, Any]) -> dict[str, Any]:
    """A message or delta as the deprecated function-calling API also shows it: its first call as
    ``function_call`` (``{name, arguments}``)."""
    first = next((c for c in message.get("tool_calls") or [] if c.get("index", 0) == 0), None)
    if first is None:
        return message
    fn = first.get("function") or {}
    return {**message, "function_call": {k: fn[k] for k in ("name", "arguments") if k in fn}}


def chat_response(run: Run) -> dict[str, Any]:
    decode = run.decode if run.params.logprobs is not None else None
    plan = run.tool_plan
    parse = None
    if plan is not None and plan.active:
        def parse(text: str, truncated: bool) -> tuple[str | None, list[dict[str, Any]]]:
            content, calls = plan.parse(text, truncated)
            return content, [c.as_dict() for c in calls]
    body = proto.chat_response(run.id, run.created, run.model, run.choices(), run.usage(), decode, parse,
                               run.echo_of(run.final[0]) if run.final else None)
    if run.legacy_functions:
        for choice in body["choices"]:
            choice["message"] = _with_function_call(choice["message"])
            if choice["finish_reason"] == "tool_calls":
                choice["finish_reason"] = "function_call"
    return body if run.metadata is None else {**body, "metadata": run.metadata}
