"""Engine throughput on the demo model, measured side by side in one process (no speculation).

Prints batch-1 greedy decode tok/s of specserve and of HF transformers ``generate`` on the same weights
(the GGUF dequantized to fp32 by transformers), then specserve's output throughput at batch 1, 8 and 32.

    .venv/bin/python benchmarks/engine_throughput.py [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works, step by step.",
    "List five tips for staying focused while studying.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten year old.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a linked list in C?",
    "Summarize the plot of Romeo and Juliet.",
]


def specserve_run(llm, prompts: list[str], max_tokens: int, batch: int) -> tuple[float, int]:
    from specserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    llm.engine.scheduler.config = type(llm.engine.scheduler.config)(
        llm.engine.scheduler.config.max_num_batched_tokens, batch)
    t0 = time.perf_counter()
    outs = llm.generate(None, sp, prompt_token_ids=ids)
    secs = time.perf_counter() - t0
    return secs, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_run(model, tok, prompt: str, max_tokens: int) -> tuple[float, int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    secs = time.perf_counter() - t0
    return secs, out.shape[1] - ids.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.llm import LLM
    from specserve.model.checkpoint.loader import default_model_path

    llm = LLM(None)
    path = default_model_path()
    hf = tok = None
    if not args.no_hf:
        d, f = os.path.dirname(path), os.path.basename(path)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()

    # Warm-up (excluded), then batch-1 interleaved: specserve, HF, specserve, HF, ...
    specserve_run(llm, PROMPTS[:1], 8, 1)
    if hf is not None:
        hf_run(hf, tok, PROMPTS[0], 8)
    ours, theirs = [], []
    for r in range(args.repeats):
        p = PROMPTS[r % len(PROMPTS)]
        s, n = specserve_run(llm, [p], args.max_tokens, 1)
        ours.append(n / s)
        if hf is not None:
            s, n = hf_run(hf, tok, p, args.max_tokens)
            theirs.append(n / s)
    result: dict[str, object] = {"threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                                 "batch1_specserve_tok_s": round(statistics.median(ours), 2)}
    from specserve.cpu_isa import cpu_class

    print(f"CPU: {cpu_class()}; batch-1 greedy decode, {args.max_tokens} tokens, median of {args.repeats}:")
    print(f"  specserve            {statistics.median(ours):8.2f} tok/s")
    if theirs:
        result["batch1_hf_tok_s"] = round(statistics.median(theirs), 2)
        result["ratio_vs_hf"] = round(statistics.median(ours) / statistics.median(theirs), 3)
        print(f"  HF transformers      {statistics.median(theirs):8.2f} tok/s")
        print(f"  ratio                {result['ratio_vs_hf']:8.3f}x")
    print("specserve output throughput by batch size:")
    base = None
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(b)]
        secs, n = specserve_run(llm, prompts, args.max_tokens, b)
        tps = n / secs
        base = base or tps
        result[f"batch{b}_tok_s"] = round(tps, 2)
        print(f"  batch {b:3d}: {tps:8.2f} tok/s  ({tps / base:5.2f}x batch 1)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
