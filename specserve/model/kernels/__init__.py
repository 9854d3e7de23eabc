"""The C++ CPU kernels (``cpu_kernels.cpp``: weight-only quantized matmuls, paged attention), registered as
``torch.ops.specserve_cpu.*``. Built with torch's extension builder on first use on a machine (~20 s on two
cores; torch caches the build in its extensions directory, ``TORCH_EXTENSIONS_DIR``) and loaded once per
process. Whether they may run at all is ``platform.Platform.quant_kernels`` / ``attention_backend``."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("specserve")

_loaded: bool | None = None


def load_cpu_kernels() -> bool:
    """True once the kernels are loaded; False, with one warning, when they cannot be built here (no C++
    compiler or ninja): callers then fall back to dequantized weights and the torch attention."""
    global _loaded
    if _loaded is None:
        _loaded = _build()
    return _loaded


def _build() -> bool:
    if hasattr(torch.ops.specserve_cpu, "q4_mm"):
        return True
    try:
        from torch.utils.cpp_extension import load

        src = os.path.join(os.path.dirname(__file__), "cpu_kernels.cpp")
        log.info("CPU kernels: loading (compiled on first use on this machine, ~20 s)")
        # -ffp-contract=off: scalar a * b + c is never fused into an FMA behind our back, so code shared by
        # the row-count instantiations of a kernel rounds the same in each (row invariance); FMAs are explicit.
        cflags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
        load(name="specserve_cpu_kernels", sources=[src], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: run without them
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("CPU kernels: cannot build them (%s: %s); quantized weights are dequantized and attention "
                    "runs in torch", type(e).__name__, first)
        return False
