"""Drafting strategies compared without the machine's noise: the controller is fed a fixed table of step costs
instead of measured ones, so two builds (or two flag sets) make the same decisions wherever their drafts
agree, and the run's *modelled* time is the sum of those costs over its steps.

On the shared 2-core machines the same command moves 1.2-1.5x between minutes, which hides changes of a few
percent in how many steps a workload takes. Here the only thing that varies is what the drafts are and how
many are accepted: greedy outputs are deterministic, and so are the controller's choices given the table.

    .venv/bin/python benchmarks/fixed_costs.py --speculative-model specserve/data/drafts/smollm2-135m-eagle \\
        --prompt-lookup-first --dataset json
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/fixed_costs.py ...   # the same for another build

Costs: ``--step-ms`` is the target step for 1, 2, ... tokens (default: `benchmarks/step_cost.py` on the
2-core AVX-512 EPYC, demo model, context 300), ``--row-ms`` each token past the table, ``--draft-ms`` one
draft-model step (per draft token of the longest model draft in the step; the EAGLE head there: 0.44 ms).
Prints, per speculative run, the steps, tokens per step by draft source and the modelled seconds, and the
modelled ratio to speculation off. Greedy, as `specserve bench offline` runs it (`--batch-size`: requests per step).
"""

from __future__ import annotations

import argparse
import statistics
import sys

DEFAULT_STEP_MS = "4.8,4.9,5.5,6.3,7.4,8.3,9.3,10.4"


def step_cost(table: list[float], row_ms: float, tokens: int) -> float:
    """Seconds of a target step of ``tokens`` tokens: the per-token-count table (ms), then ``row_ms`` a token
    past it (prefill chunks)."""
    if tokens <= len(table):
        return table[tokens - 1] / 1e3
    return (table[-1] + row_ms * (tokens - len(table))) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative-model", default=None)
    ap.add_argument("--speculative-method", default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--prompt-lookup-first", action="store_true")
    ap.add_argument("--prompt-lookup-source", default=None, choices=["prompt", "suffix"])
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--prompt-lookup-max", type=int, default=None)
    ap.add_argument("--speculative-eagle-topk", type=int, default=None, help="> 1: EAGLE-2 draft trees")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="tree nodes verified at most")
    ap.add_argument("--no-grammar-drafts", action="store_true")
    ap.add_argument("--dataset", default="json")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1, help="max_num_seqs (requests per step)")
    ap.add_argument("--runs", type=int, default=3, help="speculative runs (the controller keeps learning across them)")
    ap.add_argument("--step-ms", default=DEFAULT_STEP_MS, help="target step ms for 1, 2, ... tokens")
    ap.add_argument("--row-ms", type=float, default=0.6, help="each token past the table (prefill: ~1700 tok/s)")
    ap.add_argument("--draft-ms", type=float, default=0.44)
    args = ap.parse_args(argv)
    table = [float(x) for x in args.step_ms.split(",")]

    from specserve.bench import offline
    from specserve.cpu_isa import cpu_class
    from specserve.datasets import load_dataset
    from specserve.llm import LLM
    from specserve.spec_decode.controller import FREE_SOURCES

    kwargs = {"num_speculative_tokens": args.num_speculative_tokens}
    for key in ("speculative_model", "speculative_method", "prompt_lookup_source", "prompt_lookup_min",
                "prompt_lookup_max", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.prompt_lookup_first:
        kwargs["prompt_lookup_first"] = True
    if args.no_grammar_drafts:
        kwargs["grammar_drafts"] = False
    llm = LLM(None, **kwargs)
    controller = llm.spec_controller()
    if controller is None:
        print("fixed_costs: give a speculative method or model", file=sys.stderr)
        return 2
    totals = {"target": 0.0, "draft": 0.0}

    # NOTE: the costs are replaced on this engine's controller only (instance attributes), after the engine
    # is built; a controller reset by the benchmark would lose them, so none is done.
    record_target, record_draft = controller.record_target, controller.record_draft

    def fixed_target(num_tokens: int, seconds: float) -> None:
        cost = step_cost(table, args.row_ms, num_tokens)
        totals["target"] += cost
        record_target(num_tokens, cost)

    def fixed_draft(num_reqs: int, seconds: float) -> None:
        record_draft(num_reqs, args.draft_ms / 1e3)

    def depth(draft) -> int:  # type: ignore[no-untyped-def]
        """Draft-model steps behind a draft: its length, or a tree's depth."""
        if draft.parents is None:
            return len(draft.token_ids)
        depths: list[int] = []
        for p in draft.parents:
            depths.append(1 + (depths[p] if p >= 0 else 0))
        return max(depths, default=0)

    def count_drafts(drafts) -> None:  # type: ignore[no-untyped-def]
        stepped = [depth(d) for source, d in drafts if source not in FREE_SOURCES]
        totals["draft"] += max(stepped, default=0) * args.draft_ms / 1e3

    controller.record_target, controller.record_draft = fixed_target, fixed_draft
    with llm.observe_drafts(count_drafts):
        items = load_dataset(args.dataset)
        prompts = offline.prompt_ids(llm.tokenizer, items, args.num_prompts, llm.engine.max_model_len, args.max_tokens)
        constraints = offline.constraints_of(items[:len(prompts)])
        offline.warm_up(llm, prompts, args.max_tokens, constraints)

        def run(speculative: bool):  # type: ignore[no-untyped-def]
            totals["target"] = totals["draft"] = 0.0
            r = offline.run_once(llm, prompts, args.batch_size, args.max_tokens, speculative, constraints=constraints)
            return r, totals["target"] + totals["draft"]

        off, off_s = run(False)
        print(f"CPU: {cpu_class()} (the costs are the fixed table's)")
        print(f"{args.dataset}, {len(prompts)} prompts, batch {args.batch_size}, {args.max_tokens} tokens max; step ms {args.step_ms}, "
              f"draft ms {args.draft_ms}")
        print(f"off: {off.num_steps} steps, {off.output_tokens} tokens, modelled {off_s:.3f} s")
        ratios = []
        for i in range(args.runs):
            on, on_s = run(True)
            mismatch = sum(a != b for a, b in zip(on.outputs, off.outputs))
            per = ", ".join(f"{s} {v['accepted_tokens']}/{v['draft_tokens']} in {v['num_drafts']} steps"
                            for s, v in sorted(on.sources.items()))
            ratios.append(off_s / on_s)
            print(f"on, run {i + 1}: {on.num_steps} steps, {on.output_tokens} tokens "
                  f"({on.output_tokens / on.num_steps:.2f} per step), modelled {on_s:.3f} s = {off_s / on_s:.3f}x; "
                  f"accepted/drafted by source: {per}; outputs differing from off: {mismatch}/{len(prompts)}")
        print(f"modelled ratio, median of {len(ratios)}: {statistics.median(ratios):.3f}x")
        return 0


if __name__ == "__main__":
    sys.exit(main())
