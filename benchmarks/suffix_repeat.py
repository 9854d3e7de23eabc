"""Suffix decoding's cross-request gain: one user asks the same requests again (an agent re-running a step,
a retried prompt). Pass 1 fills the user's suffix index; pass 2 is timed against speculation off.

Batch 1, greedy, 64 tokens, the first 8 `chat` prompts; for ngram and suffix (one engine each), each round
with a fresh user: pass 1, then off, then pass 2 with speculation on; medians of ``--repeats`` rounds.

    .venv/bin/python benchmarks/suffix_repeat.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(llm, prompts: list[list[int]], user: str, speculative: bool) -> float:
    from specserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, user=user)
    t0, n = time.perf_counter(), 0
    for p in prompts:
        n += len(llm.generate(None, sp, prompt_token_ids=[p], speculative=speculative)[0].outputs[0].token_ids)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from specserve.datasets import load_dataset
    from specserve.llm import LLM
    from specserve.platform import cpu_class

    print(f"machine: {cpu_class()}")
    items = load_dataset("chat")[:8]
    for method in ("ngram", "suffix"):
        llm = LLM(None, speculative_method=method, num_speculative_tokens=5, max_num_seqs=1)
        prompts = [llm.tokenizer.apply_chat_template(i.messages) for i in items]
        off, on = [], []
        for r in range(args.repeats):
            user = f"{method}-{r}"
            run(llm, prompts, user, True)  # pass 1: this user's first time (fills its index)
            off.append(run(llm, prompts, user, False))
            on.append(run(llm, prompts, user, True))  # pass 2: the same requests again
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"{method:>6}: off {m_off:6.1f} tok/s, repeated requests {m_on:6.1f} tok/s ({m_on / m_off:.2f}x)",
              flush=True)
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
