"""Per-request sampling parameters (vLLM / OpenAI-compatible names) and their validation.

Every check raises ``ValueError`` with a message that names the field and the offending value, so the
server can return it verbatim as a 400.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

# Temperatures below this are treated as greedy (as in vLLM): dividing logits by ~0 would overflow to inf.
GREEDY_EPS = 1e-5
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 300  # entries (OpenAI takes up to 300 tokens)
MAX_GRAMMAR_CHARS = 200_000  # a schema, regex, EBNF or choice list larger than this is refused up front


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``structured_outputs`` names); exactly one field is set.

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``; ``choice``: one of
    these strings; ``grammar``: EBNF (GBNF / xgrammar syntax). Compiled by ``sample/grammar.py``."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string")
        if len(self.key()) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is larger than {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def of_response_format(cls, rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
        """``from_response_format``, or None for no format or a "text" one (no constraint)."""
        return None if rf is None or rf.get("type", "text") == "text" else cls.from_response_format(rf)

    @classmethod
    def from_response_format(cls, rf: dict[str, Any]) -> StructuredOutputsParams:
        """OpenAI's ``response_format``: {"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name", "schema", "strict", "description"}} (a "text" format is no constraint: not handled here)."""
        kind = rf.get("type")
        if kind == "json_object":
            return cls(json_object=True)
        if kind != "json_schema":
            raise ValueError(f"type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'name' and a 'schema'")
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
            raise ValueError("json_schema.name must be a string of 1 to 64 characters")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any object
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return cls(json=schema)

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    def key(self) -> str:
        """A canonical text of the constraint (its size is what ``MAX_GRAMMAR_CHARS`` caps)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}:{json.dumps(value) if self.kind == 'choice' else value}"


@dataclass
class SamplingParams:
    """How to sample one request.

    ``top_k`` <= 0 means "off" (-1 is the canonical value); ``max_tokens=None`` means "up to the context end"
    (resolved by :meth:`check_context`). ``logprobs`` is the number of top alternatives returned per generated
    token (the chosen token's logprob is always included when it is not None); ``prompt_logprobs`` the same for
    every prompt token after the first (vLLM's name: ``RequestOutput.prompt_logprobs``; the API's ``echo``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # NOTE: typed as lists (what every reader sees after __post_init__); a str or None is accepted and normalised.
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's ``user``: the partition of suffix decoding's index (spec_decode/suffix.py), whose drafts come
    # only from earlier requests of the same user.
    user: str | None = None

    def __post_init__(self) -> None:
        stop: object = self.stop
        self.stop = [] if stop is None else [stop] if isinstance(stop, str) else list(self.stop)
        ids: object = self.stop_token_ids
        self.stop_token_ids = [] if ids is None else list(self.stop_token_ids)
        bias: object = self.logit_bias
        self.logit_bias = {} if bias is None else dict(self.logit_bias)
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_float(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            # NOTE: torch generators take at most 64 bits; a larger seed failed the whole engine step.
            if not -(2**63) <= self.seed < 2**63:
                raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        self._validate_lengths()
        self._validate_stops()
        self._validate_logit_bias()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
            _check_float(f"logit_bias[{t}]", b)
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may contain at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain an empty string")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got one of {len(s)}"
                )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    # ------------------------------------------------------------------ derived properties
    @property
    def greedy(self) -> bool:
        """Temperature 0 (below ``GREEDY_EPS``): argmax after penalties; top-k/top-p/min-p are ignored."""
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    # ------------------------------------------------------------------ helpers
    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy with another seed (validated like any other)."""
        return replace(self, seed=seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                       logit_bias=dict(self.logit_bias))

    def for_child(self, index: int) -> SamplingParams:
        """Parameters for child ``index`` of an ``n > 1`` request: n=1 and, if seeded, seed + index
        (as vLLM does), so that seeded siblings differ but stay reproducible."""
        child = self.with_seed(None if self.seed is None else self.seed + index)
        child.n = 1
        return child

    def check_context(self, prompt_len: int, max_model_len: int) -> int:
        """The effective ``max_tokens`` for a prompt of ``prompt_len`` tokens (``None`` → up to the context
        end). Raises ``ValueError`` when prompt + max_tokens does not fit in ``max_model_len``."""
        if self.max_tokens is None:
            if prompt_len >= max_model_len:
                raise ValueError(
                    f"prompt ({prompt_len} tokens) + max_tokens (at least 1) exceeds the model's context "
                    f"length ({max_model_len})"
                )
            return max_model_len - prompt_len
        if prompt_len + self.max_tokens > max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the model's context "
                f"length ({max_model_len})"
            )
        return self.max_tokens


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
