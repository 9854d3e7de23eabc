"""Native llama.cpp as the measured peer of `specserve bench offline --peer llama.cpp` and
benchmarks/vs_llama_cpp.py: its own binaries, no Python in their loop (stdlib only here; never a dependency).

- ``llama-bench`` gives llama.cpp's decode and prefill rates on a GGUF: ``tg N`` (N tokens generated one at
  a time after an empty context) and ``pp P`` (a P-token prompt in one batch), ``-t`` threads, ``-r``
  repeats, ``-o json``. The figures are medians of its per-repeat samples.
- ``llama-server`` runs the same prompt token ids as specserve, one request at a time, greedy, no prompt
  cache; tok/s = generated tokens / wall seconds over the run's prompts, prefill included (specserve's
  definition), and the generated ids, for the "same tokens" check. Extra server flags (a draft model for
  llama.cpp's own speculation, for instance) pass through unchanged.

The binaries are found in ``--llama-cpp-dir DIR``, else ``$LLAMA_CPP_DIR``, else /tmp/llama.cpp-native/build/bin;
a DIR holding ``build/bin`` works too. ``bash benchmarks/build_llama_cpp.sh`` builds them.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from specserve.config import SpecserveError

DEFAULT_DIR = "/tmp/llama.cpp-native/build/bin"
DIR_ENV = "LLAMA_CPP_DIR"
BUILD_HINT = "bash benchmarks/build_llama_cpp.sh"
BENCH, SERVER, SPECULATIVE = "llama-bench", "llama-server", "llama-speculative-simple"


# -- locating the binaries ---------------------------------------------------------------------------------------
def llama_cpp_dir(explicit: str | None = None) -> str:
    """The folder searched for the binaries: ``explicit``, else $LLAMA_CPP_DIR, else the build script's default."""
    return explicit or os.environ.get(DIR_ENV) or DEFAULT_DIR


def find_binary(name: str, explicit_dir: str | None = None) -> str:
    """The path of llama.cpp's ``name`` binary; a missing one is a one-line SpecserveError naming the fix."""
    d = llama_cpp_dir(explicit_dir)
    for cand in (os.path.join(d, name), os.path.join(d, "build", "bin", name)):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    where = "--llama-cpp-dir" if explicit_dir else (f"${DIR_ENV}" if os.environ.get(DIR_ENV) else "the default")
    raise SpecserveError(f"llama.cpp peer: no executable {name} in {d} ({where}); build it with `{BUILD_HINT}` "
                         f"(binaries land in {DEFAULT_DIR}) or point --llama-cpp-dir / ${DIR_ENV} at them")


def build_info(bin_dir: str) -> dict[str, str]:
    """What benchmarks/build_llama_cpp.sh recorded beside the binaries (``source``, ``flags``), else {}: built
    from an sdist without git metadata, the binaries themselves report build 0, commit unknown."""
    info: dict[str, str] = {}
    for cand in (os.path.join(bin_dir, os.pardir, "specserve-build-flags.txt"),
                 os.path.join(bin_dir, "build", "specserve-build-flags.txt")):
        if os.path.isfile(cand):
            with open(cand, encoding="utf-8") as f:
                for line in f:
                    key, _, value = line.strip().partition(" ")
                    if key in ("source", "flags"):
                        info[key] = value
            break
    return info


def describe_build(bin_dir: str, build_number: Any, build_commit: Any) -> str:
    """One phrase naming the llama.cpp build: its source (from the build script's stamp) and build number."""
    src = build_info(bin_dir).get("source")
    own = f"build {build_number}, commit {build_commit}" if build_number else None
    return ", ".join(x for x in (src and f"native llama.cpp from {src}", own) if x) or "native llama.cpp"


# -- llama-bench -------------------------------------------------------------------------------------------------
def bench_command(exe: str, model: str, threads: int, repeats: int, n_prompt: int, n_gen: int,
                  extra: Sequence[str] = ()) -> list[str]:
    """llama-bench: one pp test (``-p``; 0 skips it) and one tg test (``-n``), JSON on stdout."""
    return [exe, "-m", model, "-t", str(threads), "-r", str(repeats), "-p", str(n_prompt), "-n", str(n_gen),
            "-o", "json", *extra]


def _median(xs: Iterable[float]) -> float | None:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else None


def parse_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench's ``-o json`` output (a list, one object per test) as one dict per test: ``test`` (``pp512``,
    ``tg128``, or ``pp512+tg128`` for a combined one), ``n_prompt``, ``n_gen``, ``n_threads``, ``tok_s``
    (median of the per-repeat samples, else its average), ``avg_tok_s``, ``stddev_tok_s``, ``samples_tok_s``
    and the build / CPU / model fields it reports. Text around the JSON list (log lines) is ignored."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("llama-bench printed no JSON list (was it run with -o json?)")
    try:
        raw = json.loads(text[start:end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench JSON does not parse: {e}") from None
    if not isinstance(raw, list):
        raise ValueError("llama-bench JSON is not a list of tests")
    tests = []
    for t in raw:
        n_prompt, n_gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        name = "+".join(f"{k}{n}" for k, n in (("pp", n_prompt), ("tg", n_gen)) if n)
        if int(t.get("n_depth", 0) or 0):
            name += f"@d{int(t['n_depth'])}"
        samples = [float(x) for x in t.get("samples_ts") or []]
        avg = t.get("avg_ts")
        tests.append({
            "test": name, "n_prompt": n_prompt, "n_gen": n_gen, "n_threads": t.get("n_threads"),
            "tok_s": _median(samples) if samples else (float(avg) if avg is not None else None),
            "avg_tok_s": None if avg is None else float(avg), "stddev_tok_s": t.get("stddev_ts"),
            "samples_tok_s": samples, "build_number": t.get("build_number"), "build_commit": t.get("build_commit"),
            "cpu_info": t.get("cpu_info"), "backends": t.get("backends"), "model_type": t.get("model_type"),
            "model_size": t.get("model_size"), "n_batch": t.get("n_batch"), "n_ubatch": t.get("n_ubatch"),
            "type_k": t.get("type_k"), "type_v": t.get("type_v"), "flash_attn": t.get("flash_attn"),
        })
    return tests


def _last_line(text: str, fallback: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else fallback


def run_bench(exe: str, model: str, threads: int, repeats: int, n_prompt: int, n_gen: int,
              extra: Sequence[str] = (), timeout: float | None = None) -> dict[str, Any]:
    """Run llama-bench; returns ``command``, ``tests`` (parse_bench_json), ``tg`` / ``pp`` (the tests with only
    generation / only a prompt, or None), ``build_number``, ``build_commit``, ``cpu_info``."""
    cmd = bench_command(exe, model, threads, repeats, n_prompt, n_gen, extra)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SpecserveError(f"llama-bench ran past {timeout} s: {shlex.join(cmd)}") from None
    if proc.returncode != 0:
        why = _last_line(proc.stderr, f"exit status {proc.returncode}")
        raise SpecserveError(f"llama-bench failed ({why}): {shlex.join(cmd)}")
    try:
        tests = parse_bench_json(proc.stdout)
    except ValueError as e:
        raise SpecserveError(f"{e}: {shlex.join(cmd)}") from None
    tg = next((t for t in tests if t["n_gen"] and not t["n_prompt"]), None)
    pp = next((t for t in tests if t["n_prompt"] and not t["n_gen"]), None)
    first = tests[0] if tests else {}
    return {"command": shlex.join(cmd), "tests": tests, "tg": tg, "pp": pp, "repeats": repeats,
            "build_number": first.get("build_number"), "build_commit": first.get("build_commit"),
            "cpu_info": first.get("cpu_info")}


# -- llama-server ------------------------------------------------------------------------------------------------
def server_command(exe: str, model: str, threads: int, port: int, n_ctx: int,
                   extra: Sequence[str] = ()) -> list[str]:
    """llama-server on 127.0.0.1:port, one slot (requests one at a time), ``threads`` for decode and prefill."""
    return [exe, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1",
            "--host", "127.0.0.1", "--port", str(port), *extra]


def completion_body(prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """A native /completion request: the prompt as token ids (no template, no BOS added), greedy, no prompt
    cache (every request pays its prefill, as specserve's runs do), the generated ids returned."""
    return {"prompt": [int(t) for t in prompt], "n_predict": int(max_tokens), "temperature": 0.0, "top_k": 1,
            "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False, "ignore_eos": bool(ignore_eos),
            "return_tokens": True, "stream": False}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


class LlamaServer:
    """llama-server in a child process for the duration of a ``with`` block (stopped by its pid at exit)."""

    def __init__(self, cmd: list[str], port: int, startup_timeout: float = 300.0):
        self.cmd, self.port, self.startup_timeout = cmd, port, startup_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)

    def log_tail(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return _last_line(f.read(), "no output")

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise SpecserveError(f"llama-server exited ({self.log_tail()}): {shlex.join(self.cmd)}")
            try:
                if _http(self.url + "/health", timeout=5)[0] == 200:
                    return self
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SpecserveError(f"llama-server not ready after {self.startup_timeout} s: {shlex.join(self.cmd)}")
            time.sleep(0.2)

    def complete(self, prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> tuple[float, dict[str, Any]]:
        """One request; (wall seconds, response)."""
        t0 = time.perf_counter()
        status, res = _http(self.url + "/completion", completion_body(prompt, max_tokens, ignore_eos))
        secs = time.perf_counter() - t0
        if status != 200:
            err = res.get("error")
            why = err.get("message") if isinstance(err, dict) else (err or f"HTTP {status}")
            raise SpecserveError(f"llama-server /completion failed: {why}")
        return secs, res

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self._log.name)


def response_tokens(res: dict[str, Any]) -> list[int] | None:
    """The generated ids of a /completion response (``return_tokens``), or None when the build omits them."""
    toks = res.get("tokens")
    return [int(t) for t in toks] if isinstance(toks, list) else None


def response_count(res: dict[str, Any]) -> int:
    toks = response_tokens(res)
    if toks is not None:
        return len(toks)
    n = res.get("tokens_predicted", (res.get("timings") or {}).get("predicted_n"))
    return int(n or 0)


def run_served(exe: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, repeats: int,
               ignore_eos: bool, threads: int, extra: Sequence[str] = (), n_ctx: int | None = None) -> dict[str, Any]:
    """The same prompt ids through llama-server, one request at a time, greedy; a short warm-up excluded.
    ``runs_tok_s`` per repeat (generated tokens / wall seconds over the prompts), ``tok_s_median``,
    ``decode_tok_s_median`` (the server's own per-request decode rate, median over every request),
    ``outputs`` (ids of the first repeat; None entries when the build returns no ids)."""
    ctx = n_ctx or max(len(p) for p in prompts) + max_tokens + 16
    port = free_port()
    cmd = server_command(exe, model, threads, port, ctx, extra)
    runs: list[float] = []
    decode: list[float] = []
    outputs: list[list[int] | None] = []
    with LlamaServer(cmd, port) as srv:
        srv.complete(prompts[0], min(8, max_tokens), ignore_eos)
        for r in range(max(1, repeats)):
            secs, n = 0.0, 0
            for p in prompts:
                s, res = srv.complete(p, max_tokens, ignore_eos)
                secs, n = secs + s, n + response_count(res)
                rate = (res.get("timings") or {}).get("predicted_per_second")
                if rate:
                    decode.append(float(rate))
                if r == 0:
                    outputs.append(response_tokens(res))
            runs.append(n / secs if secs > 0 else 0.0)
    return {"command": shlex.join(cmd), "n_ctx": ctx, "runs_tok_s": runs, "tok_s_median": statistics.median(runs),
            "decode_tok_s_median": _median(decode), "outputs": outputs}


# -- the offline peer --------------------------------------------------------------------------------------------
def _strip(t: list[int], eos_ids) -> list[int]:
    while t and t[-1] in eos_ids:
        t = t[:-1]
    return t


def agreement(outputs: Sequence[list[int] | None], reference: Sequence[list[int]], eos_ids
              ) -> tuple[int | None, list[int | None]]:
    """(prompts whose output equals the reference, trailing EOS ignored; first differing position per prompt).
    (None, []) when the peer returned no ids."""
    if any(o is None for o in outputs):
        return None, []
    pairs = [(_strip(list(a or []), eos_ids), _strip(list(b), eos_ids)) for a, b in zip(outputs, reference, strict=True)]
    diverge = [None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in pairs]
    return sum(d is None for d in diverge), diverge


def offline_peer(model: str, prompts: Sequence[Sequence[int]], max_tokens: int, repeats: int, ignore_eos: bool,
                 eos_ids, threads: int, reference: Sequence[list[int]], batch1: dict[str, Any] | None,
                 llama_dir: str | None = None, n_gen: int = 128, n_prompt: int | None = None,
                 server: bool = True, server_args: Sequence[str] = ()) -> dict[str, Any]:
    """llama.cpp beside specserve's batch-1 figures: llama-bench ``tg n_gen`` and ``pp n_prompt`` (default: the
    median prompt length of the run), then (``server``) the same prompts through llama-server. The table's
    peer figure (``tok_s``, ``off_vs_peer``, ``on_vs_peer``) is llama-bench tg."""
    bench_exe = find_binary(BENCH, llama_dir)
    server_exe = find_binary(SERVER, llama_dir) if server else None
    pp_n = n_prompt if n_prompt is not None else int(statistics.median(len(p) for p in prompts))
    bench = run_bench(bench_exe, model, threads, max(1, repeats), pp_n, n_gen)
    if bench["tg"] is None:
        raise SpecserveError(f"llama-bench reported no tg{n_gen} test: {bench['command']}")
    tg = bench["tg"]["tok_s"]
    bin_dir = os.path.dirname(bench_exe)
    build = describe_build(bin_dir, bench["build_number"], bench["build_commit"])
    name = f"llama.cpp tg{n_gen}"
    res: dict[str, Any] = {
        "name": name, "tok_s": tg, "n_threads": threads, "llama_cpp_dir": bin_dir, "build": build,
        "build_info": build_info(bin_dir), "build_number": bench["build_number"],
        "build_commit": bench["build_commit"], "cpu_info": bench["cpu_info"], "bench": bench, "modes": {}, "notes": [
            f"{build}, {threads} threads; "
            f"llama-bench: `{bench['command']}`; tok/s = median of its {max(1, repeats)} samples.",
            f"llama-bench tg{n_gen} is pure decode from an empty context, pp{pp_n} one prompt batch; specserve's "
            "tok/s includes every prompt's prefill, so off/on vs tg is conservative for specserve.",
        ]}
    if batch1:
        for side in ("off", "on"):
            tps = batch1[f"{side}_tok_s"]
            res[f"{side}_vs_peer"] = tps / tg if tps and tg else None
            res["modes"][f"specserve {side} (batch 1)"] = {"tok_s": tps, "agree": None, "num_prompts": len(prompts)}
    res["modes"][f"llama-bench tg{n_gen}"] = {"tok_s": tg, "agree": None, "num_prompts": None,
                                             "runs_tok_s": bench["tg"]["samples_tok_s"]}
    if bench["pp"] is not None:
        res["modes"][f"llama-bench pp{pp_n} (prefill)"] = {"tok_s": bench["pp"]["tok_s"], "agree": None,
                                                          "num_prompts": None,
                                                          "runs_tok_s": bench["pp"]["samples_tok_s"]}
    if server_exe is not None:
        served = run_served(server_exe, model, prompts, max_tokens, repeats, ignore_eos, threads, server_args)
        agree, diverge = agreement(served["outputs"], reference, eos_ids)
        res["served"] = {k: v for k, v in served.items() if k != "outputs"}
        res["served_tok_s"] = served["tok_s_median"]
        res["modes"]["llama-server, same prompts"] = {"tok_s": served["tok_s_median"], "agree": agree,
                                                      "num_prompts": len(prompts), "diverge_at": diverge,
                                                      "runs_tok_s": served["runs_tok_s"]}
        res["notes"] += [
            f"llama-server: `{served['command']}`; the same prompt token ids, one request at a time, greedy, "
            "cache_prompt off; tok/s = generated tokens / wall seconds over the run's prompts (prefill and "
            "localhost HTTP included), median over repeats.",
            "same tokens: llama-server's output equals specserve's greedy output without speculation (trailing "
            "EOS ignored); llama.cpp computes with the GGUF's own weight types, so near-ties can differ."
            + (" --ignore-eos: llama.cpp bans EOS where specserve emits it and goes on." if ignore_eos else ""),
        ]
    return res
