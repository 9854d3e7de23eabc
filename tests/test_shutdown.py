"""Graceful shutdown of the real `specserve serve` process (demo model) on SIGTERM.

Two servers start side by side (one load each): a long grace period, where the in-flight stream finishes
normally, and a 1-second one, where in-flight requests are ended with a final error event (streaming) or a
503 (non-streamed). Both: new requests are refused (connection refused or 503) as soon as the signal is
handled, the engine loop thread stops, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.reliability_helpers import serve_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SERVE_ARGS = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--max-model-len", "2048",
              "--num-kv-blocks", "256"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with serve_processes(tmp_path_factory.mktemp("shutdown-logs"),
                         {"long": [*SERVE_ARGS, "--shutdown-grace-seconds", "60"],
                          "short": [*SERVE_ARGS, "--shutdown-grace-seconds", "1"]}) as procs:
        yield procs


class Stream(threading.Thread):
    """A streamed completion read in the background: ``events`` (payloads), ``first`` set on the first."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=300) as http, http.stream("POST", f"{self.url}/v1/completions",
                                                              json={**self.body, "stream": True}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.first.set()


def _refuses_new_requests(url: str, timeout: float = 10.0) -> str:
    """Wait until a new request is refused: 'refused' (no listener) or '503'."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
        except httpx.TransportError:
            return "refused"
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "service_unavailable", r.text
            return "503"
        time.sleep(0.05)
    raise AssertionError("new requests are still accepted after SIGTERM")


def test_sigterm_lets_in_flight_stream_finish(servers):
    srv = servers["long"]
    stream = Stream(srv.url, {"prompt": "Write a story about the sea.", "max_tokens": 40, "temperature": 0,
                              "ignore_eos": True})
    assert stream.first.wait(120) and stream.status == 200, stream.error
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    _refuses_new_requests(srv.url)
    stream.join(120)
    assert not stream.is_alive() and stream.error is None, stream.error
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    chunks = [json.loads(e) for e in stream.events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-2:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert srv.wait(60) == 0, srv.log()
    assert time.monotonic() - t0 < 60  # did not wait for the whole grace period once the stream ended
    log = srv.log()
    assert "engine loop stopped" in log and "Traceback" not in log, log


def test_sigterm_grace_over_aborts_with_final_error(servers):
    srv = servers["short"]
    body = {"prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    stream = Stream(srv.url, body)
    assert stream.first.wait(120) and stream.status == 200, stream.error
    result: dict = {}

    def unstreamed() -> None:
        result["r"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)

    t = threading.Thread(target=unstreamed, daemon=True)
    t.start()
    time.sleep(1.0)  # the non-streamed request is in the engine
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    _refuses_new_requests(srv.url)
    stream.join(60)
    t.join(60)
    assert not stream.is_alive() and stream.error is None, stream.error
    # The stream ends properly: a final error event (503-type, says why), then [DONE].
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    err = json.loads(stream.events[-2])["error"]
    assert err["code"] == "service_unavailable" and "shutting down" in err["message"], err
    assert all("error" not in json.loads(e) for e in stream.events[:-2])
    r = result["r"]
    assert r.status_code == 503 and "grace period" in r.json()["error"]["message"], r.text
    assert srv.wait(60) == 0, srv.log()
    assert time.monotonic() - t0 < 30
    assert "engine loop stopped" in srv.log()
