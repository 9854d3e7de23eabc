"""KV exhaustion: with a tiny KV pool, many long requests all complete (preemption by recompute), none is lost,
greedy outputs equal the unpressured run, the pool is entirely free afterwards; a request that can never fit
is refused up front (a ValueError in the engine, a 400 over HTTP) instead of looping."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import Engine
from specserve.llm import LLM
from specserve.server.api import create_app
from tests.helpers import save_tiny_checkpoint
from tests.reliability_helpers import assert_openai_error, wait_engine_idle
from tests.test_engine import assert_same_or_near_tie

BLOCK = 8
SMALL_POOL = 16  # 128 token slots; the longest request below needs 100 (+ 3 lookahead)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    target = save_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3, layers=2)
    draft = save_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=4, layers=1)
    return target, draft


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts of 2..60 tokens, half of them repetitive (so n-gram drafts get accepted)."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            motif = [r.randrange(3, 250) for _ in range(r.randint(2, 5))]
            out.append((motif * 30)[:r.randint(10, 60)])
        else:
            out.append([r.randrange(3, 250) for _ in range(r.randint(2, 60))])
    return out


SPECS = {
    "none": {},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3, "speculative_adaptive": False},
    "draft": {"num_speculative_tokens": 3, "speculative_adaptive": False},  # + speculative_model (writes KV)
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_tiny_pool_all_complete_by_preemption(ckpts, spec):
    target, draft = ckpts
    kw = dict(SPECS[spec], block_size=BLOCK)
    if spec == "draft":
        kw["speculative_model"] = draft
    prompts = _prompts(24, seed=11)
    # One request fills the pool exactly (prompt + max_tokens == all slots): it must still be admitted.
    r = random.Random(5)
    prompts.append([r.randrange(3, 250) for _ in range(SMALL_POOL * BLOCK - MAX_TOKENS)])
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    ref_llm = LLM(target, num_blocks=1024, **kw)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(None, sp, prompt_token_ids=prompts)]
    assert ref_llm.get_metrics()["num_preemptions"] == 0

    small = LLM(target, num_blocks=SMALL_POOL, **kw)
    outs = small.generate(None, sp, prompt_token_ids=prompts)
    m = small.get_metrics()
    assert m["num_preemptions"] >= len(prompts) // 2, m["num_preemptions"]  # heavily pressured
    assert len(outs) == len(prompts) and all(o.finished for o in outs)  # none lost
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS and o.outputs[0].finish_reason == "length"
               for o in outs)
    ties: list[tuple] = []
    for p, o, want in zip(prompts, outs, ref, strict=True):
        assert_same_or_near_tie(ref_llm, p, o.outputs[0].token_ids, want, ties)
    assert len(ties) <= 1, ties
    assert m["kv_free_blocks"] == SMALL_POOL and m["num_running"] == m["num_waiting"] == 0
    if spec != "none":
        assert m["speculative"]["accepted_tokens"] > 0  # speculation really ran under pressure

    # Can never fit: refused at once, and the engine is still fine afterwards.
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        small.generate(None, SamplingParams(max_tokens=MAX_TOKENS + 1), prompt_token_ids=[prompts[-1]])
    again = small.generate(None, sp, prompt_token_ids=prompts[:2])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:2]]
    assert small.get_metrics()["kv_free_blocks"] == SMALL_POOL


def test_n2_and_sampled_requests_under_pressure(ckpts):
    """Seeded sampling and n > 1 siblings also survive preemption unchanged."""
    target, _ = ckpts
    prompts = _prompts(10, seed=21)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, n=2, max_tokens=24, ignore_eos=True)
    ref = LLM(target, num_blocks=1024, block_size=BLOCK).generate(None, sp, prompt_token_ids=prompts)
    small = LLM(target, num_blocks=SMALL_POOL, block_size=BLOCK)
    outs = small.generate(None, sp, prompt_token_ids=prompts)
    assert small.get_metrics()["num_preemptions"] > 0
    for o, want in zip(outs, ref, strict=True):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in want.outputs]
    assert small.get_metrics()["kv_free_blocks"] == SMALL_POOL


# -- through the HTTP server, on the demo model -----------------------------------------------------------------
HTTP_BLOCKS = 8  # 128 token slots of 16; each request below needs 3 blocks (+ lookahead), 4 run at once
HTTP_PROMPTS = ["Once upon a time, in a small village by the sea, there lived",
                "The three most important inventions in history are",
                "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
                "Here is a list of fruits: apple, banana, cherry, apple, banana,"]


@pytest.fixture(scope="module")
def demo_small_pool():
    engine = Engine(EngineConfig.from_kwargs(None, num_blocks=HTTP_BLOCKS, max_model_len=1024,
                                             speculative_method="ngram", num_speculative_tokens=3,
                                             speculative_adaptive=False))
    ae = AsyncEngine(engine, max_queue=64)
    yield engine, ae
    ae.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_http_tiny_pool_demo_model(demo_small_pool, start_server):
    engine, ae = demo_small_pool
    srv = start_server(create_app(ae))
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    try:
        # Unpressured reference: one request at a time (each fits the pool alone).
        ref = []
        for p in HTTP_PROMPTS:
            r = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": p}, timeout=120)
            assert r.status_code == 200, r.text
            ref.append(r.json()["choices"][0]["text"])
        assert engine.get_metrics()["num_preemptions"] == 0

        async def one(http: httpx.AsyncClient, p: str, stream: bool) -> str:
            if not stream:
                r = await http.post(f"{srv.url}/v1/completions", json={**body, "prompt": p})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 20
                return r.json()["choices"][0]["text"]
            async with http.stream("POST", f"{srv.url}/v1/completions",
                                   json={**body, "prompt": p, "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        async def main() -> list[str]:
            async with httpx.AsyncClient(timeout=240) as http:
                jobs = [one(http, p, stream=i % 2 == 0) for i, p in enumerate(HTTP_PROMPTS)]
                return list(await asyncio.gather(*jobs))

        texts = asyncio.run(main())
        assert engine.get_metrics()["num_preemptions"] > 0  # the pool really ran out
        assert texts == ref
        # prompt + max_tokens fits the context (1024) but never the pool (128 slots): a clear 400.
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": HTTP_PROMPTS[0], "max_tokens": 300},
                       timeout=60)
        assert_openai_error(r, 400, contains="can never fit in the KV cache")
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500})
        assert_openai_error(r, 400, contains="can never fit in the KV cache")
        wait_engine_idle(engine)
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()
