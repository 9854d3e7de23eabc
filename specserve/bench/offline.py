"""`specserve bench offline`: the same prompts with speculation off and on, in one process, on one target.

The "off" runs are ``generate(..., speculative=False)`` on the speculative engine itself (a per-request
switch that skips proposing), so both sides share the loaded weights, KV pool, threads and allocator.
Per batch size B: the scheduler's ``max_num_seqs`` is set to B and ``max(B, num_prompts)`` requests are
run (prompts cycled when B is larger); the prefix cache is reset before every measured run; a short
warm-up is excluded; off/on runs are interleaved (the order alternates per repeat) and medians are taken.

Next to the measured ratio we print what the cost model of docs/speculative_decoding.md predicts from the *measured*
acceptance and costs, using ``expected_tokens`` / ``ideal_speedup`` of ``specserve.spec_decode.controller``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from specserve.bench import llama_cpp_peer, report
from specserve.datasets import Item, load_dataset
from specserve.engine_args import engine_kwargs, model_arg
from specserve.request import SpecStats
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.spec_decode.controller import expected_tokens, ideal_speedup

log = logging.getLogger("specserve.bench")


# -- the cost model, on measured figures ----------------------------------------------------------------------
def alpha_from_length(mean_len: float, k: float) -> float:
    """Per-position acceptance alpha with E(alpha, k) = mean_len (bisection; E is increasing in alpha)."""
    if k <= 0 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < mean_len:  # type: ignore[arg-type]  # k may be a mean (float)
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def efficiency(measured: float | None, ideal: float | None) -> float | None:
    """Measured speedup over the ideal one (1.0 = the cost model's promise is met)."""
    if measured is None or not ideal:
        return None
    return measured / ideal


def model_speedup(alpha: float, k: float, b: int, t_target, t_draft: float | None) -> float | None:
    """The controller's full model: E(alpha, k) T_target(B) / (T_target(B (k + 1)) + k T_draft(B))."""
    if t_target is None or t_draft is None or k <= 0:
        return None
    t1, tk = t_target(b), t_target(b * (k + 1))
    if not t1 or not tk:
        return None
    return expected_tokens(alpha, k) * t1 / (tk + k * t_draft)  # type: ignore[arg-type]


# -- one measured run -----------------------------------------------------------------------------------------
@dataclass
class Run:
    speculative: bool
    batch_size: int
    seconds: float
    num_requests: int
    output_tokens: int
    outputs: list[list[int]]
    spec_stats: dict[str, Any]
    target_samples: list[tuple[int, float]] = field(default_factory=list)
    draft_samples: list[tuple[int, float]] = field(default_factory=list)
    # engine steps of the run, and verification counters per draft source ("model", "lookup", "grammar", ...)
    num_steps: int = 0
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    # mean time per output token after the first (TPOT: a request's first token to its last, over its tokens
    # after the first), over requests with at least two tokens; None when none has
    tpot_s: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def raw(self) -> dict[str, Any]:
        return {"speculative": self.speculative, "seconds": round(self.seconds, 5), "tok_s": round(self.tok_s, 3),
                "num_requests": self.num_requests, "output_tokens": self.output_tokens, "spec": self.spec_stats,
                "tpot_s": self.tpot_s}


@contextlib.contextmanager
def cost_tap(controller) -> Iterator[tuple[list, list]]:
    """Record the controller's cost samples of one run (through its ``cost_observers``)."""
    target: list[tuple[int, float]] = []
    draft: list[tuple[int, float]] = []
    if controller is None:
        yield target, draft
        return

    def tap(kind: str, n: int, s: float) -> None:
        (target if kind == "target" else draft).append((n, s))

    controller.cost_observers.append(tap)
    try:
        yield target, draft
    finally:
        controller.cost_observers.remove(tap)


def reset_controller(llm, adaptive: bool | None = None) -> None:
    """A fresh controller (no fitted costs, no acceptance history), adaptive or fixed-k, on the loaded
    engine: lets one process compare adaptive on and off without reloading the model."""
    llm.reset_spec_controller(adaptive=adaptive)


def set_batch_size(llm, batch_size: int) -> None:
    sched = llm.engine.scheduler
    sched.config = dataclasses.replace(sched.config, max_num_seqs=batch_size)


_RUNS = itertools.count()


def run_once(llm, prompts: list[list[int]], batch_size: int, max_tokens: int, speculative: bool,
             ignore_eos: bool = False, constraints: list[StructuredOutputsParams | None] | None = None) -> Run:
    """One timed ``generate`` of ``max(B, len(prompts))`` requests at ``max_num_seqs = B``, greedy;
    ``constraints[i]``: prompt i's structured-output constraint (the ``json`` workload)."""
    n = max(batch_size, len(prompts))
    reqs = [prompts[i % len(prompts)] for i in range(n)]
    set_batch_size(llm, batch_size)
    llm.engine.kv.pool.reset_prefix_cache()  # every run pays its own prefill
    # A user of its own per run: suffix decoding never drafts a run from an earlier run's outputs of the same
    # prompts (its index is partitioned by user), so rounds measure one pass over the workload each.
    base = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, user=f"run-{next(_RUNS)}")
    params = [dataclasses.replace(base, structured_outputs=constraints[i % len(prompts)]) if constraints else base
              for i in range(n)]
    before = llm.get_metrics()
    with cost_tap(llm.spec_controller()) as (tgt, drf):
        t0 = time.perf_counter()
        outs = llm.generate(None, params, prompt_token_ids=reqs, speculative=speculative)
        secs = time.perf_counter() - t0
    after = llm.get_metrics()
    toks = [list(o.outputs[0].token_ids) for o in outs]
    spec_stats = SpecStats.total(o.metrics.get("speculative") or {} for o in outs).as_dict()
    return Run(speculative, batch_size, secs, n, sum(len(t) for t in toks), toks, spec_stats, tgt, drf,
               after["num_steps"] - before["num_steps"], _source_deltas(before, after), _tpot(outs))


def _tpot(outs) -> float | None:
    """Mean seconds per output token after the first, over the requests that have two or more tokens."""
    per = [(o.metrics["elapsed_s"] - o.metrics["ttft_s"]) / (len(o.outputs[0].token_ids) - 1) for o in outs
           if len(o.outputs[0].token_ids) > 1 and o.metrics.get("ttft_s") is not None]
    return statistics.fmean(per) if per else None


def _source_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for source, stats in after.get("speculative_sources", {}).items():
        prev = before.get("speculative_sources", {}).get(source, {})
        delta = {k: stats[k] - prev.get(k, 0) for k in ("num_drafts", "draft_tokens", "accepted_tokens")}
        if delta["num_drafts"]:
            out[source] = delta
    return out


# -- per batch size summary -----------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _step_cost(samples: list[tuple[int, float]], x: int) -> float | None:
    return _median([s for n, s in samples if n == x])


def _mismatches(off: list[Run], on: list[Run]) -> tuple[int, list[dict[str, Any]]]:
    ref = off[0].outputs
    bad: dict[int, dict[str, Any]] = {}
    for run in on + off[1:]:
        for i, (a, b) in enumerate(zip(ref, run.outputs, strict=True)):
            if a != b and i not in bad:
                pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                bad[i] = {"request": i, "position": pos, "off": a[pos:pos + 3], "on": b[pos:pos + 3],
                          "speculative": run.speculative}
    return len(bad), [bad[i] for i in sorted(bad)][:5]


def summarize(batch_size: int, off: list[Run], on: list[Run], controller) -> dict[str, Any]:
    off_tps, on_tps = _median([r.tok_s for r in off]), _median([r.tok_s for r in on])
    spec_stats = SpecStats.total(r.spec_stats for r in on).as_dict()
    drafts, drafted, accepted = spec_stats["num_drafts"], spec_stats["draft_tokens"], spec_stats["accepted_tokens"]
    k_used = drafted / drafts if drafts else 0.0
    mean_len = 1.0 + accepted / drafts if drafts else 1.0
    alpha = alpha_from_length(mean_len, k_used)
    # passes after the prefill: each emits accepted + 1 tokens (the first token comes from the prefill)
    passes = sum(max(0, len(t) - 1) for r in on for t in r.outputs) - accepted
    t_tgt_fit = controller.target_cost.predict if controller is not None else None
    t_drf_fit = controller.draft_cost.predict(batch_size) if controller is not None else None
    t_tgt = _step_cost([s for r in off for s in r.target_samples], batch_size) or (
        t_tgt_fit(batch_size) if t_tgt_fit else None)
    t_drf = _step_cost([s for r in on for s in r.draft_samples], batch_size) or t_drf_fit
    c = t_drf / t_tgt if t_drf is not None and t_tgt else None
    c_fit = (t_drf_fit / t_tgt_fit(batch_size)) if t_drf_fit is not None and t_tgt_fit and \
        t_tgt_fit(batch_size) else None
    ratio = on_tps / off_tps if on_tps and off_tps else None
    off_tpot = _median([r.tpot_s for r in off if r.tpot_s is not None])
    on_tpot = _median([r.tpot_s for r in on if r.tpot_s is not None])
    ideal = ideal_speedup(alpha, k_used, c) if c is not None and drafts else None  # type: ignore[arg-type]
    n_bad, examples = _mismatches(off, on)
    return {
        "batch_size": batch_size, "num_requests": off[0].num_requests,
        "off_tok_s": off_tps, "on_tok_s": on_tps, "ratio": ratio,
        "off_tpot_s": off_tpot, "on_tpot_s": on_tpot, "decode_ratio": off_tpot / on_tpot if off_tpot and on_tpot else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": mean_len if drafts else None,
        "acceptance_per_position": [n / drafts for n in spec_stats["accepted_per_position"]] if drafts else [],
        "k_used": k_used if drafts else None, "k_max": controller.max_k if controller is not None else None,
        "drafting_pass_fraction": drafts / passes if passes > 0 else None,
        "alpha": alpha if drafts else None,
        "t_target_s": t_tgt, "t_draft_s": t_drf, "c": c, "c_controller_fit": c_fit,
        "ideal_speedup": ideal, "efficiency": efficiency(ratio, ideal),
        "model_speedup": model_speedup(alpha, k_used, batch_size, t_tgt_fit, t_drf) if drafts else None,
        "mismatches": n_bad, "mismatch_examples": examples,
        "runs": [r.raw() for r in off + on], "spec_totals": spec_stats,
        "sources": _sources_summary(on),
    }


def _sources_summary(on: list[Run]) -> dict[str, dict[str, Any]]:
    """Per draft source over the speculative runs: drafted and accepted tokens, and accepted tokens per
    engine step (for "grammar": the tokens per step that came free from the grammar)."""
    steps = sum(r.num_steps for r in on)
    out: dict[str, dict[str, Any]] = {}
    for r in on:
        for source, d in r.sources.items():
            acc = out.setdefault(source, {"num_drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
            for k in acc:
                acc[k] += d[k]
    for acc in out.values():
        acc["acceptance_rate"] = acc["accepted_tokens"] / acc["draft_tokens"] if acc["draft_tokens"] else None
        acc["accepted_per_step"] = acc["accepted_tokens"] / steps if steps else None
    return out


def warm_up(llm, prompts: list[list[int]], max_tokens: int,
            constraints: list[StructuredOutputsParams | None] | None = None) -> None:
    """Excluded from the figures: first-call allocations, thread pools, the proposer's code paths, grammar
    compilation."""
    for speculative in (False, True):
        run_once(llm, prompts[:2], 2, min(8, max_tokens), speculative, constraints=constraints[:2] if constraints
                 else None)


def run_offline(llm, prompts: list[list[int]], batch_sizes: list[int], max_tokens: int, repeats: int,
                ignore_eos: bool = False, progress: bool = True, desc: str = "bench",
                constraints: list[StructuredOutputsParams | None] | None = None) -> list[dict[str, Any]]:
    """The whole sweep: warm-up, then per batch size ``repeats`` interleaved off/on pairs; one summary each."""
    from tqdm import tqdm

    warm_up(llm, prompts, max_tokens, constraints)
    bar = tqdm(total=len(batch_sizes) * repeats * 2, desc=desc, disable=not progress, file=sys.stderr)
    out = []
    for b in batch_sizes:
        off: list[Run] = []
        on: list[Run] = []
        for r in range(repeats):
            for speculative in ((False, True) if r % 2 == 0 else (True, False)):
                run = run_once(llm, prompts, b, max_tokens, speculative, ignore_eos, constraints)
                (on if speculative else off).append(run)
                bar.set_postfix(batch=b, spec="on" if speculative else "off", tok_s=f"{run.tok_s:.1f}")
                bar.update(1)
        out.append(summarize(b, off, on, llm.spec_controller()))
    bar.close()
    return out


# -- peer: HF transformers generate on the same checkpoint ----------------------------------------------------
def _hf_load(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    d, f = os.path.split(os.path.abspath(path))
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def _hf_generate(model, ids: list[int], max_tokens: int, ignore_eos: bool, eos: list[int],
                 **extra: Any) -> tuple[float, list[int]]:
    import torch

    x = torch.tensor([ids])
    kw: dict[str, Any] = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                              attention_mask=torch.ones_like(x), temperature=None, top_p=None, top_k=None)
    if ignore_eos:
        kw["min_new_tokens"] = max_tokens
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kw, **extra)
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def run_hf_peer(model_path: str | None, spec_config: dict[str, Any], prompts: list[list[int]], max_tokens: int,
                repeats: int, ignore_eos: bool, eos_ids, reference: list[list[int]],
                batch1: dict[str, Any] | None) -> dict[str, Any]:
    """HF ``generate`` at batch 1, greedy, same prompt ids: plain, prompt lookup with the same k, and
    ``assistant_model`` when a draft checkpoint is given; tok/s medians and agreement with specserve."""
    from specserve.model.checkpoint.loader import default_model_path

    k = int(spec_config["num_speculative_tokens"])
    eos = sorted(eos_ids)
    hf = _hf_load(model_path or default_model_path())
    modes: dict[str, dict[str, Any]] = {"hf": {}, f"hf prompt_lookup k={k}": {"prompt_lookup_num_tokens": k}}
    if spec_config.get("model"):
        draft = _hf_load(spec_config["model"])
        draft.generation_config.num_assistant_tokens = k
        modes["hf assistant_model"] = {"assistant_model": draft}
    for extra in modes.values():  # warm-up, excluded
        _hf_generate(hf, prompts[0], 4, ignore_eos, eos, **extra)
    tok_s: dict[str, list[float]] = {m: [] for m in modes}
    outs: dict[str, list[list[int]]] = {m: [] for m in modes}
    for r in range(repeats):
        for name, extra in modes.items():
            secs, n = 0.0, 0
            for p in prompts:
                s, toks = _hf_generate(hf, p, max_tokens, ignore_eos, eos, **extra)
                secs, n = secs + s, n + len(toks)
                if r == 0:
                    outs[name].append(toks)
            tok_s[name].append(n / secs if secs > 0 else 0.0)

    def strip(t: list[int]) -> list[int]:
        while t and t[-1] in eos_ids:
            t = t[:-1]
        return t

    res: dict[str, Any] = {"modes": {}, "notes": [
        "HF runs one prompt at a time (batch 1) and re-encodes nothing: the same prompt token ids are fed.",
        "same tokens: HF output equals specserve's greedy output without speculation (trailing EOS ignored).",
    ]}
    if ignore_eos:
        res["notes"].append("--ignore-eos: HF suppresses EOS (min_new_tokens) where specserve emits it and goes "
                            "on, so outputs that reach an EOS differ by construction.")
    if batch1:
        res["modes"]["specserve off (batch 1)"] = {"tok_s": batch1["off_tok_s"], "agree": None,
                                                   "num_prompts": len(prompts)}
        res["modes"]["specserve on (batch 1)"] = {"tok_s": batch1["on_tok_s"], "agree": None,
                                                  "num_prompts": len(prompts)}
    for name in modes:
        agree = sum(strip(a) == strip(b) for a, b in zip(outs[name], reference, strict=True))
        res["modes"][name] = {"tok_s": statistics.median(tok_s[name]), "agree": agree,
                              "num_prompts": len(prompts), "runs_tok_s": tok_s[name]}
    return res


# -- peer: native llama.cpp (llama-bench, llama-server) on the same GGUF ----------------------------------------
def llama_cpp_model_path(model: str | None) -> str:
    """The GGUF llama.cpp loads: specserve's own model file (the demo model by default)."""
    from specserve.model.checkpoint.loader import default_model_path

    gguf = model or default_model_path()
    if not (gguf.endswith(".gguf") and os.path.isfile(gguf)):
        raise ValueError(f"--peer llama.cpp needs a .gguf model file, got {gguf}")
    return gguf


# -- prompts --------------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, items: list[Item], num_prompts: int, max_model_len: int, max_tokens: int
               ) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` items that fit the context with ``max_tokens`` more."""
    return [ids for ids, _ in select_prompts(tokenizer, items, num_prompts, max_model_len, max_tokens)]


def constraints_of(items: list[Item]) -> list[StructuredOutputsParams | None] | None:
    """The items' structured-output constraints (their ``response_format``), or None when none has one."""
    if all(it.response_format is None for it in items):
        return None
    return [StructuredOutputsParams.of_response_format(it.response_format) for it in items]


def select_prompts(tokenizer, items: list[Item], num_prompts: int, max_model_len: int, max_tokens: int
                   ) -> list[tuple[list[int], Item]]:
    """(token ids, item) of the first ``num_prompts`` items that fit the context with ``max_tokens`` more."""
    out = []
    skipped = 0
    for it in items:
        ids = (tokenizer.apply_chat_template(it.messages) if it.messages is not None
               else tokenizer.encode(it.prompt or ""))
        if not ids or len(ids) + max_tokens > max_model_len:
            skipped += 1
            continue
        out.append((ids, it))
        if len(out) == num_prompts:
            break
    if skipped:
        log.warning("skipped %d prompts longer than max_model_len - max_tokens", skipped)
    if not out:
        raise ValueError(f"no prompt of the dataset fits max_model_len={max_model_len} with max_tokens={max_tokens}")
    return out


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes needs positive integers")
    return sizes


# -- CLI ------------------------------------------------------------------------------------------------------
def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("offline", help="speculation off vs on, same prompts, one process",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--dataset", default="edit", help="code | summarize | chat | edit | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    p.add_argument("--peer", choices=["hf", "llama.cpp"], action="append", default=None,
                   help="also run a peer at batch 1 on the same prompt ids (repeatable): hf = HF transformers "
                        "generate in this process; llama.cpp = native llama.cpp on the same GGUF: llama-bench "
                        "tg/pp rates, then the same prompts through llama-server")
    p.add_argument("--llama-cpp-dir", default=None,
                   help=f"llama.cpp: folder with llama-bench and llama-server (default: ${llama_cpp_peer.DIR_ENV}, "
                        f"else {llama_cpp_peer.DEFAULT_DIR}; built by benchmarks/build_llama_cpp.sh)")
    p.add_argument("--peer-threads", type=int, default=None,
                   help="llama.cpp: -t threads (default: specserve's torch.get_num_threads())")
    p.add_argument("--peer-tg", type=int, default=128, help="llama.cpp: llama-bench tg length (default 128)")
    p.add_argument("--peer-pp", type=int, default=None,
                   help="llama.cpp: llama-bench pp length (default: the median prompt length; 0 skips pp)")
    p.add_argument("--peer-no-server", action="store_true",
                   help="llama.cpp: llama-bench only, skip the same-prompts run through llama-server")
    p.add_argument("--peer-server-args", default="",
                   help="llama.cpp: extra llama-server flags, e.g. '-md DRAFT.gguf --spec-type draft-simple "
                        "--spec-draft-n-max 5' for its own speculation")
    p.add_argument("--out", default=None, help="write results.json, report.md and PNG plots here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_offline)


def build_llm(model: str | None, kwargs: dict[str, Any]):
    """The speculative engine; n-gram (k=5) when no speculative flags are given."""
    from specserve.config import EngineConfig
    from specserve.llm import LLM

    if not EngineConfig.from_kwargs(model, **dict(kwargs)).speculative.enabled:
        print("bench offline: no speculative method given, using --speculative-method ngram "
              "--num-speculative-tokens 5", file=sys.stderr)
        kwargs = {**kwargs, "speculative_method": "ngram", "num_speculative_tokens": 5}
    return LLM(model, **kwargs)


def cmd_offline(args: argparse.Namespace) -> int:
    from specserve.model.checkpoint.loader import default_model_path

    batch_sizes = parse_batch_sizes(args.batch_sizes)
    if args.num_prompts < 1 or args.repeats < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts, --repeats and --max-tokens must be >= 1")
    items = load_dataset(args.dataset)
    model = model_arg(args)
    peers = args.peer or []
    if "llama.cpp" in peers:  # fail fast, before the sweep
        gguf = llama_cpp_model_path(model)
        llama_cpp_peer.find_binary(llama_cpp_peer.BENCH, args.llama_cpp_dir)
        if not args.peer_no_server:
            llama_cpp_peer.find_binary(llama_cpp_peer.SERVER, args.llama_cpp_dir)
    llm = build_llm(model, engine_kwargs(args))
    selected = select_prompts(llm.tokenizer, items, args.num_prompts, llm.engine.max_model_len, args.max_tokens)
    prompts = [ids for ids, _ in selected]
    constraints = constraints_of([it for _, it in selected])
    if constraints and peers:
        raise ValueError(f"dataset {args.dataset} constrains its outputs (response_format): the peers have no "
                         f"grammar support here; run it without --peer")
    if max(batch_sizes) > len(prompts):
        print(f"bench offline: {len(prompts)} prompts, batch sizes up to {max(batch_sizes)}: prompts are "
              f"repeated to fill the batch", file=sys.stderr)
    batches = run_offline(llm, prompts, batch_sizes, args.max_tokens, args.repeats, args.ignore_eos,
                          progress=not args.no_progress, constraints=constraints)
    spec_config = dataclasses.asdict(llm.engine.config.speculative)
    doc = report.header("offline", {k: v for k, v in vars(args).items() if k != "func"})
    doc.update(model=model or default_model_path(), speculative=spec_config, num_prompts=len(prompts),
               prompt_tokens=[len(p) for p in prompts], batches=batches,
               engine_metrics=llm.get_metrics())
    print(f"\nspeculation: {spec_config['method']} k<={spec_config['num_speculative_tokens']} "
          f"adaptive={spec_config['adaptive']}; dataset {args.dataset}, {len(prompts)} prompts, "
          f"max_tokens {args.max_tokens}, median of {args.repeats}")
    machine = llm.engine.platform.describe()
    print(f"machine: {machine.get('cpu_class') or machine.get('gpu_name', machine['device'])}; compute dtype "
          f"{str(llm.target_model().dtype).removeprefix('torch.')}, torch threads {machine['torch_threads']}")
    b1 = next((b for b in batches if b["batch_size"] == 1), None)
    ref = run_once(llm, prompts, 1, args.max_tokens, False, args.ignore_eos).outputs if peers else []
    if "llama.cpp" in peers:
        import torch

        threads = args.peer_threads or torch.get_num_threads()
        doc["llama_cpp"] = llama_cpp_peer.offline_peer(
            gguf, prompts, args.max_tokens, args.repeats, args.ignore_eos, llm.engine.eos_token_ids, threads, ref,
            b1, llama_dir=args.llama_cpp_dir, n_gen=args.peer_tg, n_prompt=args.peer_pp,
            server=not args.peer_no_server, server_args=shlex.split(args.peer_server_args))
        doc["llama_cpp"]["specserve_threads"] = torch.get_num_threads()
        peer = doc["llama_cpp"]
        print(f"llama.cpp peer: {peer['build']} ({peer['llama_cpp_dir']}), -t {threads} "
              f"(specserve torch threads {torch.get_num_threads()}), batch 1, median of {args.repeats}")
    print(report.offline_table(batches, peer=doc.get("llama_cpp")))
    print(report.sources_lines(batches))
    if "llama.cpp" in peers:
        print("\npeer llama.cpp (batch 1, greedy):")
        print(report.table(report.peer_rows(doc["llama_cpp"]), ["engine", "tok/s", "same tokens"]))
    if "hf" in peers:
        doc["peer"] = run_hf_peer(model, spec_config, prompts, args.max_tokens, args.repeats, args.ignore_eos,
                                  llm.engine.eos_token_ids, ref, b1)
        print("\npeer (batch 1, greedy):")
        print(report.table(report.peer_rows(doc["peer"]), ["engine", "tok/s", "same tokens"]))
    if args.out:
        write_offline(args.out, doc)
        print(f"\nwrote {args.out}/results.json, report.md and plots", file=sys.stderr)
    return 0


def write_offline(out_dir: str, doc: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    plots = [report.plot_throughput(doc["batches"], os.path.join(out_dir, "throughput.png")),
             report.plot_acceptance(doc["batches"], os.path.join(out_dir, "acceptance_per_position.png"))]
    doc["plots"] = [os.path.basename(p) for p in plots]
    report.write_json(out_dir, doc)
    report.write_text(out_dir, "report.md", report.offline_markdown(doc, plots))
