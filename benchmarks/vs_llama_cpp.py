"""specserve vs native llama.cpp on a GGUF (the demo model by default): batch 1, greedy, same thread count.

The peer is llama.cpp's own binaries, built by ``bash benchmarks/build_llama_cpp.sh`` (found in
``--llama-cpp-dir``, else $LLAMA_CPP_DIR, else /tmp/llama.cpp-native/build/bin). No Python in its loop.

Offline (default). Per thread count T (``--threads 2,1``) and workload (``--datasets chat,code``), ``--repeats``
rounds (>= 3), each one process of

    specserve bench offline --batch-sizes 1 --repeats 1 --peer llama.cpp --peer-threads T [SPEC ARGS] [EXTRA]

with ``SPECSERVE_NUM_THREADS=T``: specserve speculation off and on (one loaded engine, warm-up excluded), then
``llama-bench -t T -p P -n 128 -o json`` (tg128: llama.cpp's pure decode rate; pp P: its prefill rate, P = the
median prompt length) and the same chat-templated prompt ids through ``llama-server`` (one request at a time,
greedy, prompt cache off). Medians over rounds; ratios to llama-bench tg128 and to llama-server's same-prompts
rate. specserve's tok/s = generated tokens / wall seconds of a run over its prompts, prefill included.

    .venv/bin/python benchmarks/vs_llama_cpp.py --threads 2,1                    # make serve's flags
    .venv/bin/python benchmarks/vs_llama_cpp.py --spec-args '--speculative-method ngram --num-speculative-tokens 5'
    .venv/bin/python benchmarks/vs_llama_cpp.py --llama-cpp-only --model Q.gguf   # llama-bench alone, no specserve

Served (``--served``): per round, `specserve serve MODEL [SPEC ARGS] [EXTRA]` and `llama-server -m MODEL
[--llama-server-args]` each get the dataset's chat prompts through the OpenAI API (/v1/chat/completions,
streaming, greedy, ``--concurrency`` requests in flight, 1 by default), each applying the GGUF's chat template
itself; output tok/s = output tokens / wall seconds of the run. Unknown flags go to specserve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specserve.bench import llama_cpp_peer as lcp  # noqa: E402

MAKE_SERVE = ("--speculative-model specserve/data/drafts/smollm2-135m-eagle --num-speculative-tokens 5 "
              "--prompt-lookup-first")


class CpuWatch:
    """The share of the machine's CPU that processes other than this script's children used during a block: on
    a shared machine a round with other work running measures the neighbours, not the engines."""

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # seconds, all CPUs, idle and iowait excluded

    @staticmethod
    def _ours() -> float:
        return sum(ru.ru_utime + ru.ru_stime for ru in (resource.getrusage(resource.RUSAGE_SELF),
                                                         resource.getrusage(resource.RUSAGE_CHILDREN)))

    def __enter__(self) -> CpuWatch:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self.t0, 1e-6)
        foreign = (self._busy() - self.busy0) - (self._ours() - self.ours0)
        self.foreign = max(0.0, foreign / (wall * (os.cpu_count() or 1)))


def wait_quiet(limit_s: float, below: float = 0.05, window_s: float = 3.0) -> float:
    """Wait (at most ``limit_s``) until the machine's CPU has been below ``below`` busy for ``window_s``; returns
    the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        w = CpuWatch()
        with w:
            time.sleep(window_s)
        if w.foreign < below:
            break
    return time.monotonic() - t0


def guarded(args: argparse.Namespace, what: str, fn):
    """``fn()`` after waiting for a quiet machine (``--quiet-wait``), repeated (up to ``--max-tries``) while other
    processes took more than ``--max-foreign`` of the CPU during it; returns (result, foreign share)."""
    for attempt in range(1, args.max_tries + 1):
        if args.quiet_wait:
            waited = wait_quiet(args.quiet_wait)
            if waited > 5:
                print(f"  waited {waited:.0f} s for a quiet machine", file=sys.stderr)
        with CpuWatch() as w:
            res = fn()
        if args.max_foreign is None or w.foreign <= args.max_foreign or attempt == args.max_tries:
            if args.max_foreign is not None and w.foreign > args.max_foreign:
                print(f"  {what}: kept after {attempt} tries with other processes at {w.foreign:.0%} of the CPU",
                      file=sys.stderr)
            return res, w.foreign
        print(f"  {what}: other processes used {w.foreign:.0%} of the CPU, measuring again", file=sys.stderr)
    raise AssertionError("unreachable")


def specserve_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "specserve")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "specserve.cli"]


def median_table(tok_s: dict[tuple, list[float]], keys: list[tuple], engines: list[str], refs: list[str]
                 ) -> tuple[list[list[str]], list[dict]]:
    rows, summary = [], []
    for key in keys:
        ref_meds = {r: statistics.median(tok_s[(*key, r)]) if tok_s.get((*key, r)) else None for r in refs}
        for eng in engines:
            runs = tok_s.get((*key, eng))
            if not runs:
                continue
            med = statistics.median(runs)
            ratios = {r: (med / v if v else None) for r, v in ref_meds.items()}
            rows.append([*map(str, key), eng, f"{med:.2f}",
                         *(f"{x:.3f}" if x is not None else "-" for x in ratios.values())])
            summary.append({"key": list(key), "engine": eng, "tok_s_median": med, "runs": runs,
                            **{f"vs {r}": x for r, x in ratios.items()}})
    return rows, summary


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    for line in [headers, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


# -- offline ------------------------------------------------------------------------------------------------------
def one_round(args: argparse.Namespace, extra: list[str], threads: int, dataset: str, out: str) -> dict:
    """One `bench offline` process: specserve off and on, then llama-bench and llama-server; its results.json."""
    cmd = [*specserve_cmd(), "bench", "offline", "--dataset", dataset, "--num-prompts", str(args.num_prompts),
           "--batch-sizes", "1", "--max-tokens", str(args.max_tokens), "--repeats", "1", "--peer", "llama.cpp",
           "--peer-threads", str(threads), "--peer-tg", str(args.tg), "--out", out, "--no-progress",
           *shlex.split(args.spec_args), *extra]
    if args.model:
        cmd += ["--model", args.model]
    if args.llama_cpp_dir:
        cmd += ["--llama-cpp-dir", args.llama_cpp_dir]
    if args.llama_server_args:
        cmd += ["--peer-server-args", args.llama_server_args]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    env = {**os.environ, "SPECSERVE_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        sys.exit(f"vs_llama_cpp: {shlex.join(cmd)}\n  failed: {tail}")
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def offline(args: argparse.Namespace, extra: list[str], thread_counts: list[int], out: str) -> dict:
    tg_name = f"llama-bench tg{args.tg}"
    engines = ["specserve off", "specserve on", tg_name, "llama-server"]
    tok_s: dict[tuple, list[float]] = {}
    info: dict[int, dict] = {}
    foreign_share: list[float] = []
    datasets = args.datasets.split(",")
    for t in thread_counts:
        for ds in datasets:
            for r in range(args.repeats):
                print(f"threads {t}, {ds}, round {r + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
                doc, foreign = guarded(args, f"threads {t}, {ds}, round {r + 1}",
                                       partial(one_round, args, extra, t, ds, os.path.join(out, f"t{t}-{ds}-r{r}")))
                foreign_share.append(foreign)
                b, peer = doc["batches"][0], doc["llama_cpp"]
                for eng, v in (("specserve off", b["off_tok_s"]), ("specserve on", b["on_tok_s"]),
                               (tg_name, peer["tok_s"]), ("llama-server", peer.get("served_tok_s"))):
                    if v is not None:
                        tok_s.setdefault((t, ds, eng), []).append(v)
                served = peer["modes"].get("llama-server, same prompts") or {}
                info[t] = {"specserve_threads": peer.get("specserve_threads"), "llama_cpp_threads": peer["n_threads"],
                           "build": peer["build"], "llama_bench": peer["bench"]["command"],
                           "llama_server": (peer.get("served") or {}).get("command"),
                           "same_tokens": f"{served.get('agree')}/{served.get('num_prompts')}"}
    for t, i in info.items():
        print(f"threads {t}: specserve torch threads {i['specserve_threads']}; {i['build']}, "
              f"-t {i['llama_cpp_threads']}\n  {i['llama_bench']}\n  {i['llama_server']} "
              f"(last round: same tokens as specserve off {i['same_tokens']})")
    print(f"specserve on = {args.spec_args} {shlex.join(extra)}".rstrip())
    print(f"batch 1, greedy, {args.num_prompts} prompts x {args.max_tokens} max tokens, median of {args.repeats} "
          f"interleaved rounds (llama-bench: one sample per round, -r 1)\n")
    keys = [(t, ds) for t in thread_counts for ds in datasets]
    rows, summary = median_table(tok_s, keys, engines, [tg_name, "llama-server"])
    print_table(["threads", "workload", "engine", "tok/s (median)", f"vs {tg_name}", "vs llama-server"], rows)
    print(foreign_line(foreign_share))
    return {"threads": info, "rows": summary, "foreign_cpu_share": foreign_share}


def foreign_line(shares: list[float]) -> str:
    return (f"other processes' share of the CPU during the kept rounds: median {statistics.median(shares):.1%}, "
            f"max {max(shares):.1%}") if shares else ""


def llama_cpp_only(args: argparse.Namespace, thread_counts: list[int]) -> dict:
    """llama-bench alone on the model: tg and pp, one ``-r 1`` sample at a time (each gated like a round, with
    --quiet-wait / --max-foreign), ``--repeats`` kept samples each; medians."""
    from specserve.model.checkpoint.loader import default_model_path

    exe = lcp.find_binary(lcp.BENCH, args.llama_cpp_dir)
    model = args.model or default_model_path()
    res: dict = {}
    for t in thread_counts:
        tests = {f"tg{args.tg}": (0, args.tg), f"pp{args.pp}": (args.pp, 0)} if args.pp else {
            f"tg{args.tg}": (0, args.tg)}
        got: dict[str, list[float]] = {name: [] for name in tests}
        shares: list[float] = []
        r: dict = {}
        for _ in range(args.repeats):
            for name, (p, n) in tests.items():
                r, foreign = guarded(args, f"llama-bench -t {t} {name}", partial(lcp.run_bench, exe, model, t, 1, p, n))
                got[name].append((r["tg"] or r["pp"])["tok_s"])
                shares.append(foreign)
        build = lcp.describe_build(os.path.dirname(exe), r["build_number"], r["build_commit"])
        print(f"threads {t}: {shlex.join(lcp.bench_command(exe, model, t, 1, 0, args.tg))} "
              f"(and -p {args.pp} -n 0), one sample per run\n  {build}; {r['cpu_info']}")
        for name, xs in got.items():
            print(f"  {name:>8}: {statistics.median(xs):8.2f} tok/s median of {len(xs)} "
                  f"(samples {', '.join(f'{x:.2f}' for x in xs)})")
        print(f"  {foreign_line(shares)}")
        res[t] = {"samples": got, "medians": {k: statistics.median(v) for k, v in got.items()},
                  "foreign_cpu_share": shares}
    return res


# -- interleaved, in one process: short samples, each one gated -------------------------------------------------
def interleaved(args: argparse.Namespace, extra: list[str], thread_counts: list[int]) -> dict:
    """specserve loaded once per thread count in this process; then, per workload, one sample at a time in turn:
    specserve off (one `generate` over the prompts), specserve on, and ``llama-bench -r 1 -p 0 -n TG``, each
    after a quiet wait and kept only when other processes stayed under ``--max-foreign``, until every engine has
    ``--repeats`` kept samples (or ``--max-tries`` x repeats tries). Medians of the kept samples. Each sample is a
    few seconds, so a machine shared with bursty work still yields clean ones. specserve's sample is exactly a
    `bench offline` run at batch 1 (`specserve.bench.offline.run_once`: prefix cache reset, greedy, tok/s =
    generated tokens / wall seconds over the prompts, prefill included)."""
    from specserve.bench.offline import build_llm, run_once, select_prompts
    from specserve.datasets import load_dataset
    from specserve.engine_args import engine_kwargs
    from specserve.model.checkpoint.loader import default_model_path

    model = args.model or default_model_path()
    bench_exe = lcp.find_binary(lcp.BENCH, args.llama_cpp_dir)
    tg_name = f"llama-bench tg{args.tg}"
    engines = ["specserve off", "specserve on", tg_name]
    datasets = args.datasets.split(",")
    tok_s: dict[tuple, list[float]] = {}
    foreign_kept: list[float] = []
    dropped = 0
    ns = engine_namespace(extra + shlex.split(args.spec_args))
    for t in thread_counts:
        os.environ["SPECSERVE_NUM_THREADS"] = str(t)
        llm = build_llm(model, engine_kwargs(ns))
        import torch

        print(f"threads {t}: specserve torch threads {torch.get_num_threads()}; llama-bench -t {t}", file=sys.stderr)
        for ds in datasets:
            prompts = [ids for ids, _ in select_prompts(llm.tokenizer, load_dataset(ds), args.num_prompts,
                                                        llm.engine.max_model_len, args.max_tokens)]
            for spec in (False, True):  # warm-up, excluded
                run_once(llm, prompts, 1, min(8, args.max_tokens), spec, args.ignore_eos)
            def sample(eng: str, llm=llm, prompts=prompts, t=t) -> tuple[float, float | None]:
                """(tok/s, decode tok/s = 1 / TPOT: the rate after each request's first token, or None)."""
                if eng == tg_name:
                    return lcp.run_bench(bench_exe, model, t, 1, 0, args.tg)["tg"]["tok_s"], None
                run = run_once(llm, prompts, 1, args.max_tokens, eng == "specserve on", args.ignore_eos)
                return run.tok_s, (1.0 / run.tpot_s if run.tpot_s else None)

            tries = 0
            while any(len(tok_s.get((t, ds, e), [])) < args.repeats for e in engines):
                if tries >= args.max_tries * args.repeats * len(engines):
                    print(f"  threads {t}, {ds}: gave up after {tries} tries", file=sys.stderr)
                    break
                for eng in engines:
                    if len(tok_s.get((t, ds, eng), [])) >= args.repeats:
                        continue
                    tries += 1
                    if args.quiet_wait:
                        wait_quiet(args.quiet_wait)
                    with CpuWatch() as w:
                        v, decode = sample(eng)
                    if args.max_foreign is not None and w.foreign > args.max_foreign:
                        dropped += 1
                        print(f"  {eng} ({ds}, t {t}): {v:.1f} tok/s dropped, others at {w.foreign:.0%} of the CPU",
                              file=sys.stderr)
                        continue
                    foreign_kept.append(w.foreign)
                    tok_s.setdefault((t, ds, eng), []).append(v)
                    if decode is not None:
                        tok_s.setdefault((t, ds, f"{eng}, decode only"), []).append(decode)
                    print(f"  {eng} ({ds}, t {t}): {v:.1f} tok/s kept (others {w.foreign:.0%})", file=sys.stderr)
        if hasattr(llm, "close"):
            llm.close()
    print(f"specserve on = {args.spec_args} {shlex.join(extra)}".rstrip())
    print(f"{tg_name}: {shlex.join(lcp.bench_command(bench_exe, model, thread_counts[0], 1, 0, args.tg))} per sample")
    print(f"batch 1, greedy, {args.num_prompts} prompts x {args.max_tokens} max tokens, median of {args.repeats} "
          f"kept samples per engine, interleaved ({dropped} samples dropped for other processes' load)\n")
    keys = [(t, ds) for t in thread_counts for ds in datasets]
    shown = ["specserve off", "specserve off, decode only", "specserve on", "specserve on, decode only", tg_name]
    rows, summary = median_table(tok_s, keys, shown, [tg_name])
    print_table(["threads", "workload", "engine", "tok/s (median)", f"vs {tg_name}"], rows)
    print("tok/s: generated tokens / wall seconds over the prompts, prefill included; decode only: 1 / TPOT, the "
          "mean time per output token after each request's first (no prefill, as tg)")
    print(foreign_line(foreign_kept))
    return {"rows": summary, "foreign_cpu_share": foreign_kept, "dropped": dropped}


def engine_namespace(flags: list[str]) -> argparse.Namespace:
    """specserve's engine flags parsed as `specserve bench offline` parses them."""
    from specserve.cli import build_parser

    return build_parser().parse_args(["bench", "offline", *flags])


# -- served -------------------------------------------------------------------------------------------------------
def served_round(args: argparse.Namespace, configs: dict[str, list[str]], server_exe: str, model: str, t: int,
                 load: dict, out: str, commands: dict[str, str]) -> dict[str, float]:
    """One round: each specserve configuration, then llama-server, on the same load; output tok/s by engine."""
    from specserve.bench.serve import LaunchedServer, run_load

    figs: dict[str, float] = {}
    for name, serve_args in configs.items():
        srv = LaunchedServer(serve_args, os.path.join(out, f"{name.replace(' ', '_')}-t{t}.log"))
        try:
            srv.wait_ready(600)
            s = asyncio.run(run_load(srv.url, **load))
        finally:
            srv.stop()
        commands[name] = f"SPECSERVE_NUM_THREADS={t} specserve serve {shlex.join(serve_args)}"
        figs[name] = s["output_throughput"]
    port = lcp.free_port()
    cmd = lcp.server_command(server_exe, model, t, port, args.llama_server_ctx, shlex.split(args.llama_server_args))
    with lcp.LlamaServer(cmd, port) as ls:
        s = asyncio.run(run_load(ls.url, **load))
    commands["llama-server"] = shlex.join(cmd)
    figs["llama-server"] = s["output_throughput"]
    if s["failed"]:
        print(f"llama-server: {s['failed']} requests failed: {s['errors']}", file=sys.stderr)
    return figs


def served(args: argparse.Namespace, extra: list[str], thread_counts: list[int], out: str) -> dict:
    from specserve.datasets import load_dataset
    from specserve.model.checkpoint.loader import default_model_path

    model = args.model or default_model_path()
    server_exe = lcp.find_binary(lcp.SERVER, args.llama_cpp_dir)
    datasets = args.datasets.split(",")
    spec = shlex.split(args.spec_args)
    configs = {"specserve off": [model, *extra], "specserve on": [model, *spec, *extra]} if spec else {
        "specserve": [model, *extra]}
    tok_s: dict[tuple, list[float]] = {}
    commands: dict[str, str] = {}
    foreign_share: list[float] = []
    for t in thread_counts:
        os.environ["SPECSERVE_NUM_THREADS"] = str(t)
        for ds in datasets:
            items = load_dataset(ds)[:args.num_prompts]
            load = dict(items=items, concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=0.0,
                        ignore_eos=args.ignore_eos, endpoint="chat", progress=False)
            for r in range(args.repeats):
                print(f"served: threads {t}, {ds}, round {r + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
                figs, foreign = guarded(args, f"served: threads {t}, {ds}, round {r + 1}",
                                        partial(served_round, args, configs, server_exe, model, t, load, out,
                                                commands))
                foreign_share.append(foreign)
                for name, v in figs.items():
                    tok_s.setdefault((t, ds, name), []).append(v)
    for name, c in commands.items():
        print(f"{name}: {c}")
    print(f"OpenAI API, /v1/chat/completions streaming, greedy, concurrency {args.concurrency}, "
          f"{args.num_prompts} prompts x {args.max_tokens} max tokens, median of {args.repeats} rounds\n")
    keys = [(t, ds) for t in thread_counts for ds in datasets]
    rows, summary = median_table(tok_s, keys, [*configs, "llama-server"], ["llama-server"])
    print_table(["threads", "workload", "engine", "output tok/s (median)", "vs llama-server"], rows)
    print(foreign_line(foreign_share))
    return {"commands": commands, "rows": summary, "foreign_cpu_share": foreign_share}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded demo model)")
    ap.add_argument("--datasets", default="chat,code")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: every core, as serve uses)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--spec-args", default=MAKE_SERVE, help=f"specserve's speculative flags (default: {MAKE_SERVE})")
    ap.add_argument("--llama-cpp-dir", default=None, help=f"llama.cpp binaries (default: ${lcp.DIR_ENV}, else "
                                                          f"{lcp.DEFAULT_DIR})")
    ap.add_argument("--tg", type=int, default=128, help="llama-bench tg length (default 128)")
    ap.add_argument("--pp", type=int, default=512, help="--llama-cpp-only: llama-bench pp length (default 512)")
    ap.add_argument("--llama-cpp-only", action="store_true", help="llama-bench alone on --model, no specserve")
    ap.add_argument("--served", action="store_true", help="OpenAI-API runs: specserve serve vs llama-server")
    ap.add_argument("--interleaved", action="store_true",
                    help="specserve in this process, short gated samples of off / on / llama-bench tg in turn "
                         "(for shared machines, with --quiet-wait and --max-foreign)")
    ap.add_argument("--concurrency", type=int, default=1, help="--served: requests in flight (default 1)")
    ap.add_argument("--llama-server-args", default="",
                    help="extra llama-server flags, e.g. '-md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max 5' (its own speculation)")
    ap.add_argument("--llama-server-ctx", type=int, default=4096, help="--served: llama-server -c (default 4096)")
    ap.add_argument("--out", default=None, help="keep every round's results and summary.json here")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="shared machines: before each round wait up to this many seconds for the CPU to go idle")
    ap.add_argument("--max-foreign", type=float, default=None,
                    help="shared machines: measure a round again when other processes used more than this share "
                         "of the CPU during it (e.g. 0.1)")
    ap.add_argument("--max-tries", type=int, default=5, help="with --max-foreign: tries per round (default 5)")
    args, extra = ap.parse_known_args()  # unknown flags: specserve engine args (e.g. --quantization auto)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")

    from specserve.config import SpecserveError
    from specserve.cpu_isa import cpu_class
    from specserve.model.checkpoint.loader import default_model_path
    from specserve.platform import available_cores

    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [available_cores()]
    out = args.out or tempfile.mkdtemp(prefix="vs_llama_cpp-")
    os.makedirs(out, exist_ok=True)
    print(f"model {args.model or default_model_path()}")
    print(f"CPU: {cpu_class()}, {available_cores()} cores available")
    try:
        lcp.find_binary(lcp.BENCH, args.llama_cpp_dir)
        if args.llama_cpp_only:
            summary: dict = {"llama_bench": llama_cpp_only(args, thread_counts)}
        elif args.interleaved:
            summary = interleaved(args, extra, thread_counts)
        elif args.served:
            summary = served(args, extra, thread_counts, out)
        else:
            summary = offline(args, extra, thread_counts, out)
    except SpecserveError as e:
        sys.exit(f"vs_llama_cpp: {e}")
    summary.update(cpu_class=cpu_class(), spec_args=args.spec_args, extra_args=extra)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"\nper-round results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
