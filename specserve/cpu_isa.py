"""CPU instruction-set facts that must be settled before torch first calls oneDNN (stdlib only: the package's
``__init__`` applies ``pin_onednn_isa`` on import, before torch is loaded). ``specserve/platform.py`` answers
every other platform question and re-exports these."""

from __future__ import annotations

import functools
import os
import platform


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the Linux kernel names them (``/proc/cpuinfo``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Intel Xeon, 4th generation and later)."""
    return "amx_tile" in cpu_flags()


def cpu_class() -> str:
    """The CPU class every benchmark prints: "AMX (AVX-512 VNNI, bf16, AMX)" (4th-generation Xeon and later),
    "AVX-512 VNNI, bf16" (e.g. Zen 4), "AVX-512 VNNI", "AVX-512", "AVX2-only", or the machine's architecture
    where the flags are unknown (not Linux, ARM)."""
    flags = cpu_flags()
    if "avx512f" not in flags:
        return "AVX2-only" if "avx2" in flags else platform.machine() or "unknown"
    if cpu_has_amx():
        return "AMX (AVX-512 VNNI, bf16, AMX)" + ("" if onednn_amx_allowed() else "; oneDNN kept off AMX")
    vnni = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512"
    return vnni + (", bf16" if "avx512_bf16" in flags else "")


AMX_ENV = "SPECSERVE_CPU_AMX"
_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def pin_onednn_isa() -> None:
    """On CPUs with AMX, keep oneDNN's bf16 matmuls on its AVX512-BF16 kernels (``ONEDNN_MAX_CPU_ISA``).

    NOTE: oneDNN picks an AMX kernel for some row counts and an AVX512-BF16 one for others, and the two round
    differently, so a row's bf16 result would depend on how many rows share its matmul: on a Sapphire Rapids
    Xeon ``row_invariant_linear`` at 255-257 rows differed from the same rows at 2. Capping the ISA keeps every
    call on the kernel family that is row-invariant for 2..256 rows (the one Zen 4 runs). oneDNN reads the
    variable once, at its first primitive: so this runs when ``specserve`` is imported, and changes nothing
    when the user set the variable or ``SPECSERVE_CPU_AMX=1`` (AMX's faster bf16 prefill, no bit-exactness;
    ``bf16_rows_invariant`` then reports the truth). Worker processes inherit the variable."""
    if os.environ.get(AMX_ENV, "0") == "1" or any(e in os.environ for e in _ISA_ENVS) or not cpu_has_amx():
        return
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"


def onednn_amx_allowed() -> bool:
    """Whether oneDNN may use AMX kernels in this process (False where ``pin_onednn_isa`` capped it)."""
    cap = next((os.environ[e] for e in _ISA_ENVS if e in os.environ), "ALL").upper()
    return cpu_has_amx() and (cap == "ALL" or "AMX" in cap)
