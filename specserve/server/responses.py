"""``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it) and ``GET /v1/responses/{id}``.

A request runs as a chat request (``server/responses_items.py`` reads it as one; ``serving.start_chat``
starts it), so tools, grammars, speculation and its ``usage.speculative`` work as on chat. Not streamed, the
answer is the response object: ``output`` holds a ``message`` item (its ``output_text``) and/or one
``function_call`` item per call; ``status`` is ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when ``max_output_tokens`` cut it. Streamed, the semantic events, each with its
``sequence_number``: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
for text ``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, for a call ``response.function_call_arguments.delta`` / ``.done``, then
``response.output_item.done``, and last ``response.completed`` carrying the whole response, its status
included (vLLM's choice: the openai client's ``responses.stream`` waits for ``response.completed``). Unless
``store`` is false, the response and its conversation are kept (``ResponseStore``) for a later request's
``previous_response_id``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specserve.server.errors import as_api_error
from specserve.server.responses_items import (
    ResponsesRequest,
    ResponseStore,
    call_item,
    chat_request,
    ignored_fields,
    message_item,
    new_id,
    output_items,
    response_object,
)
from specserve.server.serving import Run, chat_chunks, chat_response, collect, sse_response, start_chat
from specserve.server.state import ServerState

log = logging.getLogger("specserve.server")


class _Events:
    """The streamed events of one response, built from the chat chunks of its run."""

    def __init__(self, body: ResponsesRequest, rid: str, created: int, model: str) -> None:
        self.body, self.rid, self.created, self.model = body, rid, created, model
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.text: dict[str, Any] | None = None  # the message item being streamed: {"id", "index", "text"}
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> {"item", "index"}
        self.finish: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.body, self.rid, self.created, status, list(self.output), usage, self.model,
                               self.finish)

    def _index(self) -> int:
        return len(self.output) + (self.text is not None) + len(self.calls)

    def content(self, piece: str) -> list[str]:
        out = []
        if self.text is None:
            self.text = {"id": f"msg_{uuid.uuid4().hex}", "index": self._index(), "text": ""}
            out.append(self.event("response.output_item.added", output_index=self.text["index"],
                                  item=message_item("", self.text["id"], "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.text["id"],
                                  output_index=self.text["index"], content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.text["text"] += piece
        out.append(self.event("response.output_text.delta", item_id=self.text["id"], output_index=self.text["index"],
                              content_index=0, delta=piece, logprobs=[]))
        return out

    def close_text(self) -> list[str]:
        if self.text is None:
            return []
        t, self.text = self.text, None
        item = message_item(t["text"], t["id"])
        part = item["content"][0]
        self.output.append(item)
        return [self.event("response.output_text.done", item_id=t["id"], output_index=t["index"], content_index=0,
                           text=t["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=t["id"], output_index=t["index"], content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=t["index"], item=item)]

    def call(self, entry: dict[str, Any]) -> list[str]:
        out = self.close_text()
        fn = entry.get("function") or {}
        state = self.calls.get(entry["index"])
        if state is None:
            item = call_item({"id": entry["id"], "function": {"name": fn.get("name", ""), "arguments": ""}},
                             status="in_progress")
            state = self.calls[entry["index"]] = {"item": item, "index": self._index()}
            out.append(self.event("response.output_item.added", output_index=state["index"], item=dict(item)))
        if fn.get("arguments"):
            state["item"]["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=state["item"]["id"],
                                  output_index=state["index"], delta=fn["arguments"]))
        return out

    def close_calls(self) -> list[str]:
        out = []
        for state in self.calls.values():
            item = {**state["item"], "status": "completed"}
            self.output.append(item)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=state["index"], name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=state["index"], item=item))
        self.calls = {}
        return out


async def _stream(run: Run, ev: _Events, store: ResponseStore, owner: str,
                  conversation: list[dict[str, Any]]) -> AsyncGenerator[str, None]:
    try:
        yield ev.event("response.created", response=ev.response("in_progress"))
        yield ev.event("response.in_progress", response=ev.response("in_progress"))
        async with contextlib.aclosing(chat_chunks(run)) as chunks:
            async for chunk in chunks:
                choice = chunk["choices"][0]
                delta = choice["delta"]
                if delta.get("content"):
                    for e in ev.content(delta["content"]):
                        yield e
                for entry in delta.get("tool_calls") or []:
                    for e in ev.call(entry):
                        yield e
                ev.finish = choice["finish_reason"] or ev.finish
        for e in ev.close_text() + ev.close_calls():
            yield e
        final = ev.response("completed", run.usage().model_dump())
        if ev.body.store is not False:
            store.put(owner, final, conversation)
        yield ev.event("response.completed", response=final)
    except Exception as e:
        err = as_api_error(e).info
        yield ev.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        run.abort()
        run.finish()


def make_router(state: ServerState, store: ResponseStore) -> APIRouter:
    router = APIRouter()
    fields = set(ResponsesRequest.model_fields)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        owner = store.owner(raw.headers.get("authorization"))
        rid, created = new_id()
        if ignored := ignored_fields(body):
            log.debug("response: ignoring %s (no meaning on this server)", ", ".join(ignored))
        try:
            history = store.get(owner, body.previous_response_id)[0] if body.previous_response_id else []
            chat, conversation = chat_request(body, history)
            run = await start_chat(state, chat, rid)
        except Exception as e:
            return as_api_error(e, fields).response()
        if body.stream:
            return sse_response(_stream(run, _Events(body, rid, created, state.served_name), store, owner,
                                        conversation))
        try:
            await collect(run, raw)
            answer = chat_response(run)
        except Exception as e:
            return as_api_error(e).response()
        choice = answer["choices"][0]
        out = response_object(body, rid, created, "completed", output_items(choice["message"]), answer["usage"],
                              state.served_name, choice["finish_reason"])
        if body.store is not False:
            store.put(owner, out, conversation)
        return JSONResponse(out)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, raw: Request) -> Response:
        try:
            return JSONResponse(store.get(store.owner(raw.headers.get("authorization")), response_id)[1])
        except Exception as e:
            return as_api_error(e).response()

    return router
