"""The small ops of a decoder layer, as one strategy chosen at start-up (``make_ops``):

- ``TorchOps``: the reference, plain torch ops (any device, any dtype);
- ``CpuFusedOps``: fp32 on an x86 CPU with the C++ kernels (``kernels/cpu_kernels.cpp``): residual add +
  RMSNorm in one call, and rotary embedding of q and k fused with the K/V cache write. A layer whose four
  matmul weights are all quantized for those kernels runs as one call (``decoder_layer``): a few microseconds
  of Python and dispatch per layer instead of about fifteen ops' worth, with the same arithmetic; when every
  layer can, the whole stack is one call (``decoder_stack``, the same layers in a C++ loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from specserve.model.attention import AttentionBackend, AttentionMetadata
    from specserve.model.decoder import DecoderLayer


class TorchOps:
    def stack(self, layers: list[DecoderLayer], h: torch.Tensor, positions: torch.Tensor,
              ropes: list[RotaryEmbedding], kv_caches: list[torch.Tensor], meta: AttentionMetadata,
              taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """All ``layers`` in one call: (h, delta) after the last one and the outputs ``h + delta`` of the
        layers in ``taps`` (1-based), or None where the layers run one ``layer`` call each."""
        return None

    def layer(self, layer: DecoderLayer, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
              rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: (h + delta, the layer's output), which the next layer adds (deferred residual)."""
        h, x = self.add_norm(h, delta, layer.input_norm)
        delta = layer.attn(x, positions, rope, kv_cache, meta, backend, self)
        if layer.attn_out_norm is not None:
            delta = layer.attn_out_norm(delta)
        h, x = self.add_norm(h, delta, layer.post_norm)
        out = self.mlp(layer.mlp, x)
        return h, out if layer.mlp_out_norm is None else layer.mlp_out_norm(out)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's feed-forward block on x [T, hidden]."""
        return mlp(x)

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
    def layer(self, layer: DecoderLayer, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
              rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend
              ) -> tuple[torch.Tensor, torch.Tensor]:
        args = _fused_args(layer, kv_cache)
        if args is None:
            return super().layer(layer, h, delta, positions, rope, kv_cache, meta, backend)
        return torch.ops.specserve_cpu.decoder_layer(
            h, delta, *args[0], positions, rope.cos, rope.sin, kv_cache, meta.slot_mapping, meta.block_tables,
            meta.query_start_loc, meta.seq_lens, *args[1], meta.tree_base, meta.tree_mask, *args[2])

    def stack(self, layers: list[DecoderLayer], h: torch.Tensor, positions: torch.Tensor,
              ropes: list[RotaryEmbedding], kv_caches: list[torch.Tensor], meta: AttentionMetadata,
              taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        args = _stack_args(layers, ropes, kv_caches)
        if args is None:
            return None
        h, delta, kept = torch.ops.specserve_cpu.decoder_stack(
            h, *args[0], positions, *args[1], kv_caches, meta.slot_mapping, meta.block_tables,
            meta.query_start_loc, meta.seq_lens, *args[2], sorted(t - 1 for t in taps if t <= len(layers)),
            *args[3], meta.tree_base, meta.tree_mask, args[4])
        return h, delta, kept

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if norm.chunks > 1:
            if delta is not None:
                return super().add_norm(h, delta, norm)
            return h, torch.ops.specserve_cpu.rms_norm(h, norm.weight.view(norm.chunks, norm.dim), norm.eps)
        if delta is None:
            return h, torch.ops.specserve_cpu.rms_norm(h, norm.weight, norm.eps)
        return torch.ops.specserve_cpu.add_rms_norm(h, delta, norm.weight, norm.eps)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A gated SiLU MLP with the C++ ``silu_mul`` (what ``decoder_layer`` uses, so a layer run op by op
        computes what the fused call does); anything else as the module computes it."""
        if not isinstance(mlp, GatedMLP) or mlp.act != "silu" or mlp.reduce is not None or x.dtype != torch.float32:
            return mlp(x)
        return mlp.linear(torch.ops.specserve_cpu.silu_mul(mlp.linear(x, mlp.gate_up)), mlp.down)

    def qkv_rope_write(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
                       num_kv_heads: int, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       backend: AttentionBackend) -> torch.Tensor:
        return torch.ops.specserve_cpu.rope_write_kv(qkv, positions, rope.cos, rope.sin, kv_cache,
                                                     meta.slot_mapping, num_heads, num_kv_heads)


def make_ops(device: torch.device, dtype: torch.dtype, attention_backend: str) -> TorchOps:
    """Fused CPU ops where they apply (fp32, the C++ kernels built), the torch reference elsewhere."""
    if device.type == "cpu" and dtype == torch.float32 and attention_backend == "cpu":
        from specserve.model.kernels.cpu import load_cpu_kernels

        if load_cpu_kernels():
            return CpuFusedOps()
    return TorchOps()


_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the C++ attention's caches


def _fused_args(layer: DecoderLayer, kv_cache: torch.Tensor
                ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]] | None:
    """The layer's arguments as ``decoder_layer`` takes them (those before the positions: norms, eps, the
    matmul weights; those after the attention metadata: head counts, scale, window; the second q/k/v part's
    codes, scales, mins, or Nones, then the activation bits), or None where the layer cannot run as one call
    (a float weight, weights with different activation bits, chunked norms, q/k norms, a head_dim the
    attention kernel does not take). Worked out once per layer and kept on it; the identity check of the
    matmul modules (plain dict reads: a module attribute read costs about a microsecond, and this runs for
    every layer of every step) notices weights that were loaded again."""
    from specserve.model.quant import ConcatWeight, CpuQuantWeight

    cached, mats_now = layer.__dict__.get("_fused_args"), _matmuls(layer)
    if cached is not None and all(a is b for a, b in zip(cached[0], mats_now)):
        return cached[1]
    a, mlp = layer.attn, layer.mlp
    qkv, qkv2 = a.qkv, None
    if isinstance(qkv, ConcatWeight) and len(qkv.parts) == 2:  # two formats: both parts in the one call
        qkv, qkv2 = qkv.parts
    mats: tuple[Any, ...] = (qkv, a.o, mlp.gate_up, mlp.down)
    ok = (all(isinstance(w, CpuQuantWeight) for w in (*mats, qkv2 or qkv))
          and len({w.act_bits for w in (*mats, qkv2 or qkv)}) == 1 and a.q_norm is None
          and layer.input_norm.chunks == 1
          and a.reduce is None and mlp.reduce is None
          and layer.attn_out_norm is None and isinstance(mlp, GatedMLP) and mlp.act == "silu"
          and layer.post_norm.chunks == 1 and kv_cache.shape[-1] % 8 == 0 and kv_cache.dtype in _KV_DTYPES
          and layer.input_norm.eps == layer.post_norm.eps)
    args = None
    if ok:
        head: list[Any] = [layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps]
        for w in mats:
            head += [w.packed, w.scales, w.mins]
            if w is qkv:
                head.append(a.qkv_bias)
        second = ((None, None, None) if qkv2 is None else (qkv2.packed, qkv2.scales, qkv2.mins)) + (mats[1].act_bits,)
        args = (tuple(head), (a.num_heads, a.num_kv_heads, a.scale, getattr(a, "window", None) or 0), second)
    layer.__dict__["_fused_args"] = (mats_now, args)
    return args


def _matmuls(layer: DecoderLayer) -> tuple[Any, ...]:
    """The layer's four matmul modules (plain dict reads), whose identity says its weights were not replaced."""
    attn, mlp = layer._modules["attn"], layer._modules["mlp"]
    a = attn._modules if attn is not None else {}
    m = mlp._modules if mlp is not None else {}
    return a.get("qkv"), a.get("o"), m.get("gate_up"), m.get("down")


def _stack_args(layers: list[DecoderLayer], ropes: list[RotaryEmbedding], kv_caches: list[torch.Tensor]
                ) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], int] | None:
    """``decoder_stack``'s per-layer arguments as lists (those before the positions, the rope tables, those
    after the metadata, the second q/k/v parts), then the activation bits, or None unless every layer runs as
    one ``decoder_layer`` call with the same eps, head counts, scale and activation bits. Kept on the first
    layer (per layer count), rebuilt when a layer's weights or rope changed (identity checks, as
    ``_fused_args``)."""
    if not layers or len(layers) != len(kv_caches):
        return None
    ident = tuple(m for layer in layers for m in _matmuls(layer)) + tuple(ropes)
    cache = layers[0].__dict__.setdefault("_stack_args", {})
    cached = cache.get(len(layers))
    if cached is not None and len(cached[0]) == len(ident) and all(a is b for a, b in zip(cached[0], ident)):
        return cached[1]
    per = [_fused_args(layer, kv) for layer, kv in zip(layers, kv_caches)]
    args = None
    if all(p is not None for p in per) and len({(p[0][2], *p[1][:3], p[2][3]) for p in per}) == 1:  # type: ignore[index]
        heads = [p[0] for p in per]  # type: ignore[index]
        cols = list(zip(*heads))  # input_norm, post_norm, eps, then (codes, scales, mins[, bias]) per matmul
        lists = [list(c) for c in cols]
        eps = heads[0][2]
        before = (lists[0], lists[1], eps, *lists[3:])
        n_heads, n_kv, scale = per[0][1][:3]  # type: ignore[index]
        seconds = [p[2][:3] for p in per]  # type: ignore[index]
        args = (before, ([r.cos for r in ropes], [r.sin for r in ropes]),
                (n_heads, n_kv, scale, [p[1][3] for p in per]),  # type: ignore[index]
                tuple([list(c) for c in zip(*seconds)]), per[0][2][3])  # type: ignore[index]
    cache[len(layers)] = (ident, args)
    return args
