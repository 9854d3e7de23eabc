"""`specserve serve --tensor-parallel-size 2` as a real process (demo model, 2 CPU ranks over gloo).

One server serves the core of the server tests: the official openai client, streaming, and a client that
disconnects mid-stream (its KV blocks are free again; block tables live on rank 0, so every rank's cache is
free with them), then SIGTERM stops it and its worker. A second server loses its worker mid-stream (SIGKILL):
the client gets an error event, /health turns 503, the server exits non-zero and no worker is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.reliability_helpers import serve_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ["--tensor-parallel-size", "2", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
        "--max-model-len", "2048", "--num-kv-blocks", "256"]


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _workers(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"specserve.worker.tensor_parallel" in f.read():
                    found.append(child)
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with serve_processes(tmp_path_factory.mktemp("tp-logs"), {"core": ARGS, "fault": ARGS}, timeout=400) as procs:
        yield procs


def test_openai_client_streaming_disconnect_and_sigterm(servers):
    srv = servers["core"]
    workers = _workers(srv.pid)
    assert len(workers) == 1, workers
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text.strip() and r.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, temperature=0,
        stream=True) if c.choices]
    assert "".join(pieces).strip()

    total = _metric(srv.url, "specserve:kv_cache_num_blocks")
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json={
            "prompt": "Write a long story about a dragon.", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}) as resp:
        for n, _ in enumerate(resp.iter_lines()):
            if n > 6:
                break  # disconnect mid-stream
    deadline = time.monotonic() + 30
    while _metric(srv.url, "specserve:kv_cache_free_blocks") < total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(srv.url, "specserve:kv_cache_free_blocks") == total

    assert srv.terminate(120) == 0
    assert not any(_alive(w) for w in workers), "a worker outlived the server"


def test_a_killed_worker_fails_requests_and_exits_nonzero(servers):
    srv = servers["fault"]
    workers = _workers(srv.pid)
    assert len(workers) == 1, workers
    events: list[str] = []
    status = None
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json={
            "prompt": "Write a long story about a dragon.", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}) as resp:
        status = resp.status_code
        t_kill = None
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 5 and t_kill is None:
                os.kill(workers[0], signal.SIGKILL)
                t_kill = time.monotonic()
        assert t_kill is not None
        waited = time.monotonic() - t_kill
    assert status == 200 and waited < 30, waited
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "rank 1" in errors[0]["message"], events[-3:]
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    assert srv.wait(60) != 0
    assert not any(_alive(w) for w in workers)
    log = srv.log()
    assert "tensor-parallel worker rank 1 was killed by SIGKILL" in log, log[-2000:]
