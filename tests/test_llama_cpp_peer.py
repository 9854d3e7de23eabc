"""The native llama.cpp peer (specserve/bench/llama_cpp_peer.py, `bench offline --peer llama.cpp`): locating the
binaries, the one-line error without them, llama-bench's JSON, and the command lines and requests sent, all
against FAKE llama-bench / llama-server scripts written here (no llama.cpp build needed). The last test runs the
real binaries on the demo GGUF when they are built, and skips otherwise. No timing is asserted."""

from __future__ import annotations

import json
import os
import stat
import statistics
import sys

import pytest
import torch

from specserve.bench import llama_cpp_peer as lcp
from specserve.bench import offline, report
from specserve.cli import main as cli_main
from specserve.config import SpecserveError
from tests.helpers import tiny_hf_model, write_char_tokenizer

# A llama-bench test object as build 11434 prints it with -o json (fields trimmed to those the parser reads
# plus a few it must ignore).
BENCH_JSON = [
    {"build_commit": "abc1234", "build_number": 11434, "cpu_info": "Fake CPU @ 2.0GHz", "gpu_info": "",
     "backends": "CPU", "model_filename": "/models/demo.gguf", "model_type": "llama ?B Q4_1",
     "model_size": 96000000, "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2,
     "type_k": "f16", "type_v": "f16", "flash_attn": False, "n_prompt": 64, "n_gen": 0, "n_depth": 0,
     "test_time": "2026-12-06T14:00:00Z", "avg_ns": 100, "stddev_ns": 1, "avg_ts": 1000.0, "stddev_ts": 50.0,
     "samples_ns": [1, 2, 3], "samples_ts": [900.0, 1100.0, 1000.0]},
    {"build_commit": "abc1234", "build_number": 11434, "cpu_info": "Fake CPU @ 2.0GHz", "n_threads": 2,
     "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 141.0, "stddev_ts": 2.0,
     "samples_ts": [139.0, 150.0, 140.0]},
]

FAKE_BENCH = r'''
import json, os, sys

argv = sys.argv[1:]
log = os.environ.get("FAKE_LLAMA_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({"kind": "bench", "argv": argv}) + "\n")
if os.environ.get("FAKE_LLAMA_FAIL"):
    print("error: failed to load model '" + argv[argv.index("-m") + 1] + "'", file=sys.stderr)
    sys.exit(1)
opt = {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1, 2)}
r, p, n = int(opt["-r"]), int(opt["-p"]), int(opt["-n"])
print("load_backend: loaded CPU backend (a log line on stderr)", file=sys.stderr)
tests = []
if p:
    tests.append({"build_number": 11434, "build_commit": "fake", "cpu_info": "Fake CPU", "n_threads": int(opt["-t"]),
                  "n_prompt": p, "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0, "stddev_ts": 1.0,
                  "samples_ts": [1000.0 + i for i in range(r)]})
if n:
    tests.append({"build_number": 11434, "build_commit": "fake", "cpu_info": "Fake CPU", "n_threads": int(opt["-t"]),
                  "n_prompt": 0, "n_gen": n, "n_depth": 0, "avg_ts": 100.0, "stddev_ts": 1.0,
                  "samples_ts": [100.0 + 2 * i for i in range(r)]})
print(json.dumps(tests, indent=2))
'''

FAKE_SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
log = os.environ.get("FAKE_LLAMA_LOG")


def write(rec):
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")


write({"kind": "server", "argv": argv})
if os.environ.get("FAKE_LLAMA_FAIL"):
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
EOS = 2


def fake_tokens(prompt, n, eos_at):
    return [EOS if i == eos_at else (len(prompt) * 7 + i) % 97 + 3 for i in range(n)]


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, doc):
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        write({"kind": "completion", **body})
        eos_at = int(os.environ.get("FAKE_EOS_AT", "-1"))
        toks = fake_tokens(body["prompt"], body["n_predict"], eos_at)
        if eos_at >= 0 and not body.get("ignore_eos"):
            toks = toks[:eos_at + 1]
        res = {"content": "x", "tokens_predicted": len(toks), "timings": {"predicted_per_second": 123.0}}
        if not os.environ.get("FAKE_SERVER_NO_TOKENS"):
            res["tokens"] = toks
        self.reply(200, res)


HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
'''


def write_exe(path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake_dir(tmp_path, monkeypatch):
    """A folder with fake llama-bench and llama-server, as $LLAMA_CPP_DIR; returns (folder, call log)."""
    d = tmp_path / "bin"
    d.mkdir()
    write_exe(d / "llama-bench", FAKE_BENCH)
    write_exe(d / "llama-server", FAKE_SERVER)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv(lcp.DIR_ENV, str(d))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    for v in ("FAKE_EOS_AT", "FAKE_LLAMA_FAIL", "FAKE_SERVER_NO_TOKENS"):
        monkeypatch.delenv(v, raising=False)
    return str(d), log


def calls(log, kind: str) -> list[dict]:
    return [c for c in map(json.loads, log.read_text().splitlines()) if c["kind"] == kind]


def fake_tokens(prompt, n, eos_at=-1):  # the fake server's output, for the agreement checks
    return [2 if i == eos_at else (len(prompt) * 7 + i) % 97 + 3 for i in range(n)]


# -- llama-bench JSON ------------------------------------------------------------------------------------------
def test_parse_bench_json():
    text = "main: some log line [not json]\n" + json.dumps(BENCH_JSON, indent=2) + "\nllama_perf: done\n"
    pp, tg = lcp.parse_bench_json(text[text.index("\n") + 1:])
    assert pp["test"] == "pp64" and pp["n_prompt"] == 64 and pp["n_gen"] == 0
    assert pp["tok_s"] == 1000.0 and pp["avg_tok_s"] == 1000.0 and pp["samples_tok_s"] == [900.0, 1100.0, 1000.0]
    assert tg["test"] == "tg128" and tg["tok_s"] == 140.0  # the median of the samples, not their average
    assert tg["avg_tok_s"] == 141.0 and tg["stddev_tok_s"] == 2.0 and tg["n_threads"] == 2
    assert pp["build_number"] == 11434 and pp["build_commit"] == "abc1234" and pp["cpu_info"] == "Fake CPU @ 2.0GHz"
    assert pp["model_type"] == "llama ?B Q4_1" and pp["n_batch"] == 2048
    combo, = lcp.parse_bench_json(json.dumps([{"n_prompt": 16, "n_gen": 32, "n_depth": 512, "avg_ts": 50}]))
    assert combo["test"] == "pp16+tg32@d512" and combo["tok_s"] == 50.0 and combo["samples_tok_s"] == []
    assert lcp.parse_bench_json("[]") == []
    for bad in ("", "llama-bench: error", "[{", '{"n_gen": 1}'):
        with pytest.raises(ValueError):
            lcp.parse_bench_json(bad)


def test_command_lines():
    assert lcp.bench_command("/b/llama-bench", "/m.gguf", 2, 3, 64, 128) == [
        "/b/llama-bench", "-m", "/m.gguf", "-t", "2", "-r", "3", "-p", "64", "-n", "128", "-o", "json"]
    assert lcp.bench_command("b", "m", 1, 5, 0, 16, ["-fa", "1"])[-4:] == ["-o", "json", "-fa", "1"]
    assert lcp.server_command("/b/llama-server", "/m.gguf", 2, 8080, 4096, ["-md", "d.gguf", "--spec-draft-n-max", "5"]) == [
        "/b/llama-server", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-c", "4096", "-np", "1", "--host",
        "127.0.0.1", "--port", "8080", "-md", "d.gguf", "--spec-draft-n-max", "5"]
    body = lcp.completion_body([1, 2, 3], 64, False)
    assert body == {"prompt": [1, 2, 3], "n_predict": 64, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                    "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False, "ignore_eos": False,
                    "return_tokens": True, "stream": False}


# -- locating the binaries ---------------------------------------------------------------------------------------
def test_find_binary_order_and_error(tmp_path, monkeypatch):
    monkeypatch.delenv(lcp.DIR_ENV, raising=False)
    monkeypatch.setattr(lcp, "DEFAULT_DIR", str(tmp_path / "default"))
    with pytest.raises(SpecserveError, match="build_llama_cpp.sh") as e:
        lcp.find_binary("llama-bench")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "llama-bench" in msg and str(tmp_path / "default") in msg
    os.makedirs(tmp_path / "default")
    default = write_exe(tmp_path / "default" / "llama-bench", "")
    assert lcp.find_binary("llama-bench") == default
    root = tmp_path / "root"  # a build root: DIR/build/bin is searched too
    os.makedirs(root / "build" / "bin")
    nested = write_exe(root / "build" / "bin" / "llama-bench", "")
    monkeypatch.setenv(lcp.DIR_ENV, str(root))
    assert lcp.find_binary("llama-bench") == nested
    flag = tmp_path / "flag"
    flag.mkdir()
    with pytest.raises(SpecserveError, match="--llama-cpp-dir"):
        lcp.find_binary("llama-bench", str(flag))
    explicit = write_exe(flag / "llama-bench", "")
    assert lcp.find_binary("llama-bench", str(flag)) == explicit
    (flag / "llama-server").write_text("not executable")
    with pytest.raises(SpecserveError, match="no executable llama-server"):
        lcp.find_binary("llama-server", str(flag))


def test_cli_error_without_binaries_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(lcp.DIR_ENV, str(tmp_path / "nothing"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # never loaded: the peer check comes first
    rc = cli_main(["bench", "offline", "--model", str(gguf), "--peer", "llama.cpp", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "llama-bench" in err and "build_llama_cpp.sh" in err and lcp.DIR_ENV in err
    rc = cli_main(["bench", "offline", "--model", str(tmp_path), "--peer", "llama.cpp", "--no-progress"])
    assert rc == 2 and ".gguf" in capsys.readouterr().err


# -- running the (fake) binaries -----------------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 11], [1, 7, 7, 7, 7, 3]]


def test_run_bench_on_fake(fake_dir, monkeypatch):
    d, log = fake_dir
    res = lcp.run_bench(lcp.find_binary(lcp.BENCH), "/models/demo.gguf", 2, 3, 5, 128)
    assert calls(log, "bench")[0]["argv"] == ["-m", "/models/demo.gguf", "-t", "2", "-r", "3", "-p", "5", "-n",
                                              "128", "-o", "json"]
    assert res["tg"]["test"] == "tg128" and res["tg"]["tok_s"] == 102.0 and res["pp"]["tok_s"] == 1001.0
    assert res["build_number"] == 11434 and res["command"].startswith(os.path.join(d, "llama-bench") + " -m ")
    assert lcp.run_bench(lcp.find_binary(lcp.BENCH), "m", 1, 1, 0, 8)["pp"] is None  # -p 0: no pp test
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(SpecserveError, match=r"llama-bench failed \(error: failed to load model '/x.gguf'\)"):
        lcp.run_bench(lcp.find_binary(lcp.BENCH), "/x.gguf", 1, 1, 0, 8)


def test_run_served_on_fake(fake_dir, monkeypatch):
    _, log = fake_dir
    monkeypatch.setenv("FAKE_EOS_AT", "3")
    res = lcp.run_served(lcp.find_binary(lcp.SERVER), "/models/demo.gguf", PROMPTS, 6, 2, False, 3, ["--foo", "1"])
    argv = calls(log, "server")[0]["argv"]
    assert argv[:6] == ["-m", "/models/demo.gguf", "-t", "3", "-tb", "3"] and argv[-2:] == ["--foo", "1"]
    assert argv[argv.index("-c") + 1] == str(6 + 6 + 16) and argv[argv.index("-np") + 1] == "1"
    reqs = calls(log, "completion")
    assert len(reqs) == 1 + 2 * 2  # warm-up + repeats x prompts, one at a time
    assert [r["prompt"] for r in reqs[1:3]] == PROMPTS  # the ids as given
    assert all(r["temperature"] == 0.0 and r["top_k"] == 1 and r["cache_prompt"] is False for r in reqs)
    assert reqs[0]["n_predict"] == 6 and reqs[1]["n_predict"] == 6
    assert res["outputs"] == [fake_tokens(p, 4, 3) for p in PROMPTS]  # stopped at (and including) the EOS
    assert len(res["runs_tok_s"]) == 2 and res["tok_s_median"] > 0 and res["decode_tok_s_median"] == 123.0
    monkeypatch.setenv("FAKE_SERVER_NO_TOKENS", "1")
    res = lcp.run_served(lcp.find_binary(lcp.SERVER), "m", PROMPTS, 6, 1, True, 1)
    assert res["outputs"] == [None, None] and res["tok_s_median"] > 0  # counted from tokens_predicted
    assert lcp.agreement(res["outputs"], PROMPTS, {2}) == (None, [])
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(SpecserveError, match="llama-server exited"):
        lcp.run_served(lcp.find_binary(lcp.SERVER), "m", PROMPTS, 6, 1, False, 1)


def test_offline_peer_ratios_and_table(fake_dir):
    ref = [fake_tokens(PROMPTS[0], 6) + [2], [0]]  # the first agrees (trailing EOS ignored), the second does not
    b1 = {"batch_size": 1, "off_tok_s": 204.0, "on_tok_s": 306.0}
    res = lcp.offline_peer("/models/demo.gguf", PROMPTS, 6, 3, False, {2}, 2, ref, b1)
    assert res["name"] == "llama.cpp tg128" and res["tok_s"] == 102.0 and res["build_number"] == 11434
    assert res["off_vs_peer"] == pytest.approx(2.0) and res["on_vs_peer"] == pytest.approx(3.0)
    assert list(res["modes"]) == ["specserve off (batch 1)", "specserve on (batch 1)", "llama-bench tg128",
                                  "llama-bench pp5 (prefill)", "llama-server, same prompts"]
    served = res["modes"]["llama-server, same prompts"]
    assert served["agree"] == 1 and served["diverge_at"] == [None, 0] and served["tok_s"] == res["served_tok_s"]
    assert "1/2 (differ from token -, 0)" in report.table(report.peer_rows(res), ["engine", "tok/s", "same"])
    batches = [{**b1, "ratio": 1.5, "acceptance_rate": None, "mean_acceptance_length": None,
                "drafting_pass_fraction": None, "k_used": None, "alpha": None, "c": None, "ideal_speedup": None,
                "model_speedup": None, "efficiency": None, "mismatches": 0, "num_requests": 2}]
    text = report.offline_table(batches + [{**batches[0], "batch_size": 8}], peer=res)
    head, row1, row8 = text.splitlines()
    assert "llama.cpp tg128 tok/s" in head and "on/llama.cpp tg128" in head
    assert "102.00" in row1 and "2.000" in row1 and "3.000" in row1
    assert row8.count(" - ") >= 3  # the peer is a batch-1 figure
    only_bench = lcp.offline_peer("/m.gguf", PROMPTS, 6, 1, False, {2}, 1, ref, None, n_gen=32, n_prompt=0,
                                  server=False)
    assert list(only_bench["modes"]) == ["llama-bench tg32"] and "served" not in only_bench


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama_peer") / "model")
    tiny_hf_model("llama", seed=3, layers=2, vocab=256, initializer_range=0.05).save_pretrained(path)
    write_char_tokenizer(path, 256)
    return path


def test_bench_offline_peer_llama_cpp_end_to_end(fake_dir, tiny_model, tmp_path, capsys, monkeypatch):
    """`specserve bench offline --peer llama.cpp` on a tiny random model, the fakes in place of llama.cpp (which
    would load the model's GGUF: the fakes read no file)."""
    _, log = fake_dir
    monkeypatch.setenv("SPECSERVE_NUM_THREADS", "1")
    monkeypatch.setattr(offline, "llama_cpp_model_path", lambda model: "/models/tiny.gguf")
    old_threads = torch.get_num_threads()
    out = tmp_path / "out"
    rc = cli_main(["bench", "offline", "--model", tiny_model, "--device", "cpu", "--dtype", "float32",
                   "--num-kv-blocks", "128", "--peer", "llama.cpp", "--dataset", "chat", "--num-prompts", "2",
                   "--batch-sizes", "1,2", "--max-tokens", "4", "--repeats", "1", "--peer-tg", "16",
                   "--peer-server-args", "--spec-type draft-simple",
                   "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--out", str(out),
                   "--no-progress"])
    torch.set_num_threads(old_threads)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "llama.cpp tg16 tok/s" in printed and "on/llama.cpp tg16" in printed and "build 11434, commit fake" in printed
    doc = json.loads((out / "results.json").read_text())
    peer = doc["llama_cpp"]
    assert peer["n_threads"] == peer["specserve_threads"] == 1
    bench_argv = calls(log, "bench")[0]["argv"]
    assert bench_argv[bench_argv.index("-n") + 1] == "16" and bench_argv[bench_argv.index("-t") + 1] == "1"
    assert bench_argv[bench_argv.index("-p") + 1] == str(int(statistics.median(doc["prompt_tokens"])))
    assert calls(log, "server")[0]["argv"][-2:] == ["--spec-type", "draft-simple"]
    reqs = calls(log, "completion")
    assert [len(r["prompt"]) for r in reqs[1:]] == doc["prompt_tokens"]  # specserve's chat-templated ids
    assert "## Peer: native llama.cpp" in (out / "report.md").read_text()


# -- the real binaries, when built (benchmarks/build_llama_cpp.sh) ---------------------------------------------------
@pytest.mark.slow
def test_real_llama_cpp_on_demo_gguf():
    try:
        bench, server = lcp.find_binary(lcp.BENCH), lcp.find_binary(lcp.SERVER)
    except SpecserveError as e:
        pytest.skip(str(e))
    from specserve.model.checkpoint.loader import default_model_path

    gguf = default_model_path()
    res = lcp.run_bench(bench, gguf, 1, 1, 8, 8)
    assert res["tg"]["tok_s"] > 0 and res["pp"]["tok_s"] > 0 and res["tg"]["n_gen"] == 8
    served = lcp.run_served(server, gguf, [[1, 2, 3, 4, 5]], 8, 1, True, 1)
    out, = served["outputs"]
    assert out is not None and len(out) == 8 and served["tok_s_median"] > 0
