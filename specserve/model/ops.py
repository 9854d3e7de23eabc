"""The small ops of a decoder layer, as one strategy chosen at start-up (``make_ops``):

- ``TorchOps``: the reference, plain torch ops (any device, any dtype);
- ``CpuFusedOps``: fp32 on an x86 CPU with the C++ kernels (``kernels/cpu_kernels.cpp``): residual add +
  RMSNorm in one call, and rotary embedding of q and k fused with the K/V cache write. They replace about
  twenty small torch ops per layer, each a few microseconds of dispatch on CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.model.layers import RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from specserve.model.attention import AttentionBackend, AttentionMetadata


class TorchOps:
    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)); delta None: (h, norm(h)). h, delta: [T, hidden]."""
        if delta is not None:
            h = h + delta
        return h, norm(h)

    def qkv_rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
                       num_kv_heads: int, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       backend: AttentionBackend) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D] rotated; k (rotated) and v written to the cache."""
        t, d = qkv.shape[0], kv_cache.shape[-1]
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q, k = rope(positions, q.view(t, num_heads, d), k.view(t, num_kv_heads, d))
        backend.write_kv(k, v.view(t, num_kv_heads, d), kv_cache, meta.slot_mapping)
        return q


class CpuFusedOps(TorchOps):
    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if norm.chunks > 1:
            return super().add_norm(h, delta, norm)
        if delta is None:
            return h, torch.ops.specserve_cpu.rms_norm(h, norm.weight, norm.eps)
        return torch.ops.specserve_cpu.add_rms_norm(h, delta, norm.weight, norm.eps)

    def qkv_rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
                       num_kv_heads: int, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       backend: AttentionBackend) -> torch.Tensor:
        return torch.ops.specserve_cpu.rope_write_kv(qkv, positions, rope.cos, rope.sin, kv_cache,
                                                     meta.slot_mapping, num_heads, num_kv_heads)


def make_ops(device: torch.device, dtype: torch.dtype, attention_backend: str) -> TorchOps:
    """Fused CPU ops where they apply (fp32, the C++ kernels built), the torch reference elsewhere."""
    if device.type == "cpu" and dtype == torch.float32 and attention_backend == "cpu":
        from specserve.model.kernels import load_cpu_kernels

        if load_cpu_kernels():
            return CpuFusedOps()
    return TorchOps()
