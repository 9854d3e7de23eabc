"""What structured outputs cost per engine step, measured on the demo model.

1. Requests without a grammar: the only work structured outputs add to their steps is checks (a greedy
   batch's ``greedy_argmax`` asks whether any row has a logit bias, min_tokens or a grammar before its
   argmaxes; the runner asks per row whether it has a matcher to advance; the drafter asks per candidate for
   forced tokens). They are timed on the states of a real batch and compared with the batch's measured step
   time.
2. Requests with a grammar: one request's k + 1 = 6 verification rows with and without its grammar (matcher
   fills for every draft prefix, then the mask), through ``greedy_argmax`` (greedy verification; random
   logits, so every row's argmax is forbidden and masked: its worst case) and ``process_logits`` (the masks),
   against the same step time.

    python benchmarks/grammar_overhead.py [--batch 8] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _per_call(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from specserve import SamplingParams
    from specserve.bench.offline import prompt_ids, set_batch_size
    from specserve.datasets import SIGNATURE_SCHEMA, load_dataset
    from specserve.llm import LLM
    from specserve.platform import cpu_class
    from specserve.sample.grammar import GrammarState
    from specserve.sample.sampler import RequestSamplingState, greedy_argmax, process_logits, row_argmax
    from specserve.sampling_params import StructuredOutputsParams

    llm = LLM(None, speculative_method="ngram", num_speculative_tokens=5, max_num_seqs=args.batch)
    prompts = prompt_ids(llm.tokenizer, load_dataset("chat"), args.batch, llm.engine.max_model_len,
                         args.max_tokens)
    set_batch_size(llm, args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(None, params, prompt_token_ids=prompts)  # warm-up
    steps0 = llm.get_metrics()["num_steps"]
    t0 = time.perf_counter()
    llm.generate(None, params, prompt_token_ids=prompts)
    step_s = (time.perf_counter() - t0) / (llm.get_metrics()["num_steps"] - steps0)

    # 1. the checks a grammar-free batch pays per step, on that batch's kind of states
    states = [RequestSamplingState.create(params, p) for p in prompts]
    batch_logits = torch.randn(len(states), llm.target_model().arch.vocab_size)
    ones, nothing = [1] * len(states), [[] for _ in states]
    checks = _per_call(lambda: (
        greedy_argmax(batch_logits, states, ones, nothing),
        [s.grammar is not None for s in states],
        [s.grammar.forced_tokens(5) if s.grammar is not None else [] for s in states]), 20_000) \
        - _per_call(lambda: row_argmax(batch_logits), 20_000)  # the argmaxes themselves are the step's

    # 2. one grammar request's six verification rows, with and without its grammar
    so = StructuredOutputsParams(json=SIGNATURE_SCHEMA)
    grammar = GrammarState(llm.engine.grammars.compile(so))
    tok = llm.tokenizer.hf_tokenizer
    prefix = tok.encode('{"name": "convert_field", "parameters": [{"name": "self", "default": null}, {"name": "v',
                        add_special_tokens=False)
    grammar.accept(prefix)
    drafts = tok.encode('alue", "default": null}, ', add_special_tokens=False)[:5]
    free = RequestSamplingState(params, [1], list(prefix), None)
    constrained = RequestSamplingState(params, [1], list(prefix), None, (), grammar)
    logits = torch.randn(len(drafts) + 1, llm.target_model().arch.vocab_size)
    rows = [len(drafts) + 1]
    t_free = _per_call(lambda: process_logits(logits, [free], rows, [drafts]), 500)
    t_grammar = _per_call(lambda: process_logits(logits, [constrained], rows, [drafts]), 500)
    g_free = _per_call(lambda: greedy_argmax(logits, [free], rows, [drafts]), 500)
    g_grammar = _per_call(lambda: greedy_argmax(logits, [constrained], rows, [drafts]), 500)

    print(f"CPU: {cpu_class()}; torch threads {torch.get_num_threads()}", file=sys.stderr)
    print(f"step time, batch {args.batch} free rows (ngram k<=5): {step_s * 1e3:.2f} ms")
    print(f"grammar checks a grammar-free batch pays per step: {checks * 1e6:.2f} us "
          f"= {100 * checks / step_s:.3f}% of the step")
    for name, t0_, t1_ in (("greedy_argmax", g_free, g_grammar), ("process_logits", t_free, t_grammar)):
        print(f"one request's 6 verification rows: {name} {t0_ * 1e3:.3f} ms without its grammar, "
              f"{t1_ * 1e3:.3f} ms with it (+{(t1_ - t0_) * 1e3:.3f} ms "
              f"= {100 * (t1_ - t0_) / step_s:.2f}% of the batch's step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
