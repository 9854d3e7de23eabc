"""OpenAI-compatible HTTP server: FastAPI routes, SSE streaming, errors in OpenAI's shape, /metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``), ``GET /v1/models``,
``GET /health`` (never needs the API key), ``GET /metrics`` (Prometheus text), and from ``server/webui.py``
``GET /`` (the web UI, open) and ``GET /v1/specserve/stats`` (JSON counters). Every error is
``{"error": {"message", "type", "param", "code"}}``; once a stream has started, an error arrives as one
``data: {"error": ...}`` event followed by ``data: [DONE]``. A client that disconnects aborts its request
(the KV blocks are free before the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.config import EngineConfig
from specserve.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineStepError,
    QueueFullError,
    RequestStream,
    merge_streams,
)
from specserve.engine.engine import Engine
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server import protocol as proto
from specserve.server import webui
from specserve.server.metrics import RequestTimer, ServerMetrics
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    ErrorInfo,
    ErrorResponse,
)

log = logging.getLogger("specserve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.info = status, ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def as_api_error(e: BaseException, fields: set[str] | None = None) -> APIError:
    """Map engine and validation exceptions to HTTP errors (anything unexpected is a 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_exceeded", code="rate_limit_exceeded")
    if isinstance(e, EngineClosedError):
        return APIError(503, str(e), "server_error", code="service_unavailable")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", code="internal_error")
    if isinstance(e, ValueError):
        first = str(e).split(" ", 1)[0]
        return APIError(400, str(e), param=first if fields and first in fields else None)
    log.error("unexpected error", exc_info=(type(e), e, e.__traceback__))
    return APIError(500, f"internal server error ({type(e).__name__}: {e})", "server_error",
                    code="internal_error")


class _State:
    def __init__(self, engine: AsyncEngine, served_name: str, owns_engine: bool) -> None:
        self.engine = engine
        self.served_name = served_name
        self.owns_engine = owns_engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics(engine.get_metrics, served_name)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


class _AuthMiddleware:
    """``Authorization: Bearer <key>`` on /v1/*; everything else (/health, /metrics) stays open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def _sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _sse_response(events: AsyncIterator[str]) -> _SSEResponse:
    return _SSEResponse(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- running requests ----------------------------------------------------------------------------------------
async def _start(state: _State, base_id: str, prompts: list[str | list[int]], params: SamplingParams,
                 speculative: bool) -> list[RequestStream]:
    """Add one engine request per prompt; all or nothing (validation errors raise before any streaming)."""
    streams: list[RequestStream] = []
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            if isinstance(p, str):
                streams.append(await state.engine.add_request(rid, p, params, speculative=speculative))
            else:
                streams.append(await state.engine.add_request(rid, None, params, prompt_token_ids=p,
                                                              speculative=speculative))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


class _Run:
    """One HTTP request's engine requests: merged outputs, per-choice deltas, timing and usage."""

    def __init__(self, state: _State, rid: str, streams: list[RequestStream], params: SamplingParams,
                 include_usage: bool) -> None:
        self.state, self.id, self.streams, self.params = state, rid, streams, params
        self.include_usage = include_usage
        self.model = state.served_name
        self.created = int(time.time())
        self.timer: RequestTimer = state.metrics.timer()
        self.final: list[RequestOutput | None] = [None] * len(streams)
        self.deltas: dict[int, Delta] = {}
        self._num_tokens = 0
        self._hold = max((len(s) for s in params.stop or []), default=1) - 1  # see Delta
        self.spec_info: webui.SpecInfo | None = None  # stream_options.include_spec_info (server/webui.py)

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        async for i, out in merge_streams(self.streams):
            self.final[i] = out
            total = sum(len(c.token_ids) for o in self.final if o is not None for c in o.outputs)
            self.timer.on_tokens(total - self._num_tokens)
            self._num_tokens = total
            yield i, out

    def advance(self, index: int, comp: CompletionOutput) -> tuple[str, int, int] | None:
        """The choice's new text and token range, or None when there is nothing worth a chunk."""
        step = self.deltas.setdefault(index, Delta(self._hold)).advance(comp)
        if step is None or (not step[0] and not comp.finished and
                            (self.params.logprobs is None or step[1] == step[2])):
            return None
        return step

    def decode(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id], skip_special_tokens=False)

    def finish(self) -> None:
        reasons = [c.finish_reason for o in self.final if o is not None for c in o.outputs]
        reasons += [None] * (len(self.final) * self.params.n - len(reasons))
        self.timer.on_finish(reasons)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    def usage(self) -> proto.Usage:
        return proto.usage([o for o in self.final if o is not None])

    def choices(self) -> list[tuple[int, CompletionOutput]]:
        """(choice index, completion) in OpenAI's order: prompt-major, then n."""
        out = []
        for i, o in enumerate(self.final):
            for j in range(self.params.n):
                comp = o.outputs[j] if o is not None else CompletionOutput(j, "", [], "abort")
                out.append((i * self.params.n + j, comp))
        return out


async def _collect(run: _Run, raw: Request) -> None:
    try:
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for _ in outputs:
                if await raw.is_disconnected():
                    log.info("client gone: aborting %s", run.id)
                    break
    finally:
        run.abort()
        run.finish()


async def _events(run: _Run, chunks: AsyncGenerator[dict[str, Any], None], obj: str) -> AsyncIterator[str]:
    """SSE body: the route's chunks, the usage chunk when asked, [DONE]; errors as an error event."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if run.include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if run.include_usage:
            yield _sse({"id": run.id, "object": obj, "created": run.created, "model": run.model,
                        "choices": [], "usage": run.usage().model_dump()})
        yield _sse("[DONE]")
    except Exception as e:
        yield _sse(ErrorResponse(error=as_api_error(e).info).model_dump())
        yield _sse("[DONE]")
    finally:
        run.abort()  # NOTE: synchronous: safe while this generator is being cancelled by a disconnect
        run.finish()


async def _completion_chunks(run: _Run) -> AsyncGenerator[dict[str, Any], None]:
    n, want_lp = run.params.n, run.params.logprobs is not None
    async for i, out in run.outputs():
        for comp in out.outputs:
            idx = i * n + comp.index
            offset = run.deltas[idx].sent if idx in run.deltas else 0
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


async def _chat_chunks(run: _Run) -> AsyncGenerator[dict[str, Any], None]:
    want_lp = run.params.logprobs is not None

    def chunk(index: int, delta: dict[str, Any], lp: dict[str, Any] | None = None,
              finish: str | None = None) -> dict[str, Any]:
        return {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": run.model,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    for j in range(run.params.n):
        yield chunk(j, {"role": "assistant", "content": ""})
    async for _, out in run.outputs():
        for comp in out.outputs:
            step = run.advance(comp.index, comp)
            if step is None:
                continue
            text, t0, t1 = step
            lp = proto.chat_logprobs(run.decode, (comp.logprobs or [])[t0:t1]) if want_lp else None
            delta: dict[str, Any] = {"content": text} if text else {}
            if run.spec_info is not None:
                delta.update(run.spec_info.fields(comp.index, out.prompt_token_ids, comp, text,
                                                  run.deltas[comp.index].sent))
            yield chunk(comp.index, delta, lp, comp.finish_reason)


def _completion_response(run: _Run) -> dict[str, Any]:
    decode = run.decode if run.params.logprobs is not None else None
    return proto.completion_response(run.id, run.created, run.model, run.choices(), run.usage(), decode)


def _chat_response(run: _Run) -> dict[str, Any]:
    decode = run.decode if run.params.logprobs is not None else None
    return proto.chat_response(run.id, run.created, run.model, run.choices(), run.usage(), decode)


# -- app -----------------------------------------------------------------------------------------------------
def default_served_name(engine: Engine) -> str:
    path = engine.config.model.model
    if path:
        return path
    from specserve.model.loader import DEMO_FILE

    return os.path.basename(DEMO_FILE).split(".")[0]


def create_app(engine: EngineConfig | Engine | AsyncEngine, api_key: str | None = None,
               served_model_name: str | None = None, max_queue: int = 256) -> FastAPI:
    """An app over an engine config (loaded here), a built Engine (the app's AsyncEngine then owns its loop)
    or a shared AsyncEngine (``max_queue`` is then the AsyncEngine's own; the app neither starts a second
    loop nor shuts it down)."""
    owns = not isinstance(engine, AsyncEngine)
    if isinstance(engine, EngineConfig):
        engine = Engine(engine)
    aengine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine, max_queue=max_queue)
    state = _State(aengine, served_model_name or default_served_name(aengine.engine), owns)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        if state.owns_engine:
            await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.specserve = state
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key)
    _add_error_handlers(app)
    _add_routes(app, state)
    app.include_router(webui.make_router(aengine.get_metrics, state.served_name))  # GET /: the web UI
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = proto.validation_message(list(exc.errors()))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()


def _add_routes(app: FastAPI, state: _State) -> None:
    completion_fields = set(CompletionRequest.model_fields)
    chat_fields = set(ChatCompletionRequest.model_fields)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return APIError(503, "the engine loop is not running", "server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        root = state.engine.engine.config.model.model or state.served_name
        card = proto.ModelCard(id=state.served_name, root=root, max_model_len=state.max_model_len)
        return proto.ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        try:
            state.check_model(body.model)
            params = body.sampling_params(body.max_tokens, body.logprobs)
            rid = f"cmpl-{uuid.uuid4().hex}"
            streams = await _start(state, rid, body.prompts(), params, body.speculative is not False)
        except Exception as e:
            return as_api_error(e, completion_fields).response()
        run = _Run(state, rid, streams, params, body.include_usage)
        run.spec_info = webui.spec_info_for(body, state.tokenizer, params)
        if body.stream:
            return _sse_response(_events(run, _completion_chunks(run), "text_completion"))
        try:
            await _collect(run, raw)
            return JSONResponse(_completion_response(run))
        except Exception as e:
            return as_api_error(e).response()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        try:
            state.check_model(body.model)
            ids = state.tokenizer.apply_chat_template([m.template_dict() for m in body.messages])
            max_tokens = body.resolve_max_tokens(len(ids), state.max_model_len)
            params = body.sampling_params(max_tokens, body.num_logprobs())
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = await _start(state, rid, [ids], params, body.speculative is not False)
        except Exception as e:
            return as_api_error(e, chat_fields).response()
        run = _Run(state, rid, streams, params, body.include_usage)
        run.spec_info = webui.spec_info_for(body, state.tokenizer, params)
        if body.stream:
            return _sse_response(_events(run, _chat_chunks(run), "chat.completion.chunk"))
        try:
            await _collect(run, raw)
            return JSONResponse(_chat_response(run))
        except Exception as e:
            return as_api_error(e).response()


# -- entry point ---------------------------------------------------------------------------------------------
def run_server(model: str | None, engine_kwargs: dict[str, Any], args: Any) -> int:
    """`specserve serve`: load the engine (load errors surface as CLI errors), then serve until Ctrl-C."""
    import uvicorn

    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.INFO)
    engine = Engine(EngineConfig.from_kwargs(model, **engine_kwargs))
    app = create_app(engine, api_key=getattr(args, "api_key", None),
                     served_model_name=getattr(args, "served_model_name", None),
                     max_queue=getattr(args, "max_queue", 256))
    state: _State = app.state.specserve
    host, port = args.host, args.port
    print(f"specserve: serving {state.served_name!r} at http://{host}:{port}/v1 "
          f"(max_model_len={state.max_model_len})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
