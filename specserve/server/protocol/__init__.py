"""OpenAI-compatible request and response models (pydantic 2), by route: ``chat``, ``completions``, ``info``
(models, tokenizer), with ``common`` (the shared request fields), ``usage`` and ``errors``; all importable
from here.

Requests reject unknown top-level fields (``extra="forbid"``) so that a typo is a 400, not a silently ignored
knob. ``user`` partitions suffix decoding's drafts (spec_decode/suffix.py). Accepted but ignored:
``best_of`` (only when equal to ``n``). Structured outputs:
OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's ``structured_outputs``
(``json`` | ``regex`` | ``choice`` | ``grammar`` | ``json_object``) or its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, on both routes (one of them per request).
Extensions (vLLM names): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``skip_special_tokens``, completions' ``prompt_logprobs`` and
ours, ``speculative`` (default true) and ``stream_options.include_spec_info`` (default false; see
``server/webui.py``). Completions' ``echo`` shows the prompt (and, with ``logprobs``, its tokens' logprobs).
"""

from specserve.server.protocol.chat import (
    CHAT_DEFAULT_MAX_TOKENS,
    RESERVED_TEMPLATE_KWARGS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ContentPart,
    chat_logprobs,
    chat_response,
)
from specserve.server.protocol.common import IGNORED_FIELDS, StreamOptions, _SamplingRequest, _Strict
from specserve.server.protocol.completions import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Echo,
    completion_logprobs,
    completion_response,
    join_logprobs,
)
from specserve.server.protocol.errors import ErrorInfo, ErrorResponse, validation_message
from specserve.server.protocol.info import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from specserve.server.protocol.usage import Delta, SpeculativeUsage, Usage, usage

__all__ = [
    "CHAT_DEFAULT_MAX_TOKENS", "COMPLETION_DEFAULT_MAX_TOKENS", "IGNORED_FIELDS", "RESERVED_TEMPLATE_KWARGS",
    "AssistantMessage", "ChatChoice", "ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage",
    "CompletionChoice", "CompletionRequest", "CompletionResponse", "ContentPart", "Delta", "DetokenizeRequest",
    "Echo", "ErrorInfo", "ErrorResponse", "ModelCard", "ModelList", "SpeculativeUsage", "StreamOptions",
    "TokenizeRequest", "Usage", "_SamplingRequest", "_Strict", "chat_logprobs", "chat_response",
    "completion_logprobs", "completion_response", "join_logprobs", "usage", "validation_message",
]
