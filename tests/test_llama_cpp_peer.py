"""`bench offline --peer llama.cpp`: interpreter discovery, the one-line error without a peer, and the JSON
contract of specserve/bench/llama_cpp_peer.py against a FAKE ``llama_cpp`` package (no real peer needed).
No timing is asserted."""

from __future__ import annotations

import json
import stat
import sys

import pytest
import torch

from specserve.bench import offline, report
from specserve.cli import main as cli_main
from specserve.config import SpecserveError
from tests.helpers import tiny_hf_model, write_char_tokenizer

FAKE_LLAMA_CPP = '''
import json, os

__version__ = "0.0-fake"
EOS = 2


def _log(kind, kw):
    path = os.environ.get("FAKE_LLAMA_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **kw}) + "\\n")


def fake_tokens(prompt, n, eos_at):
    """What the fake generates for ``prompt``: deterministic, an EOS at ``eos_at`` (then it goes on)."""
    return [EOS if i == eos_at else (len(prompt) * 7 + i) % 97 + 3 for i in range(n)]


class Llama:
    def __init__(self, **kw):
        if os.environ.get("FAKE_LLAMA_FAIL"):
            raise RuntimeError("cannot load " + kw["model_path"])
        _log("init", kw)

    def token_eos(self):
        return EOS

    def reset(self):
        _log("reset", {})

    def generate(self, tokens, **kw):
        _log("generate", {"prompt": list(tokens), **kw})
        eos_at = int(os.environ.get("FAKE_EOS_AT", "-1"))
        i = 0
        while True:
            yield fake_tokens(tokens, i + 1, eos_at)[i]
            i += 1
'''


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """A fake ``llama_cpp`` on PYTHONPATH (for the peer subprocess); returns the call log's path."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.delenv("FAKE_EOS_AT", raising=False)
    monkeypatch.delenv("FAKE_LLAMA_FAIL", raising=False)
    sys.path.insert(0, str(tmp_path / "fake"))
    import llama_cpp  # the fake, for fake_tokens()

    yield log, llama_cpp
    sys.path.remove(str(tmp_path / "fake"))
    sys.modules.pop("llama_cpp", None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_peer") / "model")
    tiny_hf_model("llama", seed=3, layers=2, vocab=256, initializer_range=0.05).save_pretrained(path)
    write_char_tokenizer(path, 256)
    return path


def calls(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def executable(path) -> str:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# -- interpreter discovery --------------------------------------------------------------------------------------
@pytest.fixture
def no_peer(monkeypatch, tmp_path):
    """Nothing found anywhere: no flag, no env, no llama_cpp here, no /tmp/llama-venv."""
    monkeypatch.delenv(offline.LLAMA_CPP_ENV, raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.setattr(offline, "LLAMA_CPP_DEFAULT_PYTHON", str(tmp_path / "absent" / "python"))


def test_discovery_order(no_peer, monkeypatch, tmp_path):
    flag, env, venv = (executable(tmp_path / n) for n in ("flag-python", "env-python", "venv-python"))
    with pytest.raises(SpecserveError, match="build_llama_cpp.sh"):
        offline.find_llama_cpp_python()
    monkeypatch.setattr(offline, "LLAMA_CPP_DEFAULT_PYTHON", venv)
    assert offline.find_llama_cpp_python() == venv
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "llama_cpp" else None)
    assert offline.find_llama_cpp_python() == sys.executable  # this interpreter has llama_cpp
    monkeypatch.setenv(offline.LLAMA_CPP_ENV, env)
    assert offline.find_llama_cpp_python() == env
    assert offline.find_llama_cpp_python(flag) == flag
    with pytest.raises(SpecserveError, match="--peer-python"):
        offline.find_llama_cpp_python(str(tmp_path / "nope"))
    monkeypatch.setenv(offline.LLAMA_CPP_ENV, str(tmp_path / "nope"))
    with pytest.raises(SpecserveError, match=offline.LLAMA_CPP_ENV):
        offline.find_llama_cpp_python()


def test_cli_error_without_peer_is_one_line(no_peer, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # never loaded: the peer check comes first
    rc = cli_main(["bench", "offline", "--model", str(gguf), "--peer", "llama.cpp", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "llama_cpp" in err and "build_llama_cpp.sh" in err
    rc = cli_main(["bench", "offline", "--model", str(tmp_path), "--peer", "llama.cpp", "--no-progress"])
    assert rc == 2 and ".gguf" in capsys.readouterr().err


def test_cli_error_python_without_llama_cpp(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rc = cli_main(["bench", "offline", "--model", str(gguf), "--peer", "llama.cpp", "--peer-python",
                   sys.executable, "--no-progress"])  # specserve's venv: no llama_cpp
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err and "cannot import llama_cpp" in err


# -- the peer script's JSON contract, on a fake llama_cpp ----------------------------------------------------------
PROMPTS = [[1, 5, 9, 11], [1, 7, 7, 7, 7, 3]]


def cfg(**kw) -> dict:
    return {"model_path": "/models/demo.gguf", "prompts": PROMPTS, "max_tokens": 6, "ignore_eos": False,
            "eos_token_ids": [2], "repeats": 3, "n_threads": 3, **kw}


def test_peer_json_contract(fake_llama, monkeypatch):
    log, fake = fake_llama
    monkeypatch.setenv("FAKE_EOS_AT", "3")
    assert offline.check_llama_cpp_python(sys.executable) == "0.0-fake"
    res = offline.call_llama_cpp_peer(sys.executable, cfg())
    assert res["llama_cpp_version"] == "0.0-fake" and res["n_threads"] == 3 and res["n_batch"] == 512
    assert res["n_ctx"] >= max(map(len, PROMPTS)) + 6
    assert len(res["runs"]) == 3 and res["tok_s_median"] >= 0
    for run in res["runs"]:
        assert [p["tokens"] for p in run["prompts"]] == [4, 4]  # stopped at (and including) the EOS
        assert run["output_tokens"] == 8 and run["seconds"] >= 0 and run["tok_s"] >= 0
        assert set(run["prompts"][0]) == {"tokens", "seconds", "tok_s"}
    assert res["outputs"] == [fake.fake_tokens(p, 4, 3) for p in PROMPTS]
    log_calls = calls(log)
    init = [c for c in log_calls if c["kind"] == "init"]
    assert len(init) == 1 and init[0] == {
        "kind": "init", "model_path": "/models/demo.gguf", "n_ctx": res["n_ctx"], "n_threads": 3,
        "n_threads_batch": 3, "n_batch": 512, "verbose": False, "logits_all": False}
    gens = [c for c in log_calls if c["kind"] == "generate"]
    assert len(gens) == 1 + 3 * 2  # warm-up + repeats x prompts
    assert all(g["temp"] == 0.0 and g["top_k"] == 1 and g["repeat_penalty"] == 1.0 for g in gens)
    assert [g["prompt"] for g in gens[1:3]] == PROMPTS  # the token ids as given: no template, no BOS added
    assert sum(c["kind"] == "reset" for c in log_calls) == len(gens)  # KV emptied before every prompt

    res = offline.call_llama_cpp_peer(sys.executable, cfg(ignore_eos=True, repeats=1, warmup=False))
    assert res["outputs"] == [fake.fake_tokens(p, 6, 3) for p in PROMPTS]  # EOS emitted, then goes on
    assert len(res["runs"]) == 1


def test_peer_failure_is_one_line(fake_llama, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(SpecserveError, match="llama.cpp peer .* failed: RuntimeError: cannot load /models/demo.gguf"):
        offline.call_llama_cpp_peer(sys.executable, cfg())


def test_run_llama_cpp_peer_ratios_and_table(fake_llama):
    _, fake = fake_llama
    ref = [fake.fake_tokens(PROMPTS[0], 6, -1), [0]]  # the first output agrees, the second does not
    b1 = {"batch_size": 1, "off_tok_s": 10.0, "on_tok_s": 20.0}
    res = offline.run_llama_cpp_peer(sys.executable, "/models/demo.gguf", PROMPTS, 6, 2, False, {2}, 1, ref, b1)
    peer = res["tok_s"]
    assert res["n_threads"] == 1 and res["llama_cpp_version"] == "0.0-fake" and len(res["raw"]["runs"]) == 2
    if peer:
        assert res["off_vs_peer"] == pytest.approx(10.0 / peer) and res["on_vs_peer"] == pytest.approx(20.0 / peer)
    assert res["modes"]["llama.cpp"]["agree"] == 1 and res["modes"]["llama.cpp"]["diverge_at"] == [None, 0]
    assert "1/2 (differ from token -, 0)" in report.table(report.peer_rows(res), ["engine", "tok/s", "same"])
    assert list(res["modes"]) == ["specserve off (batch 1)", "specserve on (batch 1)", "llama.cpp"]
    batches = [{**b1, "ratio": 2.0, "acceptance_rate": None, "mean_acceptance_length": None,
                "drafting_pass_fraction": None, "k_used": None, "alpha": None, "c": None, "ideal_speedup": None,
                "model_speedup": None, "efficiency": None, "mismatches": 0, "num_requests": 2}]
    text = report.offline_table(batches + [{**batches[0], "batch_size": 8}], peer=res)
    head, row1, row8 = text.splitlines()
    assert "llama.cpp tok/s" in head and "off/llama.cpp" in head and "on/llama.cpp" in head
    assert row8.split()[3:6] == ["-", "-", "-"]  # the peer is a batch-1 figure
    assert "| llama.cpp tok/s |" in report.offline_table(batches, markdown=True, peer=res)
    assert "off/llama.cpp" not in report.offline_table(batches)


def test_bench_offline_peer_llama_cpp_end_to_end(fake_llama, tiny_model, tmp_path, capsys, monkeypatch):
    """`specserve bench offline --peer llama.cpp` on a tiny random model, the fake in place of llama.cpp (which
    would load the model's GGUF: the fake reads no file)."""
    monkeypatch.setenv("SPECSERVE_NUM_THREADS", "1")
    monkeypatch.setattr(offline, "llama_cpp_model_path", lambda model: "/models/tiny.gguf")
    old_threads = torch.get_num_threads()
    out = tmp_path / "out"
    rc = cli_main(["bench", "offline", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
                   "--num-kv-blocks", "128", "--peer", "llama.cpp", "--peer-python", sys.executable,
                   "--dataset", "chat", "--num-prompts", "2", "--batch-sizes", "1,2", "--max-tokens", "4",
                   "--repeats", "1",
                   "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--out", str(out),
                   "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "llama.cpp tok/s" in printed and "on/llama.cpp" in printed and "llama-cpp-python 0.0-fake" in printed
    doc = json.loads((out / "results.json").read_text())
    peer = doc["llama_cpp"]
    assert peer["n_threads"] == peer["specserve_threads"] == 1 and len(peer["raw"]["runs"]) == 1
    gens = [c for c in calls(fake_llama[0]) if c["kind"] == "generate"]
    assert [len(g["prompt"]) for g in gens[1:]] == doc["prompt_tokens"]  # specserve's chat-templated ids
    assert peer["raw"]["runs"][0]["output_tokens"] == 2 * 4  # the fake never emits specserve's EOS here
    assert "## Peer: llama.cpp" in (out / "report.md").read_text()
    torch.set_num_threads(old_threads)
