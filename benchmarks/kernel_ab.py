"""Two builds of the C++ CPU kernels in one process: this checkout's and another ``cpu_kernels.cpp``, on a model's
own quantized weights, interleaved, with a bit-exactness check.

On the shared 2-core machines two processes running the *same* kernels differ by 20-30 % (other tenants'
memory traffic moves from minute to minute), which hides a kernel change of a few percent. Here the other
source is built under a second op namespace (``specserve_cpu_ab``) and both builds multiply the same inputs
by the same packed weights, alternating which goes first; the figure to read is the median per-round ratio.

    .venv/bin/python benchmarks/kernel_ab.py --other /path/to/other/cpu_kernels.cpp \\
        --model ~/.cache/specserve-bench/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --activation-bits 8 --rows 1,5,9,13,88

Per row count: ms of one pass over every quantized matmul of the model (the LM head only up to 17 rows, as
verification uses it), for this checkout (A) and the other build (B), the median of B / A over rounds, and
whether B's outputs equal A's bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

NAMESPACE = "specserve_cpu_ab"


def build_other(path: str) -> None:
    """Builds ``path`` (a cpu_kernels.cpp) with its ops registered as ``torch.ops.specserve_cpu_ab.*``."""
    from torch.utils.cpp_extension import load

    from specserve.model.kernels.cpu import CFLAGS

    src = open(path).read()
    for old in ("TORCH_LIBRARY(specserve_cpu,", "TORCH_LIBRARY_IMPL(specserve_cpu,"):
        if old not in src:
            raise SystemExit(f"{path}: no `{old}` (not a specserve cpu_kernels.cpp?)")
        src = src.replace(old, old.replace("specserve_cpu", NAMESPACE))
    out = os.path.join(tempfile.mkdtemp(prefix="kernel_ab_"), "cpu_kernels_ab.cpp")
    with open(out, "w") as f:
        f.write(src)
    load(name="specserve_cpu_kernels_ab", sources=[out], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False)


def matmul(namespace: str, w, x: torch.Tensor) -> torch.Tensor:
    ops = getattr(torch.ops, namespace)
    if w.bits == 4:
        return ops.q4_mm(x, w.packed, w.scales, w.mins, w.act_bits)
    return ops.q8_mm(x, w.packed, w.scales, w.act_bits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other build's cpu_kernels.cpp")
    ap.add_argument("--model", default=None, help="whose weights (default: the embedded demo model)")
    ap.add_argument("--activation-bits", type=int, default=16, choices=(8, 16))
    ap.add_argument("--rows", default="1,5,9,13,17,88", help="row counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from specserve.llm import LLM
    from specserve.model.checkpoint.loader import default_model_path
    from specserve.model.kernels.cpu import load_cpu_kernels
    from specserve.model.quant import CpuQuantWeight
    from specserve.platform import cpu_class

    if not load_cpu_kernels():
        print("the C++ CPU kernels cannot be built here: nothing to compare")
        return 1
    llm = LLM(args.model or default_model_path(), activation_bits=args.activation_bits, max_model_len=512)
    weights = [(n, m) for n, m in llm.target_model().named_modules() if isinstance(m, CpuQuantWeight)]
    if not weights:
        print("no weight of this model runs the C++ kernels")
        return 1
    build_other(args.other)
    print(f"CPU: {cpu_class()}; {torch.get_num_threads()} threads; {len(weights)} matmuls; "
          f"{args.activation_bits}-bit activations; A = this checkout, B = {args.other}")
    torch.manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        used = [(n, w) for n, w in weights if rows <= 17 or not n.endswith("lm_head")]
        xs = [torch.randn(rows, w.shape[1]) for _, w in used]
        exact = all(torch.equal(matmul("specserve_cpu", w, x), matmul(NAMESPACE, w, x)) for (_, w), x in zip(used, xs))
        times: dict[str, list[float]] = {"specserve_cpu": [], NAMESPACE: []}
        for r in range(args.rounds + 1):
            for ns in (("specserve_cpu", NAMESPACE) if r % 2 else (NAMESPACE, "specserve_cpu")):
                t0 = time.perf_counter()
                for (_, w), x in zip(used, xs):
                    matmul(ns, w, x)
                if r:  # round 0 warms both
                    times[ns].append(time.perf_counter() - t0)
        a, b = times["specserve_cpu"], times[NAMESPACE]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"{rows:4d} rows: A {statistics.median(a) * 1e3:8.1f} ms  B {statistics.median(b) * 1e3:8.1f} ms  "
              f"B / A {ratio:.3f}  {'bit-identical' if exact else 'OUTPUTS DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
