"""The Ray executor (``--distributed-executor-backend ray``): the test starts a local Ray cluster (2 CPUs) with
`ray start --head`, rank 1 runs as an actor placed on it, and greedy output equals TP=1's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from specserve import SamplingParams
from specserve.llm import LLM
from tests.helpers import save_tiny_checkpoint
from tests.test_engine import assert_same_or_near_tie
from tests.test_tensor_parallel import DEMO_PROMPTS

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster():
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    assert ray_bin, "the ray CLI is not installed next to this Python"
    port = _free_port()
    start = subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--port", str(port),
                            "--include-dashboard=false", "--disable-usage-stats"],
                           capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stdout[-2000:] + start.stderr[-2000:]
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)


def test_ray_executor_matches_one_rank(cluster):
    ref_llm = LLM(None, num_blocks=256, device="cpu", max_num_seqs=8)
    prompts = [ref_llm.tokenizer.encode(p) for p in DEMO_PROMPTS[:8]]
    sp = SamplingParams(temperature=0, max_tokens=16)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(None, sp, prompt_token_ids=prompts)]
    with LLM(None, tensor_parallel_size=2, distributed_executor_backend="ray", num_blocks=256, device="cpu",
             max_num_seqs=8, speculative_method="ngram", num_speculative_tokens=3) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]
        assert llm.engine.tp_group.backend == "ray"
    ties: list[tuple] = []
    for p, g, r in zip(prompts, got, ref):
        assert_same_or_near_tie(ref_llm, p, g, r, ties)
    assert len(ties) <= 1, ties


def test_ray_worker_loss_is_reported_with_its_rank(cluster, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m", "llama", layers=1)
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", num_blocks=64, device="cpu")
    group = llm.engine.tp_group
    reasons: list[str] = []
    llm.engine.add_failure_listener(reasons.append)
    ray.kill(group.workers.actors[0])
    with pytest.raises(Exception, match="rank 1"):
        for _ in range(50):  # the monitor notices within a second; a step fails at once
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert reasons and "rank 1" in reasons[0]
    llm.close()
