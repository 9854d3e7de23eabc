"""What every request model shares: unknown fields and invalid Unicode refused, ``stream_options``, and the
sampling fields of completions and chat completions (``_SamplingRequest``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from specserve.sampling_params import SamplingParams, StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may spell lone UTF-16 surrogates (``"\\ud800"``); Python keeps them in str, and the tokenizer
        (and any response echoing them) then fails with a 500. Refuse them here, as a 400."""
        bad = _lone_surrogate_path(data, ())
        if bad is not None:
            where = ".".join(str(x) for x in bad) or "body"
            raise ValueError(f"'{where}' contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             f"escape): strings must be valid Unicode")
        return data


def _lone_surrogate_path(x: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if isinstance(x, str):
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            found = _lone_surrogate_path(k, path) if isinstance(k, str) else None
            if found is None:
                found = _lone_surrogate_path(v, (*path, k))
            if found is not None:
                return found
    elif isinstance(x, list):
        for i, v in enumerate(x):
            if (found := _lone_surrogate_path(v, (*path, i))) is not None:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. include_obfuscation: harmless to ignore

    include_usage: bool = False
    include_spec_info: bool = False  # ours: per-token spec_tokens / spec_accepted in chunks (server/webui.py)


# OpenAI fields accepted and ignored: hints to OpenAI's own infrastructure (storage, tiers, caches, safety
# tracking, predicted outputs, verbosity of reasoning models), meaningless for one local model.
IGNORED_FIELDS = frozenset({"store", "service_tier", "prompt_cache_key", "prompt_cache_options",
                            "prompt_cache_retention", "safety_identifier", "verbosity", "prediction",
                            "moderation", "audio"})


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    speculative: bool | None = True
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs (completions: per choice; chat: in the body)
    # OpenAI's: ``metadata`` is echoed in the response; the others change nothing here (logged at debug level).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 characters, values up to 512")
        return v

    def ignored_fields(self) -> list[str]:
        """The fields given that change nothing on this server (for a debug log line)."""
        return sorted(name for name in IGNORED_FIELDS & self.model_fields_set
                      if getattr(self, name) not in (None, False, [], {}))

    def constraint_param(self) -> str | None:
        """The request field a structured-output constraint came from (None when there is none or several)."""
        try:
            return self.constraint()[1]
        except ValueError:
            return None

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The structured-output constraint and the parameter it came from (None, None: free text).
        Raises ValueError starting with that parameter's name."""
        given = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} both constrain the output; give one")
        if not given:
            return None, None
        name = given[0]
        try:
            if name == "response_format":
                return StructuredOutputsParams.from_response_format(rf or {}), name
            if name == "structured_outputs":
                so = dict(self.structured_outputs or {})
                known = {"json", "regex", "choice", "grammar", "json_object"}
                so = {k: v for k, v in so.items() if v is not None and v is not False}
                unknown = sorted(set(so) - known)
                if unknown:
                    raise ValueError(f"unknown field {unknown[0]!r}; use one of {sorted(known)}")
                return StructuredOutputsParams(**so), name
            field = name.removeprefix("guided_")
            return StructuredOutputsParams(**{field: getattr(self, name)}), name
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: {str(e).removeprefix('structured_outputs ')}") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (with SamplingParams' message naming the field) for out-of-range values."""
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise ValueError(f"best_of must equal n ({n}) when given, got {self.best_of}")
        kw: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "logprobs": logprobs,
                              "prompt_logprobs": self.prompt_logprobs}
        if self.logit_bias:
            kw["logit_bias"] = _logit_bias(self.logit_bias)
        constraint, _ = self.constraint()
        if constraint is not None:
            kw["structured_outputs"] = constraint
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                     "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "user"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
        out[token] = value
    return out
