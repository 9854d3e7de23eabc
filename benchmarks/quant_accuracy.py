"""How far each ``--quantization`` mode's logits are from a dequantize-then-fp32 reference of the same file,
and whether greedy outputs agree (issue: "the numbers are the file's own").

    .venv/bin/python benchmarks/quant_accuracy.py                        # demo GGUF, 8 chat + 8 code prompts
    .venv/bin/python benchmarks/quant_accuracy.py --modes auto,int8,int4 --num-prompts 4 --max-tokens 64
    .venv/bin/python benchmarks/quant_accuracy.py --modes auto,auto:a8      # a8: 8-bit activations

For every mode: the largest |logit difference| over every position of every prompt's reference output
(teacher-forced: both models read the same tokens), and on how many prompts the greedy outputs of
``--max-tokens`` tokens are identical. ``none`` is the reference (the file dequantized, float32 matmuls).
"""

from __future__ import annotations

import argparse
import sys

import torch


def logits_of(llm, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of one fresh forward over ``tokens``."""
    from specserve.model.attention import build_metadata

    model = llm.target_model()
    n, bs = len(tokens), 16
    blocks = -(-n // bs)
    kv = [torch.zeros(model.kv_cache_shape(blocks, bs), dtype=model.dtype) for _ in range(model.arch.num_layers)]
    meta = build_metadata([n], [n], [list(range(blocks))], bs)
    hidden = model(torch.tensor(tokens), torch.arange(n), kv, meta)
    return model.compute_logits(hidden).float()


def compare(model: str | None, modes: list[str], prompts: list[list[int]], max_tokens: int
            ) -> list[dict[str, object]]:
    from specserve import SamplingParams
    from specserve.llm import LLM
    from specserve.model.quant import describe_weights

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ref_llm = LLM(model, quantization="none", dtype="float32", device="cpu", num_blocks=512)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(None, params, prompt_token_ids=prompts)]
    ref_logits = [logits_of(ref_llm, p + r) for p, r in zip(prompts, ref)]
    del ref_llm
    rows = []
    for mode in modes:
        quant, _, act = mode.partition(":a")  # "auto:a8": --activation-bits 8
        llm = LLM(model, quantization=quant, dtype="float32", device="cpu", num_blocks=512,
                  activation_bits=int(act or 16))
        out = [o.outputs[0].token_ids for o in llm.generate(None, params, prompt_token_ids=prompts)]
        delta = max(float((logits_of(llm, p + r) - rl).abs().max()) for p, r, rl in zip(prompts, ref, ref_logits))
        rows.append({"mode": mode, "max_abs_logit_delta": delta, "greedy_equal": sum(a == b for a, b in zip(ref, out)),
                     "prompts": len(prompts), "weights": describe_weights(llm.target_model())})
        del llm
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or HF dir (default: the embedded demo model)")
    ap.add_argument("--modes", default="auto,int8,int4", help="--quantization modes; MODE:a8 with 8-bit activations")
    ap.add_argument("--datasets", default="chat,code")
    ap.add_argument("--num-prompts", type=int, default=8, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from specserve.datasets import load_dataset
    from specserve.platform import configure_threads, cpu_class
    from specserve.tokenizer import Tokenizer

    configure_threads()
    from specserve.model.checkpoint.loader import default_model_path

    tok = Tokenizer.from_checkpoint(args.model or default_model_path())
    prompts = [tok.apply_chat_template(item.messages) if item.messages else tok.encode(item.prompt or "")
               for name in args.datasets.split(",") for item in load_dataset(name)[:args.num_prompts]]
    print(f"CPU: {cpu_class()}; {torch.get_num_threads()} threads; {len(prompts)} prompts, greedy "
          f"{args.max_tokens} tokens; reference: --quantization none (dequantized, float32)")
    print(f"{'mode':<8} {'max |logit delta|':>18} {'greedy outputs equal':>22}  weights")
    for r in compare(args.model, args.modes.split(","), prompts, args.max_tokens):
        print(f"{r['mode']:<8} {r['max_abs_logit_delta']:>18.2e} {r['greedy_equal']:>14} of {r['prompts']:<5}  "
              f"{r['weights']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
