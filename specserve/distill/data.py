"""Training text for drafts: the target's *own* samples, collected through the engine.

Prompts come from the benchmark workloads (``specserve/datasets.py``: code, summarize, chat, edit, json), a
built-in list of everyday instructions (``instructions``), ``vocab-chat`` (everyday requests about words of the
target's own vocabulary), ``stdlib-code`` / ``stdlib-json`` (the code and json tasks over the stdlib modules no
benchmark workload reads: more of those tasks, none of their prompts), or a user file (``.txt``: one raw
prompt per line; ``.json``/``.jsonl``: the workload formats). A prompt with a ``response_format`` is sampled
under its grammar. A stable hash of each prompt id holds a fraction out for evaluation. The engine samples
every training prompt (batched, temperature ~0.8); a feature sink on the
worker captures the target's pre-norm last-layer features for every position as they are computed, so the
target never runs twice. Soft targets are the target's top-K next-token log-probabilities at every position
of the sampled continuation (computed once from those features, kept in fp16).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from specserve.datasets import NUM_VOCAB_CHAT, VOCAB_CHAT
from specserve.distill import dense
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

_TOPICS = (
    "volcanoes", "the French Revolution", "black holes", "photosynthesis", "the stock market", "machine learning",
    "coral reefs", "the Roman Empire", "electric cars", "sleep", "coffee", "the internet", "honey bees",
    "climate change", "chess", "the human heart", "jazz music", "recycling", "earthquakes", "vaccines",
    "the moon landing", "solar panels", "ancient Egypt", "rainforests", "bicycles", "the printing press",
    "democracy", "friendship", "public libraries", "time management", "gardening", "the ocean tides",
)
_TEMPLATES = (
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.", "Give me three facts about {t}.",
    "What are the pros and cons of {t}?", "Write a short poem about {t}.",
    "How would you teach a child about {t}?", "Summarize the history of {t} in a few sentences.",
    "Write a short blog post introduction about {t}.",
)


_WORD = re.compile(r"^ [a-z]{5,12}$")  # a whole-word token (leading space)
_WORD_TEMPLATES = _TEMPLATES + (
    "What is {t}?", "Tell me something interesting about {t}.", "Write a short story that involves {t}.",
    "Describe {t} to someone who has never heard of it.", "Why does {t} matter?",
    "Give an example of {t} in everyday life.", "Write a dialogue between two friends about {t}.",
    "What questions would a student ask about {t}?",
)


@dataclass
class Prompt:
    id: str
    token_ids: list[int]
    response_format: dict[str, Any] | None = None  # the item's structured output (OpenAI's shape), if any


@dataclass
class Sample:
    """One sampled sequence. Position p's feature is h_p; the soft targets cover p = prompt_len - 1 .. L - 2
    (the distributions the output tokens were drawn from)."""

    token_ids: list[int]  # prompt + sampled output (L tokens)
    prompt_len: int
    # [L - 1, n * hidden] fp16: the target's pre-norm features h_0 .. h_{L-2} (n layers, the last one last)
    features: torch.Tensor
    top_ids: torch.Tensor  # [L - 1 - first_target, K] int64
    top_logp: torch.Tensor  # [L - 1 - first_target, K] fp16
    # First position with a soft target (None: prompt_len - 1, the sampled output only; 0: every position,
    # the prompt included -- the target's distributions over the prompt are training signal too).
    target_from: int | None = None

    @property
    def first_target(self) -> int:
        return self.prompt_len - 1 if self.target_from is None else self.target_from

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "prompt_len": self.prompt_len, "features": self.features,
                "top_ids": self.top_ids, "top_logp": self.top_logp, "target_from": self.target_from}


def builtin_instructions() -> list[tuple[str, list[dict[str, str]]]]:
    return [(f"instructions-{i:03d}", [{"role": "user", "content": tpl.format(t=topic)}])
            for i, (tpl, topic) in enumerate((tpl, t) for t in _TOPICS for tpl in _TEMPLATES)]


def vocab_chat(tokenizer: Any, limit: int = NUM_VOCAB_CHAT, seed: int = 0) -> list[tuple[str, list[dict[str, str]]]]:
    """Everyday requests about words of the target's own vocabulary (whole-word tokens of 5-12 lowercase
    letters, in a seeded order), one template each: many more topics than the built-in instructions, with no
    text from outside the model."""
    words = sorted({t.strip() for t in (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
                    if _WORD.match(t)})
    random.Random(seed).shuffle(words)
    n = len(_WORD_TEMPLATES)
    return [(f"{VOCAB_CHAT}-{i:04d}", [{"role": "user", "content": _WORD_TEMPLATES[i % n].format(t=w)}])
            for i, w in enumerate(words[:limit])]


def sources(dataset_arg: str) -> list[str]:
    """``--dataset``'s comma-separated source names, in order."""
    return [s.strip() for s in dataset_arg.split(",") if s.strip()]


def load_prompts(dataset_arg: str, tokenizer: Any) -> list[Prompt]:
    """Comma-separated workload names (code, summarize, chat, edit, instructions, stdlib-code) and/or files."""
    from specserve.datasets import TRAIN_CODE, TRAIN_JSON, build_code_train, build_json_train

    out: list[Prompt] = []
    for name in sources(dataset_arg):
        if name == "instructions":
            out += [Prompt(i, tokenizer.apply_chat_template(m)) for i, m in builtin_instructions()]
        elif name == VOCAB_CHAT:
            out += [Prompt(i, tokenizer.apply_chat_template(m)) for i, m in vocab_chat(tokenizer)]
        elif name in (TRAIN_CODE, TRAIN_JSON):
            build = build_code_train if name == TRAIN_CODE else build_json_train
            out += [Prompt(it.id, tokenizer.apply_chat_template(it.messages or []), it.response_format)
                    for it in build()]
        elif name.endswith(".txt") and os.path.isfile(name):
            with open(name, encoding="utf-8") as f:
                lines = [ln.rstrip("\n") for ln in f if ln.strip()]
            out += [Prompt(f"{os.path.basename(name)}:{i}", tokenizer.encode(ln)) for i, ln in enumerate(lines)]
        else:
            from specserve.datasets import load_dataset

            for item in load_dataset(name):
                ids = tokenizer.apply_chat_template(item.messages) if item.messages is not None \
                    else tokenizer.encode(item.prompt or "")
                out.append(Prompt(item.id, ids, item.response_format))
    if not out:
        raise ValueError(f"--dataset {dataset_arg!r} gave no prompts")
    return out


def is_held_out(prompt_id: str, fraction: float) -> bool:
    h = int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16) / 16**8
    return h < fraction


def split(prompts: list[Prompt], fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out); every prompt goes to training when fraction is 0."""
    held = [p for p in prompts if is_held_out(p.id, fraction)]
    train = [p for p in prompts if not is_held_out(p.id, fraction)]
    return train or prompts, held


def collect(llm: Any, prompts: list[Prompt], num_tokens: int, max_tokens: int, temperature: float,
            batch: int, seed: int, top_k: int = 32, samples: list[Sample] | None = None, start: int = 0,
            on_batch: Callable[[list[Sample], int], None] | None = None, greedy_every: int = 0) -> list[Sample]:
    """Sample the target on ``prompts`` (cycling, a new seed each pass) until ``num_tokens`` are generated.
    ``greedy_every`` > 0: every that many-th batch decodes greedily (the trajectories greedy serving sees).

    Continues ``samples`` collected from prompt index ``start`` on (a resumed collection); ``on_batch(samples,
    next index)`` runs after every batch (the CLI saves a partial ``samples.pt`` there)."""
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def sink(req_id: str, pos: int, h: torch.Tensor, owned: bool) -> None:
        chunks.setdefault(req_id, []).append((pos, h.detach().float().cpu().clone()))

    samples = list(samples or [])
    generated, i = sum(len(s.token_ids) - s.prompt_len for s in samples), start
    bar = tqdm(total=num_tokens, initial=min(generated, num_tokens), desc="collect (target samples)", unit="tok")
    with llm.observe_features(sink), contextlib.closing(bar):
        while generated < num_tokens:
            group = [prompts[(i + j) % len(prompts)] for j in range(batch)]
            greedy = greedy_every > 0 and (i // batch) % greedy_every == greedy_every - 1
            params = [SamplingParams(temperature=0.0 if greedy else temperature, max_tokens=max_tokens,
                                     seed=seed + i + j,  # a prompt's grammar shapes its text, as when served
                                     structured_outputs=StructuredOutputsParams.of_response_format(p.response_format))
                      for j, p in enumerate(group)]
            outs = llm.generate(None, params, prompt_token_ids=[p.token_ids for p in group])
            i += batch
            for p, o in zip(group, outs, strict=True):
                s = _sample(llm.target_model(), p.token_ids, o.outputs[0].token_ids, chunks.pop(o.request_id, []), top_k)
                if s is not None:
                    samples.append(s)
                    new = len(s.token_ids) - s.prompt_len
                    generated += new
                    bar.update(new)
            if on_batch is not None:
                on_batch(samples, i)
    return samples


def _sample(model: Any, prompt: list[int], output: list[int], parts: list[tuple[int, torch.Tensor]],
            top_k: int) -> Sample | None:
    if not output:
        return None
    ids = list(prompt) + list(output)
    parts.sort(key=lambda x: x[0])
    pos = 0
    for p, h in parts:
        if p != pos:
            raise RuntimeError(f"feature capture is not contiguous (position {p}, expected {pos})")
        pos += h.shape[0]
    feats = torch.cat([h for _, h in parts])  # [L - 1, hidden]
    if feats.shape[0] != len(ids) - 1:
        raise RuntimeError(f"captured {feats.shape[0]} features for a sequence of {len(ids)} tokens")
    h = model.arch.hidden_size  # features may hold several layers (the head's taps); the last is the last layer
    idx, vals = top_logprobs(model, feats[:, -h:], top_k)  # every position, the prompt's included
    return Sample(ids, len(prompt), _compact(feats), idx, vals, target_from=0)


def top_logprobs(model: Any, feats: torch.Tensor, top_k: int, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm features [N, hidden] -> the target's top-K next-token (ids int64, log-probs fp16), on the CPU."""
    ids, vals = [], []
    with torch.inference_mode():
        for i in range(0, feats.shape[0], chunk):
            h = feats[i:i + chunk].to(model.device, model.dtype)
            logp = torch.log_softmax(model.compute_logits(model.norm(h)).float(), dim=-1)  # [n, V]
            v, j = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            ids.append(j.cpu())
            vals.append(v.half().cpu())
    return torch.cat(ids), torch.cat(vals)


def stdlib_code_chunks(tokenizer: Any, exclude: tuple[str, ...], seq_len: int, seed: int = 0
                       ) -> Iterator[list[int]]:
    """Token chunks of ``seq_len`` from the Python standard library's source files, in a seeded file order.

    Modules named in ``exclude`` (the benchmark workloads' sources) are skipped, so benchmark prompts stay
    unseen. The files are read, never imported; the tokenizer's BOS (if any) is not added."""
    from specserve.datasets import stdlib_sources

    files = [path for _, path in stdlib_sources(exclude)]
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        for i in range(0, len(ids) - seq_len // 4, seq_len):
            yield ids[i:i + seq_len]


def collect_text(model: Any, chunks: Iterator[list[int]], num_tokens: int, batch: int, top_k: int = 32,
                 taps: tuple[int, ...] | None = None, skip: int = 0) -> list[Sample]:
    """Teacher-forced target passes over text (no sampling): features and soft targets at every position.
    ``skip``: chunks an earlier collection already read (one sample each), passed over.

    A dense causal forward over [batch, seq_len] is several times faster per token on a CPU than decoding, so
    this buys volume; the engine-sampled data (``collect``) buys the target's own style."""
    samples: list[Sample] = []
    done = 0
    bar = tqdm(total=num_tokens, desc="collect (teacher-forced text)", unit="tok")
    group: list[list[int]] = []
    for chunk in chunks:
        if len(chunk) < 8:
            continue
        if skip > 0:
            skip -= 1
            continue
        group.append(chunk)
        if len(group) < batch:
            continue
        n = _text_batch(model, group, top_k, samples, taps)
        done += n
        bar.update(n)
        group = []
        if done >= num_tokens:
            break
    bar.close()
    return samples


def _text_batch(model: Any, group: list[list[int]], top_k: int, out: list[Sample],
                taps: tuple[int, ...] | None = None) -> int:
    n = max(len(c) for c in group)
    ids = torch.zeros(len(group), n, dtype=torch.long)
    for b, c in enumerate(group):
        ids[b, :len(c)] = torch.tensor(c)
    with torch.inference_mode():
        feats = dense.model_features(model, ids.to(model.device), taps=taps).float().cpu()  # [B, n, taps x hidden]
    h = model.arch.hidden_size
    for b, c in enumerate(group):
        f = feats[b, :len(c) - 1]
        top, lp = top_logprobs(model, f[:, -h:], top_k)  # from the last layer's slot
        out.append(Sample(list(c), 1, _compact(f), top, lp, target_from=0))
    return sum(len(c) for c in group)


def draft_vocab(samples: list[Sample], size: int, vocab_size: int) -> tuple[torch.Tensor | None, float]:
    """The ``size`` tokens the target most often chose or considered first in the data (sorted ids), and the
    share of the target's top-1 choices they cover; (None, 1.0) for the full vocabulary."""
    top1 = torch.cat([s.top_ids[:, 0] for s in samples]).long()
    if size <= 0 or size >= vocab_size:
        return None, 1.0
    counts = torch.bincount(top1, minlength=vocab_size).float() * 4
    counts += torch.bincount(torch.tensor([t for s in samples for t in s.token_ids]), minlength=vocab_size)
    ids = counts.argsort(descending=True)[:size].sort().values
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[ids] = True
    return ids, float(keep[top1].float().mean())


def save_samples(path: str, samples: list[Sample], meta: dict[str, Any]) -> None:
    torch.save({"meta": meta, "samples": [s.to_dict() for s in samples]}, path)


def load_samples(path: str) -> tuple[list[Sample], dict[str, Any]]:
    data = torch.load(path, weights_only=True)
    return [Sample(**s) for s in data["samples"]], data["meta"]


def _compact(features: torch.Tensor) -> torch.Tensor:
    """Features as stored: float16 (finer), or bfloat16 where the residual stream exceeds float16's range
    (Gemma 3's reaches 4e4 and more)."""
    return features.half() if bool(features.abs().max() < 6e4) else features.bfloat16()
