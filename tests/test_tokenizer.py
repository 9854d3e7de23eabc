"""Tokenizer on the demo model: round trips, chat template, end ids, streaming detokenization."""

from __future__ import annotations

import random

import pytest

from specserve.config import CheckpointError
from specserve.tokenizer import Tokenizer

MULTIBYTE = "héllo 世界 🚀 naïve café — ✓ 日本語のテキスト 🎉🎉"


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = tok.incremental(prompt, skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def test_basic_properties(demo_tokenizer):
    tok = demo_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [2] and 2 in tok.eos_token_ids
    assert tok.encode("<|endoftext|>", add_special_tokens=False)[0] in tok.eos_token_ids
    assert {0, 1, 2} <= tok.special_token_ids()
    assert tok.encode("hello")[0] not in tok.special_token_ids()


@pytest.mark.parametrize("text", ["Hello, world!", "  leading spaces and\nnewlines\t", MULTIBYTE, ""])
def test_encode_decode_round_trip(demo_tokenizer, text):
    ids = demo_tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert demo_tokenizer.decode(ids) == text


def test_decode_special_tokens(demo_tokenizer):
    ids = [1] + demo_tokenizer.encode("hi", add_special_tokens=False) + [2]
    assert demo_tokenizer.decode(ids) == "hi"
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template(demo_tokenizer):
    tok = demo_tokenizer
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(msgs)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == ids.count(2) + 1  # one <|im_start|> per turn, the open assistant turn included
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    assert tok.apply_chat_template(parts) == ids  # OpenAI content parts


def test_chat_template_fallback(demo_tokenizer):
    tok = Tokenizer(demo_tokenizer.hf_tokenizer)
    tok.hf_tokenizer = _NoTemplate(demo_tokenizer.hf_tokenizer)
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tok.decode(ids) == "system: Be brief.\nuser: Hi\nassistant: "


class _NoTemplate:
    """The demo tokenizer as if its checkpoint had no chat template."""

    chat_template = None

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_incremental_matches_decode_on_multibyte_text(demo_tokenizer):
    tok = demo_tokenizer
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # characters really are split across tokens
    pieces = stream(tok, ids)
    assert "".join(pieces) == MULTIBYTE and pieces[-1] == ""  # nothing held back at the end
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 1  # some tokens were held back until their character completed


def test_incremental_with_prompt_context(demo_tokenizer):
    """Generation continues a prompt: the prompt's last tokens are decoding context, never emitted."""
    tok = demo_tokenizer
    full = tok.encode("Say: " + MULTIBYTE)
    for k in range(1, len(full)):
        prompt_text = tok.decode(full[:k])
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt itself ends mid-character
        pieces = stream(tok, full[k:], prompt=full[:k])
        assert prompt_text + "".join(pieces) == "Say: " + MULTIBYTE
        assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_random_ids(demo_tokenizer, seed, skip):
    tok = demo_tokenizer
    rng = random.Random(seed)
    # Random ids, biased towards the byte tokens (which carry partial UTF-8) and the special tokens.
    pool = [i for i in range(tok.vocab_size) if len(tok.hf_tokenizer.convert_ids_to_tokens(i)) == 1][:300]
    ids = [rng.choice(pool) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) if rng.random() < 0.9
           else rng.randrange(17) for _ in range(300)]
    pieces = stream(tok, ids, skip=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    # Random bytes are often invalid for good (U+FFFD inside a piece), but a piece never ends with an
    # incomplete character: that tail is held back until it completes or the stream is flushed.
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_from_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        Tokenizer.from_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, '
                                          '"intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 1}')
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        Tokenizer.from_checkpoint(str(tmp_path))


def test_hf_dir_tokenizer_and_generation_config_eos(demo_tokenizer, tmp_path):
    """An HF dir: the tokenizer files plus config eos lists (as Qwen2.5 / Llama 3 declare several)."""
    demo_tokenizer.hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, '
                                          '"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 4, "eos_token_id": 2}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    tok = Tokenizer.from_checkpoint(str(tmp_path))
    assert tok.vocab_size == 49152 and {0, 2, 5} <= tok.eos_token_ids
    assert tok.encode(MULTIBYTE) == demo_tokenizer.encode(MULTIBYTE)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        demo_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
