"""`specserve bench serve`: an OpenAI-API streaming load generator, like ``vllm bench serve``.

Requests arrive as a Poisson process (exponential gaps, fixed seed; ``--request-rate inf`` sends them all at
once), at most ``--concurrency`` in flight, each streamed over SSE. Reported: request and output-token
throughput, TTFT, TPOT and ITL (mean, median, p99) and end-to-end latency. Only the public OpenAI HTTP API is
used (``/v1/chat/completions`` for chat items, ``/v1/completions`` for raw prompts, ``/v1/models``), so any
compatible server can be measured. Where the server exports Prometheus ``/metrics`` with speculative-decoding
counters (specserve's ``specserve:spec_decode_*`` or vLLM's ``vllm:spec_decode_*`` names), the counters are read
before and after the measured requests, and their difference gives the run's drafts, acceptance rate, mean
acceptance length and acceptance per draft position.

``--launch 'SERVE ARGS' --compare-spec`` starts ``specserve serve SERVE ARGS`` itself on a free loopback
port twice -- first with the speculative flags removed, then as given -- waits for ``/health``, runs the same
load against each, stops it, and prints both side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from specserve.bench import report
from specserve.config import SpecserveError
from specserve.datasets import Item, load_dataset


@dataclass
class RequestResult:
    ok: bool
    start: float  # seconds since the benchmark started
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# -- one request -----------------------------------------------------------------------------------------------
def request_body(item: Item, endpoint: str, model: str, max_tokens: int, temperature: float,
                 ignore_eos: bool) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one item: chat items go to chat completions, raw prompts to completions."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / specserve extension
    chat = endpoint == "chat" or (endpoint == "auto" and item.messages is not None)
    if chat:
        body["messages"] = item.messages if item.messages is not None else [
            {"role": "user", "content": item.prompt or ""}]
        return "/v1/chat/completions", body
    body["prompt"] = item.prompt if item.prompt is not None else item.text
    return "/v1/completions", body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client, url: str, body: dict[str, Any], headers: dict[str, str], t_origin: float
                       ) -> RequestResult:
    """Stream one request; time every content chunk (one chunk may carry several tokens)."""
    t0 = time.perf_counter()
    res = RequestResult(False, t0 - t_origin)
    last = t0
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:200]
                    return res
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                if any(_chunk_text(c) for c in obj.get("choices") or []):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # connection errors, timeouts, bad JSON: count as a failed request
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2el = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no content in the stream"
    return res


# -- the load -------------------------------------------------------------------------------------------------
def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process); all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def resolve_model(client, base_url: str, headers: dict[str, str]) -> str:
    try:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        data = r.json().get("data") or []
        if data:
            return str(data[0]["id"])
    except Exception:
        pass
    return "default"


SPEC_COUNTERS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "draft_tokens",
                 "spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def parse_spec_counters(text: str) -> dict[str, Any] | None:
    """The speculative-decoding counters of a Prometheus exposition (summed over label sets, the per-position
    counter by its ``position`` label), or None if it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.split(":", 1)[-1].removesuffix("_total")
            if name == PER_POSITION and "position" in sample.labels:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif name in SPEC_COUNTERS:
                out[SPEC_COUNTERS[name]] = out.get(SPEC_COUNTERS[name], 0.0) + sample.value
    if not out:
        return None
    out["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


async def read_spec_counters(client, base_url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    """``/metrics``' speculative-decoding counters (None: no such endpoint or counters)."""
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers)
        return parse_spec_counters(r.text) if r.status_code == 200 else None
    except Exception:  # a server without Prometheus metrics, or an exposition this parser cannot read
        return None


def spec_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the counters moved by during a run, as ``bench offline`` reports it: drafting passes, draft and
    accepted tokens, acceptance rate, mean acceptance length (1 + accepted / passes: the bonus token counts)
    and acceptance per position (the fraction of drafting passes that accepted position i)."""
    if after is None:
        return None
    before = before or {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS.values()}
    per0 = before.get("accepted_per_position") or []
    per = [n - (per0[i] if i < len(per0) else 0.0) for i, n in enumerate(after["accepted_per_position"])]
    drafts = d["num_drafts"]
    return {**{k: int(v) for k, v in d.items()},
            "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
            "mean_acceptance_length": 1.0 + d["accepted_tokens"] / drafts if drafts else None,
            "acceptance_per_position": [n / drafts for n in per] if drafts else []}


async def run_load(base_url: str, items: list[Item], *, api_key: str | None = None, model: str | None = None,
                   request_rate: float = math.inf, concurrency: int | None = None, max_tokens: int = 128,
                   temperature: float = 0.0, ignore_eos: bool = False, endpoint: str = "auto", seed: int = 0,
                   warmup: bool = True, progress: bool = True) -> dict[str, Any]:
    """Send every item once; return the summary (figures in ms) plus the raw per-request samples (s)."""
    import httpx
    from tqdm import tqdm

    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or len(items), 1) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        model = model or await resolve_model(client, base_url, headers)
        bodies = [request_body(it, endpoint, model, max_tokens, temperature, ignore_eos) for it in items]
        if warmup:  # excluded: first-request costs (connection, allocations)
            path, body = bodies[0]
            w = await send_request(client, base_url + path, {**body, "max_tokens": min(4, max_tokens)}, headers,
                                   time.perf_counter())
            if not w.ok:
                raise SpecserveError(f"warm-up request to {base_url}{path} failed: {w.error}")
        counters = await read_spec_counters(client, base_url, headers)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        bar = tqdm(total=len(items), desc="requests", disable=not progress, file=sys.stderr)

        async def one(path: str, body: dict[str, Any]) -> RequestResult:
            if sem is None:
                r = await send_request(client, base_url + path, body, headers, t_origin)
            else:
                async with sem:
                    r = await send_request(client, base_url + path, body, headers, t_origin)
            bar.update(1)
            return r

        tasks = []
        t_origin = time.perf_counter()
        for gap, (path, body) in zip(arrival_gaps(len(bodies), request_rate, seed), bodies, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(path, body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_origin
        bar.close()
        spec = spec_summary(counters, await read_spec_counters(client, base_url, headers)) \
            if counters is not None else None
    summary = summarize(results, duration)
    summary["model"] = model
    summary["speculative"] = spec
    return summary


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(xs: list[float]) -> dict[str, float | None]:
    return {"mean": sum(xs) / len(xs) * 1000 if xs else None,
            "median": None if not xs else percentile(xs, 50) * 1000,  # type: ignore[operator]
            "p90": None if not xs else percentile(xs, 90) * 1000,  # type: ignore[operator]
            "p99": None if not xs else percentile(xs, 99) * 1000}  # type: ignore[operator]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2el for r in ok if r.e2el is not None],
    }
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        **{m: _stats_ms(v) for m, v in samples.items()},
        "samples": samples, "requests": [asdict(r) | {"itl": None} for r in results],
    }


# -- launching specserve serve ----------------------------------------------------------------------------------
SPEC_VALUE_FLAGS = ("--speculative-model", "--num-speculative-tokens", "--speculative-method",
                    "--speculative-config", "--draft-layers", "--prompt-lookup-min", "--prompt-lookup-max",
                    "--speculative-calibration-seconds", "--speculative-quantization",
                    "--speculative-draft-vocab-size", "--prompt-lookup-source", "--speculative-model-revision",
                    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--suffix-cache-tokens",
                    "--speculative-draft-tensor-parallel-size")
SPEC_BOOL_FLAGS = ("--speculative-adaptive", "--no-speculative-adaptive", "--prompt-lookup-first",
                   "--no-grammar-drafts")


def strip_flags(args: list[str], value_flags: tuple[str, ...], bool_flags: tuple[str, ...] = ()) -> list[str]:
    """``args`` without the given flags (``--flag value`` and ``--flag=value`` forms)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in value_flags:
            skip = "=" not in a
            continue
        if a in bool_flags:
            continue
        out.append(a)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """``specserve serve ARGS`` as a subprocess on a free loopback port; its output goes to a log file."""

    def __init__(self, serve_args: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = strip_flags(serve_args, ("--host", "--port"))
        cmd = [sys.executable, "-m", "specserve.cli", "serve", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SpecserveError(f"specserve serve exited with code {self.proc.returncode}: "
                                     f"{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SpecserveError(f"specserve serve did not become healthy within {timeout:.0f}s: {self._tail()}")

    def _tail(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            lines = f.read().strip().splitlines()
        return " | ".join(lines[-3:]) if lines else "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def launch_and_run(serve_args: list[str], log_path: str, timeout: float, name: str, **load: Any) -> dict[str, Any]:
    print(f"bench serve: starting `specserve serve {shlex.join(serve_args)}` ({name}); log: {log_path}",
          file=sys.stderr)
    srv = LaunchedServer(serve_args, log_path)
    try:
        srv.wait_ready(timeout)
        summary = asyncio.run(run_load(srv.url, **load))
    finally:
        srv.stop()
    summary["launch"] = shlex.join(srv.args)
    return summary


# -- CLI --------------------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--model", default=None, help="model name in requests (default: the first of /v1/models)")
    p.add_argument("--dataset", default="chat", help="code | summarize | chat | edit | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", default="inf", help="requests per second (Poisson), or inf")
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: unlimited)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--endpoint", choices=["auto", "chat", "completions"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch", default=None, metavar="'SERVE ARGS'", help="start `specserve serve SERVE ARGS`")
    p.add_argument("--compare-spec", action="store_true",
                   help="with --launch: run once without the speculative flags, once with them")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --compare-spec: rounds of off and on servers (alternating which goes first); the "
                        "ratios are printed per round with their median")
    p.add_argument("--launch-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write results.json, report.md and latency CDF plots here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    rate = float(args.request_rate)
    if rate <= 0 or args.num_prompts < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ValueError("--request-rate, --num-prompts and --concurrency must be positive")
    if args.compare_spec and not args.launch:
        raise ValueError("--compare-spec needs --launch 'SERVE ARGS'")
    if args.repeats < 1 or (args.repeats > 1 and not args.compare_spec):
        raise ValueError("--repeats must be positive and needs --compare-spec")
    items = load_dataset(args.dataset)
    items = [items[i % len(items)] for i in range(args.num_prompts)]
    load = dict(items=items, api_key=args.api_key, model=args.model, request_rate=rate,
                concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature,
                ignore_eos=args.ignore_eos, endpoint=args.endpoint, seed=args.seed, progress=not args.no_progress)
    runs: dict[str, dict[str, Any]] = {}
    if args.launch:
        serve_args = shlex.split(args.launch)
        log_dir = args.out or tempfile.mkdtemp(prefix="specserve-bench-")
        os.makedirs(log_dir, exist_ok=True)
        if args.compare_spec:
            off_args = strip_flags(serve_args, SPEC_VALUE_FLAGS, SPEC_BOOL_FLAGS)
            if off_args == serve_args:
                raise ValueError("--compare-spec: --launch has no speculative flags to compare")
            for r in range(1, args.repeats + 1):  # off first in odd rounds, on first in even ones (drift)
                sides = [("off", off_args), ("on", serve_args)]
                for side, side_args in sides if r % 2 else sides[::-1]:
                    tag = "" if args.repeats == 1 else f" {r}"
                    runs[f"spec {side}{tag}"] = launch_and_run(
                        side_args, os.path.join(log_dir, f"server_{side}{tag.strip()}.log"), args.launch_timeout,
                        f"speculation {side}{tag}", **load)
        else:
            runs["server"] = launch_and_run(serve_args, os.path.join(log_dir, "server.log"),
                                            args.launch_timeout, "as given", **load)
    else:
        runs["server"] = asyncio.run(run_load(args.base_url, **load))
    print(report.serve_table(runs))
    if line := report.spec_rounds_line(runs):
        print(line)
    doc = report.header("serve", {k: v for k, v in vars(args).items() if k not in ("func", "api_key")})
    doc.update(base_url=None if args.launch else args.base_url, runs=runs)
    if args.out:
        write_serve(args.out, doc)
        print(f"\nwrote {args.out}/results.json, report.md and plots", file=sys.stderr)
    return 0 if all(r["completed"] for r in runs.values()) else 1


def write_serve(out_dir: str, doc: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    plots = [report.plot_latency_cdfs({n: r["samples"] for n, r in doc["runs"].items()},
                                      os.path.join(out_dir, "latency_cdf.png"))]
    drafted = [{"batch_size": n, **r["speculative"]} for n, r in doc["runs"].items()
               if (r.get("speculative") or {}).get("num_drafts")]
    if drafted:
        plots.append(report.plot_acceptance(drafted, os.path.join(out_dir, "acceptance_per_position.png"),
                                            label="{}"))
    doc["plots"] = [os.path.basename(p) for p in plots]
    report.write_json(out_dir, doc)
    report.write_text(out_dir, "report.md", report.serve_markdown(doc, plots))
