"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import CheckpointError

Linear = Callable[..., torch.Tensor]  # F.linear, or platform.row_invariant_linear (Platform.linear)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 as the reference does. ``chunks`` > 1: the last
    dimension is that many concatenated vectors of ``dim``, each normalised on its own (weight [chunks * dim])."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device, chunks: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(chunks * dim, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.dim, self.chunks = eps, dim, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x = x.float()
        if self.chunks > 1:
            x = x.reshape(*shape[:-1], self.chunks, self.dim)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.reshape(shape).to(dtype)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (as in Meta's reference and HF's _compute_llama3_parameters).
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX layout) rotary embedding with a precomputed cos/sin table."""

    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU (SwiGLU) or the tanh
    approximation of GELU (GeGLU)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 linear: Linear = F.linear, act: str = "silu") -> None:
        super().__init__()
        self.inter, self.linear, self.act = inter, linear, act
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, dtype=dtype, device=device),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden, inter, dtype=dtype, device=device), requires_grad=False)
        # Tensor parallel: the all-reduce of the row-parallel down projection's partial sums.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.linear(x, self.gate_up)  # [T, 2 * inter]
        gate, up = gu.split(self.inter, dim=-1)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        y = self.linear(gate * up, self.down)
        return y if self.reduce is None else self.reduce(y)
