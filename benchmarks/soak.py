"""Load and fault soak: many concurrent streaming clients against a loopback specserve server, with abrupt
disconnects and client timeouts, then checks that nothing leaked and every finished answer is right.

    .venv/bin/python benchmarks/soak.py [--clients 64] [--duration 60] [--json]
    .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000 [--server-pid PID]

Without ``--base-url`` it starts ``specserve serve`` itself (demo model, n-gram speculation, 127.0.0.1, a free
port) and stops it with SIGTERM at the end (its exit code must be 0). Only loopback addresses are accepted.

Clients: chat and completion requests, mostly streamed, mostly greedy (temperature 0; those must equal a
reference answer fetched one at a time before the load), the rest sampled with a seed; ~10% of the clients
disconnect abruptly at a random point of every request (FIN, or RST via SO_LINGER 0, sometimes before the
first byte of the answer), and ~5% of the other requests give up on a short client timeout. Each client runs
requests back to back until ``--duration`` is over; in-flight requests then get ``--drain-timeout`` seconds.

At the end (all must hold for exit code 0): every finished response is complete and well-formed, greedy ones
equal their reference, no request is stuck, the server is idle (running == waiting == 0) with the whole KV
pool free (``specserve:kv_cache_free_blocks`` == ``specserve:kv_cache_num_blocks``), /health and a normal
completion still work, and the server's RSS grew by less than ``--max-rss-growth-mb``. Figures printed:
requests ok / failed / disconnected / timed out, leaked blocks, p50/p99 latency, RSS start/end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

# (kind, prompt): chat prompts are user messages, completion prompts are raw text.
PROMPTS: list[tuple[str, str]] = [
    ("chat", "Say hi in five words."),
    ("completion", "one two three four five, one two three four five, one two"),
    ("chat", "List three colours, comma separated."),
    ("completion", "The capital of France is"),
    ("chat", "Count from one to ten in words."),
    ("completion", "def fibonacci(n):\n    "),
    ("chat", "What is the opposite of cold?"),
    ("completion", "Water boils at"),
]


@dataclass
class SoakConfig:
    clients: int = 64
    duration: float = 60.0
    greedy_max_tokens: int = 24  # greedy requests: always this many (so one reference per prompt suffices)
    max_tokens: int = 32  # sampled requests: 1..max_tokens
    disconnect_fraction: float = 0.10  # of the clients
    timeout_fraction: float = 0.05  # of the other clients' requests
    stream_fraction: float = 0.8
    greedy_fraction: float = 0.7
    num_prompts: int = len(PROMPTS)
    request_timeout: float = 300.0
    drain_timeout: float = 120.0
    idle_timeout: float = 30.0
    seed: int = 0


@dataclass
class SoakReport:
    ok: int = 0
    failed: int = 0
    disconnected: int = 0
    timed_out: int = 0
    rejected_429: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    stuck: int = 0
    leaked_blocks: int | None = None
    kv_num_blocks: int | None = None
    running_end: float | None = None
    waiting_end: float | None = None
    kv_usage_end: float | None = None
    preemptions: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    ttft_p50_s: float | None = None
    rss_start_mb: float | None = None
    rss_end_mb: float | None = None
    healthy_after: bool = False
    server_exit_code: int | None = None
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list, repr=False)
    ttfts: list[float] = field(default_factory=list, repr=False)

    def problems(self, max_rss_growth_mb: float | None = None) -> list[str]:
        out = []
        if self.failed:
            out.append(f"{self.failed} failed request(s): {self.failures[:5]}")
        if self.greedy_mismatches:
            out.append(f"{self.greedy_mismatches} greedy answer(s) differ from the reference")
        if self.stuck:
            out.append(f"{self.stuck} request(s) stuck")
        if self.leaked_blocks != 0:
            out.append(f"KV blocks not free at the end: {self.leaked_blocks}")
        if self.running_end or self.waiting_end:
            out.append(f"server not idle: running={self.running_end} waiting={self.waiting_end}")
        if not self.healthy_after:
            out.append("server unhealthy after the soak")
        if self.ok == 0:
            out.append("no request succeeded")
        if (max_rss_growth_mb is not None and self.rss_start_mb is not None and self.rss_end_mb is not None
                and self.rss_end_mb - self.rss_start_mb > max_rss_growth_mb):
            out.append(f"RSS grew by {self.rss_end_mb - self.rss_start_mb:.0f} MB")
        if self.server_exit_code not in (None, 0):
            out.append(f"server exit code {self.server_exit_code}")
        return out

    def figures(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("latencies")
        d.pop("ttfts")
        d["failures"] = d["failures"][:20]
        return d


# -- helpers shared with the tests ----------------------------------------------------------------------------
def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"refusing to send load to {host!r}: only loopback addresses are allowed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summing a metric's samples over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil

        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except Exception:
        return None


class ServerProcess:
    """``python -m specserve.cli serve`` on 127.0.0.1 and a free port; output goes to ``log_path``."""

    def __init__(self, args: list[str], log_path: str, port: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in wait())
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{self.log()}")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        finally:
            self._log.close()

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")[-5000:]


# -- requests -------------------------------------------------------------------------------------------------
def request_body(kind: str, prompt: str, max_tokens: int, stream: bool, greedy: bool, seed: int,
                 include_usage: bool = False, speculative: bool = True) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, "speculative": speculative}
    if greedy:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=seed)
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def check_json_response(kind: str, data: dict[str, Any], max_tokens: int) -> str:
    """The text of a complete non-streamed answer; raises AssertionError when it is malformed."""
    assert "error" not in data, data
    assert data["object"] == ("chat.completion" if kind == "chat" else "text_completion"), data
    (choice,) = data["choices"]
    assert choice["finish_reason"] in ("stop", "length"), choice
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert isinstance(text, str), choice
    usage = data["usage"]
    n = usage["completion_tokens"]
    assert 1 <= n <= max_tokens and usage["total_tokens"] == usage["prompt_tokens"] + n, usage
    assert choice["finish_reason"] != "length" or n == max_tokens, (choice, usage)
    return text


def check_sse(kind: str, payloads: list[str], max_tokens: int, include_usage: bool) -> str:
    """The text of a complete streamed answer (``data:`` payloads in order); raises AssertionError."""
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, ids
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert all(c["object"] == obj for c in chunks), chunks
    usage = chunks.pop()["usage"] if include_usage else None
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes and finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1]), finishes
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", chunks[0]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    if usage is not None:
        n = usage["completion_tokens"]
        assert 1 <= n <= max_tokens and (finishes[-1] != "length" or n == max_tokens), usage
    return text


def sse_payloads(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


async def fetch_reference(http: httpx.AsyncClient, base_url: str, kind: str, prompt: str, max_tokens: int) -> str:
    path, body = request_body(kind, prompt, max_tokens, stream=False, greedy=True, seed=0)
    r = await http.post(f"{base_url}{path}", json=body)
    assert r.status_code == 200, r.text
    return check_json_response(kind, r.json(), max_tokens)


class _Soak:
    def __init__(self, base_url: str, cfg: SoakConfig, refs: dict[tuple[str, str], str]) -> None:
        self.base_url, self.cfg, self.refs = base_url, cfg, refs
        self.report = SoakReport()
        self.prompts = PROMPTS[:cfg.num_prompts]
        u = urlparse(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def fail(self, why: str) -> None:
        self.report.failed += 1
        self.report.failures.append(why)

    async def client(self, idx: int, deadline: float, http: httpx.AsyncClient) -> None:
        rng = random.Random(self.cfg.seed * 100_003 + idx)
        disconnector = idx < round(self.cfg.clients * self.cfg.disconnect_fraction)
        while time.monotonic() < deadline:
            kind, prompt = rng.choice(self.prompts)
            greedy = rng.random() < self.cfg.greedy_fraction
            max_tokens = self.cfg.greedy_max_tokens if greedy else rng.randint(1, self.cfg.max_tokens)
            stream = disconnector or rng.random() < self.cfg.stream_fraction
            include_usage = stream and rng.random() < 0.3
            speculative = rng.random() < 0.9
            path, body = request_body(kind, prompt, max_tokens, stream, greedy, rng.randrange(2**31),
                                      include_usage, speculative)
            if disconnector:
                await self.disconnecting_request(rng, path, body)
                continue
            timeout = rng.uniform(0.2, 3.0) if rng.random() < self.cfg.timeout_fraction else None
            await self.normal_request(kind, prompt, path, body, greedy, max_tokens, include_usage, timeout, http)

    async def normal_request(self, kind: str, prompt: str, path: str, body: dict[str, Any], greedy: bool,
                             max_tokens: int, include_usage: bool, timeout: float | None,
                             http: httpx.AsyncClient) -> None:
        t0 = time.monotonic()
        ttft: list[float] = []

        async def go() -> str | None:
            if body["stream"]:
                payloads = []
                async with http.stream("POST", f"{self.base_url}{path}", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self.status_error(r.status_code, r.text)
                        return None
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            ttft.append(time.monotonic() - t0)
                            payloads.append(line[6:])
                return check_sse(kind, payloads, max_tokens, include_usage)
            r = await http.post(f"{self.base_url}{path}", json=body)
            if r.status_code != 200:
                self.status_error(r.status_code, r.text)
                return None
            return check_json_response(kind, r.json(), max_tokens)

        try:
            text = await asyncio.wait_for(go(), timeout or self.cfg.request_timeout)
        except asyncio.TimeoutError:
            if timeout is None:
                self.fail(f"{path}: no answer within {self.cfg.request_timeout}s")
            else:
                self.report.timed_out += 1
            return
        except AssertionError as e:
            self.fail(f"{path}: malformed answer: {str(e)[:300]}")
            return
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            self.fail(f"{path}: {type(e).__name__}: {str(e)[:300]}")
            return
        if text is None:
            return
        self.report.ok += 1
        self.report.latencies.append(time.monotonic() - t0)
        if ttft:
            self.report.ttfts.append(ttft[0])
        if greedy:
            self.report.greedy_checked += 1
            if text != self.refs[(kind, prompt)]:
                self.report.greedy_mismatches += 1
                self.report.failures.append(f"greedy mismatch for {prompt!r}: {text!r} != "
                                            f"{self.refs[(kind, prompt)]!r}")

    def status_error(self, status: int, text: str) -> None:
        if status == 429:
            self.report.rejected_429 += 1
        else:
            self.fail(f"HTTP {status}: {text[:300]}")

    async def disconnecting_request(self, rng: random.Random, path: str, body: dict[str, Any]) -> None:
        """Raw HTTP/1.1 over a socket: read a random number of events (maybe none), then vanish (FIN, or an
        RST through SO_LINGER 0)."""
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        events_wanted = rng.choice([0, 0, 1, 2, rng.randint(3, 20)])
        rst = rng.random() < 0.5
        reader, writer = await asyncio.open_connection(self.host, self.port)

        async def go() -> None:
            writer.write(head + payload)
            await writer.drain()
            seen, buf = 0, b""
            while seen < events_wanted:
                chunk = await reader.read(4096)
                if not chunk:
                    return  # finished before we left: fine
                buf += chunk
                seen = buf.count(b"data: ")
            if events_wanted == 0:
                await asyncio.sleep(rng.uniform(0, 0.5))  # gone before (or right after) the first byte

        try:
            await asyncio.wait_for(go(), self.cfg.request_timeout)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            sock = writer.get_extra_info("socket")
            if rst and sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
            self.report.disconnected += 1


async def server_state(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    r = await http.get(f"{base_url}/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


async def wait_idle(http: httpx.AsyncClient, base_url: str, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await server_state(http, base_url)
        idle = (m.get("specserve:num_requests_running", 0) == 0 and m.get("specserve:num_requests_waiting", 0) == 0
                and m.get("specserve:kv_cache_free_blocks", -1) == m.get("specserve:kv_cache_num_blocks", -2))
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.25)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


async def run_soak(base_url: str, cfg: SoakConfig, server_pid: int | None = None,
                   log: Any = print) -> SoakReport:
    check_loopback(base_url)
    t_start = time.monotonic()
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout, connect=30), limits=limits) as http:
        refs: dict[tuple[str, str], str] = {}
        for kind, prompt in PROMPTS[:cfg.num_prompts]:  # one at a time: the unloaded reference
            refs[(kind, prompt)] = await fetch_reference(http, base_url, kind, prompt, cfg.greedy_max_tokens)
        log(f"soak: {len(refs)} reference answers; {cfg.clients} clients for {cfg.duration:.0f}s")
        soak = _Soak(base_url, cfg, refs)
        rep = soak.report
        rep.rss_start_mb = rss_mb(server_pid) if server_pid else None
        deadline = time.monotonic() + cfg.duration
        tasks = [asyncio.create_task(soak.client(i, deadline, http)) for i in range(cfg.clients)]
        await asyncio.sleep(cfg.duration)
        done, pending = await asyncio.wait(tasks, timeout=cfg.drain_timeout)
        rep.stuck = len(pending)
        for t in pending:
            t.cancel()
        for t in done:
            if t.exception() is not None:
                soak.fail(f"client crashed: {t.exception()!r}")
        m = await wait_idle(http, base_url, cfg.idle_timeout)
        rep.running_end = m.get("specserve:num_requests_running")
        rep.waiting_end = m.get("specserve:num_requests_waiting")
        rep.kv_usage_end = m.get("specserve:kv_cache_usage_perc")
        rep.preemptions = m.get("specserve:num_preemptions_total")
        if "specserve:kv_cache_num_blocks" in m:
            rep.kv_num_blocks = int(m["specserve:kv_cache_num_blocks"])
            rep.leaked_blocks = int(m["specserve:kv_cache_num_blocks"] - m["specserve:kv_cache_free_blocks"])
        rep.rss_end_mb = rss_mb(server_pid) if server_pid else None
        health = await http.get(f"{base_url}/health")
        kind, prompt = PROMPTS[0]
        after = await fetch_reference(http, base_url, kind, prompt, cfg.greedy_max_tokens)
        rep.healthy_after = health.status_code == 200 and after == refs[(kind, prompt)]
    rep.latency_p50_s, rep.latency_p99_s = _pct(rep.latencies, 0.5), _pct(rep.latencies, 0.99)
    rep.ttft_p50_s = _pct(rep.ttfts, 0.5)
    rep.seconds = round(time.monotonic() - t_start, 1)
    return rep


def print_report(rep: SoakReport, cfg: SoakConfig) -> None:
    def mb(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f} MB"

    print(f"clients {cfg.clients}, duration {cfg.duration:.0f}s (total {rep.seconds:.0f}s with references "
          f"and drain)")
    print(f"requests ok {rep.ok} / failed {rep.failed} / disconnected {rep.disconnected} / timed out "
          f"{rep.timed_out} / rejected 429 {rep.rejected_429}; stuck {rep.stuck}")
    print(f"greedy answers checked against the reference: {rep.greedy_checked}, mismatches "
          f"{rep.greedy_mismatches}")
    print(f"latency p50 {rep.latency_p50_s}s p99 {rep.latency_p99_s}s (ttft p50 {rep.ttft_p50_s}s); "
          f"preemptions {rep.preemptions}")
    print(f"end: running {rep.running_end} waiting {rep.waiting_end} kv usage {rep.kv_usage_end}; "
          f"leaked blocks {rep.leaked_blocks} of {rep.kv_num_blocks}")
    print(f"server RSS start {mb(rep.rss_start_mb)} end {mb(rep.rss_end_mb)}; healthy after: "
          f"{rep.healthy_after}; server exit code {rep.server_exit_code}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="an already running server (loopback only)")
    ap.add_argument("--server-pid", type=int, default=None, help="with --base-url: its PID, for RSS")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--greedy-max-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-fraction", type=float, default=0.10)
    ap.add_argument("--timeout-fraction", type=float, default=0.05)
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    ap.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the load this many times against the same server (RSS after each round)")
    ap.add_argument("--server-args", default="--speculative-method ngram --num-speculative-tokens 5",
                    help="extra `specserve serve` flags when the soak starts the server")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server we started
    cfg = SoakConfig(clients=args.clients, duration=args.duration, greedy_max_tokens=args.greedy_max_tokens,
                     max_tokens=args.max_tokens, disconnect_fraction=args.disconnect_fraction,
                     timeout_fraction=args.timeout_fraction, drain_timeout=args.drain_timeout, seed=args.seed)
    server = None
    base_url, pid = args.base_url, args.server_pid
    if base_url is None:
        import shlex
        import tempfile

        log_path = os.path.join(tempfile.mkdtemp(prefix="specserve-soak-"), "server.log")
        server = ServerProcess([*shlex.split(args.server_args), "--max-queue", str(max(256, 2 * args.clients))],
                               log_path)
        print(f"soak: starting `specserve serve {args.server_args}` on {server.url} (log: {log_path})")
        server.wait_healthy()
        base_url, pid = server.url, server.pid
    reports: list[SoakReport] = []
    try:
        for i in range(args.rounds):
            cfg.seed = args.seed + i
            reports.append(asyncio.run(run_soak(base_url, cfg, pid)))
            if args.rounds > 1:
                print(f"-- round {i + 1}/{args.rounds}")
                print_report(reports[-1], cfg)
    finally:
        if server is not None:
            code = server.terminate()
    rep = reports[-1]
    if server is not None:
        rep.server_exit_code = code
    if args.rounds > 1:  # the totals, RSS from the first round's start to the last round's end
        for name in ("ok", "failed", "disconnected", "timed_out", "rejected_429", "greedy_checked",
                     "greedy_mismatches", "stuck"):
            setattr(rep, name, sum(getattr(r, name) for r in reports))
        rep.failures = [f for r in reports for f in r.failures]
        rep.latencies = [x for r in reports for x in r.latencies]
        rep.ttfts = [x for r in reports for x in r.ttfts]
        rep.latency_p50_s, rep.latency_p99_s = _pct(rep.latencies, 0.5), _pct(rep.latencies, 0.99)
        rep.ttft_p50_s = _pct(rep.ttfts, 0.5)
        rep.rss_start_mb = reports[0].rss_start_mb
        print(f"-- all {args.rounds} rounds; RSS after each round: "
              f"{[None if r.rss_end_mb is None else round(r.rss_end_mb) for r in reports]} MB")
    print_report(rep, cfg)
    if args.json:
        print(json.dumps(rep.figures()))
    problems = rep.problems(args.max_rss_growth_mb)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
