"""One GPU check, run through the device tool when a task is lent a GPU (see gpu_check.sh).

Measures, in one process: batch-1 decode tok/s for the demo model and for a random-weight ~1B Llama shape
against the HBM-bandwidth roofline (weight bytes / bandwidth), speculation (ngram) off vs on at batch
1 and 32 with greedy outputs compared, and batch-1 decode with graphs (the default) vs ``--enforce-eager``. Writes JSON to $OUT/gpu_check.json (or --out). ``--tiny`` runs the
same code on CPU with tiny shapes, so the script itself is tested where no GPU exists.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "MI300X": 5.3e12}


def roofline(name: str) -> float | None:
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


def random_llama_dir(path: str, tiny: bool) -> str:
    import transformers as tf
    from safetensors.torch import save_file

    from tests.helpers import byte_tokenizer

    if tiny:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=260, max_position_embeddings=2048)
    else:  # ~1.1B parameters (TinyLlama-like shape)
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=4096)
    cfg.bos_token_id, cfg.eos_token_id = 256, 257
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for n in range(L):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    sd = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
          for k, s in shapes.items()}
    save_file(sd, os.path.join(path, "model.safetensors"))
    byte_tokenizer(260).save_pretrained(path)
    return path


def decode_tok_s(llm, prompt_ids: list[list[int]], max_tokens: int, speculative: bool = True) -> tuple[float, list]:
    from specserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up at the measured batch size: Triton compilation and most graph captures happen here
    llm.generate(None, SamplingParams(temperature=0, max_tokens=min(max_tokens, 16), ignore_eos=True),
                 prompt_token_ids=prompt_ids, speculative=speculative)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(None, sp, prompt_token_ids=prompt_ids, speculative=speculative)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / secs, [o.outputs[0].token_ids for o in outs]


def weight_bytes(llm) -> int:
    return sum(p.numel() * p.element_size() for p in llm.target_model().parameters())


def graph_buckets(llm) -> list:
    return llm.graph_buckets()


def release(gpu: bool) -> None:
    gc.collect()  # the engine holds reference cycles; its KV cache is most of the device memory
    if gpu:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test of this script)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    from specserve.llm import LLM

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    bw = roofline(name)
    res: dict = {"device": name, "torch": torch.__version__, "hbm_bytes_per_s": bw}
    print(f"device: {name}", flush=True)
    n_tok = 16 if args.tiny else args.max_tokens
    demo_prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
                     407, 19712, 8182, 2, 198, 1, 4093, 198] + [28, 1780, 1009, 28, 1780] * 8]
    with tempfile.TemporaryDirectory() as tmp:
        models = {"random_llama": random_llama_dir(tmp, args.tiny)}
        if not args.tiny:
            models = {"demo": None, **models}
        for label, path in models.items():
            engine_args = dict(speculative_method="ngram", num_speculative_tokens=5, speculative_adaptive=False,
                               max_num_seqs=32, num_blocks=512 if args.tiny else None)
            llm = LLM(path, **engine_args)
            prompts = demo_prompts if label == "demo" else [[5, 6, 7, 8, 9] * 6]
            off, ref = decode_tok_s(llm, prompts, n_tok, speculative=False)
            wb = weight_bytes(llm)
            entry = {"weight_bytes": wb, "batch1_tok_s": round(off, 2)}
            if bw:
                entry["roofline_tok_s"] = round(bw / wb, 1)
                entry["fraction_of_roofline"] = round(off * wb / bw, 3)
            for b in (1, 32):
                batch = [prompts[i % len(prompts)] + [i + 3] for i in range(b)]
                t_off, o_off = decode_tok_s(llm, batch, n_tok, speculative=False)
                t_on, o_on = decode_tok_s(llm, batch, n_tok, speculative=True)
                same = sum(a == c for a, c in zip(o_off, o_on))
                entry[f"spec_batch{b}"] = {"off_tok_s": round(t_off, 2), "on_tok_s": round(t_on, 2),
                                           "ratio": round(t_on / t_off, 3), "greedy_identical": f"{same}/{b}",
                                           "metrics": llm.get_metrics()["speculative"]}
            entry["graph_buckets_captured"] = [list(b) for b in graph_buckets(llm)]
            del llm
            release(gpu)
            # graphs (the default, measured above as batch1_tok_s) vs --enforce-eager, batch-1 decode
            eager_llm = LLM(path, enforce_eager=True, **engine_args)
            eager, eager_out = decode_tok_s(eager_llm, prompts, n_tok, speculative=False)
            entry["eager_vs_graphs_batch1"] = {"eager_tok_s": round(eager, 2), "graphs_tok_s": round(off, 2),
                                               "ratio": round(off / eager, 3),
                                               "greedy_identical": eager_out == ref}
            del eager_llm
            release(gpu)
            res[label] = entry
            print(json.dumps({label: entry}), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
