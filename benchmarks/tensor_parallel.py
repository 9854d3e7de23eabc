"""Tensor parallel on this machine: the demo model at TP=1 and TP=2 side by side, one process group each.

For batch 1 and 8, speculation off and ngram: output tok/s of greedy chat requests, the two engines
measured alternately (``--repeats`` rounds), plus each rank's weight bytes. On a CPU the ranks share the
machine's cores (each takes cores / N threads) and add two all-reduces per layer over gloo, so TP=2 is not
expected to be faster here: tensor parallel is for models that do not fit one device. The point of the CPU
figure is the overhead of the collectives and the mirrored calls.

    .venv/bin/python benchmarks/tensor_parallel.py [--max-tokens 48] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine_throughput import PROMPTS  # benchmarks/ is the script's directory, first on sys.path


def run(llm, batch: int, max_tokens: int, speculative: bool) -> float:
    from specserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(ids), batch):
        outs = llm.generate(None, sp, prompt_token_ids=ids[i:i + batch], speculative=speculative)
        n += sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", type=int, default=2, help="the tensor-parallel size compared with 1")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from specserve.llm import LLM
    from specserve.model.quant import weight_bytes
    from specserve.platform import cpu_class, detect

    platform = detect(args.device)
    print(f"machine: {platform.kind}, {cpu_class() if platform.kind == 'cpu' else platform.describe()['gpu_name']}, "
          f"{os.cpu_count()} cores")
    kw = dict(num_blocks=512, max_num_seqs=8, speculative_method="ngram", num_speculative_tokens=4, device=args.device)
    engines = {1: LLM(None, **kw), args.size: LLM(None, tensor_parallel_size=args.size, **kw)}
    weights = {tp: weight_bytes(llm.target_model()) for tp, llm in engines.items()}
    for tp, b in weights.items():
        print(f"TP={tp}: rank 0 holds {b / 2**20:.1f} MiB of weights ({b / weights[1]:.2f}x of TP=1)")
    for llm in engines.values():  # warm-up (kernels, allocator)
        run(llm, 8, 8, False)
    results = []
    for speculative in (False, True):
        for batch in (1, 8):
            rates: dict[int, list[float]] = {tp: [] for tp in engines}
            for _ in range(args.repeats):
                for tp, llm in engines.items():
                    rates[tp].append(run(llm, batch, args.max_tokens, speculative))
            med = {tp: statistics.median(r) for tp, r in rates.items()}
            row = {"speculation": "ngram" if speculative else "off", "batch": batch,
                   **{f"tp{tp}_tok_s": round(v, 1) for tp, v in med.items()},
                   "ratio": round(med[args.size] / med[1], 2),
                   "spread": {f"tp{tp}": [round(min(r), 1), round(max(r), 1)] for tp, r in rates.items()}}
            results.append(row)
            print(f"{row['speculation']:>5} batch {batch}: TP=1 {med[1]:6.1f} tok/s, TP={args.size} "
                  f"{med[args.size]:6.1f} tok/s ({row['ratio']:.2f}x)  spread {row['spread']}", flush=True)
    for llm in engines.values():
        llm.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tensor_parallel.json"), "w") as f:
            json.dump({"weights_bytes": weights, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
