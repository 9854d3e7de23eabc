"""Weight-only quantized matmuls ``y = x @ w.T``: Triton kernels and the pure-torch references they are tested
against (``tests/test_triton_quant.py``).

Formats (fixed by the rest of the engine):
- ``x``: [M, K] float32 / bfloat16 / float16. Output [M, N] in ``x.dtype``; accumulation is fp32.
- int4: ``qweight`` uint8 [N, K // 2], two 4-bit codes per byte along K: byte ``j`` of row ``n`` holds the
  code of ``k = 2j`` in the LOW nibble and of ``k = 2j + 1`` in the HIGH nibble. ``scales`` and ``mins``:
  [N, K // group_size] (float32 or the compute dtype); ``w[n, k] = scales[n, k // G] * code[n, k] +
  mins[n, k // G]``.
- int8: ``qweight`` int8 [N, K], ``scales`` float32 [N]; ``w[n, k] = qweight[n, k] * scales[n]``.
- grouped int8 (GGUF Q8_0 / Q5_0 with group 32, Q6_K with group 16, held as 8-bit codes): ``qweight`` int8
  [N, K], ``scales`` [N, K // group_size] (float32 or the compute dtype);
  ``w[n, k] = qweight[n, k] * scales[n, k // G]``. The kernel takes any group size that divides K and is a
  multiple of 16.

Kernel design (grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``, one fp32 [BLOCK_M, BLOCK_N] tile per program,
walking K in ``BLOCK_K`` steps):
- int4: ``BLOCK_K`` divides the group size, so each K step lies in a single group and its scale / min are
  one [BLOCK_N] vector per step. A step loads the packed bytes once as [BLOCK_K // 2, BLOCK_N], unpacks the
  low and high nibbles in registers and dots them with the even and odd columns of ``x``; the per-group
  affine map is applied to the dot products instead of to every weight:
  ``sum_k x[k] (s c[k] + m) = s * sum_k x[k] c[k] + m * sum_k x[k]``.
  Codes 0..15 are exact in any float dtype, so the only rounding of a half-precision step is that of ``x``
  itself; the scale and min are applied in fp32.
- int8: codes -128..127 are exact in fp16 / bf16 as well; the per-row scale is constant along K, so it is
  applied once to the finished accumulator.
- grouped int8: as int4, ``BLOCK_K`` (64 / 32 / 16) divides the group size, so a K step lies in one group;
  the step's int8 tile is cast to the activations' dtype (exact), dotted with ``x`` into a fresh fp32
  [BLOCK_M, BLOCK_N] tile, and that tile is multiplied by the group's [BLOCK_N] scales in fp32 before it is
  added to the accumulator: ``sum_k x[k] s c[k] = s * sum_k x[k] c[k]``.
- ``BLOCK_M`` is at least 16 (``tl.dot`` needs >= 16 on GPUs; decode's M = 1..8 rows are masked), up to 64
  for prefill so each dequantized weight tile is reused by more rows.
- fp32 activations dot with ``input_precision="ieee"`` (no TF32), the others in their own dtype with fp32
  accumulation. Plain ``tl.*`` only (no vendor intrinsics): the same source compiles for NVIDIA and AMD GPUs;
  on CPU the tests run it under ``TRITON_INTERPRET=1``.

Triton is optional: importing this module without it works and the reference functions run; the Triton
functions then raise ``ImportError``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- pure-torch references ---------------------------------------------------------------------------------
def _unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> int64 codes [N, K]; low nibble = even k, high nibble = odd k."""
    q = qweight.to(torch.int64)
    return torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1)


def int4_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """``x @ w.T`` with ``w`` dequantized to float32 from the int4 format above; result in ``x.dtype``."""
    # x: [M, K]; qweight: uint8 [N, K // 2]; scales, mins: [N, K // group_size] -> [M, N]
    _check_int4(x, qweight, scales, mins, group_size, kernel=False)
    codes = _unpack_int4(qweight).to(torch.float32)  # [N, K]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=1)  # [N, K]
    m = mins.to(torch.float32).repeat_interleave(group_size, dim=1)
    w = s * codes + m
    return (x.to(torch.float32) @ w.T).to(x.dtype)


def int8_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with ``w`` dequantized to float32 from the int8 format above; result in ``x.dtype``."""
    # x: [M, K]; qweight: int8 [N, K]; scales: [N] -> [M, N]
    _check_int8(x, qweight, scales)
    w = qweight.to(torch.float32) * scales.to(torch.float32)[:, None]  # [N, K]
    return (x.to(torch.float32) @ w.T).to(x.dtype)


def int8_group_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                group_size: int) -> torch.Tensor:
    """``x @ w.T`` with ``w`` dequantized to float32 from the grouped int8 format above; result in ``x.dtype``."""
    # x: [M, K]; qweight: int8 [N, K]; scales: [N, K // group_size] -> [M, N]
    _check_int8_group(x, qweight, scales, group_size, kernel=False)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=1)  # [N, K]
    w = qweight.to(torch.float32) * s
    return (x.to(torch.float32) @ w.T).to(x.dtype)


# -- argument checks (shared) -----------------------------------------------------------------------------
def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D float32/bfloat16/float16 tensor, got {tuple(x.shape)} {x.dtype}")


def _check_groups(kind: str, qweight: torch.Tensor, K: int, group_size: int, multiple: int | None,
                  named: tuple[tuple[str, torch.Tensor], ...]) -> None:
    """The group size (dividing K; a multiple of ``multiple`` for the kernel) and the [N, K // group_size]
    float tensors ``named`` of a grouped format ``kind``."""
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide K = {K}")
    if multiple is not None and group_size % multiple:
        raise ValueError(f"the Triton {kind} kernel needs group_size to be a multiple of {multiple}, got {group_size}")
    want = (qweight.shape[0], K // group_size)
    for name, t in named:
        if tuple(t.shape) != want or t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{kind} {name} must be a float [N, K // group_size] = {list(want)} tensor, "
                             f"got {tuple(t.shape)} {t.dtype}")


def _check_int4(x, qweight, scales, mins, group_size, *, kernel: bool) -> None:
    _check_x(x)
    K = x.shape[1]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or 2 * qweight.shape[1] != K:
        raise ValueError(f"int4 qweight must be uint8 [N, K // 2] = [N, {K // 2}] (K = {K} must be even), "
                         f"got {tuple(qweight.shape)} {qweight.dtype}")
    _check_groups("int4", qweight, K, group_size, 32 if kernel else None, (("scales", scales), ("mins", mins)))


def _check_int8(x, qweight, scales) -> None:
    _check_x(x)
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(f"int8 qweight must be int8 [N, K = {x.shape[1]}], got {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    if tuple(scales.shape) != (qweight.shape[0],) or scales.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"int8 scales must be a float [N] = [{qweight.shape[0]}] tensor, got "
                         f"{tuple(scales.shape)} {scales.dtype}")


def _check_int8_group(x, qweight, scales, group_size, *, kernel: bool) -> None:
    _check_x(x)
    K = x.shape[1]
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != K:
        raise ValueError(f"grouped int8 qweight must be int8 [N, K = {K}], got {tuple(qweight.shape)} "
                         f"{qweight.dtype}")
    _check_groups("grouped int8", qweight, K, group_size, 16 if kernel else None, (("scales", scales),))


# -- Triton kernels -----------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _int4_matmul_kernel(
        out_ptr, x_ptr, q_ptr, scales_ptr, mins_ptr,
        M, N, K, group_size,
        stride_xm, stride_xk,
        stride_qn, stride_qk,
        stride_sn, stride_sg,
        stride_mn, stride_mg,
        stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] output tile; ``BLOCK_K`` divides ``group_size`` (one group per K step)."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_K // 2)  # byte index within the step: codes k0 + 2j (low) and k0 + 2j + 1 (high)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: the weight tile is read as w.T
        s_rows = scales_ptr + rn.to(tl.int64) * stride_sn  # [BLOCK_N]
        m_rows = mins_ptr + rn.to(tl.int64) * stride_mn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_even = k0 + 2 * rj  # [BLOCK_K // 2]
            k_ok = k_even < K  # K is even, so the odd column k_even + 1 is in range too
            x_mask = m_ok[:, None] & k_ok[None, :]
            x_even = tl.load(x_rows + k_even[None, :] * stride_xk, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K // 2]
            x_odd = tl.load(x_rows + (k_even + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
            packed = tl.load(q_cols + (k0 // 2 + rj)[:, None] * stride_qk,
                             mask=k_ok[:, None] & n_ok[None, :], other=0)  # uint8 [BLOCK_K // 2, BLOCK_N]
            lo = (packed & 0xF).to(x_even.dtype)  # codes of k_even, exact in any float dtype
            hi = (packed >> 4).to(x_even.dtype)  # codes of k_even + 1
            dot = tl.dot(x_even, lo, input_precision="ieee")  # [BLOCK_M, BLOCK_N] fp32
            dot = tl.dot(x_odd, hi, acc=dot, input_precision="ieee")
            x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)  # [BLOCK_M]
            g = k0 // group_size
            s = tl.load(s_rows + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            mn = tl.load(m_rows + g * stride_mg, mask=n_ok, other=0.0).to(tl.float32)
            # sum_k x (s c + m) over the step = s * (x . c) + m * sum_k x
            acc += dot * s[None, :] + x_sum[:, None] * mn[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn.to(tl.int64)[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _int8_matmul_kernel(
        out_ptr, x_ptr, q_ptr, scales_ptr,
        M, N, K,
        stride_xm, stride_xk,
        stride_qn, stride_qk,
        stride_s,
        stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] output tile; the per-row scale multiplies the finished accumulator."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: the weight tile is read as w.T
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_K]
            q = tl.load(q_cols + k[:, None] * stride_qk, mask=k_ok[:, None] & n_ok[None, :],
                        other=0)  # int8 [BLOCK_K, BLOCK_N]
            acc = tl.dot(xt, q.to(xt.dtype), acc=acc, input_precision="ieee")  # int8 codes: exact
        s = tl.load(scales_ptr + rn.to(tl.int64) * stride_s, mask=n_ok, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn.to(tl.int64)[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _int8_group_matmul_kernel(
        out_ptr, x_ptr, q_ptr, scales_ptr,
        M, N, K, group_size,
        stride_xm, stride_xk,
        stride_qn, stride_qk,
        stride_sn, stride_sg,
        stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] output tile; ``BLOCK_K`` divides ``group_size`` (one group per K step) and so
        K (a multiple of the group size): the K steps need no mask."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: the weight tile is read as w.T
        s_rows = scales_ptr + rn.to(tl.int64) * stride_sn  # [BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            q = tl.load(q_cols + k[:, None] * stride_qk, mask=n_ok[None, :], other=0)  # int8 [BLOCK_K, BLOCK_N]
            dot = tl.dot(xt, q.to(xt.dtype), input_precision="ieee")  # int8 codes: exact; fp32 [BLOCK_M, BLOCK_N]
            s = tl.load(s_rows + (k0 // group_size) * stride_sg, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            acc += dot * s[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn.to(tl.int64)[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _require_triton() -> None:
    if triton is None:
        raise ImportError("the Triton quantized matmuls need Triton: `pip install triton` "
                          "(or `pip install specserve[triton]`), or use the *_matmul_reference functions")


def _block_m(M: int) -> int:
    # NOTE: tl.dot needs every dimension >= 16 on GPUs; decode (M = 1..8) pads to 16 masked rows.
    return min(64, max(16, triton.next_power_of_2(M)))


_BLOCK_N = 64
_INT8_BLOCK_K = 64


def _int4_block_k(group_size: int) -> int:
    """Largest of 128 / 64 / 32 dividing the group size: every K step then stays inside one group."""
    for b in (128, 64, 32):
        if group_size % b == 0:
            return b
    raise ValueError(f"group_size {group_size} is not a multiple of 32")  # pragma: no cover - checked before


def _int8_group_block_k(group_size: int) -> int:
    """Largest of 64 / 32 / 16 dividing the group size (16 for Q6_K, 32 for Q8_0 / Q5_0)."""
    for b in (64, 32, 16):
        if group_size % b == 0:
            return b
    raise ValueError(f"group_size {group_size} is not a multiple of 16")  # pragma: no cover - checked before


def _launch(kernel, x: torch.Tensor, n: int, tensors: tuple[torch.Tensor, ...], sizes: tuple[int, ...],
            block_k: int) -> torch.Tensor:  # noqa: ANN001 - a Triton kernel
    """The common launch of the matmuls below: ``out`` [M, n] in x's dtype, the grid, then the kernel with
    (out, x, *tensors, M, N, *sizes, each tensor's strides, out's strides) and the block sizes."""
    M, K = x.shape
    out = torch.empty((M, n), dtype=x.dtype, device=x.device)
    if M == 0 or n == 0:
        return out
    if K == 0:
        return out.zero_()
    block_m = _block_m(M)
    grid = (triton.cdiv(M, block_m), triton.cdiv(n, _BLOCK_N))
    strides = [v for t in (x, *tensors, out) for v in t.stride()]
    kernel[grid](out, x, *tensors, M, n, *sizes, *strides, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=block_k)
    return out


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """Triton version of ``int4_matmul_reference`` (group_size a multiple of 32)."""
    # x: [M, K]; qweight: uint8 [N, K // 2]; scales, mins: [N, K // group_size] -> [M, N] in x.dtype
    _require_triton()
    _check_int4(x, qweight, scales, mins, group_size, kernel=True)
    return _launch(_int4_matmul_kernel, x, qweight.shape[0], (qweight, scales, mins), (x.shape[1], group_size),
                   _int4_block_k(group_size))


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Triton version of ``int8_matmul_reference``."""
    # x: [M, K]; qweight: int8 [N, K]; scales: [N] -> [M, N] in x.dtype
    _require_triton()
    _check_int8(x, qweight, scales)
    return _launch(_int8_matmul_kernel, x, qweight.shape[0], (qweight, scales), (x.shape[1],), _INT8_BLOCK_K)


def int8_group_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Triton version of ``int8_group_matmul_reference`` (group_size a multiple of 16 dividing K)."""
    # x: [M, K]; qweight: int8 [N, K]; scales: [N, K // group_size] -> [M, N] in x.dtype
    _require_triton()
    _check_int8_group(x, qweight, scales, group_size, kernel=True)
    return _launch(_int8_group_matmul_kernel, x, qweight.shape[0], (qweight, scales), (x.shape[1], group_size),
                   _int8_group_block_k(group_size))
