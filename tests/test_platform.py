"""platform.py answers every vendor question; nothing else in the package asks."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from specserve import platform as plat
from specserve.config import SpecserveError


@pytest.mark.parametrize("native_bf16", [True, False])
def test_cpu_platform(monkeypatch, native_bf16):
    monkeypatch.delenv("SPECSERVE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    p = plat.detect("auto")
    dtype = torch.bfloat16 if native_bf16 else torch.float32  # bf16 only where the CPU has bf16 hardware
    assert (p.kind, p.device.type, p.default_dtype) == ("cpu", "cpu", dtype)
    # the C++ attention kernel on x86 with AVX2; the torch reference elsewhere or when asked for
    want = "cpu" if plat.cpu_capability() in ("AVX2", "AVX512") else "torch"
    assert (p.attention_backend, p.supports_graphs, p.dist_backend) == (want, False, "gloo")
    assert p.quant_kernels == ("cpu" if want == "cpu" else None)
    assert plat.detect("cpu").kind == "cpu"
    monkeypatch.setenv("SPECSERVE_ATTENTION", "torch")
    assert plat.detect("cpu").attention_backend == "torch"
    monkeypatch.setattr(plat, "cpu_capability", lambda: "DEFAULT")  # e.g. ARM: no kernels, dequantized weights
    monkeypatch.delenv("SPECSERVE_ATTENTION")
    assert (plat.detect("cpu").attention_backend, plat.detect("cpu").quant_kernels) == ("torch", None)


def _fake_gpu(monkeypatch, hip: str | None, triton_ok: bool = True):
    monkeypatch.delenv("SPECSERVE_DEVICE", raising=False)
    monkeypatch.delenv("SPECSERVE_ATTENTION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(plat, "_triton_available", lambda: triton_ok)


def test_cuda_platform(monkeypatch):
    _fake_gpu(monkeypatch, hip=None)
    p = plat.detect("auto")
    assert (p.kind, p.device.type, p.default_dtype) == ("cuda", "cuda", torch.bfloat16)
    assert (p.attention_backend, p.supports_graphs, p.dist_backend) == ("triton", True, "nccl")
    assert plat.detect("cuda").kind == "cuda"
    with pytest.raises(SpecserveError, match="targets cuda"):
        plat.detect("rocm")


def test_rocm_platform_same_code_path(monkeypatch):
    _fake_gpu(monkeypatch, hip="6.2.41133")
    p = plat.detect("auto")
    # HIP devices are torch "cuda" devices: one code path, only the label differs.
    assert (p.kind, p.device.type) == ("rocm", "cuda")
    assert (p.attention_backend, p.supports_graphs, p.dist_backend) == ("triton", True, "nccl")
    assert plat.detect("rocm").kind == "rocm"
    assert plat.stack_warnings() == [] or all("ROCm" not in w for w in plat.stack_warnings())


def test_old_rocm_warns(monkeypatch):
    _fake_gpu(monkeypatch, hip="5.7.1")
    assert any("older than 6.0" in w for w in plat.stack_warnings())


def test_no_triton_falls_back_to_torch_attention(monkeypatch):
    _fake_gpu(monkeypatch, hip=None, triton_ok=False)
    assert plat.detect("auto").attention_backend == "torch"


def test_env_var_and_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("SPECSERVE_DEVICE", "cpu")
    assert plat.detect("auto").kind == "cpu"
    monkeypatch.setenv("SPECSERVE_DEVICE", "cuda")
    with pytest.raises(SpecserveError, match="no usable GPU"):
        plat.detect("auto")
    with pytest.raises(SpecserveError, match="unknown device"):
        plat.detect("tpu")


def test_dtype_resolution():
    cpu = plat.Platform("cpu", torch.device("cpu"), torch.float32, "torch", False, "gloo")
    assert plat.resolve_dtype(cpu, "auto") == torch.float32
    assert plat.resolve_dtype(cpu, "bfloat16") == torch.bfloat16


def test_auto_dtype_is_fp32_for_quantized_weights_on_the_cpu_kernels(monkeypatch):
    # bf16 hardware: float models compute in bf16, but quantized weights run the fp32 kernels (fused layers).
    bf16 = plat.Platform("cpu", torch.device("cpu"), torch.bfloat16, "cpu", False, "gloo")
    monkeypatch.setattr(plat, "cpu_capability", lambda: "AVX512")
    assert plat.resolve_dtype(bf16, "auto") == torch.bfloat16
    assert plat.resolve_dtype(bf16, "auto", quantized=True) == torch.float32
    assert plat.resolve_dtype(bf16, "bfloat16", quantized=True) == torch.bfloat16  # asked for: kept
    monkeypatch.setattr(plat, "cpu_capability", lambda: "DEFAULT")  # no kernels: weights get dequantized
    assert plat.resolve_dtype(bf16, "auto", quantized=True) == torch.bfloat16


def test_no_vendor_question_outside_platform_module():
    root = pathlib.Path(__file__).resolve().parents[1] / "specserve"
    pattern = re.compile(r"\bhip\b|rocm|torch\.version", re.IGNORECASE)
    offenders = []
    for f in root.rglob("*.py"):
        if f.name == "platform.py" and f.parent == root:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_vendor_only_imports():
    root = pathlib.Path(__file__).resolve().parents[1] / "specserve"
    bad = re.compile(r"^\s*(import|from)\s+(flash_attn|xformers|vllm|apex|cupy)\b", re.MULTILINE)
    assert not [f for f in root.rglob("*.py") if bad.search(f.read_text())]


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 513, 600])
def test_row_invariant_linear(n):
    """Same values as F.linear; where this machine's probe finds bf16 rows invariant (every class with bf16
    hardware and oneDNN off AMX, test below), each row bit-identical to that row computed at 2 rows (the
    invariant count); a single row is padded, more than 256 are chunked."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 1536, generator=gen).bfloat16()
    w = (torch.randn(576, 1536, generator=gen) * 0.02).bfloat16()
    b = torch.randn(576, generator=gen).bfloat16()
    got = plat.row_invariant_linear(x, w, b)
    assert got.shape == (n, 576) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               atol=0.05, rtol=0.02)
    if plat.bf16_rows_invariant():
        for i in sorted({0, n // 2, n - 1}):
            pair = x[[i, i]] if n == 1 else x[i:i + 2] if i + 1 < n else x[i - 1:i + 1]
            alone = torch.nn.functional.linear(pair, w, b)[0 if i + 1 < n else 1]
            assert torch.equal(got[i], alone), i


@pytest.mark.skipif(not plat.cpu_has_native_bf16() or plat.cpu_has_amx(),
                    reason="the promise is checked on CPUs with bf16 hardware and no AMX (Zen 4 class)")
def test_bf16_rows_invariant_where_promised():
    """On AVX512-BF16 CPUs without AMX (oneDNN's AVX512-BF16 kernels) the probe must find every row count
    invariant: README promises bit-exact bf16 speculation there. On AMX CPUs the probe's answer is printed by
    `specserve env` and the bf16 speculation tests follow it (exact, or the near-tie rule)."""
    assert plat.bf16_rows_invariant()


def test_onednn_isa_pinned_on_amx_only(monkeypatch):
    from specserve import cpu_isa

    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", cpu_isa.AMX_ENV):
        monkeypatch.setenv(var, "")  # recorded, so teardown restores what was there (pin writes os.environ)
        monkeypatch.delenv(var)
    monkeypatch.setattr(cpu_isa, "cpu_has_amx", lambda: False)
    cpu_isa.pin_onednn_isa()
    assert "ONEDNN_MAX_CPU_ISA" not in plat.os.environ
    monkeypatch.setattr(cpu_isa, "cpu_has_amx", lambda: True)
    monkeypatch.setenv(cpu_isa.AMX_ENV, "1")  # the user keeps AMX (faster bf16 prefill, not bit-exact)
    cpu_isa.pin_onednn_isa()
    assert "ONEDNN_MAX_CPU_ISA" not in plat.os.environ and cpu_isa.onednn_amx_allowed()
    monkeypatch.delenv(cpu_isa.AMX_ENV)
    cpu_isa.pin_onednn_isa()
    assert plat.os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" and not cpu_isa.onednn_amx_allowed()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # a user's own setting is left alone
    cpu_isa.pin_onednn_isa()
    assert plat.os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX" and cpu_isa.onednn_amx_allowed()


@pytest.mark.skipif(not plat.cpu_has_native_bf16(), reason="oneDNN runs bf16 matmuls only with bf16 hardware")
def test_onednn_honours_the_isa_cap():
    """The cap pin_onednn_isa sets is read by the oneDNN inside this torch build: a fresh process capped at
    AVX2 stops using oneDNN for bf16 matmuls, one capped at AVX512_CORE_BF16 runs its avx512_core_bf16
    kernel (ONEDNN_VERBOSE names the kernel of every matmul it executes)."""
    import os
    import subprocess
    import sys

    code = ("import torch; x = torch.randn(64, 256).bfloat16(); w = torch.randn(128, 256).bfloat16(); "
            "torch.nn.functional.linear(x, w)")

    def kernels(cap: str) -> list[str]:
        env = {**os.environ, "ONEDNN_VERBOSE": "1", "ONEDNN_MAX_CPU_ISA": cap}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        return [line for line in out.stdout.splitlines() if ",exec,cpu,matmul," in line]

    capped = kernels("AVX512_CORE_BF16")
    assert capped and all("amx" not in line and "avx512_core_bf16" in line for line in capped), capped
    assert kernels("AVX2") == []


def test_cpu_class_names_every_class(monkeypatch):
    from specserve import cpu_isa

    def flags(*names: str) -> None:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(("sse4_2", "avx", *names)))

    flags("avx2")
    assert plat.cpu_class() == "AVX2-only"
    flags("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
    assert plat.cpu_class() == "AVX-512 VNNI, bf16"
    flags("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert plat.cpu_class() == "AMX (AVX-512 VNNI, bf16, AMX); oneDNN kept off AMX"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert plat.cpu_class() == "AMX (AVX-512 VNNI, bf16, AMX)"
    assert plat.cpu_class() == cpu_isa.cpu_class()  # one definition, re-exported


def test_row_invariant_linear_flattens_leading_dims():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen).bfloat16()  # e.g. distill's dense [B, S, in]
    w = torch.randn(32, 64, generator=gen).bfloat16()
    got = plat.row_invariant_linear(x, w)
    assert got.shape == (3, 5, 32)
    assert torch.equal(got, plat.row_invariant_linear(x.reshape(15, 64), w).view(3, 5, 32))


def test_platform_linear_choice():
    cpu = plat.Platform("cpu", torch.device("cpu"), torch.bfloat16, "torch", False, "gloo")
    assert cpu.linear(torch.bfloat16) is plat.row_invariant_linear
    assert cpu.linear(torch.float32) is torch.nn.functional.linear
    gpu = plat.Platform("cuda", torch.device("cpu"), torch.bfloat16, "triton", True, "nccl")
    assert gpu.linear(torch.bfloat16) is torch.nn.functional.linear
