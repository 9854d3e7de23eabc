"""Engines that close: ``LLM.close()``, ``with LLM(...)``, ``del llm`` and interpreter exit release the same
things (tensor-parallel workers, their monitor thread, the default process group, shared-memory files, the
models), so a second engine of any tensor-parallel size starts in the same process."""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch.distributed as dist

from specserve import SamplingParams
from specserve.config import SpecserveError
from specserve.llm import LLM
from tests.helpers import save_tiny_checkpoint

KW = dict(num_blocks=128, block_size=8, device="cpu", dtype="float32")
PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [4, 4, 4, 4, 4, 4, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("lifecycle") / "m", "llama", seed=3, layers=2)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(None, GREEDY, prompt_token_ids=PROMPTS)]


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/specserve-tp-*")) | set(glob.glob(os.path.join("/tmp", "specserve-tp-*")))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_released(pids: list[int], shm_before: set[str]) -> None:
    assert pids and not [p for p in pids if _alive(p)], "a tensor-parallel worker is still running"
    assert not dist.is_initialized(), "the default process group was left behind"
    assert not [t for t in threading.enumerate() if t.name == "specserve-tp-monitor"]
    assert _shm_files() <= shm_before, "a shared-memory file was left behind"


def _worker_pids(llm: LLM) -> list[int]:
    group = llm.engine.tp_group
    assert group is not None
    return [p.pid for p in group.workers.procs]


@pytest.mark.parametrize("how", ["close", "del"])
def test_second_tp2_engine_after_the_first_is_released(ckpt, how):
    shm_before = _shm_files()
    llm = LLM(ckpt, tensor_parallel_size=2, **KW)
    pids = _worker_pids(llm)
    first = _greedy(llm)
    if how == "close":
        llm.close()
        llm.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate(None, GREEDY, prompt_token_ids=PROMPTS)
    else:
        del llm
        gc.collect()
    _assert_released(pids, shm_before)
    with LLM(ckpt, tensor_parallel_size=2, **KW) as again:
        pids = _worker_pids(again)
        assert _greedy(again) == first
    _assert_released(pids, shm_before)


def test_tp_engine_while_another_is_open_is_one_clear_error(ckpt):
    with LLM(ckpt, tensor_parallel_size=2, **KW) as llm:
        with pytest.raises(SpecserveError, match="still open in this process"):
            LLM(ckpt, tensor_parallel_size=2, **KW)
        assert len(_greedy(llm)[0]) == 12  # the open one is untouched
    one = LLM(ckpt, **KW)  # TP=1 next to nothing, then TP=2 again: any size may follow any other
    ref = _greedy(one)
    one.close()
    with LLM(ckpt, tensor_parallel_size=2, **KW) as llm:
        assert len(_greedy(llm)) == len(ref)


def test_del_releases_the_models_and_draft(ckpt):
    """Without tensor parallel nothing outlives the object: after ``del`` and a collection the engine, its
    runner and its draft model are gone (nothing global keeps them)."""
    llm = LLM(ckpt, speculative_model=ckpt, num_speculative_tokens=2, **KW)
    assert _greedy(llm)
    refs = [weakref.ref(o) for o in (llm.engine, llm.engine.runner, llm.engine.runner.model)]
    del llm
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_interpreter_exit_releases_tensor_parallel_workers(ckpt):
    """A script that never closes its engine: the finalizer stops the workers at exit (cleanly: no
    traceback, exit code 0) and leaves no shared-memory file."""
    shm_before = _shm_files()
    script = textwrap.dedent(f"""
        from specserve.llm import LLM
        from specserve import SamplingParams
        llm = LLM({ckpt!r}, tensor_parallel_size=2, **{KW!r})
        print("PIDS", *[p.pid for p in llm.engine.tp_group.workers.procs], flush=True)
        llm.generate(None, SamplingParams(max_tokens=4), prompt_token_ids=[[5, 6, 7]])
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    pids = [int(p) for line in out.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert pids and not [p for p in pids if _alive(p)]
    assert _shm_files() <= shm_before


def test_a_server_engine_is_built_off_the_main_thread_and_errors_reach_the_caller(ckpt, tmp_path, monkeypatch):
    """``build_engine`` (what `specserve serve` and ``create_app`` use) builds a single-process engine in a
    thread that ends, so the loop thread is the only one whose OpenMP team stays; the engine works, and a load
    error is raised in the caller's thread as itself."""
    from specserve.config import EngineConfig
    from specserve.engine import engine as engine_module
    from specserve.engine.async_engine import build_engine
    from specserve.errors import CheckpointError

    seen: list[str] = []
    real = engine_module.Engine.__init__

    def init(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        seen.append(threading.current_thread().name)
        real(self, *a, **kw)

    monkeypatch.setattr(engine_module.Engine, "__init__", init)
    engine = build_engine(EngineConfig.from_kwargs(ckpt, dtype="float32", num_blocks=32))
    assert seen == ["specserve-load"] and threading.current_thread().name != "specserve-load"
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(CheckpointError):
        build_engine(EngineConfig.from_kwargs(str(tmp_path / "missing")))
