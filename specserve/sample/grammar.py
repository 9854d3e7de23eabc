"""Structured outputs: grammars compiled by xgrammar, one matcher per request, a token mask per logits row.

- ``GrammarCompiler`` (one per engine) turns a ``StructuredOutputsParams`` (JSON schema, any JSON object,
  regex, choice list, EBNF) into a compiled grammar; xgrammar's compile cache makes a repeated
  constraint cost a lookup. A bad constraint is a ``ValueError`` carrying the compiler's
  message (a 400 for the server). Compiling happens off the engine loop in the server (``AsyncEngine``).
- ``GrammarState`` (one per request, in the worker) holds the matcher. The rows of a verification step are
  masked as speculation requires: row j by the grammar state after drafts 0..j-1 (accepted tentatively,
  then rolled back); after verification the matcher advances on the emitted tokens only.
- ``apply_grammar`` masks logits rows in place from packed 32-bit bitmasks (pure torch: every device).

The mask is a logits-processing step (``sample/sampler.py``), so it composes with penalties, temperature,
top-k/p and min-p, and speculation stays exact: drafts are verified against the masked distribution.
"""

from __future__ import annotations

import bisect
import json
import threading
from typing import Any, NamedTuple

import torch

from specserve.platform import to_device
from specserve.sampling_params import StructuredOutputsParams

# Drafts per step are at most this many; the matcher keeps this much history to roll back.
MAX_ROLLBACK_TOKENS = 64


class GrammarError(ValueError):
    """A structured-output constraint that does not compile (the server names the parameter it came from)."""


def _xgr():  # type: ignore[no-untyped-def]
    import xgrammar  # a dependency; imported on first use so that start-up without grammars skips it

    return xgrammar


# xgrammar's own compile cache (per compile call and arguments), bounded in bytes.
_CACHE_BYTES = 256 << 20


class Compiled(NamedTuple):
    """A compiled grammar and each token id's bytes (xgrammar's decoded vocabulary, shared by all)."""

    grammar: Any
    token_bytes: list[bytes]


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary size; thread-safe; repeated constraints come from
    xgrammar's compile cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2
                 ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: Any = None
        self._token_bytes: list[bytes] = []
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        """Built on first use (reading the vocabulary takes a fraction of a second)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=True,
                                                     cache_limit_bytes=_CACHE_BYTES)
                self._token_bytes = list(info.decoded_vocab)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        return Compiled(self._compile(params), self._token_bytes)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind == "json_object":  # OpenAI's JSON mode: an object (xgrammar's builtin allows any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                try:
                    parsed = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
                if not isinstance(parsed, dict):
                    raise GrammarError("the JSON schema must be a JSON object")
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None
                alternatives = " | ".join(json.dumps(c) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(params.grammar)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError with "[time] file:line: message"
            raise GrammarError(f"invalid {_NAMES[kind]}: {_compiler_message(e)}") from None


def json_union_ebnf(alternatives: list[tuple[str, dict[str, Any], str]]) -> str:
    """EBNF (xgrammar's dialect) for one of several JSON schemas, each between a literal prefix and suffix:
    ``(prefix, schema, suffix)`` per alternative. The server's grammar for "a tool call or the
    ``response_format`` object" (``server/tools.py``); compiled like any ``structured_outputs.grammar``."""
    xgr = _xgr()
    grammars = []
    try:
        for prefix, schema, suffix in alternatives:
            parts = [xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)]
            if prefix:
                parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"))
            if suffix:
                parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix)}"))
            grammars.append(parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts))
        return str(grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars))
    except Exception as e:
        raise GrammarError(f"invalid JSON schema: {_compiler_message(e)}") from None


_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
          "grammar": "EBNF grammar"}


def _compiler_message(e: Exception) -> str:
    text = str(e).strip()
    # "[15:12:23] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the part after the location
    if text.startswith("[") and ".cc:" in text:
        text = text.split(": ", 1)[-1] if ": " in text else text
    return text.splitlines()[0] if text else type(e).__name__


class GrammarState:
    """One request's matcher. ``fill_rows`` masks its verification rows; ``accept`` advances on emitted
    tokens; ``valid_prefix`` is how many of a draft's tokens the grammar allows."""

    def __init__(self, compiled: Compiled) -> None:
        xgr = _xgr()
        self.token_bytes = compiled.token_bytes
        self.matcher = xgr.GrammarMatcher(compiled.grammar, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        # What the matcher accepted: the tokens, their bytes, and where each token's bytes start.
        self._tokens: list[int] = []
        self._text = bytearray()
        self._starts: list[int] = []

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Rows first .. first + len(drafts) of ``bitmask``: row j allows what the grammar allows after
        drafts[:j]. Rows after a draft the grammar rejects keep the last mask (that draft has probability 0 at
        its row, so verification never reaches them)."""
        m = self.matcher
        self._fill(bitmask, first)
        accepted = 0
        for j, tok in enumerate(drafts):
            if not m.is_terminated() and m.accept_token(tok):
                accepted += 1
                self._fill(bitmask, first + j + 1)
            else:
                bitmask[first + j + 1:first + len(drafts) + 1] = bitmask[first + j]
                break
        if accepted:
            m.rollback(accepted)

    def fill_after(self, bitmask: torch.Tensor, row: int, tokens: list[int]) -> None:
        """Row ``row`` of ``bitmask``: what the grammar allows after ``tokens`` (accepted tentatively, then
        rolled back). Where it does not allow ``tokens`` the row is left as it is."""
        n = self._advance(tokens)
        if n == len(tokens):
            self._fill(bitmask, row)
        if n:
            self.matcher.rollback(n)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            bitmask[row] = -1  # finished: the stop check ends the request; nothing left to constrain
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def _advance(self, tokens: list[int]) -> int:
        """Accept ``tokens`` up to the first the grammar does not allow (or its end); how many it accepted."""
        m, n = self.matcher, 0
        for tok in tokens:
            if m.is_terminated() or not m.accept_token(tok):
                break
            n += 1
        return n

    def accept(self, tokens: list[int]) -> None:
        # Stops early only on the stop token after completion, or with ignore_eos: the mask no longer applies.
        n = self._advance(tokens)
        vocab, text = self.token_bytes, self._text
        for t in tokens[:n]:
            self._starts.append(len(text))
            self._tokens.append(t)
            text += vocab[t]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from the current state (the matcher is unchanged)."""
        n = self._advance(tokens)
        if n:
            self.matcher.rollback(n)
        return n

    def forced_tokens(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (at most ``limit``): free drafts.

        xgrammar's jump-forward tokens spell the forced text with the longest vocabulary tokens, but the
        grammar allows every tokenization of it, and the masked target often picks another (a key it would
        not have written itself comes out as ``"``, ``n``, ``am``, ``e":``). So where the request's output so
        far holds the same text on token boundaries, the drafts are the tokens the target used there last,
        where the grammar allows them."""
        if limit <= 0 or self.matcher.is_terminated():
            return []
        forced = list(self.matcher.find_jump_forward_tokens())
        if forced and self._tokens:
            seen = self._last_spelling(b"".join(self.token_bytes[t] for t in forced))
            if seen is not None and seen != forced and self.valid_prefix(seen) == len(seen):
                forced = seen
        return forced[:limit]

    def _last_spelling(self, text: bytes, tries: int = 8) -> list[int] | None:
        """The accepted tokens of the latest occurrence of ``text`` in the output that starts on a token
        boundary (its last token may run past ``text``'s end); None where the last ``tries`` occurrences
        all start inside a token."""
        starts, end = self._starts, len(self._text)
        for _ in range(tries):
            pos = self._text.rfind(text, 0, end)
            if pos < 0:
                return None
            i = bisect.bisect_left(starts, pos)
            if i < len(starts) and starts[i] == pos:
                j = bisect.bisect_left(starts, pos + len(text))  # the first token starting at or after the end
                return self._tokens[i:j]
            end = pos + len(text) - 1  # the next occurrence to the left
        return None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_table(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: entry (b, i) is 0.0 where bit i of byte b is set, -inf where it is clear."""
    table = _BIT_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BIT_TABLES[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return table


def apply_grammar(out: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """``out[rows[i], t] = -inf`` where bit t of ``bitmask[i]`` (int32 words, xgrammar's layout: token t is
    bit t % 32 of word t // 32) is clear.

    NOTE: one gather of a byte -> 8-floats table and one add (-inf + x = -inf, 0 + x = x): several times
    faster on CPUs than unpacking bits and ``masked_fill``. The byte view of the int32 words assumes a
    little-endian host, as every supported platform is."""
    vocab = out.shape[1]
    words = bitmask.to(out.device).contiguous()
    codes = words.view(torch.uint8).view(-1).int()  # [R * 4W]
    bias = _bit_table(out.device).index_select(0, codes).view(len(rows), -1)[:, :vocab]  # [R, V]
    if rows == list(range(out.shape[0])):
        out.add_(bias)
    else:
        out.index_add_(0, to_device(rows, out.device, torch.long), bias)
