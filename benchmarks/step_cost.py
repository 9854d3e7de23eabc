"""What one target forward costs for 1..8 new tokens, per dtype x ``--quantization`` mode x thread count,
and whether a row's logits depend on the row count (batch invariance). Speculation at batch 1 pays only when
verifying k + 1 tokens costs about what one decode step costs (the cost model in docs/architecture.md);
this measures that assumption (docs/architecture.md, "CPU compute dtype").

    .venv/bin/python benchmarks/step_cost.py          # demo model; float32 (+ bfloat16 with bf16 hardware)
    .venv/bin/python benchmarks/step_cost.py --model PATH --context 1000 --dtypes bfloat16 --quantizations int4

Per row: median ms of one forward + logits for T = 1 .. 8 tokens of one request after a context
of ``--context`` tokens (the KV cache in the engine's default dtype), the ratio to T = 1 (T = 5 is verifying k = 4 drafts), and how many logits of the
first row differ from the T = 1 run (0 = batch-invariant). Every configuration is built first, and each of the
``--repeats`` rounds steps all of them in turn; the ratio is the median of the per-round ratios (the machine's
speed drifts between rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

TOKEN_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8)


class Setup:
    """One configuration's model with a filled context, and its step for T new tokens."""

    def __init__(self, ckpt, dtype: torch.dtype, quantization: str, prompt: torch.Tensor, ctx: int,
                 table: list[int]) -> None:
        from specserve.model.attention import build_metadata
        from specserve.platform import detect, resolve_kv_dtype
        from specserve.worker.model_runner import build_model

        self.build_metadata, self.prompt, self.ctx, self.table, self.block_size = build_metadata, prompt, ctx, table, 16
        platform = detect("cpu")
        quant, _, act = quantization.partition(":a")  # "auto:a8": --activation-bits 8
        self.model = build_model(ckpt, platform, dtype, ctx + 64, quant, activation_bits=int(act or 16))
        kv_dtype = resolve_kv_dtype(platform, "auto", dtype)  # the engine's default cache
        self.kv = [torch.zeros(self.model.kv_cache_shape(len(table) + 1, self.block_size), dtype=kv_dtype)
                   for _ in range(ckpt.arch.num_layers)]
        self.model(prompt[:ctx], torch.arange(ctx), self.kv, build_metadata([ctx], [ctx], [table], self.block_size))

    def step(self, t: int) -> torch.Tensor:
        ctx = self.ctx
        meta = self.build_metadata([t], [ctx + t], [self.table], self.block_size)
        return self.model.compute_logits(self.model(self.prompt[ctx:ctx + t], torch.arange(ctx, ctx + t), self.kv,
                                                    meta))

    def row_differences(self) -> dict[int, int]:
        """Logits of row 0 differing from the 1-token run, per token count (0: batch-invariant)."""
        ref = self.step(1)[0]
        return {t: int((self.step(t)[0] != ref).sum()) for t in TOKEN_COUNTS}


def measure(setups: list[Setup], repeats: int) -> list[tuple[dict[int, float], dict[int, float]]]:
    """Per setup: (median ms per token count, median per-round ratio to the 1-token step). Each round steps
    every setup in turn, so configurations are compared on the same machine state (this machine's speed
    drifts between rounds and between minutes); the ratio is taken within each round, then the median."""
    times: list[dict[int, list[float]]] = [{t: [] for t in TOKEN_COUNTS} for _ in setups]
    for _ in range(repeats):
        for s, own in zip(setups, times):
            for t in TOKEN_COUNTS:
                t0 = time.perf_counter()
                s.step(t)
                own[t].append(time.perf_counter() - t0)
    out = []
    for own in times:
        ratios = {t: statistics.median(a / b for a, b in zip(v, own[1])) for t, v in own.items()}
        out.append(({t: statistics.median(v) * 1e3 for t, v in own.items()}, ratios))
    return out


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
          f"CPU: {cpu_class()}; torch {torch.__version__}; configurations interleaved in each round")
    header = "threads dtype    quant   " + "".join(f"  T={t:<2} ms (x)  " for t in TOKEN_COUNTS) + \
        "  row-0 logits differing from T=1"
    print(header)
    configs = [(name, quant) for name in dtypes for quant in args.quantizations.split(",")]
    setups = [Setup(ckpt, getattr(torch, name), quant, prompt, ctx, table) for name, quant in configs]
    diffs = [s.row_differences() for s in setups]
    for n in threads:
        torch.set_num_threads(n)
        for (name, quant), (med, ratio), diff in zip(configs, measure(setups, args.repeats), diffs):
            cells = "".join(f"  {med[t]:6.1f} ({ratio[t]:.2f}) " for t in TOKEN_COUNTS)
            print(f"{n:<8}{name:<9}{quant:<8}{cells}  {max(diff.values())} of {ckpt.arch.vocab_size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
