"""specserve.bench: cost-model figures, deterministic workloads, `bench offline` end to end on a tiny random
model, and `bench serve` timing against a fake OpenAI streaming server with known delays."""

from __future__ import annotations

import asyncio
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from specserve import datasets as workloads
from specserve.bench import offline, report, serve
from specserve.cli import main as cli_main
from specserve.spec_decode.controller import expected_tokens, ideal_speedup
from tests.helpers import tiny_hf_model, write_char_tokenizer


# -- cost model on constructed numbers ------------------------------------------------------------------------
def test_ideal_speedup_and_efficiency():
    # alpha 0.8, k 4: E = (1 - 0.8^5) / 0.2 = 3.3616; cost 1 + 4 * 0.05 = 1.2
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert ideal_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert ideal_speedup(0.0, 4, 0.0) == pytest.approx(1.0)  # nothing accepted, free drafts: no gain
    assert ideal_speedup(0.9, 0, 0.5) == pytest.approx(1.0)  # k = 0 is plain decoding
    assert offline.efficiency(2.0, 2.5) == pytest.approx(0.8)
    assert offline.efficiency(None, 2.5) is None and offline.efficiency(1.0, None) is None
    for a, k in [(0.3, 3), (0.8, 4), (0.95, 5), (0.6, 2.5)]:  # alpha recovered from the mean length
        assert offline.alpha_from_length(expected_tokens(a, k), k) == pytest.approx(a, abs=1e-6)
    assert offline.alpha_from_length(1.0, 4) == 0.0 and offline.alpha_from_length(5.0, 4) == 1.0


class _FakeCost:
    def __init__(self, per_token: float, base: float) -> None:
        self.per_token, self.base = per_token, base

    def predict(self, tokens: float) -> float:
        return self.base + self.per_token * tokens


class _FakeController:
    max_k = 4
    target_cost = _FakeCost(0.0, 0.1)  # memory-bound: verification of k+1 tokens costs one step
    draft_cost = _FakeCost(0.0, 0.005)


def _run(spec: bool, tok_s: float, outputs, drafts=0, drafted=0, accepted=0, per=(), tpot=None):
    n = sum(len(o) for o in outputs)
    return offline.Run(spec, 1, n / tok_s, len(outputs), n, outputs,
                       {"num_drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                        "accepted_per_position": list(per)},
                       target_samples=[(1, 0.1), (1, 0.1), (40, 0.3)], draft_samples=[(1, 0.005)], tpot_s=tpot)


def test_summarize_constructed_runs():
    outs = [[5, 6, 7, 8] * 5, [9] * 20]
    off = [_run(False, 10.0, outs, tpot=0.010), _run(False, 10.0, outs, tpot=0.012)]
    on_outs = [outs[0], [9] * 10 + [4] * 10]  # request 1 diverges at output token 10
    on = [_run(True, 20.0, on_outs, drafts=10, drafted=40, accepted=20, per=(8, 6, 4, 2), tpot=0.004)] * 2
    s = offline.summarize(1, off, on, _FakeController())
    assert s["off_tok_s"] == pytest.approx(10) and s["on_tok_s"] == pytest.approx(20)
    assert s["ratio"] == pytest.approx(2.0)
    assert s["decode_ratio"] == pytest.approx(0.011 / 0.004)  # medians of the runs' TPOTs
    assert s["acceptance_rate"] == pytest.approx(0.5) and s["mean_acceptance_length"] == pytest.approx(3.0)
    assert s["k_used"] == pytest.approx(4.0)
    assert s["c"] == pytest.approx(0.05)  # 0.005 / median of the 1-token target steps
    # ideal = E(alpha, 4) / (1 + 4 c) with E(alpha, 4) = mean acceptance length = 3.0
    assert s["ideal_speedup"] == pytest.approx(3.0 / 1.2, rel=1e-6)
    assert s["efficiency"] == pytest.approx(2.0 / 2.5, rel=1e-6)
    assert s["model_speedup"] == pytest.approx(3.0 * 0.1 / (0.1 + 4 * 0.005), rel=1e-6)
    assert s["acceptance_per_position"] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert s["mismatches"] == 1 and s["mismatch_examples"][0]["position"] == 10
    text = report.offline_table([s])
    assert "2.000" in text and "2.750" in text and "1/2" in text


def test_tpot_of_request_outputs():
    """TPOT: a request's first token to its last over its tokens after the first, averaged over requests; a
    request of one token has none."""
    def out(n_tokens: int, ttft: float, elapsed: float):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n_tokens)))],
                               metrics={"ttft_s": ttft, "elapsed_s": elapsed})

    assert offline._tpot([out(11, 0.5, 1.5), out(5, 2.0, 2.2), out(1, 3.0, 3.0)]) == pytest.approx((0.1 + 0.05) / 2)
    assert offline._tpot([out(1, 0.1, 0.1)]) is None


# -- workloads ----------------------------------------------------------------------------------------------------
def test_workloads_deterministic_and_shipped():
    for name in workloads.BUILDERS:
        first, second = workloads.dumps(workloads.build(name)), workloads.dumps(workloads.build(name))
        assert first == second, name
        doc = json.loads(first)
        assert doc["num_prompts"] == len(doc["prompts"]) >= 40
        assert len(first.encode()) < 200_000
        ids = [p["id"] for p in doc["prompts"]]
        assert len(set(ids)) == len(ids)
        for p in doc["prompts"]:
            assert p["messages"][0]["content"] and p["source"]
            assert len(p["messages"][0]["content"]) <= workloads.MAX_PROMPT_CHARS + 200
            assert ("response_format" in p) == (name == "json")
        path = os.path.join(workloads.WORKLOADS_DIR, f"{name}.json")
        with open(path, encoding="utf-8") as f:
            shipped = f.read()
        if name != "chat" and json.loads(shipped)["python_version"] != doc["python_version"]:
            continue  # stdlib sources differ between Python versions; rebuild with `-m specserve.datasets`
        assert shipped == first, f"{path} is stale: python -m specserve.datasets"
    assert len(workloads.CHAT_INSTRUCTIONS) >= 50


def test_load_dataset_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "def f(x):"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = workloads.load_dataset(str(path))
    assert [it.prompt for it in items] == ["def f(x):", None]
    assert items[1].messages == [{"role": "user", "content": "hi"}]
    assert serve.request_body(items[0], "auto", "m", 8, 0.0, False)[0] == "/v1/completions"
    assert serve.request_body(items[1], "auto", "m", 8, 0.0, False)[0] == "/v1/chat/completions"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        workloads.load_dataset(str(bad))
    with pytest.raises(ValueError, match="built-in"):
        workloads.load_dataset("no-such-workload")


# -- bench offline end to end on a tiny random model ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_bench") / "model")
    tiny_hf_model("llama", seed=3, layers=2, vocab=256, initializer_range=0.05).save_pretrained(path)
    write_char_tokenizer(path, 256)
    return path


@pytest.fixture
def one_thread(monkeypatch):
    """Engines read SPECSERVE_NUM_THREADS; tiny matmuls are fastest (and deterministic) on one thread."""
    monkeypatch.setenv("SPECSERVE_NUM_THREADS", "1")
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_bench_offline_end_to_end(tiny_model, tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    rc = cli_main(["bench", "offline", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
                   "--num-kv-blocks", "128", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                   "--dataset", "chat", "--num-prompts", "2", "--batch-sizes", "1,2", "--max-tokens", "12",
                   "--repeats", "1", "--peer", "hf", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "off tok/s" in printed and "hf prompt_lookup k=3" in printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["benchmark"] == "offline" and doc["machine"]["cpu_count"] >= 1
    assert doc["versions"]["torch"] and doc["command"] and doc["args"]["dataset"] == "chat"
    assert [b["batch_size"] for b in doc["batches"]] == [1, 2]
    for b in doc["batches"]:
        assert b["off_tok_s"] > 0 and b["on_tok_s"] > 0 and b["num_requests"] == 2
        assert len(b["runs"]) == 2 and b["mismatches"] == 0  # fp32 tiny model, greedy: speculation exact
        if b["k_used"] is not None:
            assert 0 < b["k_used"] <= 3 and 0 <= b["acceptance_rate"] <= 1
    peer = doc["peer"]["modes"]
    assert peer["hf"]["tok_s"] > 0 and peer["hf"]["num_prompts"] == 2
    assert peer["hf"]["agree"] == 2  # same weights, greedy, fp32: the same tokens as specserve
    md = (out / "report.md").read_text()
    assert "| batch |" in md and "throughput.png" in md
    for png in ("throughput.png", "acceptance_per_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench serve against a fake OpenAI streaming server ----------------------------------------------------------
TTFT, ITL = 0.2, 0.05


def fake_openai_app():
    """Streams ``max_tokens`` tokens after TTFT, ITL apart; its ``/metrics`` (vLLM's names) count one drafting
    pass per finished request, 3 drafts of which positions 0 and 1 are accepted."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    finished = [0]

    async def stream(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        n = int(body["max_tokens"])

        async def events():
            if chat:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
            await asyncio.sleep(TTFT)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL)
                choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            finished[0] += 1
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def metrics(request: Request):
        n = finished[0]
        return PlainTextResponse(vllm_metrics(n, 3 * n, [n, n, 0]))

    return Starlette(routes=[Route("/v1/chat/completions", stream, methods=["POST"]),
                             Route("/v1/completions", stream, methods=["POST"]),
                             Route("/v1/models", models), Route("/metrics", metrics)])


def vllm_metrics(drafts: int, draft_tokens: int, per_pos: list[int]) -> str:
    """A Prometheus exposition with vLLM's speculative-decoding counters (and one unrelated counter)."""
    lines = ["# HELP vllm:num_preemptions Preemptions.", "# TYPE vllm:num_preemptions counter",
             'vllm:num_preemptions_total{model_name="m"} 7.0']
    for name, value in (("spec_decode_num_drafts", drafts), ("spec_decode_num_draft_tokens", draft_tokens),
                        ("spec_decode_num_accepted_tokens", sum(per_pos))):
        lines += [f"# HELP vllm:{name} x.", f"# TYPE vllm:{name} counter", f'vllm:{name}_total{{model_name="m"}} {value}.0']
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos x.",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}.0'
              for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def test_spec_counters_are_read_from_vllm_and_specserve_metrics():
    before = serve.parse_spec_counters(vllm_metrics(10, 30, [9, 6, 3]))
    after = serve.parse_spec_counters(vllm_metrics(20, 70, [18, 13, 8, 2]))
    assert before == {"num_drafts": 10, "draft_tokens": 30, "accepted_tokens": 18, "accepted_per_position": [9, 6, 3]}
    s = serve.spec_summary(before, after)
    assert s["num_drafts"] == 10 and s["draft_tokens"] == 40 and s["accepted_tokens"] == 23
    assert s["acceptance_rate"] == pytest.approx(23 / 40) and s["mean_acceptance_length"] == pytest.approx(3.3)
    assert s["acceptance_per_position"] == pytest.approx([0.9, 0.7, 0.5, 0.2])
    assert serve.parse_spec_counters("# TYPE other counter\nother_total 3\n") is None
    # specserve's own exposition, as its server writes it
    from specserve.server.metrics import ServerMetrics
    stats = {"num_drafts": 4, "draft_tokens": 12, "accepted_tokens": 7, "accepted_per_position": [4, 2, 1]}
    text = ServerMetrics(lambda: {"speculative": stats}, "m").render()[0].decode()
    assert serve.parse_spec_counters(text) == {**stats, "accepted_per_position": [4, 2, 1]}


@pytest.fixture(scope="module")
def fake_server(start_server):
    srv = start_server(fake_openai_app())  # tests/conftest.py: uvicorn in a thread on a free loopback port
    yield srv
    srv.stop()


def assert_measures(measured_ms: float, delay_ms: float, low: float = 0.9) -> None:
    """A latency the load generator measured against the fake server's known delay: not below it (the server
    sleeps that long; gaps between streamed tokens can shrink when two arrive in one read: ``low``), and not
    orders above it (a unit or a missing part would be). No tighter upper bound: on a shared 2-core machine
    scheduling adds 50 % and more."""
    assert low * delay_ms <= measured_ms <= 3 * delay_ms, (measured_ms, delay_ms)


def test_bench_serve_timing(fake_server):
    items = workloads.load_dataset("chat")[:6]
    s = asyncio.run(serve.run_load(fake_server.url, items, request_rate=math.inf, concurrency=3, max_tokens=5,
                                   progress=False))
    assert s["completed"] == 6 and s["failed"] == 0 and s["model"] == "fake-model"
    assert s["total_output_tokens"] == 30
    assert_measures(s["ttft"]["mean"], TTFT * 1000)
    assert_measures(s["ttft"]["p99"], TTFT * 1000)
    assert_measures(s["itl"]["mean"], ITL * 1000, low=0.5)
    assert_measures(s["itl"]["median"], ITL * 1000, low=0.5)
    assert_measures(s["tpot"]["mean"], ITL * 1000, low=0.5)
    assert_measures(s["e2el"]["mean"], (TTFT + 4 * ITL) * 1000)
    assert len(s["samples"]["itl"]) == 6 * 4
    # the server's counters moved by these 6 requests (the warm-up request's pass is not counted)
    assert s["speculative"]["num_drafts"] == 6 and s["speculative"]["acceptance_per_position"] == [1.0, 1.0, 0.0]
    assert s["speculative"]["mean_acceptance_length"] == pytest.approx(3.0)
    # concurrency 3, 6 requests of ~0.4 s: two waves
    assert_measures(s["duration_s"] * 1000, 2 * (TTFT + 4 * ITL) * 1000)


def test_bench_serve_cli_poisson(fake_server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    out = tmp_path / "serve"
    rc = cli_main(["bench", "serve", "--base-url", fake_server.url + "/v1", "--dataset", str(data),
                   "--num-prompts", "4", "--request-rate", "20", "--max-tokens", "3", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT median (ms)" in printed and "acceptance per position" in printed
    doc = json.loads((out / "results.json").read_text())
    run = doc["runs"]["server"]
    assert run["completed"] == 4 and run["total_output_tokens"] == 12
    assert_measures(run["ttft"]["mean"], TTFT * 1000)
    assert [r["start"] for r in run["requests"]] == sorted(r["start"] for r in run["requests"])
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "acceptance_per_position.png").read_bytes()[:4] == b"\x89PNG"
    assert "TTFT" in (out / "report.md").read_text()
    assert run["speculative"]["num_drafts"] == 4


def test_poisson_gaps_and_flag_stripping():
    gaps = serve.arrival_gaps(2000, 10.0, seed=1)
    assert gaps == serve.arrival_gaps(2000, 10.0, seed=1) and gaps[0] == 0.0
    assert sum(gaps) / (len(gaps) - 1) == pytest.approx(0.1, rel=0.1)
    assert serve.arrival_gaps(3, math.inf, 0) == [0.0, 0.0, 0.0]
    args = ["m.gguf", "--speculative-method", "ngram", "--num-speculative-tokens=5", "--max-num-seqs", "8",
            "--no-speculative-adaptive", "--port", "9000"]
    assert serve.strip_flags(args, serve.SPEC_VALUE_FLAGS, serve.SPEC_BOOL_FLAGS) == [
        "m.gguf", "--max-num-seqs", "8", "--port", "9000"]
    assert serve.strip_flags(args, ("--port",)) == args[:-2]
    assert serve.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_compare_spec_rounds_are_paired_by_number_and_summarised_by_their_median():
    from specserve.bench import report

    def run(tps: float, ttft: float) -> dict:
        return {"output_throughput": tps, "ttft": {"median": ttft}}

    # --repeats 3: round 2 ran on first (the order alternates against drift)
    runs = {"spec off 1": run(10, 2.0), "spec on 1": run(12, 1.0), "spec on 2": run(9, 3.0),
            "spec off 2": run(10, 2.0), "spec off 3": run(20, 4.0), "spec on 3": run(30, 4.0)}
    assert report.spec_rounds(runs) == [(1.2, 0.5), (0.9, 1.5), (1.5, 1.0)]
    line = report.spec_rounds_line(runs)
    assert "1.20, 0.90, 1.50 (median 1.20x)" in line and "0.50, 1.50, 1.00 (median 1.00x)" in line
    assert report.spec_rounds_line({"spec off": run(10, 1.0), "spec on": run(11, 1.0)}) == ""  # one round

def test_repeats_need_compare_spec(capsys):
    assert cli_main(["bench", "serve", "--repeats", "2", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--repeats must be positive and needs --compare-spec" in capsys.readouterr().err


def test_bench_serve_launch_compare_spec(tiny_model, tmp_path, capsys, one_thread):
    """`--launch ... --compare-spec` starts the real `specserve serve` twice (tiny model), off then on."""
    out = tmp_path / "launch"
    launch = f"{tiny_model} --device cpu --num-kv-blocks 128 --speculative-method ngram --num-speculative-tokens 3"
    rc = cli_main(["bench", "serve", "--launch", launch, "--compare-spec", "--dataset", "chat", "--num-prompts", "4",
                   "--concurrency", "2", "--max-tokens", "8", "--out", str(out), "--no-progress",
                   "--launch-timeout", "120"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "spec off" in printed and "spec on" in printed and "output throughput ratio" in printed
    doc = json.loads((out / "results.json").read_text())
    off, on = doc["runs"]["spec off"], doc["runs"]["spec on"]
    assert "--speculative-method" not in off["launch"] and "--speculative-method ngram" in on["launch"]
    for run in (off, on):
        assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] > 0
        assert run["ttft"]["mean"] > 0 and run["e2el"]["p99"] >= run["ttft"]["p99"]
    assert (out / "server_off.log").exists() and (out / "server_on.log").exists()
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    # the servers' own counters: off never drafts; on's counters are consistent
    assert off["speculative"]["num_drafts"] == 0 and off["speculative"]["acceptance_rate"] is None
    s = on["speculative"]
    assert s["accepted_tokens"] <= s["draft_tokens"] <= 3 * s["num_drafts"]


@pytest.mark.slow
def test_fixed_costs_prices_every_step_from_its_table(capsys):
    """benchmarks/fixed_costs.py: the off run's modelled time is exactly its steps priced by the table (a
    prefill step, then one 1-token step per further output token; one prompt, so no prefix-cache hits), and
    greedy output with speculation equals the off run's."""
    from specserve.llm import LLM
    from tests.reliability_helpers import load_benchmark

    fc = load_benchmark("fixed_costs")
    table = [5.0, 6.0, 7.0]
    assert fc.step_cost(table, 0.5, 2) == pytest.approx(6e-3)
    assert fc.step_cost(table, 0.5, 10) == pytest.approx((7.0 + 0.5 * 7) / 1e3)
    assert fc.main(["--speculative-method", "ngram", "--dataset", "json", "--num-prompts", "1", "--max-tokens", "12",
                    "--runs", "1", "--step-ms", "5,6,7", "--row-ms", "0.5"]) == 0
    out = capsys.readouterr().out
    off = next(line for line in out.splitlines() if line.startswith("off:"))
    steps, tokens, seconds = int(off.split()[1]), int(off.split()[3]), float(off.split()[-2])
    llm = LLM(None)
    items = workloads.load_dataset("json")
    prompts = offline.prompt_ids(llm.tokenizer, items, 1, llm.engine.max_model_len, 12)
    want = sum(fc.step_cost(table, 0.5, len(p)) for p in prompts) + (tokens - len(prompts)) * 5e-3
    assert steps == tokens and seconds == pytest.approx(want, abs=1e-3)
    assert "outputs differing from off: 0/1" in out
