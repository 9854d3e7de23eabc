"""Prometheus metrics for the server, with vLLM's names under the ``specserve:`` prefix.

Two sources: request-level latencies and finish reasons are observed by the HTTP handlers (what a client
sees, queueing included); engine counters and gauges are read at scrape time from the snapshot the engine
loop thread publishes after every step (so the scrape never touches the Engine itself). Each app has its own
``CollectorRegistry``: several apps can live in one process (tests) without clashing.

NOTE: prometheus_client exposes a counter ``specserve:x`` as ``specserve:x_total`` (as vLLM's are).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)

# (metric name, help, key in the engine snapshot)
_ENGINE_COUNTERS = (
    ("specserve:prompt_tokens", "Prefill tokens processed.", "num_prompt_tokens"),
    ("specserve:generation_tokens", "Generation tokens produced.", "num_generated_tokens"),
    ("specserve:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries"),
    ("specserve:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits"),
    ("specserve:num_preemptions", "Requests preempted (recomputed later).", "num_preemptions"),
)
_SPEC_COUNTERS = (
    ("specserve:spec_decode_num_drafts", "Verification passes with at least one draft token.", "num_drafts"),
    ("specserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", "draft_tokens"),
    ("specserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"),
)


class _EngineCollector:
    """Gauges and counters read from the engine loop's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []  # NOTE: no collect() at registration (the engine may not be running yet)

    def collect(self) -> Iterator[Metric]:
        m = self._snapshot()
        labels, values = ["model_name"], [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge("specserve:num_requests_running", "Requests in the running batch.",
                    m.get("num_running", 0))
        yield gauge("specserve:num_requests_waiting", "Requests waiting to be scheduled.",
                    m.get("num_waiting", 0))
        yield gauge("specserve:kv_cache_usage_perc", "KV cache usage (1 = full).", m.get("kv_usage", 0.0))
        yield gauge("specserve:kv_cache_free_blocks", "KV cache blocks free (prefix-cached ones included).",
                    m.get("kv_free_blocks", 0))
        yield gauge("specserve:kv_cache_num_blocks", "KV cache blocks in the pool.", m.get("kv_num_blocks", 0))
        yield gauge("specserve:spec_decode_k", "Drafts per step chosen by the controller.",
                    m.get("speculative_k", 0))
        for name, doc, key in _ENGINE_COUNTERS:
            yield counter(name, doc, m.get(key, 0))
        spec_stats = m.get("speculative") or {}
        for name, doc, key in _SPEC_COUNTERS:
            yield counter(name, doc, spec_stats.get(key, 0))
        per_pos = CounterMetricFamily("specserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(spec_stats.get("accepted_per_position") or []):
            per_pos.add_metric([self._model, str(pos)], float(n))
        yield per_pos
        # The same counters per draft source (the vLLM-named totals above stay label-free): "lookup", "model"
        # and "grammar" under --prompt-lookup-first and structured outputs, else the method's name.
        sources = m.get("speculative_sources") or {}
        method = m.get("speculative_method") or ""
        for name, doc, key in _SPEC_COUNTERS:
            fam = CounterMetricFamily(name.replace("spec_decode_", "spec_decode_source_"), doc + " By draft source.",
                                      labels=["model_name", "source"])
            for source, stats in sorted(sources.items()):
                fam.add_metric([self._model, source or method], float(stats.get(key, 0)))
            yield fam


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], model_name: str) -> None:
        disable_created_metrics()  # NOTE: process-wide; no `*_created` series (as vLLM)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.request_success = Counter(
            "specserve:request_success", "Finished completions (choices), by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("specserve:time_to_first_token_seconds", "Time to first token (server side).",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("specserve:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request (one per engine step; a step "
                             "may carry several tokens when drafts are accepted).",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specserve:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(snapshot, model_name))  # type: ignore[arg-type]

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latencies of one HTTP request, observed as outputs reach the handler."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self.start = time.monotonic()
        self._last: float | None = None
        self._done = False

    def on_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        model = self._m.model_name
        if self._last is None:
            self._m.ttft.labels(model).observe(now - self.start)
        else:
            self._m.itl.labels(model).observe(now - self._last)
        self._last = now

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        if self._done:
            return
        self._done = True
        model = self._m.model_name
        self._m.e2e.labels(model).observe(time.monotonic() - self.start)
        for reason in finish_reasons:
            self._m.request_success.labels(model, reason or "abort").inc()
