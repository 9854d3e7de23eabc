"""HF tokenizer wrapper: encode/decode, chat templates, end-of-turn ids and streaming detokenization."""

from __future__ import annotations

import os
from typing import Any

from specserve.config import CheckpointError
from specserve.model.checkpoint.loader import default_model_path, read_arch
from specserve.model.families import family

# End-of-turn markers of common chat formats (ChatML, Llama 3, Phi, Gemma, GPT-2 style documents).
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Tokenizer:
    """A loaded HF (fast) tokenizer plus what serving needs from the checkpoint: every id that ends a turn."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        added = hf_tokenizer.get_added_vocab()  # token text -> id, special or not
        specials = {t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special}
        eos = {i for i in (hf_tokenizer.eos_token_id, *extra_eos_ids) if i is not None}
        # NOTE: a chat model's turn ends with its template's marker, which is often not the declared eos.
        eos |= {added[m] for m in _END_MARKERS if m in added and m in specials}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if 0 <= i < self.vocab_size)
        self._special_ids = frozenset(hf_tokenizer.all_special_ids) | {
            i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}

    @staticmethod
    def from_checkpoint(path: str | None) -> Tokenizer:
        """From an HF model dir or a GGUF file (transformers rebuilds the tokenizer from its metadata)."""
        from transformers import AutoTokenizer

        path = default_model_path() if path is None else os.path.expanduser(str(path))
        arch = read_arch(path)  # raises a CheckpointError naming the file for a bad path
        try:
            if os.path.isdir(path):
                hf = AutoTokenizer.from_pretrained(path)
            else:
                hf = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                   gguf_file=os.path.basename(path))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
        if not getattr(hf, "chat_template", None):
            hf.chat_template = family(arch.architecture).chat_template
        return Tokenizer(hf, arch.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # NOTE: no clean-up of tokenization spaces: it is not local to a token, so streamed text would
        # differ from the full decode.
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation in the checkpoint's chat format ("role: content" lines without one);
        ``tools`` (OpenAI tool dicts) go to the template's ``tools`` variable, ``template_kwargs`` (vLLM's
        ``chat_template_kwargs``, e.g. ``enable_thinking``) are further template variables."""
        messages = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        if not getattr(self.hf_tokenizer, "chat_template", None):
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self.encode(text + ("assistant: " if add_generation_prompt else ""))
        try:
            # Render to text, then encode: the template already spells out bos and the turn markers.
            text = self.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                         tokenize=False, tools=tools, **(template_kwargs or {}))
        except Exception as e:  # jinja2 errors, raise_exception() in templates ("roles must alternate")
            raise ValueError(f"chat template error: {e}") from e
        return self.encode(text, add_special_tokens=False)

    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def incremental(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


def _text_of(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of {"type": "text", "text": ...} parts (joined with
    newlines, as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


class IncrementalDetokenizer:
    """Streams text one token at a time, as vLLM's `detokenize_incrementally` does.

    Decoding one token alone is wrong twice over: byte-level tokens may hold part of a UTF-8 character, and
    a token's text can depend on its left neighbours (SentencePiece's leading space). So keep two offsets
    into the ids: text of `ids[prefix:read]` was already emitted and serves as context; decode
    `ids[prefix:]`, emit what extends past the context, and hold everything back while it ends in U+FFFD
    (an incomplete character). NOTE: `read` only ever lands after a complete character, so the emitted
    pieces concatenate to `decode(ids)`; `flush()` emits a tail that is still incomplete at the end.
    """

    _CONTEXT = 5  # prompt tokens decoded as left context of the first generated token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(self._read - self._CONTEXT, 0)
        self._prefix_text = self._decode(self._prefix, self._read)
        self.text = ""  # everything emitted so far (the prompt excluded)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, incomplete characters (U+FFFD) included."""
        new_text = self._decode(self._prefix)
        return self._emit(new_text) if len(new_text) > len(self._prefix_text) else ""

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self.text += delta
        return delta
