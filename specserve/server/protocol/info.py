"""The routes that generate nothing: ``/v1/models`` and vLLM's ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from specserve.server.protocol.chat import ChatMessage
from specserve.server.protocol.common import _Strict


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
