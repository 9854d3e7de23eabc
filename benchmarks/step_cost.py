"""What one target forward costs for 1..8 new tokens, per dtype x ``--quantization`` mode x thread count,
and whether a row's logits depend on the row count (batch invariance). Speculation at batch 1 pays only when
verifying k + 1 tokens costs about what one decode step costs (the cost model in docs/architecture.md);
this measures that assumption (docs/architecture.md, "CPU compute dtype").

    .venv/bin/python benchmarks/step_cost.py          # demo model; float32 (+ bfloat16 with bf16 hardware)
    .venv/bin/python benchmarks/step_cost.py --model PATH --context 1000 --dtypes bfloat16 --quantizations int4

Per row: median ms of one forward + logits for T = 1 .. 8 tokens of one request after a context
of ``--context`` tokens (the KV cache in the engine's default dtype), the ratio to T = 1 (T = 5 is verifying k = 4 drafts), and how many logits of the
first row differ from the T = 1 run (0 = batch-invariant). Medians over ``--repeats`` interleaved rounds; the
ratio is the median of the per-round ratios (the machine's speed drifts between rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

TOKEN_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8)


def measure(ckpt, dtype: torch.dtype, quantization: str, prompt: torch.Tensor, ctx: int, table: list[int],
            repeats: int) -> tuple[dict[int, float], dict[int, float], dict[int, int]]:
    """(median ms per token count, median per-round ratio to the 1-token step, logits of row 0 differing from
    the 1-token run per token count). The ratio is taken within each round (this machine's speed drifts
    between rounds) and then the median over rounds."""
    from specserve.model.attention import build_metadata
    from specserve.platform import detect, resolve_kv_dtype
    from specserve.worker.model_runner import build_model

    block_size = 16
    platform = detect("cpu")
    quant, _, act = quantization.partition(":a")  # "auto:a8": --activation-bits 8
    model = build_model(ckpt, platform, dtype, ctx + 64, quant, activation_bits=int(act or 16))
    kv_dtype = resolve_kv_dtype(platform, "auto", dtype)  # the engine's default cache
    kv = [torch.zeros(model.kv_cache_shape(len(table) + 1, block_size), dtype=kv_dtype)
          for _ in range(ckpt.arch.num_layers)]
    model(prompt[:ctx], torch.arange(ctx), kv, build_metadata([ctx], [ctx], [table], block_size))

    def step(t: int) -> torch.Tensor:
        meta = build_metadata([t], [ctx + t], [table], block_size)
        return model.compute_logits(model(prompt[ctx:ctx + t], torch.arange(ctx, ctx + t), kv, meta))

    ref = step(1)[0]
    diffs = {t: int((step(t)[0] != ref).sum()) for t in TOKEN_COUNTS}
    times: dict[int, list[float]] = {t: [] for t in TOKEN_COUNTS}
    for _ in range(repeats):
        for t in TOKEN_COUNTS:
            t0 = time.perf_counter()
            step(t)
            times[t].append(time.perf_counter() - t0)
    ratios = {t: statistics.median(a / b for a, b in zip(v, times[1])) for t, v in times.items()}
    return {t: statistics.median(v) * 1e3 for t, v in times.items()}, ratios, diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the embedded demo model)")
    ap.add_argument("--dtypes", default=None, help="default: float32, and bfloat16 where the CPU has bf16 hardware")
    ap.add_argument("--quantizations", default="none,auto,int8,int4",
                    help="--quantization modes; MODE:a8 with 8-bit activations (--activation-bits 8)")
    ap.add_argument("--threads", default=None, help="intra-op thread counts, e.g. 1,2 (default: what serve uses)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    from specserve.model.checkpoint.loader import default_model_path, load_checkpoint
    from specserve.platform import configure_threads, cpu_class, cpu_has_native_bf16

    configure_threads()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    ckpt = load_checkpoint(args.model or default_model_path(), keep_quantized=True)
    ctx = args.context
    table = list(range(1, 1 + -(-(ctx + max(TOKEN_COUNTS)) // 16)))  # block 0 unused
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ckpt.arch.vocab_size, (ctx + max(TOKEN_COUNTS),), generator=gen)
    print(f"{ckpt.arch.architecture} {ckpt.arch.num_layers} layers, hidden {ckpt.arch.hidden_size}; context {ctx}; "
          f"CPU: {cpu_class()}; torch {torch.__version__}")
    header = "threads dtype    quant   " + "".join(f"  T={t:<2} ms (x)  " for t in TOKEN_COUNTS) + \
        "  row-0 logits differing from T=1"
    print(header)
    for n in threads:
        torch.set_num_threads(n)
        for name in dtypes:
            for quant in args.quantizations.split(","):
                med, ratio, diffs = measure(ckpt, getattr(torch, name), quant, prompt, ctx, table, args.repeats)
                cells = "".join(f"  {med[t]:6.1f} ({ratio[t]:.2f}) " for t in TOKEN_COUNTS)
                print(f"{n:<8}{name:<9}{quant:<8}{cells}  {max(diffs.values())} of {ckpt.arch.vocab_size}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
