"""End to end: the real server (uvicorn, loopback) on the demo model, driven by the official openai client.

One server for the whole module; the engine speculates with n-gram drafts (k=3) unless a request says
``speculative: false``.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
# Repetitive: the n-gram proposer finds matches, so drafts are proposed (and some accepted).
REPEAT_PROMPT = "one two three four five, one two three four five, one two three four five, one two"


def _complete(client: openai.OpenAI, prompt, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def test_echo_scores_the_prompt_as_lm_eval_asks(server, client, server_engine):
    """lm-evaluation-harness's loglikelihood request (token-id prompts, max_tokens 1, logprobs 1, echo): every
    prompt token after the first gets its logprob, and the prompt's last token scores as it did when the
    model generated it; the text is prompt + completion, streamed or not; vLLM's ``prompt_logprobs`` field."""
    tok = server_engine.tokenizer
    ctx = tok.encode("The capital of France is")
    gen = _complete(client, ctx, max_tokens=1, logprobs=1)
    g_text, g_lp = gen.choices[0].text, gen.choices[0].logprobs.token_logprobs[0]
    g = tok.encode(g_text)
    assert len(g) == 1  # (" Paris": one token, as generated)
    full = ctx + g
    other = tok.encode("def add(a, b):")
    r = _complete(client, [full, other], max_tokens=1, logprobs=1, echo=True)
    for choice, ids in zip(r.choices, (full, other)):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the one new token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
        assert choice.text == tok.decode(ids, skip_special_tokens=False) + lp.tokens[-1]
        assert lp.text_offset[len(ids)] == len(choice.text) - len(lp.tokens[-1])
        # lm-eval's parse: the continuation's logprob and whether it is greedy
        cont, tops = lp.token_logprobs[1:-1], lp.top_logprobs[1:-1]
        assert sum(cont) < 0 and all(c <= max(t.values()) + 1e-6 for c, t in zip(cont, tops))
    # the generated token, scored as part of a prompt
    assert r.choices[0].logprobs.token_logprobs[len(ctx)] == pytest.approx(g_lp, abs=1e-4)
    assert r.choices[0].logprobs.top_logprobs[len(ctx)] == {g_text: pytest.approx(g_lp, abs=1e-4)}
    streamed = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0,
                                              echo=True, stream=True))
    plain = _complete(client, "Hello there", max_tokens=4, echo=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None
    # max_tokens 0 with echo: the prompt scored, nothing generated (the older lm-eval and HELM recipe)
    only = _complete(client, other, max_tokens=0, logprobs=1, echo=True)
    (c,) = only.choices
    assert c.text == tok.decode(other, skip_special_tokens=False) and c.finish_reason == "length"
    assert c.logprobs.token_logprobs == r.choices[1].logprobs.token_logprobs[:-1]
    assert only.usage.completion_tokens == 0 and only.usage.total_tokens == only.usage.prompt_tokens == len(other)
    chunks = list(client.completions.create(model=MODEL, prompt=other, max_tokens=0, echo=True, stream=True,
                                            temperature=0))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text and chunks[-1].choices[0].finish_reason == "length"
    v = _complete(client, other, max_tokens=1, extra_body={"prompt_logprobs": 2})
    pl = v.choices[0].model_extra["prompt_logprobs"]
    assert v.choices[0].text == r.choices[1].logprobs.tokens[-1] and pl[0] is None and len(pl) == len(other)
    for j in range(1, len(other)):
        assert str(other[j]) in pl[j] and 2 <= len(pl[j]) <= 3
        assert pl[j][str(other[j])]["logprob"] == pytest.approx(r.choices[1].logprobs.token_logprobs[j], abs=1e-5)


def test_tokenizer_routes_as_vllm_and_lm_eval_use_them(server, server_engine):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness tokenizes through them when a
    server has them): the engine's own tokenizer and chat template, round trips, the model's context."""
    tok = server_engine.tokenizer
    text = "The capital of France is Paris."
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server_engine.max_model_len and "".join(r["token_strs"]) == text
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    msgs = [{"role": "user", "content": "Say hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == tok.apply_chat_template(msgs) and chat["token_strs"] is None
    # vLLM's prompt_logprobs on chat: the rendered conversation's tokens, scored (in the body, not streamed)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={"messages": msgs, "max_tokens": 1, "prompt_logprobs": 1}).json()
    pl = r["prompt_logprobs"]
    assert len(pl) == len(chat["tokens"]) == r["usage"]["prompt_tokens"] and pl[0] is None
    assert all(str(t) in e and e[str(t)]["logprob"] <= 0 for t, e in zip(chat["tokens"][1:], pl[1:]))
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={"messages": msgs, "max_tokens": 1})
    assert plain.json()["prompt_logprobs"] is None
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == server_engine.max_model_len
    assert httpx.post(f"{server.url}/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "specserve"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": __import__("specserve").__version__}


def test_completion_shape_and_usage(client, server_engine):
    prompt = "The capital of France is"
    r = _complete(client, prompt, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert isinstance(r.created, int)
    (choice,) = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(server_engine.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    spec = r.usage.model_extra["speculative"]
    assert set(spec) >= {"draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length"}


def test_completion_logprobs_and_token_prompt(client, server_engine):
    ids = server_engine.tokenizer.encode("Hello, my name is")
    by_text = _complete(client, "Hello, my name is", logprobs=2)
    by_ids = _complete(client, ids, logprobs=2)
    assert by_ids.choices[0].text == by_text.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == by_ids.usage.completion_tokens
    assert "".join(lp.tokens) == by_ids.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)


def test_multiple_prompts(client, server_engine):
    prompts = ["The sky is", "My favourite food is"]
    both = _complete(client, prompts)
    assert [c.index for c in both.choices] == [0, 1]
    for c, p in zip(both.choices, prompts, strict=True):
        assert c.text == _complete(client, p).choices[0].text
    ids = [server_engine.tokenizer.encode(p) for p in prompts]
    by_ids = _complete(client, ids)
    assert [c.text for c in by_ids.choices] == [c.text for c in both.choices]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_chat(client, server_engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(server_engine.tokenizer.apply_chat_template(messages))
    assert 1 <= r.usage.completion_tokens <= 12
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # The chosen token is the top-1 alternative when decoding greedily.
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_stream_and_non_stream(client):
    prompt = "List the days of the week: Monday, Tuesday,"
    base = _complete(client, prompt, max_tokens=16).choices[0].text
    words = [w.strip(",.") for w in base.split() if len(w.strip(",.")) > 2]
    assert words, base
    stop = words[min(1, len(words) - 1)]
    expected = base[:base.index(stop)]
    r = _complete(client, prompt, max_tokens=16, stop=[stop, "@@never@@"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = _complete(client, prompt, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_n2_and_seed_reproducible(client):
    kw = dict(max_tokens=8, temperature=0.8, seed=1234, n=2, extra_body={"ignore_eos": True})
    a = _complete(client, "Once upon a time", **kw)
    b = _complete(client, "Once upon a time", **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 16
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
                temperature=0.8, seed=7)
    assert (client.chat.completions.create(**chat).choices[0].message.content
            == client.chat.completions.create(**chat).choices[0].message.content)
    # Streamed n=2: each index's deltas concatenate to the non-streamed choice.
    streamed = ["", ""]
    for chunk in _complete(client, "Once upon a time", stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in a.choices]


def test_greedy_identical_with_and_without_speculation(client):
    on = _complete(client, REPEAT_PROMPT, max_tokens=16, extra_body={"ignore_eos": True})
    off = _complete(client, REPEAT_PROMPT, max_tokens=16, extra_body={"ignore_eos": True, "speculative": False})
    assert on.choices[0].text == off.choices[0].text
    spec_on, spec_off = on.usage.model_extra["speculative"], off.usage.model_extra["speculative"]
    assert spec_on["draft_tokens"] > 0 and spec_on["accepted_tokens"] > 0
    assert spec_off["draft_tokens"] == 0 and spec_off["accepted_tokens"] == 0
    # Per draft source: the sources' counters add up to the totals.
    sources = spec_on["sources"]
    assert sources and all(k in ("lookup", "model", "ngram", "eagle", "draft", "layer_skip", "suffix") for k in sources)
    for key in ("num_drafts", "draft_tokens", "accepted_tokens"):
        assert sum(v[key] for v in sources.values()) == spec_on[key]
    assert spec_off["sources"] is None
    chat = dict(model=MODEL, messages=[{"role": "user", "content": REPEAT_PROMPT}], max_tokens=12, temperature=0)
    assert (client.chat.completions.create(**chat).choices[0].message.content
            == client.chat.completions.create(**chat, extra_body={"speculative": False}).choices[0].message.content)


def test_disconnect_mid_stream_frees_kv(server, server_engine):
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 2:
                break
        assert server_engine.kv.num_free_blocks < server_engine.kv.pool.num_blocks  # still generating
    # Connection closed: the request is aborted and its blocks freed within a step or so.
    deadline = time.monotonic() + 15
    while server_engine.kv.num_free_blocks != server_engine.kv.pool.num_blocks:
        assert time.monotonic() < deadline, "KV blocks were not freed after the client disconnected"
        time.sleep(0.05)
    assert not server_engine.has_unfinished()
    # Non-streamed: a client that gives up (read timeout closes the connection) aborts its request too.
    body.update(stream=False, max_tokens=1000)  # would take a minute or more to finish
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 15
    while server_engine.kv.num_free_blocks != server_engine.kv.pool.num_blocks or server_engine.has_unfinished():
        assert time.monotonic() < deadline, "a non-streamed request went on after its client left"
        time.sleep(0.05)


def test_concurrent_streaming_clients(server, client):
    prompts = ["The quick brown fox", "In a galaxy far away", "Water boils at", "The best way to learn is"]
    expected = {p: _complete(client, p, max_tokens=10).choices[0].text for p in prompts}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(16)))

    texts = asyncio.run(main())
    assert texts == [expected[prompts[i % 4]] for i in range(16)]


def test_metrics_endpoint(server, client):
    _complete(client, REPEAT_PROMPT, max_tokens=8)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("specserve:time_to_first_token_seconds_bucket", "specserve:inter_token_latency_seconds_count",
                 "specserve:e2e_request_latency_seconds_count", "specserve:num_requests_running",
                 "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc",
                 "specserve:prefix_cache_queries_total", "specserve:prefix_cache_hits_total",
                 "specserve:prompt_tokens_total", "specserve:generation_tokens_total",
                 "specserve:spec_decode_num_drafts_total", "specserve:spec_decode_num_draft_tokens_total",
                 "specserve:spec_decode_num_accepted_tokens_total",
                 'specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",'
                 'position="0"}',
                 'specserve:request_success_total{finished_reason="length"'):
        assert name in text, name

    def value(prefix: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith(prefix)).rsplit(" ", 1)[1])

    assert value("specserve:spec_decode_num_draft_tokens_total") > 0
    # per source: the server's proposer is its one source, labelled by the method
    assert re.search(r'^specserve:spec_decode_source_num_draft_tokens_total\{model_name="[^"]+",source="[a-z_]+"\} '
                     r'[1-9]', text, re.M), text
    assert value("specserve:generation_tokens_total") >= 8
    assert value("specserve:e2e_request_latency_seconds_count") >= 1
