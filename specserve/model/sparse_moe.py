"""Sparse mixture-of-experts block of Qwen3-MoE, Mixtral and OLMoE: a router picks ``top_k`` of
``num_experts`` SwiGLU experts per token and the output is their weighted sum.

Semantics (HF transformers' ``*SparseMoeBlock``): ``logits = x @ gate.T``; probabilities = softmax over the
experts in fp32; the ``top_k`` largest, renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always),
then cast to ``x.dtype`` (HF 5's Mixtral skips that cast and multiplies in fp32: the same bits in fp32,
one rounding apart in bf16); expert ``e`` computes ``down[e] @ (silu(g) * u)`` with ``[g; u] = gate_up[e] @ x``
in ``x.dtype``; its output is multiplied by the token's weight for ``e`` and the weighted outputs are added
in ascending expert order (HF's order: its expert loop adds each expert's rows into a zero tensor, expert by
expert).

Execution: only experts that received tokens run. The (token, rank) assignments are sorted by expert;
- ``kernel="torch"``: one matmul pair per active expert over its rows (the expert counts come to the host,
  so this path syncs and cannot be graph-captured);
- ``kernel="triton"``: grouped kernels over the sorted assignments (``model/kernels/triton_moe.py``), no host sync.
Both add a token's k weighted expert outputs rank by rank with its ranks in ascending expert order, so the
sum's float order depends only on the token's own experts, never on the other tokens of the batch. Row
invariance of the matmuls themselves is the ``linear``'s business (``Platform.linear``): MKL's fp32 sgemm is
not row-invariant (1, 2-3 and >= 4 rows round differently on a 2-core AVX2 EPYC, torch 2.13).

Weights: ``gate`` [E, hidden] is HF's ``mlp.gate.weight`` (Mixtral: ``block_sparse_moe.gate.weight``);
``gate_up[e]`` is ``cat([gate_proj, up_proj])`` of expert ``e`` (Mixtral: ``cat([w1, w3])``), ``down[e]`` its
``down_proj`` (Mixtral: ``w2``); HF >= 5 holds the same stacked tensors as ``experts.gate_up_proj`` /
``experts.down_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.layers import Linear

MOE_KERNELS = ("torch", "triton")


class SparseMoE(nn.Module):
    """[T, hidden] -> [T, hidden]; ``kernel`` is ``Platform.moe_kernel``, ``linear`` is ``Platform.linear``
    (router and torch-path experts)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype, device: torch.device, kernel: str = "torch", linear: Linear = F.linear) -> None:
        super().__init__()
        if kernel not in MOE_KERNELS:
            raise ValueError(f"unknown MoE kernel {kernel!r}: use one of {MOE_KERNELS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be in 1..num_experts = {num_experts}")
        if kernel == "triton":
            from specserve.model.kernels import (
                triton_moe,  # ImportError without Triton: fail at build, not mid-step
            )

            self._fused_experts = triton_moe.fused_experts
        self.hidden, self.inter, self.num_experts, self.top_k = hidden, inter, num_experts, top_k
        self.norm_topk_prob, self.kernel, self.linear = norm_topk_prob, kernel, linear
        self.gate = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype, device=device),
                                 requires_grad=False)
        self.packed: nn.ModuleList | None = None  # per expert (gate_up, down) packed weights (pack_experts)
        # Tensor parallel: the all-reduce of the experts' partial sums (each rank holds a slice of every expert).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def pack_experts(self, experts: list[tuple[nn.Module, nn.Module]]) -> None:
        """Run the experts on packed weights (``model/quant.py``: ``(gate_up, down)`` per expert, each called as
        ``w(x)``) instead of the float stacks, which are released. The torch path only."""
        if self.kernel != "torch":
            raise ValueError("packed experts run on the torch path only")
        self.packed = nn.ModuleList(nn.ModuleList(pair) for pair in experts)
        self.gate_up = nn.Parameter(self.gate_up.new_empty(0), requires_grad=False)
        self.down = nn.Parameter(self.down.new_empty(0), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, top_k] in ``x.dtype`` and expert ids [T, top_k] (int64), each row in ascending
        expert order."""
        logits = self.linear(x, self.gate)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        ids, pos = ids.sort(dim=-1)
        return weights.gather(-1, pos).to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.kernel == "triton":
            y = self._fused_experts(x, self.gate_up, self.down, weights, ids)
        else:
            y = self._experts_torch(x, weights, ids)
        return y if self.reduce is None else self.reduce(y)

    def _experts_torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat = ids.flatten()  # assignment a = t * k + rank
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        out = x.new_empty(T * k, self.hidden)  # expert output of each assignment
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            xe = x.index_select(0, tokens[rows])
            if self.packed is not None:
                pair = cast(nn.ModuleList, self.packed[e])
                packed_gate_up, packed_down = pair[0], pair[1]
                gate, up = packed_gate_up(xe).split(self.inter, dim=-1)
                out.index_copy_(0, order[rows], packed_down(F.silu(gate) * up).to(out.dtype))
            else:
                gate, up = self.linear(xe, self.gate_up[e]).split(self.inter, dim=-1)
                out.index_copy_(0, order[rows], self.linear(F.silu(gate) * up, self.down[e]))
            start += n
        out = out.view(T, k, self.hidden) * weights.unsqueeze(-1)
        y = out[:, 0]
        for rank in range(1, k):  # fixed per-token order: ascending expert id
            y = y + out[:, rank]
        return y
