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
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import specserve
from specserve.config import EngineConfig
from specserve.engine.async_engine import (
    AsyncEngine,
    build_engine,
)
from specserve.engine.engine import Engine
from specserve.server import embeddings, responses, webui
from specserve.server import protocol as proto
from specserve.server.errors import APIError, as_api_error
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from specserve.server.responses_items import ResponseStore
from specserve.server.serving import (
    Run,
    chat_chunks,
    chat_response,
    collect,
    completion_chunks,
    completion_response,
    events,
    sse_response,
    start,
    start_chat,
)
from specserve.server.state import ServerState
from specserve.server.tools import PARSERS, detect_parser

log = logging.getLogger("specserve.server")


# vLLM's tokenizer routes (outside /v1, as there), behind the API key like /v1/*.
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


class _AuthMiddleware:
    """``Authorization: Bearer <key>`` on /v1/* and the tokenizer routes; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in TOKENIZER_ROUTES) \
                and scope["method"] != "OPTIONS":
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


DEFAULT_MAX_REQUEST_BYTES = 1 << 20


class _GuardMiddleware:
    """Before any route runs: 503 on /v1 while draining for shutdown; request bodies are read here, up to
    ``max_bytes`` (400 past it, before any JSON parsing) and must be UTF-8 when declared JSON (400)."""

    def __init__(self, app: ASGIApp, state: ServerState, max_bytes: int) -> None:
        self.app, self.state, self.max_bytes = app, state, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining and scope["path"].startswith("/v1"):
            err = APIError(503, "The server is shutting down; retry the request elsewhere or later.",
                           "server_error", code="service_unavailable")
            await err.response()(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        body, more = bytearray(), not too_large
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            too_large = len(body) > self.max_bytes
            if too_large:
                break
        if too_large:
            size = f"{declared} bytes" if declared.isdigit() else f"more than {self.max_bytes} bytes"
            err = APIError(400, f"Request body too large ({size}); the limit is {self.max_bytes} bytes "
                                f"(--max-request-bytes).", code="request_too_large")
            await err.response()(scope, receive, send)
            return
        if "json" in headers.get("content-type", ""):
            try:
                bytes(body).decode("utf-8")
            except UnicodeDecodeError as e:
                err = APIError(400, f"Invalid JSON body: not valid UTF-8 ({e.reason} at byte {e.start}).")
                await err.response()(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then the real channel: disconnects still reach the app

        await self.app(scope, replay, send)


# -- app -----------------------------------------------------------------------------------------------------
def default_served_name(engine: Engine) -> str:
    path = engine.config.model.model_id or engine.config.model.model  # a hub id as the user typed it
    if path:
        return path
    from specserve.model.checkpoint.loader import DEMO_FILE

    return os.path.basename(DEMO_FILE).split(".")[0]


def create_app(engine: EngineConfig | Engine | AsyncEngine, api_key: str | None = None,
               served_model_name: str | None = None, max_queue: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_prompt_tokens: int | None = None, tool_call_parser: str = "auto",
               pooler_config: str | dict[str, Any] | None = None) -> FastAPI:
    """An app over an engine config (loaded here), a built Engine (the app's AsyncEngine then owns its loop)
    or a shared AsyncEngine (``max_queue`` is then the AsyncEngine's own; the app neither starts a second
    loop nor shuts it down)."""
    owns = not isinstance(engine, AsyncEngine)
    if isinstance(engine, EngineConfig):
        engine = build_engine(engine)
    aengine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine, max_queue=max_queue)
    state = ServerState(aengine, served_model_name or default_served_name(aengine.engine), owns)
    if max_request_bytes < 1 or (max_prompt_tokens is not None and max_prompt_tokens < 1):
        raise ValueError("max_request_bytes and max_prompt_tokens must be >= 1")
    state.max_prompt_tokens = max_prompt_tokens
    if tool_call_parser not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {PARSERS}, got {tool_call_parser!r}")
    state.tool_parser = detect_parser(state.chat_template) if tool_call_parser == "auto" else tool_call_parser

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        if state.owns_engine:
            await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.specserve = state
    app.add_middleware(_GuardMiddleware, state=state, max_bytes=max_request_bytes)  # inside auth
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key)
    _add_error_handlers(app)
    _add_routes(app, state)
    app.include_router(webui.make_router(aengine.get_metrics, state.served_name))  # GET /: the web UI
    app.include_router(embeddings.make_router(state, pooler_config))  # POST /v1/embeddings
    app.include_router(responses.make_router(state, ResponseStore()))  # /v1/responses
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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    _add_status_routes(app, state)
    _add_tokenizer_routes(app, state)
    _add_model_routes(app, state)
    _add_generation_routes(app, state)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /version and /metrics."""

    @app.get("/health")
    async def health() -> Response:
        if state.engine.fatal is not None:
            return APIError(503, f"the engine failed: {state.engine.fatal}", "server_error").response()
        if not state.engine.is_running:
            return APIError(503, "the engine loop is not running", "server_error").response()
        if state.draining:
            return APIError(503, "the server is shutting down", "server_error",
                            code="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": specserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info."""
    tokenize_fields = set(TokenizeRequest.model_fields)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        try:
            state.check_model(body.model)
            tok = state.tokenizer
            if body.messages is not None:
                ids = tok.apply_chat_template([m.template_dict() for m in body.messages], body.add_generation_prompt)
            else:
                ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        except Exception as e:
            return as_api_error(e, tokenize_fields).response()
        strs = [tok.decode([i], skip_special_tokens=False) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        vocab = state.tokenizer.vocab_size
        try:
            state.check_model(body.model)
            if any(t < 0 or t >= vocab for t in body.tokens):
                raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        except Exception as e:
            return as_api_error(e).response()
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        hf = state.tokenizer.hf_tokenizer
        return {"tokenizer_class": type(hf).__name__, "bos_token": hf.bos_token, "eos_token": hf.eos_token,
                "pad_token": hf.pad_token, "unk_token": hf.unk_token, "chat_template": state.chat_template,
                "model_max_length": state.max_model_len, "vocab_size": state.tokenizer.vocab_size}


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/models and /v1/models/{id}: the served model."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        root = state.engine.engine.config.model.model or state.served_name
        card = proto.ModelCard(id=state.served_name, root=root, max_model_len=state.max_model_len)
        return proto.ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != state.served_name:
            return APIError(404, f"The model `{model_id}` does not exist.", param="model",
                            code="model_not_found").response()
        return JSONResponse(proto.ModelCard(id=state.served_name, max_model_len=state.max_model_len,
                                            root=state.engine.engine.config.model.model or state.served_name
                                            ).model_dump())


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/completions and /v1/chat/completions."""
    completion_fields = set(CompletionRequest.model_fields)
    chat_fields = set(ChatCompletionRequest.model_fields)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        try:
            state.check_model(body.model)
            if ignored := body.ignored_fields():
                log.debug("completion: ignoring %s (no meaning on this server)", ", ".join(ignored))
            prompt_only = bool(body.echo) and body.max_tokens == 0  # the prompt's logprobs, nothing generated
            params = body.sampling_params(1 if prompt_only else body.max_tokens, body.logprobs)
            rid = f"cmpl-{uuid.uuid4().hex}"
            streams = await start(state, rid, body.prompts(), params, body.speculative is not False)
        except Exception as e:
            return as_api_error(e, completion_fields, body.constraint_param()).response()
        run = Run(state, rid, streams, params, body.include_usage,
                  spec_info=webui.spec_info_for(body, state.tokenizer, params), metadata=body.metadata,
                  echo=bool(body.echo), prompt_field=body.prompt_logprobs is not None, prompt_only=prompt_only)
        if body.stream:
            return sse_response(events(run, completion_chunks(run), "text_completion"))
        try:
            await collect(run, raw)
            return JSONResponse(completion_response(run))
        except Exception as e:
            return as_api_error(e).response()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        try:
            run = await start_chat(state, body, f"chatcmpl-{uuid.uuid4().hex}")
        except Exception as e:
            return as_api_error(e, chat_fields, body.constraint_param() or "tools").response()
        if body.stream:
            return sse_response(events(run, chat_chunks(run), "chat.completion.chunk"))
        try:
            await collect(run, raw)
            return JSONResponse(chat_response(run))
        except Exception as e:
            return as_api_error(e).response()


# -- entry point ---------------------------------------------------------------------------------------------
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# After a fatal engine failure (a lost tensor-parallel rank) the server answers 503 for this long, so that
# balancers and clients polling /health see it, then exits with status 1.
FATAL_EXIT_DELAY_S = 2.0


def run_server(model: str | None, engine_kwargs: dict[str, Any], args: Any) -> int:
    """`specserve serve`: load the engine (load errors surface as CLI errors), then serve until SIGTERM or
    Ctrl-C (graceful: see `_GracefulServer`)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.INFO)
    engine = build_engine(EngineConfig.from_kwargs(model, **engine_kwargs))
    app = create_app(engine, api_key=getattr(args, "api_key", None),
                     served_model_name=getattr(args, "served_model_name", None),
                     max_queue=getattr(args, "max_queue", 256),
                     max_request_bytes=getattr(args, "max_request_bytes", None) or DEFAULT_MAX_REQUEST_BYTES,
                     max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
                     tool_call_parser=getattr(args, "tool_call_parser", None) or "auto",
                     pooler_config=getattr(args, "pooler_config", None))
    state: ServerState = app.state.specserve
    host, port = args.host, args.port
    print(f"specserve: serving {state.served_name!r} at http://{host}:{port}/v1 "
          f"(max_model_len={state.max_model_len})", file=sys.stderr, flush=True)
    grace = getattr(args, "shutdown_grace_seconds", None)
    grace = DEFAULT_SHUTDOWN_GRACE_S if grace is None else float(grace)
    if grace < 0:
        raise ValueError(f"--shutdown-grace-seconds must be >= 0, got {grace}")
    server = _GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="info",
                                            timeout_graceful_shutdown=int(grace) + 10), state, grace)
    server.run()
    if not server.started:
        return 1  # uvicorn logged why (e.g. the port is in use)
    if state.engine.fatal is not None:
        print(f"specserve: exiting: {state.engine.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM / SIGINT, /v1 answers 503 at once, requests in flight get ``grace`` seconds
    to finish (then an error event / a 503), uvicorn closes the listening socket and waits for the responses,
    and the lifespan shutdown stops the engine loop thread. SIGTERM exits 0 (uvicorn would re-raise it after
    its graceful shutdown, so the process would die of it); a second SIGINT forces the exit."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.state, self.grace = state, grace
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True  # NOTE: not recorded in _captured_signals: no re-raise, exit code 0
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        fatal = self.state.engine.fatal
        if fatal is not None and not self.should_exit:  # the engine cannot step again: exit non-zero, soon
            now = time.monotonic()
            self._fatal_at = getattr(self, "_fatal_at", None) or now
            if now - self._fatal_at >= FATAL_EXIT_DELAY_S:  # /health answers 503 meanwhile
                self.should_exit = True
        should_exit: bool = await super().on_tick(counter)
        if should_exit and self._drain is None:
            self._drain = asyncio.create_task(self.state.drain(self.grace))
        return should_exit

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._drain is not None and not self._drain.done():
                self._drain.cancel()
