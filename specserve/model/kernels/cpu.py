"""The C++ CPU kernels (``cpu_kernels.cpp``: weight-only quantized matmuls, paged attention), registered as
``torch.ops.specserve_cpu.*``. Built with torch's extension builder on first use on a machine (~50 s on two
cores; torch caches the build in its extensions directory, ``TORCH_EXTENSIONS_DIR``) and loaded once per
process. Whether they may run at all is ``platform.Platform.quant_kernels`` / ``attention_backend``."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import torch

log = logging.getLogger("specserve")

_loaded: bool | None = None
NAME = "specserve_cpu_kernels"
# -ffp-contract=off: scalar a * b + c is never fused into an FMA behind our back, so code shared by the
# row-count instantiations of a kernel rounds the same in each (row invariance); FMAs are explicit.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


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
        log.info("CPU kernels: loading (compiled on first use on this machine, ~50 s)")
        with _stale_lock_watch(_build_dir()):
            load(name=NAME, sources=[src], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: run without them
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("CPU kernels: cannot build them (%s: %s); quantized weights are dequantized and attention "
                    "runs in torch", type(e).__name__, first)
        return False


# A build takes ~20-60 s on two cores; torch's builder waits for the build directory's lock file without a
# limit, so a process killed while building (Ctrl-C during the first start) would make every later start wait
# forever. A lock older than this is taken as abandoned and removed.
STALE_LOCK_S = 180.0


def _build_dir() -> str | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return str(_get_build_directory(NAME, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper: without it there is just no watch
        return None


def remove_stale_lock(build_dir: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir``'s build lock if it is older than ``max_age_s``; True if one was removed."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("CPU kernels: removing a build lock left %.0f s ago (a process stopped while building them): %s",
                age, lock)
    with contextlib.suppress(OSError):
        os.remove(lock)
    return True


@contextlib.contextmanager
def _stale_lock_watch(build_dir: str | None, every_s: float = 5.0) -> Iterator[None]:
    """While the build runs, check every ``every_s`` for an abandoned lock (``remove_stale_lock``)."""
    if build_dir is None:
        yield
        return
    remove_stale_lock(build_dir)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every_s):
            remove_stale_lock(build_dir)

    thread = threading.Thread(target=watch, name="specserve-kernel-build-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
