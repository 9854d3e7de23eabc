"""What the HTTP server keeps for its lifetime: the engine, the served model name, metrics, limits, and the
draining flag of a graceful shutdown."""

from __future__ import annotations

import asyncio
import logging

from specserve.engine.async_engine import AsyncEngine, EngineClosedError
from specserve.server.errors import APIError
from specserve.server.metrics import ServerMetrics

log = logging.getLogger("specserve.server")


class ServerState:
    def __init__(self, engine: AsyncEngine, served_name: str, owns_engine: bool) -> None:
        self.engine = engine
        self.served_name = served_name
        self.owns_engine = owns_engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics(engine.get_metrics, served_name)
        self.max_prompt_tokens: int | None = None  # --max-prompt-tokens (None: only the context bounds it)
        self.draining = False  # set on SIGTERM: /v1 answers 503 while in-flight requests finish
        self.chat_template: str | None = getattr(self.tokenizer.hf_tokenizer, "chat_template", None)
        self.tool_parser = "hermes"  # --tool-call-parser, resolved (server/tools.py)

    def check_prompt_tokens(self, num_tokens: int, param: str) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise APIError(400, f"The prompt has {num_tokens} tokens, more than this server's limit of "
                                f"{self.max_prompt_tokens} (--max-prompt-tokens).", param=param)

    async def drain(self, grace: float) -> None:
        """Graceful shutdown: stop taking requests (503), let those in flight finish for up to ``grace``
        seconds, then end them with an error (a final error event when streaming, else a 503)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.engine.num_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_requests:
            log.warning("shutdown grace period (%gs) over: aborting %d request(s)", grace,
                        self.engine.num_requests)
            self.engine.abort_all(EngineClosedError(
                f"the server is shutting down: request aborted after the {grace:g} s grace period"))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
