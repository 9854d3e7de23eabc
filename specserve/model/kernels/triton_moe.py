"""Grouped Triton kernels for the experts of ``SparseMoE`` (``model/sparse_moe.py``, whose torch path is the reference).

``fused_experts(x, gate_up, down, weights, ids)``: token ``t``'s output is ``sum_j weights[t, j] *
down[e] @ (silu(g) * u)`` over its experts ``e = ids[t, j]``, ``[g; u] = gate_up[e] @ x[t]``.

Design (the assignment ``a = t * top_k + j`` is the unit of work; no host sync, so it can be graph-captured):
- align (torch ops on the device): the assignments sorted by expert, each expert's run padded to a multiple
  of ``BLOCK_M``; ``sorted_ids`` holds the padded order (``A`` = padding), ``block_expert`` the expert of
  each row block (``num_experts`` = unused). The block count is bounded by ``cdiv(A, BLOCK_M) +
  min(A, num_experts)`` (each active expert leaves at most one partial block), so the grid depends only on
  the shapes.
- gate/up kernel, grid ``(blocks, cdiv(inter, BLOCK_N))``: a program gathers its ``BLOCK_M`` token rows of
  ``x``, dots them with the ``BLOCK_N`` gate rows and the matching up rows of its expert (two fp32
  accumulators) and writes ``silu(g) * u`` to ``h[a]``.
- down kernel, same pattern over ``hidden``: ``h[a] @ down[e].T`` times the routing weight, to ``out[a]``.
- combine, grid ``(T, cdiv(hidden, BLOCK_H))``: ``y[t] = sum_j out[t * top_k + j]`` in fp32, ranks in order.
``BLOCK_M`` is fixed (16, the least ``tl.dot`` takes on GPUs; padded rows are masked) so a row's tiles and
their accumulation order never depend on the batch: with the fixed-order combine a token's output bits
depend only on its own routing. fp32 dots use ``input_precision="ieee"`` (no TF32). Plain ``tl.*`` only:
the same source compiles for NVIDIA and AMD GPUs; on CPU the tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the 'triton' MoE kernel needs Triton: `pip install triton` "
                      "(or `pip install specserve[triton]`), or use the 'torch' kernel") from exc

BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 64
_BLOCK_H = 256


@triton.jit
def _gate_up_kernel(
    h_ptr, x_ptr, w_ptr, sorted_ptr, block_expert_ptr,
    A, TOP_K, K, N, num_experts,
    stride_xt, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_ha, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``h[a, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n])`` for the block's rows ``a`` (token ``t``)."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e >= num_experts:
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # assignments; A = padding
    row_ok = rows < A
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    x_rows = x_ptr + (rows // TOP_K).to(tl.int64)[:, None] * stride_xt  # [BLOCK_M, 1]
    w_gate = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]: read as w.T
    w_up = w_gate + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + k[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_g = tl.dot(xt, wg, acc=acc_g, input_precision="ieee")
        acc_u = tl.dot(xt, wu, acc=acc_u, input_precision="ieee")
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = h_ptr + rows.to(tl.int64)[:, None] * stride_ha + rn.to(tl.int64)[None, :] * stride_hn
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    out_ptr, h_ptr, w_ptr, weight_ptr, sorted_ptr, block_expert_ptr,
    A, K, N, num_experts,
    stride_ha, stride_hk,
    stride_we, stride_wn, stride_wk,
    stride_oa, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out[a, n] = weight[a] * (h[a] . w[e, n])`` for the block's rows ``a``."""
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e >= num_experts:
        return
    rows = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < A
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_ha
    w_cols = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        ht = tl.load(h_rows + k[None, :] * stride_hk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(ht, wt, acc=acc, input_precision="ieee")
    weight = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_oa + rn.to(tl.int64)[None, :] * stride_on
    tl.store(out, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, out_ptr, TOP_K, H,
    stride_yt, stride_yh, stride_oa, stride_oh,
    BLOCK_H: tl.constexpr,
):
    """``y[t] = sum_j out[t * TOP_K + j]``, j ascending, in fp32."""
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, TOP_K):
        acc += tl.load(out_ptr + (t * TOP_K + j) * stride_oa + rh * stride_oh, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + rh * stride_yh, acc.to(y_ptr.dtype.element_ty), mask=h_ok)


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_ids`` int32 [blocks * block_m] (assignments grouped by expert, each expert's run padded to a
    multiple of ``block_m`` with ``A = ids.numel()``) and ``block_expert`` int32 [blocks] (``num_experts``:
    unused block), from the expert ids [T, top_k]; device ops only, no host sync."""
    flat = ids.flatten()
    A, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    num_blocks = triton.cdiv(A, block_m) + min(A, num_experts)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(A, device=dev) - (counts.cumsum(0) - counts)[expert]  # position within its expert's run
    sorted_ids = torch.full((num_blocks * block_m,), A, dtype=torch.int32, device=dev)
    sorted_ids[(block_end - blocks)[expert] * block_m + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)
    return sorted_ids, block_expert.to(torch.int32)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights [T, k] (any float dtype); ids [T, k] int64
    -> [T, H] in ``x.dtype``."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    inter, top_k = I2 // 2, ids.shape[1]
    y = x.new_empty(T, H)
    if T == 0:
        return y
    A = T * top_k
    sorted_ids, block_expert = align(ids, E)
    blocks = block_expert.shape[0]
    h = x.new_empty(A, inter)
    _gate_up_kernel[(blocks, triton.cdiv(inter, _BLOCK_N))](
        h, x, gate_up, sorted_ids, block_expert,
        A, top_k, H, inter, E,
        *x.stride(), *gate_up.stride(), *h.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    out = x.new_empty(A, H)
    _down_kernel[(blocks, triton.cdiv(H, _BLOCK_N))](
        out, h, down, weights.reshape(-1).float(), sorted_ids, block_expert,
        A, inter, H, E,
        *h.stride(), *down.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    _combine_kernel[(T, triton.cdiv(H, _BLOCK_H))](
        y, out, top_k, H, *y.stride(), *out.stride(), BLOCK_H=_BLOCK_H,
    )
    return y
