"""``POST /v1/embeddings`` for the served (generative) model, as vLLM serves it with ``--pooler-config``.

An input's embedding is the model's final hidden state (after the final norm) pooled over its tokens: the last
token's (``LAST``, vLLM's default for decoder models), the first token's (``CLS``) or their mean (``MEAN``),
L2-normalised unless ``"normalize": false``. ``Engine.embed`` computes it in one target forward between
engine steps, over KV blocks taken from the free pool and given back at once: generation requests in flight
keep their blocks and go on after it. While too few blocks are free it waits (then a 503). Responses are
OpenAI's (``encoding_format`` ``float`` or ``base64``: little-endian float32, which the openai client asks
for by default) with ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator

from specserve.engine.engine import Engine
from specserve.server.errors import APIError, as_api_error
from specserve.server.protocol import _Strict
from specserve.server.state import ServerState

POOLING_TYPES = ("LAST", "MEAN", "CLS")
MAX_INPUTS = 2048  # OpenAI's limit per request
# How long an embedding request waits for free KV blocks while generation requests hold them.
KV_WAIT_S = 30.0


def parse_pooler_config(text: str | dict[str, Any] | None) -> tuple[str, bool]:
    """vLLM's ``--pooler-config`` (JSON: ``pooling_type``, ``normalize``) -> (pooling type, normalize);
    ValueError naming the problem."""
    cfg = json.loads(text) if isinstance(text, str) else dict(text or {})
    if not isinstance(cfg, dict):
        raise ValueError("--pooler-config must be a JSON object, e.g. '{\"pooling_type\": \"MEAN\"}'")
    unknown = sorted(set(cfg) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unsupported key {unknown[0]!r} (supported: pooling_type, normalize)")
    kind = str(cfg.get("pooling_type", "LAST")).upper()
    if kind not in POOLING_TYPES:
        raise ValueError(f"--pooler-config: pooling_type must be one of {POOLING_TYPES}, got {kind!r}")
    return kind, bool(cfg.get("normalize", True))


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's

    @field_validator("dimensions")
    @classmethod
    def _full_size_only(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("this model's embeddings have one size (its hidden size); leave dimensions out")
        return v

    def inputs(self) -> list[str | list[int]]:
        x: Any = self.input
        items: list[str | list[int]] = [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)
        if not items or any(len(i) == 0 for i in items):
            raise ValueError("input must not be empty (nor hold an empty string or token list)")
        if len(items) > MAX_INPUTS:
            raise ValueError(f"input has {len(items)} items; at most {MAX_INPUTS} per request")
        return items


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _normalise(vector: list[float]) -> list[float]:
    norm = sum(v * v for v in vector) ** 0.5
    return [v / norm for v in vector] if norm > 0 else vector


async def embed_one(state: ServerState, ids: list[int], pooling: str) -> list[float]:
    """One input's pooled hidden state, waiting up to ``KV_WAIT_S`` for free KV blocks."""
    deadline = time.monotonic() + KV_WAIT_S
    while True:
        vector = await state.engine.call(lambda engine: Engine.embed(engine, ids, pooling))
        if vector is not None:
            return vector
        if time.monotonic() > deadline:
            raise APIError(503, "the KV cache is full with running requests; retry the embedding later",
                           "server_error", code="service_unavailable")
        await asyncio.sleep(0.05)


def make_router(state: ServerState, pooler_config: str | dict[str, Any] | None) -> APIRouter:
    pooling, normalize = parse_pooler_config(pooler_config)
    router = APIRouter()
    fields = set(EmbeddingRequest.model_fields)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Response:
        try:
            state.check_model(body.model)
            vocab = state.tokenizer.vocab_size
            data, num_tokens = [], 0
            for i, item in enumerate(body.inputs()):
                ids = state.tokenizer.encode(item, body.add_special_tokens) if isinstance(item, str) else item
                if any(t < 0 or t >= vocab for t in ids):
                    raise APIError(400, f"input token ids must be in [0, {vocab})", param="input")
                state.check_prompt_tokens(len(ids), "input")
                if len(ids) > state.max_model_len:
                    raise APIError(400, f"input {i} has {len(ids)} tokens, more than the context length "
                                        f"({state.max_model_len})", param="input")
                vector = await embed_one(state, ids, pooling)
                vector = _normalise(vector) if normalize else vector
                data.append({"object": "embedding", "index": i, "embedding": _encode(vector, body.encoding_format)})
                num_tokens += len(ids)
        except Exception as e:
            return as_api_error(e, fields).response()
        return JSONResponse({"object": "list", "data": data, "model": state.served_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    return router
