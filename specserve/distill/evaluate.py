"""Held-out acceptance by k, measured by running speculative greedy decoding through the engine.

One engine with the trained draft: the held-out prompts are decoded greedily once without speculation (the
reference, and the "off" speed) and once per k with a fixed k (non-adaptive controller); acceptance comes
from the engine's own counters (``llm.get_metrics()["speculative"]``), deltas per run. Every run must
reproduce the reference tokens (exactness never depends on the draft).
"""

from __future__ import annotations

import time
from typing import Any

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def acceptance_by_k(target: str | None, method: str, draft_dir: str, prompts: list[list[int]], max_tokens: int,
                    ks: list[int], **engine_kw: Any) -> dict[str, Any]:
    llm = LLM(target, speculative_method=method, speculative_model=draft_dir, num_speculative_tokens=max(ks),
              speculative_adaptive=False, max_num_seqs=max(1, len(prompts)), **engine_kw)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    ref = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts, speculative=False)]
    off_s = time.perf_counter() - t0
    num = sum(len(r) for r in ref)
    assert llm.spec_controller() is not None
    rows = []
    for k in ks:
        llm.reset_spec_controller(adaptive=False, max_k=k)  # every step drafts exactly min(k, room left) tokens
        before = llm.get_metrics()["speculative"]
        t0 = time.perf_counter()
        out = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]
        secs = time.perf_counter() - t0
        after = llm.get_metrics()["speculative"]
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        passes = after["num_drafts"] - before["num_drafts"]
        rows.append({"k": k, "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                     "mean_acceptance_length": round(1 + accepted / passes, 3) if passes else 1.0,
                     "draft_tokens": drafted, "tokens_per_s": round(num / secs, 1), "exact": out == ref})
    return {"method": method, "num_prompts": len(prompts), "max_tokens": max_tokens, "generated_tokens": num,
            "batch": len(prompts), "off_tokens_per_s": round(num / off_s, 1), "by_k": rows}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"held-out acceptance ({result['num_prompts']} prompts, greedy, {result['max_tokens']} max tokens, "
             f"engine at batch {result['batch']}; off: {result['off_tokens_per_s']} tok/s)",
             "  k  acceptance  mean accepted length  tok/s  exact"]
    for r in result["by_k"]:
        lines.append(f"  {r['k']}  {r['acceptance_rate']:10.3f}  {r['mean_acceptance_length']:20.3f}  "
                     f"{r['tokens_per_s']:5.1f}  {r['exact']}")
    return "\n".join(lines)
