"""The load-and-fault soak (benchmarks/soak.py), shortened for CI: 16 streaming clients for 20 s on the demo
model with n-gram speculation, ~10% of them disconnecting abruptly, some requests timing out; afterwards every
finished answer is well-formed (greedy ones equal the unloaded reference), nothing is stuck, the engine is idle
with the whole KV pool free, and the server still answers. The long run (64 clients, 60 s, a real
`specserve serve` process) is ``benchmarks/soak.py``; its figures are in the README."""

from __future__ import annotations

import asyncio
import os

import pytest

from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import create_app
from tests.reliability_helpers import load_benchmark, wait_engine_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def server(server_engine, start_server):
    ae = AsyncEngine(server_engine, max_queue=64)
    ae.start()
    srv = start_server(create_app(ae))
    yield srv
    srv.stop()
    ae.shutdown()


def test_soak_short(server, server_engine):
    soak = load_benchmark("soak")
    cfg = soak.SoakConfig(clients=16, duration=20.0, greedy_max_tokens=16, max_tokens=24, num_prompts=4,
                          disconnect_fraction=0.125, timeout_fraction=0.1, drain_timeout=120.0)
    rep = asyncio.run(soak.run_soak(server.url, cfg, server_pid=os.getpid()))
    soak.print_report(rep, cfg)
    # In-process server: the RSS is this whole pytest process's, hence the loose bound.
    assert not rep.problems(max_rss_growth_mb=500), rep.problems(500)
    assert rep.ok >= 8 and rep.greedy_checked >= 4, rep.figures()
    assert rep.disconnected >= 2, rep.figures()  # the fault injection really happened
    assert rep.leaked_blocks == 0 and rep.stuck == 0
    wait_engine_idle(server_engine)
    assert server_engine.kv.num_free_blocks == server_engine.kv.pool.num_blocks
