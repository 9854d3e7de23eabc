"""The ONLY module that asks "CUDA, ROCm or CPU?".

PyTorch exposes HIP devices through the ``torch.cuda`` API on ROCm builds, so everything downstream uses
``torch.device("cuda")`` for both vendors; this module answers the vendor questions (default dtype,
attention backend, graph capture, distributed backend) once.
"""

from __future__ import annotations

import functools
import os
import platform as platform_mod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.config import SpecserveError
from specserve.cpu_isa import cpu_class
from specserve.cpu_isa import cpu_has_amx as cpu_has_amx  # re-exported: platform answers CPU questions too
from specserve.cpu_isa import onednn_amx_allowed as onednn_amx_allowed

DEVICE_CHOICES = ("auto", "cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Platform:
    kind: str  # "cuda" | "rocm" | "cpu"
    device: torch.device
    default_dtype: torch.dtype
    attention_backend: str  # "torch" (reference) | "cpu" (C++ kernel) | "triton"
    supports_graphs: bool
    dist_backend: str  # "nccl" (RCCL on ROCm speaks the nccl backend name) | "gloo"

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"

    def linear(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """The matmul the model layers use: on CPU in bf16 one whose rows do not depend on the row count."""
        return row_invariant_linear if self.kind == "cpu" and dtype == torch.bfloat16 else F.linear

    @property
    def quant_kernels(self) -> str | None:
        """Which weight-only quantized matmuls run here (model/quant.py): "cpu" (the C++ kernels, x86 with
        AVX2; in their tiled layout with AVX-512 VNNI, ``cpu_has_vnni``), "triton" (GPUs of either vendor), or
        None (weights are dequantized)."""
        if self.kind == "cpu":
            return "cpu" if cpu_capability() in ("AVX2", "AVX512") else None
        return "triton" if _triton_available() else None

    @property
    def moe_kernel(self) -> str:
        """The sparse-MoE experts' kernel (model/sparse_moe.py): "triton" (grouped kernels, capturable) with the
        Triton attention backend, else "torch" (a matmul per active expert)."""
        return "triton" if self.attention_backend == "triton" else "torch"

    @property
    def can_capture_graphs(self) -> bool:
        """Graph capture needs the platform's support and a capturable attention backend (Triton; the torch
        reference plans its gathers from host lists and syncs, so it cannot be captured)."""
        return self.supports_graphs and self.attention_backend == "triton"

    def graphs_label(self) -> str:
        if self.can_capture_graphs:
            return "HIP graphs" if self.kind == "rocm" else "CUDA graphs"
        if self.supports_graphs:
            return "eager (the torch attention backend is not capturable)"
        return "eager (no graph capture on this platform)"

    @property
    def shared_memory_collectives(self) -> bool:
        """Tensor-parallel ranks on one host exchange tensors through shared memory instead of the
        distributed backend: on x86 CPUs (whose stores are seen in order, which the spin-waits rely on);
        ``SPECSERVE_TP_COMM=gloo`` keeps gloo."""
        return (self.kind == "cpu" and platform_mod.machine().lower() in ("x86_64", "amd64")
                and os.environ.get("SPECSERVE_TP_COMM", "shm") == "shm")

    def describe(self) -> dict[str, str]:
        info = {
            "platform": self.kind,
            "device": str(self.device),
            "default_dtype": str(self.default_dtype).replace("torch.", ""),
            "attention_backend": self.attention_backend,
            "graphs": self.graphs_label(),
            "dist_backend": self.dist_backend,
            "torch": torch.__version__,
            "torch_threads": str(torch.get_num_threads()),
            "quant_kernels": self.quant_kernels or "none (weights dequantized)",
        }
        if self.quant_kernels == "cpu":
            info["quant_layout"] = "tiled (AVX-512 VNNI)" if cpu_has_vnni() else "rows (AVX2)"
        if self.kind == "cpu":
            info["cpu_class"] = cpu_class()
            if cpu_has_native_bf16():
                info["bf16_rows"] = "bit-exact at any row count (probed)" if bf16_rows_invariant() else \
                    "NOT row-invariant here (AMX kernels?): greedy speculation in bf16 follows the near-tie rule"
        if self.kind == "cuda":
            info["cuda_runtime"] = str(torch.version.cuda)
        if self.kind == "rocm":
            info["hip_runtime"] = str(torch.version.hip)
        if self.is_gpu:
            info["gpu_name"] = torch.cuda.get_device_name(self.device)
        return info


def _hip_version() -> str | None:
    return getattr(torch.version, "hip", None)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def cpu_capability() -> str:
    """The widest x86 vector extension torch dispatches to here: "AVX512", "AVX2", or "DEFAULT" (ARM, old x86)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch
        return "DEFAULT"


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): bf16 is then the CPU default.

    NOTE: measured on a 2-core AVX512-BF16 EPYC (torch 2.13, `benchmarks/step_cost.py`): the demo model's
    forward costs 0.95-1.20x its 1-token time for 2-8 tokens in bf16 (oneDNN) but 1.35-1.97x in fp32 (MKL's
    small-M sgemm), so only bf16 lets a k+1-token verification cost about one decode step; and with
    ``row_invariant_linear`` bf16 decoding is batch-invariant (see model/attention.py). Without hardware
    bf16, oneDNN emulates it and fp32 is the safer default.
    """
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check is not None and bool(check()) for check in checks)


def cpu_has_vnni() -> bool:
    """True when the CPU has AVX-512 with VNNI (8-bit dot products, vpdpbusd): the CPU kernels then keep
    quantized weights in their tiled layout (model/quant.py, CpuQuantWeight). ``SPECSERVE_CPU_TILED=0``
    keeps the AVX2 row layout (for comparisons)."""
    if os.environ.get("SPECSERVE_CPU_TILED", "1") == "0":
        return False
    checks = (getattr(torch.cpu, "_is_vnni_supported", None), getattr(torch.cpu, "_is_avx512_supported", None))
    return all(check is not None and bool(check()) for check in checks)


# oneDNN's bf16 matmul (torch 2.13, AVX512-BF16) rounds a row the same for any row count from 2 to 256
# (checked on 230k outputs of every demo-model weight shape) but accumulates differently for a single row
# (42 of 230k outputs of the 1536-wide down projection differ by an ulp) and, rarely, for 400 rows.
_INVARIANT_ROWS = (2, 256)


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over [N, in] with every call made at 2..256 rows: a single row is computed next to a copy
    of itself, more than 256 rows in chunks (a trailing single row together with its predecessor). Inputs
    with more dimensions ([..., in], e.g. distill's dense [B, S, in]) are flattened to rows first."""
    if x.dim() > 2:
        return row_invariant_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
    lo, hi = _INVARIANT_ROWS
    n = x.shape[0]
    if lo <= n <= hi:
        return F.linear(x, weight, bias)
    if n < lo:
        return F.linear(x.expand(lo, -1).contiguous(), weight, bias)[:n]
    outs = [F.linear(x[i:i + hi], weight, bias) for i in range(0, n - n % hi, hi)]
    if n % hi == 1:
        outs.append(F.linear(x[n - 2:], weight, bias)[1:])
    elif n % hi:
        outs.append(F.linear(x[n - n % hi:], weight, bias))
    return torch.cat(outs)


@functools.lru_cache(maxsize=1)
def bf16_rows_invariant() -> bool:
    """Whether bf16 ``row_invariant_linear`` gives every row the same bits at any row count on this machine,
    probed once: two projection shapes at 1, 3, 255, 257 and 600 rows against the same rows computed two at
    a time. True on the CPU classes where bf16 speculation is promised bit-exact (``cpu_has_native_bf16``
    and oneDNN kept off AMX); where False the near-tie rule applies (docs/speculative_decoding.md)."""
    if not cpu_has_native_bf16():
        return False  # bf16 is emulated: oneDNN is not used for it
    gen = torch.Generator().manual_seed(0)
    for n_in, n_out in ((1536, 576), (576, 1536)):
        w = (torch.randn(n_out, n_in, generator=gen) * 0.02).bfloat16()
        x = torch.randn(600, n_in, generator=gen).bfloat16()
        pairs = torch.cat([F.linear(x[i:i + 2], w) for i in range(0, 600, 2)])  # [600, n_out], each at 2 rows
        if not all(torch.equal(row_invariant_linear(x[:m], w), pairs[:m]) for m in (1, 3, 255, 257, 600)):
            return False
    return True


def detect(requested: str = "auto", rank: int | None = None) -> Platform:
    """Pick the platform: ``requested`` (or env ``SPECSERVE_DEVICE``) in auto | cuda | rocm | cpu. ``rank``:
    a tensor-parallel rank's process, which takes visible GPU ``rank`` (modulo the count: a Ray actor sees
    only its own)."""
    requested = os.environ.get("SPECSERVE_DEVICE", requested) if requested == "auto" else requested
    gpu_ok = torch.cuda.is_available()
    vendor = "rocm" if _hip_version() else "cuda"
    if requested in ("cuda", "rocm"):
        if not gpu_ok:
            raise SpecserveError(f"--device {requested} requested but no usable GPU was found by torch "
                                 f"{torch.__version__} (check the driver and that this torch build supports it)")
        if requested != vendor:
            raise SpecserveError(f"--device {requested} requested but this torch build targets {vendor}")
    kind = vendor if (requested in ("cuda", "rocm") or (requested == "auto" and gpu_ok)) else "cpu"
    if requested not in ("auto", "cuda", "rocm", "cpu"):
        raise SpecserveError(f"unknown device {requested!r}: use auto, cuda, rocm or cpu")
    if kind == "cpu":
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        kernel = cpu_capability() in ("AVX2", "AVX512") and os.environ.get("SPECSERVE_ATTENTION", "cpu") == "cpu"
        return Platform("cpu", torch.device("cpu"), dtype, "cpu" if kernel else "torch", False, "gloo")
    use_triton = _triton_available() and os.environ.get("SPECSERVE_ATTENTION", "triton") == "triton"
    if rank is not None:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return Platform(
        kind=kind,
        device=torch.device("cuda", torch.cuda.current_device()),
        default_dtype=torch.bfloat16,
        attention_backend="triton" if use_triton else "torch",
        supports_graphs=True,
        dist_backend="nccl",
    )


DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(platform: Platform, dtype: str, quantized: bool = False) -> torch.dtype:
    """The compute dtype for ``--dtype``; ``quantized``: the model's matmul weights will be quantized.

    NOTE: ``auto`` with quantized weights on the CPU kernels is float32 even with bf16 hardware: the kernels
    take fp32 activations and the fused decoder layer (model/ops.py) runs in fp32 only. Measured on a 2-core
    AVX512-BF16 EPYC, demo Q4_1 model (`benchmarks/step_cost.py --dtypes float32,bfloat16`): 6.7 ms per decode
    step in fp32 against 12.5 ms with bf16 activations, and fp32 stays ahead for every T up to 8 tokens.
    """
    if dtype == "auto":
        if quantized and platform.kind == "cpu" and platform.quant_kernels == "cpu":
            return torch.float32
        return platform.default_dtype
    return DTYPE_BY_NAME[dtype]


def resolve_kv_dtype(platform: Platform, kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for ``--kv-cache-dtype``.

    ``auto``: fp16 where fp32 compute runs the C++ CPU attention (it reads fp16 rows with one conversion
    instruction; llama.cpp's default cache type too), else the compute dtype. On the demo model (2-core
    AVX-512 EPYC, fp32, batch 1, chat) that took speculation-off decoding from 178 to 189 tok/s with the
    same greedy outputs, and it halves the cache's memory; at a 1500-token context the attention's bytes
    dominate a decode step. ``float32`` keeps the old cache.
    """
    if kv_cache_dtype == "auto":
        if platform.kind == "cpu" and compute == torch.float32 and platform.attention_backend == "cpu":
            return torch.float16
        return compute
    return DTYPE_BY_NAME[kv_cache_dtype]


def staged(values: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """Host values as a CPU tensor ready for a non-blocking copy to ``device``: pinned when it is a GPU.

    NOTE: pinned blocks come from torch's caching host allocator, which records an event on every
    non-blocking copy out of a block and reuses the block only after that copy has run; so the tensor may
    be dropped right after ``copy_(..., non_blocking=True)``. ``pin_memory`` needs a GPU: never on CPU.
    """
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.pin_memory() if device.type != "cpu" else t


def to_device(values: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host sync: a blocking host-to-GPU copy
    waits for the whole stream, a pinned non-blocking one is only queued on it. On CPU: the plain tensor."""
    t = staged(values, device, dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def visible_gpus() -> int:
    """GPUs this process may use (either vendor); 0 on a CPU-only build or machine."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_tensor_parallel_devices(platform: Platform, size: int) -> None:
    """A tensor-parallel size the local GPUs can hold with the ``mp`` executor (one GPU per rank)."""
    if platform.is_gpu and size > visible_gpus():
        raise SpecserveError(f"--tensor-parallel-size {size} needs {size} GPUs, but {visible_gpus()} are visible "
                             f"(CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")


def configure_threads(ranks: int = 1) -> None:
    """Intra-op threads for CPU kernels: every core (``SPECSERVE_NUM_THREADS`` overrides).

    NOTE: measured on a 2-core AVX2 EPYC with the demo GGUF (quantized, C++ kernels), 1 vs 2 threads:
    a decode step 31.8 vs 23.9 ms (`benchmarks/step_cost.py --threads 1,2`); `specserve serve`, chat, 64
    tokens: 27-30 vs 36-38 tok/s one request at a time, 51 vs 80 tok/s with 8 concurrent requests. The
    event loop and the tokenizer do not need a core of their own, so none is left free.
    With ``ranks`` tensor-parallel processes on one machine each takes its share of the cores.
    """
    n = int(os.environ.get("SPECSERVE_NUM_THREADS", "0")) or max(1, available_cores() // ranks)
    torch.set_num_threads(n)


def stack_warnings() -> list[str]:
    """Loud warnings about a GPU stack that would otherwise fail silently (old ROCm, unusable GPU)."""
    out = []
    hip = _hip_version()
    if hip:
        try:
            major = int(str(hip).split(".")[0])
        except ValueError:
            major = -1
        if major < 6:
            out.append(f"ROCm/HIP {hip} is older than 6.0: specserve's Triton kernels and HIP graphs need "
                       "ROCm >= 6.0; expect failures or fall back to --device cpu")
    has_node = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/kfd"))
    if has_node and not torch.cuda.is_available():
        build = "a CPU-only torch build" if not (torch.version.cuda or hip) else "a driver too old for this torch"
        out.append(f"a GPU device node exists but torch cannot use it ({build}?): running on the CPU")
    return out


def runtime_versions() -> dict[str, str]:
    """torch, CUDA or HIP runtime, driver (when torch can tell), Triton."""
    info: dict[str, str] = {"torch": str(torch.__version__)}
    if torch.version.cuda:
        info["cuda_runtime"] = str(torch.version.cuda)
    if _hip_version():
        info["hip_runtime"] = str(_hip_version())
    get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    if torch.cuda.is_available() and get_driver is not None:
        try:
            v = int(get_driver())
            info["driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:  # noqa: BLE001 - best effort reporting
            pass
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = "not installed"
    return info
