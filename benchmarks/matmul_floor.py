"""What one more row costs the quantized matmuls, against the instruction floor of this CPU.

A decode step (1 row) streams the weights from memory; each further row of a k + 1-token verification adds
integer work only. Per 32 weights of a row the tiled (AVX-512 VNNI) kernels issue one 512-bit ``vpdpbusd``
(64 byte products: the 16-bit activation grid takes two byte planes, docs/quantization.md), the row layout
(AVX2) two 256-bit ``vpmaddwd``. So a row costs at least (its multiply-adds / 32) / (instructions per cycle x
clock x threads). This script measures the clock (a chain of dependent adds), that instruction's throughput
on one core, and the kernels on the model's matmul shapes at 1, 5 and 8 rows (the same weights each call:
in cache where they fit), and prints each extra row's time against that floor. Together with ``benchmarks/step_cost.py`` it says how much of a
verification's extra cost is the matmuls' integer work and how close to the hardware it runs.

    .venv/bin/python benchmarks/matmul_floor.py [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

_SRC = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>

static double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GHz from a chain of dependent 1-cycle adds.
double clock_ghz() {
  uint64_t x = 1;
  const int64_t n = 200000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4.0 * n / seconds(t0) / 1e9;
}

// Instructions per second over 12 independent accumulator chains (no latency limit): a[j] = STEP(a[j], w).
#define CHAINS_PER_S(V, INIT, W, STEP, LOW32)                                    \
  V a[12];                                                                       \
  for (int i = 0; i < 12; ++i) a[i] = INIT;                                      \
  V w = W;                                                                       \
  const int64_t n = 50000000;                                                    \
  const auto t0 = std::chrono::steady_clock::now();                              \
  for (int64_t i = 0; i < n; ++i) {                                              \
    _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) a[j] = STEP(a[j], w);  \
    asm volatile("" : "+v"(w));                                                  \
  }                                                                              \
  const double s = seconds(t0);                                                  \
  int sink = 0;                                                                  \
  for (int i = 0; i < 12; ++i) sink += LOW32(a[i]);                              \
  asm volatile("" : : "r"(sink));                                                \
  return 12.0 * n / s;

#define DPBUSD(a, w) _mm512_dpbusd_epi32(a, w, w)
#define LOW512(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vpdpbusd_per_s() {
  CHAINS_PER_S(__m512i, _mm512_set1_epi32(1), _mm512_set1_epi8(3), DPBUSD, LOW512)
}

#define MADDWD_ADD(a, w) _mm256_add_epi32(a, _mm256_madd_epi16(w, w))  // the row layout's pair
#define LOW256(v) _mm_cvtsi128_si32(_mm256_castsi256_si128(v))
__attribute__((target("avx2"))) double vpmaddwd_add_per_s() {
  CHAINS_PER_S(__m256i, _mm256_set1_epi32(1), _mm256_set1_epi16(3), MADDWD_ADD, LOW256)
}
"""

ROWS = (1, 5, 8)


def time_us(fn, x: torch.Tensor, repeats: int) -> float:
    for _ in range(20):
        fn(x)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(100):
            fn(x)
        runs.append((time.perf_counter() - t0) / 100 * 1e6)
    return statistics.median(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="whose shapes (default: the embedded demo model)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: what serve uses)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()

    from torch.utils.cpp_extension import load_inline

    from specserve.model.checkpoint.loader import default_model_path, load_checkpoint
    from specserve.model.kernels.cpu import load_cpu_kernels
    from specserve.model.quant import CpuQuantWeight, quantize
    from specserve.platform import configure_threads, cpu_class, cpu_has_vnni

    configure_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if not load_cpu_kernels():
        print("the C++ CPU kernels cannot be built here: nothing to measure")
        return 1
    probe = load_inline("specserve_matmul_floor", cpp_sources=_SRC, extra_cflags=["-O2"],
                        functions=["clock_ghz", "vpdpbusd_per_s", "vpmaddwd_add_per_s"])
    tiled = cpu_has_vnni()
    ghz = probe.clock_ghz()
    # products per instruction pair counted per 32 weights of a row: one vpdpbusd (tiled), two vpmaddwd (row)
    per_s = probe.vpdpbusd_per_s() if tiled else probe.vpmaddwd_add_per_s() / 2
    arch = load_checkpoint(args.model or default_model_path(), keep_quantized=True).arch
    d = arch.head_dim
    shapes = [("qkv", (arch.num_heads + 2 * arch.num_kv_heads) * d, arch.hidden_size, 4),
              ("o", arch.hidden_size, arch.num_heads * d, 4),
              ("gate_up", 2 * arch.intermediate_size, arch.hidden_size, 4),
              ("down", arch.hidden_size, arch.intermediate_size, 4),
              ("lm_head", arch.vocab_size, arch.hidden_size, 8)]
    print(f"CPU: {cpu_class()}; {threads} threads; layout {'tiled (vpdpbusd)' if tiled else 'row (vpmaddwd)'}; "
          f"clock {ghz:.2f} GHz; {per_s / ghz / 1e9:.2f} instructions (per 32 weights of a row) per cycle per core")
    print(f"{'matmul':<8}{'N x K':>14}{'bits':>5}" + "".join(f"{f'{m} rows us':>11}" for m in ROWS)
          + f"{'extra row us':>14}{'floor us':>10}{'floor/extra':>13}")
    torch.manual_seed(0)
    total = floor_total = 0.0
    for name, n, k, bits in shapes:
        w = CpuQuantWeight(quantize(torch.randn(n, k), bits), torch.device("cpu"))
        t = {m: time_us(w, torch.randn(m, k), args.repeats) for m in ROWS}
        extra = (t[ROWS[-1]] - t[1]) / (ROWS[-1] - 1)
        floor = n * k / 32 / (per_s * threads) * 1e6
        count = arch.num_layers if name != "lm_head" else 1
        total += extra * count
        floor_total += floor * count
        print(f"{name:<8}{f'{n} x {k}':>14}{bits:>5}" + "".join(f"{t[m]:11.1f}" for m in ROWS)
              + f"{extra:14.2f}{floor:10.2f}{floor / extra:13.0%}")
    print(f"per extra row of a step ({arch.num_layers} layers + LM head): {total / 1e3:.3f} ms, "
          f"floor {floor_total / 1e3:.3f} ms ({floor_total / total:.0%})")
    print("floor/extra above 100%: the shape streams its weights from memory at one row, and the extra rows' "
          "work overlaps that stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
