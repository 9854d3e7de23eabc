"""Triton int4 / int8 / grouped int8 weight-only matmuls vs the pure-torch references, and the references vs a dequantization
written out by hand from the format (so a wrong nibble order or group index fails here, not only in a model).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported);
shapes are kept tiny because the interpreter executes every program instance in Python. The reference tests
run without Triton.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specserve.model.kernels import triton_quant  # noqa: E402
from specserve.model.kernels.triton_quant import (  # noqa: E402
    int4_matmul,
    int4_matmul_reference,
    int8_group_matmul,
    int8_group_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
)

HAS_TRITON = triton_quant.triton is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _bf16_dot_probe_kernel(out_ptr, a_ptr, b_ptr):
        """out = a @ b.to(bf16) for one 16x16 tile: the bf16 features the quant kernels rely on."""
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])  # bf16 [16, 16]
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :]).to(a.dtype)  # uint8 [16, 16] -> bf16
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))


def _bf16_supported() -> bool:
    """On a device always; under the interpreter only if its bf16 loads / casts / tl.dot give right answers.
    (Triton 3.x's interpreter stores bf16 as raw uint16 and its tl.dot multiplies the bit patterns,
    triton-lang/triton#11584.)"""
    if not HAS_TRITON:
        return False
    if torch.cuda.is_available():
        return True
    a = torch.arange(256, dtype=torch.float32).reshape(16, 16).div(64).to(torch.bfloat16)
    b = torch.arange(256).remainder(16).to(torch.uint8).reshape(16, 16)
    out = torch.empty(16, 16)
    try:
        _bf16_dot_probe_kernel[(1,)](out, a, b)
    except Exception:  # any failure means "not supported here"
        return False
    return torch.allclose(out, a.float() @ b.float(), rtol=1e-3, atol=1e-3)


def _half_params():
    # fp16 runs everywhere; bf16 where the backend can (see _bf16_supported), evaluated at collection time.
    bf16 = pytest.mark.skipif(not _bf16_supported(),
                              reason="the Triton interpreter has no bf16 arithmetic (triton-lang/triton#11584)")
    return [torch.float16, pytest.param(torch.bfloat16, marks=bf16)]


# -- cases --------------------------------------------------------------------------------------------------
def _pack(codes: torch.Tensor, *, swap: bool = False) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> packed [N, K // 2]: even k in the low nibble (swap=True: the bug)."""
    lo, hi = codes[:, 0::2], codes[:, 1::2]
    if swap:
        lo, hi = hi, lo
    return lo | (hi << 4)


def _int4_case(M, N, K, G, *, seed=0, x_dtype=torch.float32, s_dtype=torch.float32):
    """Random codes / scales / mins (asymmetric, like a min-max quantizer's) and activations."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // G, generator=g) * 0.1 + 0.01
    mins = -8 * scales + 0.05 * torch.randn(N, K // G, generator=g)
    x = torch.randn(M, K, generator=g)
    return (x.to(x_dtype).to(DEVICE), codes.to(DEVICE), scales.to(s_dtype).to(DEVICE),
            mins.to(s_dtype).to(DEVICE))


def _int8_case(M, N, K, *, seed=0, x_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) * 0.02 + 0.001
    x = torch.randn(M, K, generator=g)
    return x.to(x_dtype).to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE)


def _int8_group_case(M, N, K, G, *, seed=0, x_dtype=torch.float32):
    """Codes over the whole int8 range and fp16-valued scales per group (as GGUF's Q8_0 / Q6_K hold them)."""
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = (torch.rand(N, K // G, generator=g) * 0.02 + 0.001).half().float()
    x = torch.randn(M, K, generator=g)
    return x.to(x_dtype).to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE)


def _int4_by_hand(codes, scales, mins, G):
    """w[n, k] = scales[n, k // G] * code[n, k] + mins[n, k // G], in fp64, by explicit index gather."""
    g_of_k = torch.arange(codes.shape[1], device=codes.device) // G  # [K]
    return scales.double()[:, g_of_k] * codes.double() + mins.double()[:, g_of_k]  # [N, K]


# -- Triton vs reference ------------------------------------------------------------------------------------
# (N, K, group_size): BLOCK_K is 32 / 64 / 128 (the largest dividing G), BLOCK_N = 64.
INT4_SHAPES = [
    (40, 96, 32),  # N < BLOCK_N (masked columns), K = 3 groups, K not a multiple of 64
    (70, 192, 64),  # two N tiles, the second one ragged
    (24, 288, 96),  # group not a power of two: BLOCK_K 32, three steps per group
    (16, 256, 128),  # BLOCK_K 128, two groups
]
INT8_SHAPES = [
    (40, 96),  # K = 64 + a ragged 32-column step
    (70, 200),  # two N tiles, K = 3 * 64 + 8
]


@needs_triton
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("N,K,G", INT4_SHAPES)
def test_int4_matches_reference(M, N, K, G):
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=M * 1000 + K)
    qweight = _pack(codes)
    ref = int4_matmul_reference(x, qweight, scales, mins, G)
    out = int4_matmul(x, qweight, scales, mins, G)
    assert out.shape == (M, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("N,K", INT8_SHAPES)
def test_int8_matches_reference(M, N, K):
    x, qweight, scales = _int8_case(M, N, K, seed=M * 1000 + K)
    ref = int8_matmul_reference(x, qweight, scales)
    out = int8_matmul(x, qweight, scales)
    assert out.shape == (M, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


# (N, K, group_size): BLOCK_K is 16 (Q6_K) / 32 (Q8_0, Q5_0) / 64; BLOCK_N = 64, so N = 40 and 70 leave masked
# columns; K = 256 and 768 (one and three Q6_K super-blocks).
INT8_GROUP_SHAPES = [
    (40, 256, 16),
    (70, 768, 16),
    (40, 256, 32),
    (70, 768, 32),
]


@needs_triton
@pytest.mark.parametrize("M", [1, 3, 17, 40])  # BLOCK_M 16 (masked rows), 32, 64 (M = 40 masks 24 of 64)
@pytest.mark.parametrize("N,K,G", INT8_GROUP_SHAPES)
def test_int8_group_matches_reference(M, N, K, G):
    x, qweight, scales = _int8_group_case(M, N, K, G, seed=M * 1000 + K + G)
    ref = int8_group_matmul_reference(x, qweight, scales, G)
    out = int8_group_matmul(x, qweight, scales, G)
    assert out.shape == (M, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", _half_params())
@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("K,G", [(256, 16), (768, 32)])
def test_int8_group_half_precision_activations(dtype, M, K, G):
    # The codes are exact in fp16 / bf16, so the kernel's only rounding beyond fp32 is the output's.
    N = 40
    x, qweight, scales = _int8_group_case(M, N, K, G, seed=61 + M + G, x_dtype=dtype)
    out = int8_group_matmul(x, qweight, scales, G)
    ref = int8_group_matmul_reference(x, qweight, scales, G)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # |y| ~ 10: an output ulp or two, relative
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # Scales in the compute dtype are accepted too (the format allows either).
    out_s = int8_group_matmul(x, qweight, scales.to(dtype), G)
    torch.testing.assert_close(out_s.float(), ref.float(), rtol=tol, atol=tol)


@needs_triton
def test_int8_group_wrong_group_is_caught():
    # The same codes with their scales read as the other group size must differ: the grouping is checked.
    M, N, K = 3, 40, 256
    x, qweight, scales16 = _int8_group_case(M, N, K, 16, seed=71)
    scales32 = scales16[:, 0::2].contiguous()  # a group-32 tensor from every other group-16 scale
    good = int8_group_matmul(x, qweight, scales16, 16)
    want = torch.einsum("mk,nk,nk->mn", x.double(), qweight.double(),
                        scales16.double().repeat_interleave(16, 1))
    assert (good.double() - want).abs().max().item() < 1e-4
    other = int8_group_matmul(x, qweight, scales32, 32)
    assert (other.double() - want).abs().max().item() > 0.1


@needs_triton
def test_prefill_sized_m_and_strided_x():
    # M = 70: BLOCK_M 64, two row tiles; x a column slice of a wider buffer (row stride != K).
    M, N, K, G = 70, 40, 96, 32
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=11)
    wide = torch.randn(M, K + 24, device=DEVICE)
    wide[:, 8:8 + K] = x
    xs = wide[:, 8:8 + K]
    qweight = _pack(codes)
    torch.testing.assert_close(int4_matmul(xs, qweight, scales, mins, G),
                               int4_matmul_reference(x, qweight, scales, mins, G), rtol=1e-5, atol=1e-4)
    _, q8, s8 = _int8_case(M, N, K, seed=12)
    torch.testing.assert_close(int8_matmul(xs, q8, s8), int8_matmul_reference(x, q8, s8), rtol=1e-5, atol=1e-4)
    _, qg, sg = _int8_group_case(M, N, K, 32, seed=13)
    torch.testing.assert_close(int8_group_matmul(xs, qg, sg, 32), int8_group_matmul_reference(x, qg, sg, 32),
                               rtol=1e-5, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", _half_params())
def test_half_precision_activations(dtype):
    # Scales / mins in the compute dtype (the format allows either); output in x.dtype.
    M, N, K, G = 3, 40, 96, 32
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=21, x_dtype=dtype, s_dtype=dtype)
    qweight = _pack(codes)
    out = int4_matmul(x, qweight, scales, mins, G)
    ref = int4_matmul_reference(x, qweight, scales, mins, G)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # a few ulps of |y| ~ 10
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)

    x8, q8, s8 = _int8_case(M, N, K, seed=22, x_dtype=dtype)
    out8 = int8_matmul(x8, q8, s8)
    assert out8.dtype == dtype
    torch.testing.assert_close(out8.float(), int8_matmul_reference(x8, q8, s8).float(), rtol=tol, atol=tol)


@needs_triton
def test_empty_batch():
    x, codes, scales, mins = _int4_case(0, 40, 96, 32)
    assert int4_matmul(x, _pack(codes), scales, mins, 32).shape == (0, 40)
    x, q8, s8 = _int8_case(0, 40, 96)
    assert int8_matmul(x, q8, s8).shape == (0, 40)
    x, qg, sg = _int8_group_case(0, 40, 96, 16)
    assert int8_group_matmul(x, qg, sg, 16).shape == (0, 40)


# -- the references against the format, written out by hand -----------------------------------------------
@pytest.mark.parametrize("G", [16, 32])  # 16: the reference takes any divisor of K, the kernel multiples of 32
def test_int4_reference_matches_dequantize_by_hand(G):
    M, N, K = 3, 5, 64
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=31)
    ref = int4_matmul_reference(x, _pack(codes), scales, mins, G)
    want = x.double() @ _int4_by_hand(codes, scales, mins, G).T
    assert ref.dtype == x.dtype
    assert (ref.double() - want).abs().max().item() < 1e-4
    # Spot-check the packing convention itself on one byte: k = 2 in the low nibble, k = 3 in the high one.
    assert _pack(codes)[1, 1].item() == codes[1, 2].item() + 16 * codes[1, 3].item()


@pytest.mark.parametrize("G", [8, 16, 32])  # 8: the reference takes any divisor of K, the kernel multiples of 16
def test_int8_group_reference_matches_dequantize_by_hand(G):
    M, N, K = 3, 5, 64
    x, qweight, scales = _int8_group_case(M, N, K, G, seed=33)
    ref = int8_group_matmul_reference(x, qweight, scales, G)
    g_of_k = torch.arange(K, device=qweight.device) // G  # [K]
    want = x.double() @ (qweight.double() * scales.double()[:, g_of_k]).T
    assert ref.dtype == x.dtype
    assert (ref.double() - want).abs().max().item() < 1e-4


def test_int8_reference_matches_dequantize_by_hand():
    x, qweight, scales = _int8_case(3, 5, 40, seed=32)
    ref = int8_matmul_reference(x, qweight, scales)
    want = torch.einsum("mk,nk,n->mn", x.double(), qweight.double(), scales.double())
    assert (ref.double() - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("impl", [
    int4_matmul_reference,
    pytest.param(int4_matmul, marks=needs_triton),
])
def test_swapped_nibbles_are_caught(impl):
    # The same codes packed high/low swapped must give a clearly wrong product: the checks above can fail.
    M, N, K, G = 3, 40, 96, 32
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=41)
    want = x.double() @ _int4_by_hand(codes, scales, mins, G).T
    good = impl(x, _pack(codes), scales, mins, G)
    bad = impl(x, _pack(codes, swap=True), scales, mins, G)
    assert (good.double() - want).abs().max().item() < 1e-4
    assert (bad.double() - want).abs().max().item() > 0.1


def test_argument_checks():
    x, codes, scales, mins = _int4_case(2, 8, 64, 32)
    qweight = _pack(codes)
    with pytest.raises(ValueError, match="divide"):
        int4_matmul_reference(x, qweight, scales, mins, 24)
    with pytest.raises(ValueError, match="uint8"):
        int4_matmul_reference(x, qweight.to(torch.int8), scales, mins, 32)
    with pytest.raises(ValueError, match="mins"):
        int4_matmul_reference(x, qweight, scales, mins[:, :1], 32)
    x8, q8, s8 = _int8_case(2, 8, 64)
    with pytest.raises(ValueError, match="int8 qweight"):
        int8_matmul_reference(x8[:, :32], q8, s8)
    with pytest.raises(ValueError, match="scales"):
        int8_matmul_reference(x8, q8, s8[:4])
    if HAS_TRITON:
        with pytest.raises(ValueError, match="multiple of 32"):
            int4_matmul(x, qweight, scales.repeat_interleave(2, 1), mins.repeat_interleave(2, 1), 16)


@pytest.mark.parametrize("impl", [
    int8_group_matmul_reference,
    pytest.param(int8_group_matmul, marks=needs_triton),
])
def test_int8_group_argument_checks(impl):
    x, qweight, scales = _int8_group_case(2, 8, 64, 16)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        impl(x[None], qweight, scales, 16)
    with pytest.raises(ValueError, match="x must be a 2-D float"):
        impl(x.to(torch.int32), qweight, scales, 16)
    with pytest.raises(ValueError, match=r"qweight must be int8 \[N, K = 64\]"):
        impl(x, qweight.to(torch.uint8), scales, 16)
    with pytest.raises(ValueError, match=r"qweight must be int8 \[N, K = 32\]"):
        impl(x[:, :32], qweight, scales, 16)
    with pytest.raises(ValueError, match="group_size 24 must be positive and divide K = 64"):
        impl(x, qweight, scales, 24)
    with pytest.raises(ValueError, match="group_size 0"):
        impl(x, qweight, scales, 0)
    with pytest.raises(ValueError, match=r"scales must be a float \[N, K // group_size\] = \[8, 2\]"):
        impl(x, qweight, scales, 32)  # group-16 scales passed as group 32
    with pytest.raises(ValueError, match="scales must be a float"):
        impl(x, qweight, scales.to(torch.int32), 16)
    if impl is int8_group_matmul:
        with pytest.raises(ValueError, match="multiple of 16, got 8"):
            impl(x, qweight, scales.repeat_interleave(2, 1), 8)


def test_module_imports_without_triton(monkeypatch):
    # A fresh copy of the module with `import triton` failing: the references work, the kernels say why not.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    path = Path(triton_quant.__file__)
    spec = importlib.util.spec_from_file_location("_triton_quant_without_triton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.triton is None
    x, codes, scales, mins = _int4_case(2, 8, 64, 32)
    qweight = _pack(codes)
    torch.testing.assert_close(mod.int4_matmul_reference(x, qweight, scales, mins, 32),
                               int4_matmul_reference(x, qweight, scales, mins, 32))
    with pytest.raises(ImportError, match="pip install triton"):
        mod.int4_matmul(x, qweight, scales, mins, 32)
    with pytest.raises(ImportError, match="pip install triton"):
        mod.int8_matmul(*_int8_case(2, 8, 64))
    xg, qg, sg = _int8_group_case(2, 8, 64, 16)
    torch.testing.assert_close(mod.int8_group_matmul_reference(xg, qg, sg, 16),
                               int8_group_matmul_reference(xg, qg, sg, 16))
    with pytest.raises(ImportError, match="pip install triton"):
        mod.int8_group_matmul(xg, qg, sg, 16)


# -- the packed weight the engine holds (quant.TritonQuant8Weight) ---------------------------------------------
@needs_triton
@pytest.mark.parametrize("G", [16, 32])
def test_triton_quant8_weight(G):
    from specserve.model.quant import QuantizedTensor, TritonQuant8Weight

    M, N, K = 3, 40, 256
    x, qweight, scales = _int8_group_case(M, N, K, G, seed=81 + G)
    qt = QuantizedTensor(8, qweight, scales, None)
    assert qt.group == G
    w = TritonQuant8Weight(qt, torch.device(DEVICE))
    assert w.packed.dtype == torch.int8 and w.shape == (N, K) and w.bits == 8
    back = w.unpacked()
    assert back.bits == 8 and back.mins is None and back.group == G
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.scales, qt.scales)
    torch.testing.assert_close(w.dequantize(), qt.dequantize())
    want = x @ qt.dequantize().T
    torch.testing.assert_close(w(x), want, rtol=1e-5, atol=1e-4)
    # forward() flattens leading dimensions: [B, T, K] -> [B, T, N]
    torch.testing.assert_close(w(x.view(1, M, K)), want.view(1, M, N), rtol=1e-5, atol=1e-4)


def test_pack_picks_the_triton_weight_by_format():
    # pack() only builds the modules here (no kernel runs): 8 bits in groups of 16 / 32 -> TritonQuant8Weight,
    # 4 bits in groups of 32 -> TritonQuantWeight; an 8-bit group the kernel cannot take stays dense.
    from specserve.model.quant import (
        DenseWeight,
        QuantizedTensor,
        TritonQuant8Weight,
        TritonQuantWeight,
        pack,
    )

    cpu = torch.device("cpu")
    N, K = 8, 64
    codes8 = torch.randint(-128, 128, (N, K), dtype=torch.int8)
    for G in (16, 32):
        qt = QuantizedTensor(8, codes8, torch.rand(N, K // G), None)
        assert isinstance(pack(qt, "triton", cpu, torch.float32), TritonQuant8Weight)
    codes4 = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    q4 = QuantizedTensor(4, codes4, torch.rand(N, K // 32), torch.rand(N, K // 32))
    assert isinstance(pack(q4, "triton", cpu, torch.float32), TritonQuantWeight)
    q8_g8 = QuantizedTensor(8, codes8, torch.rand(N, K // 8), None)
    assert isinstance(pack(q8_g8, "triton", cpu, torch.float32), DenseWeight)
    with pytest.raises(ValueError, match="groups of 8"):
        TritonQuant8Weight(q8_g8, cpu)


# -- device ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 8, 300])
def test_gpu_realistic_shapes(dtype, M):
    N, K, G = 4096, 4096, 128
    x, codes, scales, mins = _int4_case(M, N, K, G, seed=51, x_dtype=dtype)
    qweight = _pack(codes)
    ref = int4_matmul_reference(x, qweight, scales, mins, G).float()
    out = int4_matmul(x, qweight, scales, mins, G).float()
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert (out - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    x8, q8, s8 = _int8_case(M, N, K, seed=52, x_dtype=dtype)
    ref8 = int8_matmul_reference(x8, q8, s8).float()
    out8 = int8_matmul(x8, q8, s8).float()
    assert (out8 - ref8).abs().max().item() < tol * max(1.0, ref8.abs().max().item())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 8, 300])
@pytest.mark.parametrize("G", [16, 32])
def test_gpu_int8_group_realistic_shapes(dtype, M, G):
    N, K = 4096, 4096
    x, qweight, scales = _int8_group_case(M, N, K, G, seed=53, x_dtype=dtype)
    ref = int8_group_matmul_reference(x, qweight, scales, G).float()
    out = int8_group_matmul(x, qweight, scales, G).float()
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert (out - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
