"""Speculative decoding on the demo model: every method, adaptive on and off, batch 1 / 8 / 32, in one run.

For each method (n-gram k=5, suffix k=5, layer_skip k=4, a draft model k=4 when ``--draft PATH`` is given, an
EAGLE head with ``--eagle DIR``, k = ``--eagle-k``: chains, with prompt lookup first, and draft trees) one engine
is loaded; for each dataset and each controller mode
(``--adaptive on|off|both``) a fresh controller is installed on it, and ``specserve.bench.offline.run_offline`` measures the same prompts with speculation off and on (interleaved,
warm-up excluded, medians over repeats). Printed per row: tok/s off and on, their ratio, acceptance rate,
mean acceptance length, the ideal speedup from the measured alpha and c, and efficiency = measured / ideal.

    .venv/bin/python benchmarks/spec_decode.py --quick                 # a few minutes on a laptop CPU
    .venv/bin/python benchmarks/spec_decode.py [--draft PATH] [--out DIR]
    # trained draft vs the rest, fixed k, on held-out prompts (files written by `specserve distill`):
    .venv/bin/python benchmarks/spec_decode.py --eagle specserve/data/drafts/smollm2-135m-eagle --adaptive off \
        --datasets DIR/heldout-chat.jsonl,DIR/heldout-code.jsonl --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

HEADERS = ["dataset", "method", "adaptive", "batch", "off tok/s", "on tok/s", "ratio", "decode x", "acc rate",
           "mean acc len", "drafted", "k used", "alpha", "c", "ideal", "eff", "mismatch"]


def row(dataset: str, method: str, adaptive: bool, b: dict[str, Any]) -> list[str]:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    drafted = b["drafting_pass_fraction"]
    return [dataset, method, "on" if adaptive else "off", str(b["batch_size"]), f(b["off_tok_s"], ".2f"),
            f(b["on_tok_s"], ".2f"), f(b["ratio"], ".3f"), f(b.get("decode_ratio"), ".3f"),
            f(b["acceptance_rate"], ".3f"),
            f(b["mean_acceptance_length"], ".2f"), "-" if drafted is None else f"{100 * drafted:.0f}%",
            f(b["k_used"], ".2f"), f(b["alpha"], ".3f"), f(b["c"], ".4f"), f(b["ideal_speedup"], ".2f"),
            f(b["efficiency"], ".2f"), f"{b['mismatches']}/{b['num_requests']}"]


def methods(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out = [("ngram k=5", {"speculative_method": "ngram", "num_speculative_tokens": 5}),
           ("suffix k=5", {"speculative_method": "suffix", "num_speculative_tokens": 5}),
           ("layer_skip k=4", {"speculative_method": "layer_skip", "num_speculative_tokens": 4,
                               "draft_layers": args.draft_layers})]
    if args.draft:
        out.append(("draft k=4", {"speculative_model": args.draft, "num_speculative_tokens": 4}))
    if args.eagle:
        out.append((f"eagle k={args.eagle_k}", {"speculative_method": "eagle", "speculative_model": args.eagle,
                                                "num_speculative_tokens": args.eagle_k}))
        for lookup_k in [int(k) for k in args.lookup_k.split(",")] if args.lookup_k else [args.eagle_k]:
            out.append((f"eagle+lookup k={lookup_k}",
                        {"speculative_method": "eagle", "speculative_model": args.eagle,
                         "num_speculative_tokens": lookup_k, "prompt_lookup_first": True,
                         "prompt_lookup_min": args.lookup_min}))
        if args.tree_topk > 1:
            out.append((f"eagle-tree k={args.eagle_k} B={args.tree_topk} N={args.tree_nodes}",
                        {"speculative_method": "eagle", "speculative_model": args.eagle,
                         "num_speculative_tokens": args.eagle_k, "speculative_eagle_topk": args.tree_topk,
                         "speculative_num_draft_tokens": args.tree_nodes}))
    wanted = args.methods.split(",") if args.methods else None
    return [(n, kw) for n, kw in out if wanted is None or n.split()[0] in wanted]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the embedded demo model)")
    ap.add_argument("--draft", default=None, help="draft checkpoint: adds the `draft` method")
    ap.add_argument("--draft-layers", type=int, default=None, help="layer_skip: layers the draft uses")
    ap.add_argument("--eagle", default=None, help="EAGLE head dir: adds the `eagle` method")
    ap.add_argument("--eagle-k", type=int, default=3)
    ap.add_argument("--lookup-min", type=int, default=None,
                    help="eagle+lookup: shortest repeated suffix that lets prompt lookup draft (default: the engine's)")
    ap.add_argument("--lookup-k", default=None, help="eagle+lookup: k, or several comma-separated (default: --eagle-k)")
    ap.add_argument("--tree-topk", type=int, default=3, help="eagle-tree: branching (1: no tree method)")
    ap.add_argument("--tree-nodes", type=int, default=8, help="eagle-tree: the most nodes verified per step")
    ap.add_argument("--methods", default=None, help="subset, e.g. ngram,layer_skip")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (the engine's --dtype)")
    ap.add_argument("--datasets", "--dataset", dest="datasets", default="edit",
                    help="comma-separated: code | summarize | chat | edit | FILE.jsonl")
    ap.add_argument("--adaptive", choices=["on", "off", "both"], default="both",
                    help="controller on (what serving does), off (fixed k: the draft's raw worth), or both")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 prompts, batch 1 and 4, 32 tokens, 1 repeat")
    ap.add_argument("--out", default=None, help="write results.json and report.md here")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.batch_sizes, args.max_tokens, args.repeats = 4, "1,4", 32, 1

    from specserve.bench import offline, report
    from specserve.datasets import load_dataset
    from specserve.llm import LLM

    batch_sizes = offline.parse_batch_sizes(args.batch_sizes)
    datasets = [(d, load_dataset(d)) for d in args.datasets.split(",") if d]
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.adaptive]
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for name, kw in methods(args):
        print(f"== {name}: loading", file=sys.stderr)
        llm = LLM(args.model, dtype=args.dtype, **kw)
        for dataset, items in datasets:
            label = os.path.basename(dataset).removesuffix(".jsonl")
            prompts = offline.prompt_ids(llm.tokenizer, items, args.num_prompts, llm.engine.max_model_len,
                                         args.max_tokens)
            for adaptive in modes:
                offline.reset_controller(llm, adaptive)
                batches = offline.run_offline(llm, prompts, batch_sizes, args.max_tokens, args.repeats,
                                              desc=f"{label} {name} adaptive={'on' if adaptive else 'off'}")
                for b in batches:
                    rows.append(row(label, name, adaptive, b))
                    results.append({"dataset": dataset, "method": name, "adaptive": adaptive, **b})
                print(report.table(rows[-len(batches):], HEADERS), file=sys.stderr)
        del llm
        gc.collect()
    print(f"\nCPU: {report.machine_info()['cpu_class']}; {args.num_prompts} prompts, max_tokens {args.max_tokens}, "
          f"median of {args.repeats}, greedy")
    print(report.table(rows, HEADERS))
    if args.out:
        doc = report.header("spec_decode", vars(args))
        doc["results"] = results
        report.write_json(args.out, doc)
        md = ["# benchmarks/spec_decode.py", "", f"Command: `{' '.join(doc['command'])}`", "",
              report.table(rows, HEADERS, markdown=True), "", report.OFFLINE_LEGEND]
        report.write_text(args.out, "report.md", "\n".join(md))
        print(f"wrote {os.path.join(args.out, 'results.json')} and report.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
