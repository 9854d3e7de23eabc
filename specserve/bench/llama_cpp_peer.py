"""llama.cpp as a measured peer of `specserve bench offline`: a standalone script (stdlib + ``llama_cpp`` only).

specserve's venv does not have llama-cpp-python, so ``specserve.bench.offline`` runs this file by its path with
an interpreter that has it (``benchmarks/build_llama_cpp.sh`` builds one into /tmp/llama-venv):

    PYTHON specserve/bench/llama_cpp_peer.py IN.json OUT.json

IN.json: ``model_path``, ``prompts`` (token ids: specserve's chat template already applied, so both engines see
identical tokens), ``max_tokens``, ``ignore_eos``, ``eos_token_ids``, ``repeats``, ``n_threads``, ``n_ctx``
(optional), ``n_batch`` (optional, 512), ``warmup`` (optional, true).
OUT.json: ``llama_cpp_version``, ``n_threads``, ``n_ctx``, ``n_batch``, ``runs`` (per repeat: per prompt
``tokens`` / ``seconds`` / ``tok_s``, and the run's ``output_tokens`` / ``seconds`` / ``tok_s``),
``tok_s_median``, ``outputs`` (token ids of the first repeat); or ``{"error": "..."}`` with exit status 2.

Batch 1 (one sequence at a time), greedy (temperature 0, top_k 1, no penalties), the KV cache emptied before
every prompt so every prompt pays its prefill, exactly like specserve's runs (prefix cache reset per run).
tok/s matches specserve's definition: generated tokens / wall seconds of the whole run, prefill included
(here: the sum over the run's prompts, one after the other).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this file's folder (specserve/bench) heads sys.path: never let it shadow a package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def generate(llm, prompt: list[int], max_tokens: int, ignore_eos: bool, eos: set[int]) -> tuple[float, list[int]]:
    """One greedy generation; with ``ignore_eos`` an EOS is emitted and generation goes on (as specserve does)."""
    llm.reset()  # no KV reuse between prompts or repeats: every generation pays its prefill
    out: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) >= max_tokens or (not ignore_eos and tok in eos):
            break
    return time.perf_counter() - t0, out


def run(cfg: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    prompts: list[list[int]] = [list(map(int, p)) for p in cfg["prompts"]]
    max_tokens, ignore_eos = int(cfg["max_tokens"]), bool(cfg.get("ignore_eos", False))
    n_threads, n_batch = int(cfg["n_threads"]), int(cfg.get("n_batch", 512))
    n_ctx = int(cfg.get("n_ctx") or 0) or max(len(p) for p in prompts) + max_tokens + 8
    llm = Llama(model_path=cfg["model_path"], n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                n_batch=n_batch, verbose=False, logits_all=False)
    eos = {int(t) for t in cfg.get("eos_token_ids") or [llm.token_eos()]}
    if cfg.get("warmup", True):  # excluded: first-call allocations, thread pool start
        generate(llm, prompts[0], min(8, max_tokens), ignore_eos, eos)
    runs: list[dict] = []
    outputs: list[list[int]] = []
    run_tok_s: list[float] = []
    for r in range(max(1, int(cfg.get("repeats", 1)))):
        per = []
        for p in prompts:
            secs, toks = generate(llm, p, max_tokens, ignore_eos, eos)
            per.append({"tokens": len(toks), "seconds": round(secs, 6),
                        "tok_s": len(toks) / secs if secs > 0 else 0.0})
            if r == 0:
                outputs.append(toks)
        n, secs = sum(x["tokens"] for x in per), sum(x["seconds"] for x in per)
        run_tok_s.append(n / secs if secs > 0 else 0.0)
        runs.append({"prompts": per, "output_tokens": n, "seconds": round(secs, 6), "tok_s": run_tok_s[-1]})
    return {"llama_cpp_version": getattr(llama_cpp, "__version__", None), "n_threads": n_threads, "n_ctx": n_ctx,
            "n_batch": n_batch, "num_prompts": len(prompts), "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "runs": runs, "tok_s_median": statistics.median(run_tok_s), "outputs": outputs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: llama_cpp_peer.py IN.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        cfg = json.load(f)
    try:
        res = run(cfg)
        rc = 0
    except Exception as e:  # reported to specserve as one line, never a traceback there
        res, rc = {"error": f"{type(e).__name__}: {e}"}, 2
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(res, f)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
