"""specserve vs llama.cpp on the demo GGUF: batch 1, greedy, same prompt token ids, same thread count.

Per thread count T (``--threads 1,2``) and workload (``--datasets chat,code``), ``--repeats`` rounds (>= 3), each
one process of

    specserve bench offline --batch-sizes 1 --repeats 1 --peer llama.cpp --peer-threads T [SPEC ARGS] [EXTRA]

with ``SPECSERVE_NUM_THREADS=T``: it loads specserve once, measures speculation off and on (the same engine,
``generate(speculative=False)`` for off; warm-up excluded), then runs llama.cpp (llama-cpp-python on the same
GGUF, its own process, n_threads = T) on the same chat-templated prompt ids. So the three engines are
interleaved round by round; medians over rounds are printed with the ratio to llama.cpp. tok/s everywhere =
generated tokens / wall seconds of a run over its prompts, prefill included.

    .venv/bin/python benchmarks/vs_llama_cpp.py                                  # make serve's flags, T = every core
    .venv/bin/python benchmarks/vs_llama_cpp.py --threads 1,2 --quantization auto   # unknown flags go to specserve
    .venv/bin/python benchmarks/vs_llama_cpp.py --spec-args '--speculative-method ngram --num-speculative-tokens 5'

The peer interpreter: ``--peer-python``, else $SPECSERVE_LLAMA_CPP_PYTHON, else /tmp/llama-venv/bin/python (built by
``benchmarks/build_llama_cpp.sh /tmp/llama-venv``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAKE_SERVE = ("--speculative-model specserve/data/drafts/smollm2-135m-eagle --num-speculative-tokens 5 "
              "--prompt-lookup-first")
ENGINES = ("specserve off", "specserve on", "llama.cpp")


def specserve_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "specserve")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "specserve.cli"]


def one_round(args: argparse.Namespace, extra: list[str], threads: int, dataset: str, out: str) -> dict:
    """One `bench offline` process: specserve off and on, then llama.cpp; returns its results.json."""
    cmd = [*specserve_cmd(), "bench", "offline", "--dataset", dataset, "--num-prompts", str(args.num_prompts),
           "--batch-sizes", "1", "--max-tokens", str(args.max_tokens), "--repeats", "1", "--peer", "llama.cpp",
           "--peer-threads", str(threads), "--out", out, "--no-progress",
           *shlex.split(args.spec_args), *extra]
    if args.model:
        cmd += ["--model", args.model]
    if args.peer_python:
        cmd += ["--peer-python", args.peer_python]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    env = {**os.environ, "SPECSERVE_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        sys.exit(f"vs_llama_cpp: {shlex.join(cmd)}\n  failed: {tail}")
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def figures(doc: dict) -> dict[str, float]:
    b, peer = doc["batches"][0], doc["llama_cpp"]
    return {"specserve off": b["off_tok_s"], "specserve on": b["on_tok_s"], "llama.cpp": peer["tok_s"]}


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
    ap.add_argument("--peer-python", default=None, help="interpreter with llama_cpp")
    ap.add_argument("--out", default=None, help="keep every round's results.json / report.md and summary.json here")
    args, extra = ap.parse_known_args()  # unknown flags: specserve engine args (e.g. --quantization auto)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")

    sys.path.insert(0, ROOT)
    from specserve.model.loader import default_model_path
    from specserve.platform import available_cores, cpu_class, cpu_has_native_bf16

    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [available_cores()]
    datasets = args.datasets.split(",")
    out = args.out or tempfile.mkdtemp(prefix="vs_llama_cpp-")
    tok_s: dict[tuple[int, str, str], list[float]] = {}
    info: dict[int, dict] = {}
    for t in thread_counts:
        for ds in datasets:
            for r in range(args.repeats):
                print(f"threads {t}, {ds}, round {r + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
                doc = one_round(args, extra, t, ds, os.path.join(out, f"t{t}-{ds}-r{r}"))
                for eng, v in figures(doc).items():
                    tok_s.setdefault((t, ds, eng), []).append(v)
                peer = doc["llama_cpp"]
                info[t] = {"specserve_threads": peer.get("specserve_threads"), "llama_cpp_threads": peer["n_threads"],
                           "llama_cpp_version": peer["llama_cpp_version"]}

    print(f"\nmodel {args.model or default_model_path()}")
    print(f"CPU: {cpu_class()}, "
          f"{available_cores()} cores available")
    for t, i in info.items():
        print(f"threads {t}: specserve torch threads {i['specserve_threads']}, llama.cpp n_threads "
              f"{i['llama_cpp_threads']} (llama-cpp-python {i['llama_cpp_version']})")
    print(f"specserve on = {args.spec_args} {shlex.join(extra)}".rstrip())
    print(f"batch 1, greedy, {args.num_prompts} prompts x {args.max_tokens} max tokens, median of {args.repeats} "
          f"interleaved rounds\n")
    rows, summary = [], []
    for t in thread_counts:
        for ds in datasets:
            peer = statistics.median(tok_s[(t, ds, "llama.cpp")])
            for eng in ENGINES:
                med = statistics.median(tok_s[(t, ds, eng)])
                rows.append([str(t), ds, eng, f"{med:.2f}", f"{med / peer:.3f}" if peer else "-"])
                summary.append({"threads": t, "dataset": ds, "engine": eng, "tok_s_median": med,
                                "vs_llama_cpp": med / peer if peer else None, "runs": tok_s[(t, ds, eng)]})
    headers = ["threads", "workload", "engine", "tok/s (median)", "vs llama.cpp"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    for line in [headers, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"cpu_native_bf16": cpu_has_native_bf16(), "threads": info, "rows": summary,
                   "spec_args": args.spec_args, "extra_args": extra}, f, indent=1)
    print(f"\nper-round results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
