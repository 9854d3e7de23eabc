"""The C++ CPU paged attention alone: one forward's attention over the model's layers for T new tokens of one
request after a context (T = 1 is a decode step, T = k + 1 a k-draft verification), the demo model's head
shapes and the engine's default fp16 cache. The cache is random and hot (all layers' K/V of a short context
fit in L3), so this isolates the kernel's own work; in the engine the first row of a chunk reads it from
memory.

    .venv/bin/python benchmarks/attention_rows.py                       # contexts 300, 1400; rows 1, 6
    .venv/bin/python benchmarks/attention_rows.py --contexts 4000 --rows 1,2,4,8 --kv-dtype bfloat16

Per (context, rows): the best and the median ms of ``--rounds`` rounds of ``--inner`` forwards' attention.
docs/quantization.md quotes it (alternating processes of two builds for a before / after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def forward_ms(q: torch.Tensor, caches: list[torch.Tensor], meta, scale: float, inner: int) -> float:  # noqa: ANN001
    """Mean ms of ``inner`` forwards' attention (every layer's cache in turn)."""
    t0 = time.perf_counter()
    for _ in range(inner):
        for kv in caches:
            torch.ops.specserve_cpu.paged_attention(q, kv, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                                    scale, 0)
    return (time.perf_counter() - t0) / inner * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="300,1400")
    ap.add_argument("--rows", default="1,6")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args(argv)

    from specserve.model.attention import build_metadata
    from specserve.model.kernels.cpu import load_cpu_kernels
    from specserve.platform import configure_threads, cpu_class

    configure_threads()
    if not load_cpu_kernels():
        print("the C++ CPU kernels are not available on this machine", file=sys.stderr)
        return 1
    kv_dtype = getattr(torch, args.kv_dtype)
    bs = 16
    print(f"CPU: {cpu_class()}; torch threads {torch.get_num_threads()}; {args.layers} layers, {args.heads} heads / "
          f"{args.kv_heads} KV heads of {args.head_dim}, {args.kv_dtype} cache")
    print("context  rows  best ms  median ms")
    gen = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        rows_list = [int(r) for r in args.rows.split(",")]
        blocks = (ctx + max(rows_list)) // bs + 2
        caches = [torch.randn(2, blocks + 1, bs, args.kv_heads, args.head_dim, generator=gen).to(kv_dtype)
                  for _ in range(args.layers)]
        table = list(range(1, blocks + 1))
        for t in rows_list:
            meta = build_metadata([t], [ctx + t], [table], bs)
            q = torch.randn(t, args.heads, args.head_dim, generator=gen)
            times = [forward_ms(q, caches, meta, args.head_dim ** -0.5, args.inner) for _ in range(args.rounds + 1)][1:]
            print(f"{ctx:7d}  {t:4d}  {min(times):7.3f}  {statistics.median(times):9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
