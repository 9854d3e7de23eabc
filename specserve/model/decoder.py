"""The decoder over a flat token batch with a paged KV cache, shared by every family (``model/families/``).

One graph, composed from ``ModelArch``: Llama's pre-norm layer; q/k/v biases (Qwen2); q/k RMSNorm before
rope, per head (Qwen3, Gemma 3) or over the whole projection (OLMoE); sliding-window layers with their own rope
base (Mistral, Gemma 3); norms after attention and after the MLP as well (Gemma 3's sandwich); a SiLU or GeGLU
gated MLP, or a sparse mixture-of-experts block (Qwen3-MoE, Mixtral, OLMoE); scaled embeddings (Gemma).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import CheckpointError, ModelArch
from specserve.model.attention import AttentionBackend, AttentionMetadata
from specserve.model.families import MoeNames, family
from specserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from specserve.model.ops import TorchOps
from specserve.model.quant import (
    CpuQuantWeight,
    PackedWeight,
    QuantEmbedding,
    QuantizedTensor,
    TiedEmbedding,
    cat_rows,
    embedding,
)
from specserve.model.sharding import TensorParallel, local_arch, shard_tensor
from specserve.model.sparse_moe import SparseMoE

_TORCH_OPS = TorchOps()

# Turns a matmul weight (float tensor or QuantizedTensor, HF name of its first part) into the packed form
# a quantized model's layers call (model/quant.py ``pack``); None: plain float parameters.
Packer = Callable[[Any, str], PackedWeight]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, linear: Linear = F.linear) -> None:
        super().__init__()
        self.linear = linear
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.attn_scale if arch.attn_scale is not None else arch.head_dim ** -0.5
        self.window: int | None = None  # this layer's sliding window (set by DecoderLayer)
        self.qkv = _param(self.q_size + 2 * self.kv_size, arch.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) \
            if arch.attention_bias else None
        self.o = _param(arch.hidden_size, self.q_size, dtype=dtype, device=device)
        self.qk_norm_full = arch.qk_norm_full
        q_dim, k_dim = (self.q_size, self.kv_size) if arch.qk_norm_full else (arch.head_dim, arch.head_dim)
        self.q_norm = RMSNorm(q_dim, arch.rms_norm_eps, dtype, device) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_dim, arch.rms_norm_eps, dtype, device) if arch.qk_norm else None
        # Tensor parallel: the all-reduce of the row-parallel o projection's partial sums.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, ops: TorchOps = _TORCH_OPS) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.linear(x, self.qkv, self.qkv_bias)  # [T, (H + 2 Hkv) * D]
        if self.q_norm is not None and self.k_norm is not None:  # before rope: per head, or per projection
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm_full:
                qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
            else:
                d = self.head_dim
                qkv = torch.cat([self.q_norm(q.reshape(t, self.num_heads, d)).reshape(t, self.q_size),
                                 self.k_norm(k.reshape(t, self.num_kv_heads, d)).reshape(t, self.kv_size), v], dim=-1)
        q = ops.qkv_rope_write(qkv, positions, rope, self.num_heads, self.num_kv_heads, kv_cache, meta, backend)
        o = backend.attend(q, kv_cache, meta, self.scale, self.window)  # [T, H, D]
        y = self.linear(o.reshape(t, self.q_size), self.o)
        return y if self.reduce is None else self.reduce(y)


class DecoderLayer(nn.Module):
    """Layer ``index`` of ``arch``. ``post_norm`` is the norm before the MLP (HF's post_attention_layernorm in
    Llama, pre_feedforward_layernorm in Gemma 3); with sandwich norms ``attn_out_norm`` and ``mlp_out_norm``
    normalise the two sublayers' outputs before they join the residual stream."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, linear: Linear = F.linear,
                 index: int = 0, moe_kernel: str = "torch", float_linear: Linear = F.linear) -> None:
        super().__init__()
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.attn = Attention(arch, dtype, device, linear)
        self.attn.window = arch.window(index)
        self.post_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp: GatedMLP | SparseMoE
        if arch.is_moe(index):  # experts stay float: ``float_linear`` even where ``linear`` takes packed weights
            self.mlp = SparseMoE(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                                 arch.num_experts_per_tok, arch.norm_topk_prob, dtype, device, moe_kernel,
                                 float_linear)
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, dtype, device, linear, arch.hidden_act)
        self.attn_out_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device) \
            if arch.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device) \
            if arch.sandwich_norms else None


class DecoderModel(nn.Module):
    """``forward(input_ids, positions, kv_caches, meta) -> hidden`` over flat tokens; logits on request.

    With ``tp`` (``model/sharding.py``) the model is one rank's slice: its layers are built from the
    slice's architecture (``self.local``), two all-reduces per layer join the partial sums, and the
    embedding and LM head hold a slice of the vocabulary. ``self.arch`` stays the whole model's."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                 max_positions: int, linear: Linear = F.linear, ops: TorchOps = _TORCH_OPS, moe_kernel: str = "torch",
                 float_linear: Linear = F.linear, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.arch, self.dtype, self.device, self.backend, self.linear = arch, dtype, device, backend, linear
        self.tp = tp
        self.local = local = local_arch(arch, tp.spec) if tp is not None else arch
        self.ops = ops  # model/ops.py: residual + norm, rope + KV write (fused on CPU in fp32)
        self.embed = _param(local.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        # The scale rounded to the model's dtype first, as HF's Gemma does; a Python float: no tensor per step.
        self.embed_scale = float(torch.tensor(arch.embed_scale, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(local, dtype, device, linear, i, moe_kernel, float_linear)
                                    for i in range(arch.num_layers))
        if tp is not None:
            for layer in self.decoder_layers:
                layer.attn.reduce = layer.mlp.reduce = tp.comm.all_reduce
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.lm_head = self.embed if arch.tie_word_embeddings else \
            _param(local.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        rope_dtype = torch.float32 if dtype == torch.float32 else dtype
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, rope_dtype,
                                    device)
        # Sliding layers may rotate with their own base and no scaling (Gemma 3's local layers).
        local_rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta, None, rope_dtype, device) \
            if arch.rope_local_theta is not None else self.rope
        self.layer_ropes = [local_rope if arch.window(i) is not None else self.rope for i in range(arch.num_layers)]
        # The layers (1-based) whose outputs ``return_prenorm`` concatenates (an EAGLE-3-style head's
        # feature); None: the last layer only.
        self.feature_layers: tuple[int, ...] | None = None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, num_layers: int | None = None, return_prenorm: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden].

        ``num_layers`` runs only the first layers (layer-skip self-drafting); ``kv_caches`` then needs only
        as many entries. ``return_prenorm``: also return the last layer's output before the final norm
        (the features an EAGLE head reads): ``(normed, prenorm)``, [T, hidden] and [T, n * hidden] with the
        outputs of ``self.feature_layers`` (n of them) concatenated.
        """
        h = self.embed_tokens(input_ids)  # [T, hidden]
        layers = self.decoder_layers if num_layers is None else self.decoder_layers[:num_layers]
        taps = self.feature_layers if return_prenorm and self.feature_layers else ()
        kept: list[torch.Tensor] = []
        ops, delta = self.ops, None  # delta: the last sublayer's output, added to h by the next add_norm
        stacked = ops.stack(layers, h, positions, self.layer_ropes[:len(layers)], kv_caches[:len(layers)], meta,
                            taps)
        if stacked is not None:
            h, delta, kept = stacked
        else:
            for i, (layer, rope, kv_cache) in enumerate(zip(layers, self.layer_ropes, kv_caches), start=1):
                h, delta = ops.layer(layer, h, delta, positions, rope, kv_cache, meta, self.backend)
                if i in taps:
                    kept.append(h + delta)
        h, normed = ops.add_norm(h, delta, self.norm)  # the last delta added, then the final norm
        if not return_prenorm:
            return normed
        return normed, (torch.cat(kept, dim=-1) if taps else h)

    def embedding_table(self) -> torch.Tensor:
        """The (unscaled) embedding table as a float tensor, whether kept float or in its GGUF blocks."""
        e = self.embed
        return e.dequantize(self.dtype) if isinstance(e, (QuantEmbedding, TiedEmbedding)) else e

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the (scaled) token embeddings, the first layer's input."""
        tp = self.tp
        if tp is None:
            h = embedding(input_ids, self.embed)
        else:  # this rank's vocabulary rows; the other ranks' tokens are zeros here and come in the all-reduce
            start, end = tp.spec.vocab
            mine = (input_ids >= start) & (input_ids < end)
            h = embedding((input_ids - start).clamp_(0, end - start - 1), self.embed) * mine.unsqueeze(-1)
            h = tp.comm.all_reduce(h)
        return h if self.embed_scale == 1.0 else h * self.embed_scale

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden, self.lm_head).float()  # [N, vocab] (tensor parallel: this rank's rows)
        if self.tp is None:
            return logits
        return self.tp.comm.all_gather_last(logits)[:, :self.arch.vocab_size]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head as a float [vocab, hidden] tensor, also when it is packed (dequantized on each call:
        for start-up and training, not for a step). Tensor parallel: gathered from every rank, which must
        all call it."""
        head = self.lm_head
        w = head.dequantize(self.dtype) if isinstance(head, PackedWeight) else head
        if self.tp is None:
            return w
        return self.tp.comm.all_gather_last(w.t().contiguous()).t()[:self.arch.vocab_size]  # a collective

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.local.num_kv_heads, self.arch.head_dim)

    # -- weights ---------------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, Any], packer: Packer | None = None) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Names a missing tensor clearly.

        With ``packer`` (a quantized model, whose ``linear`` is ``quant.packed_linear``) every matmul weight,
        the LM head and (on the torch MoE path) each expert included, is replaced by its packed form; the
        embedding table and MoE routers stay float.
        """
        w = _WeightCopier(state_dict, packer, self.tp, self.arch.head_dim, self.dtype, self.device)
        with torch.no_grad():
            if packer is not None or not self.arch.tie_word_embeddings:
                head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
                w.put(self, "lm_head", head, matmul=True, roles=("vocab",))
            if self.arch.tie_word_embeddings and isinstance(self.lm_head, CpuQuantWeight):
                del self.embed  # the packed head's rows are the table
                self.embed = TiedEmbedding(self.lm_head, self.dtype)
            else:
                w.put(self, "embed", "model.embed_tokens.weight", roles=("vocab",))
            w.put(self.norm, "weight", "model.norm.weight")
            moe = family(self.arch.architecture).moe
            for i, layer in enumerate(self.decoder_layers):
                _load_layer(w, layer, f"model.layers.{i}.", moe, self.arch.num_experts)


class _WeightCopier:
    """Copies a checkpoint's HF-named tensors into parameters (``DecoderModel.load_weights``): sharded for
    tensor parallelism, fused where the model keeps several projections in one matrix, packed by ``packer``
    where it quantizes, checked against the parameter's shape."""

    def __init__(self, state_dict: dict[str, Any], packer: Packer | None, tp: TensorParallel | None, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.state_dict, self.packer, self.tp, self.head_dim = state_dict, packer, tp, head_dim
        self.dtype, self.device = dtype, device

    def get(self, name: str, role: str | None = None) -> Any:
        if name not in self.state_dict:
            raise CheckpointError(f"missing tensor {name}")
        t = self.state_dict[name]
        if self.tp is not None and role is not None:
            t = shard_tensor(t, role, self.tp.spec, self.head_dim)
        return t.dequantize() if isinstance(t, QuantizedTensor) and self.packer is None else t

    def fused(self, names: tuple[str, ...], roles: tuple[str | None, ...] = ()) -> Any:
        parts = [self.get(n, r) for n, r in zip(names, roles or (None,) * len(names))]
        if len(parts) == 1:
            return parts[0]
        if any(isinstance(t, QuantizedTensor) for t in parts):
            return cat_rows([t if isinstance(t, QuantizedTensor) else _float_as(t, parts) for t in parts])
        return torch.cat(parts, dim=0)

    def put(self, module: nn.Module, attr: str, *names: str, matmul: bool = False,
            roles: tuple[str | None, ...] = ()) -> None:
        src, dst = self.fused(names, roles), getattr(module, attr)
        if tuple(src.shape) != tuple(dst.shape):
            raise CheckpointError(f"tensor {names[0]} has shape {tuple(src.shape)}, expected "
                                  f"{tuple(dst.shape)} from the model config")
        if matmul and self.packer is not None:
            delattr(module, attr)  # a registered Parameter cannot be reassigned to a module
            setattr(module, attr, self.packer(src, names[0]))
        elif attr == "embed" and self.packer is not None and isinstance(src, QuantizedTensor):
            delattr(module, attr)  # kept in its blocks: rows are dequantized when looked up
            setattr(module, attr, QuantEmbedding(src, self.dtype, self.device))
        else:
            dst.copy_((src.dequantize() if isinstance(src, QuantizedTensor) else src).to(dst.dtype))


def _load_layer(w: _WeightCopier, layer: DecoderLayer, p: str, moe: MoeNames | None, num_experts: int) -> None:
    """One decoder layer's tensors, named with the prefix ``p`` (``model.layers.{i}.``)."""
    a = p + "self_attn."
    qkv_roles = ("q", "kv", "kv")
    w.put(layer.attn, "qkv", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", matmul=True,
          roles=qkv_roles)
    if layer.attn.qkv_bias is not None:
        w.put(layer.attn, "qkv_bias", a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", roles=qkv_roles)
    w.put(layer.attn, "o", a + "o_proj.weight", matmul=True, roles=("o",))
    if layer.attn.q_norm is not None and layer.attn.k_norm is not None:
        w.put(layer.attn.q_norm, "weight", a + "q_norm.weight")
        w.put(layer.attn.k_norm, "weight", a + "k_norm.weight")
    if isinstance(layer.mlp, GatedMLP):
        w.put(layer.mlp, "gate_up", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", matmul=True,
              roles=("ffn_out", "ffn_out"))
        w.put(layer.mlp, "down", p + "mlp.down_proj.weight", matmul=True, roles=("ffn_in",))
    else:
        assert moe is not None
        _load_experts(w, layer.mlp, p, moe, num_experts)
    w.put(layer.input_norm, "weight", p + "input_layernorm.weight")
    if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
        w.put(layer.attn_out_norm, "weight", p + "post_attention_layernorm.weight")
        w.put(layer.post_norm, "weight", p + "pre_feedforward_layernorm.weight")
        w.put(layer.mlp_out_norm, "weight", p + "post_feedforward_layernorm.weight")
    else:
        w.put(layer.post_norm, "weight", p + "post_attention_layernorm.weight")


def _load_experts(w: _WeightCopier, mlp: SparseMoE, p: str, moe: MoeNames, num_experts: int) -> None:
    """A sparse MoE block: float stacks [E, rows, cols], or packed per expert on the torch path."""
    mlp.gate.copy_(_float(w.get(p + moe.router)))
    names = [(p + moe.gate.format(e=e), p + moe.up.format(e=e), p + moe.down.format(e=e))
             for e in range(num_experts)]
    out, inn = ("moe_out", "moe_out"), "moe_in"
    if w.packer is not None and mlp.kernel == "torch":
        packer = w.packer
        mlp.pack_experts([(packer(w.fused((g, u), out), g), packer(w.get(d, inn), d)) for g, u, d in names])
    else:
        mlp.gate_up.copy_(torch.stack([_float(w.fused((g, u), out)) for g, u, _ in names]))
        mlp.down.copy_(torch.stack([_float(w.get(d, inn)) for _, _, d in names]))


def _float(t: Any) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _float_as(t: torch.Tensor, parts: list[Any]) -> QuantizedTensor:
    """A float part fused with quantized ones is quantized at the width of the first quantized part."""
    from specserve.model.quant import quantize

    bits = next(p.bits for p in parts if isinstance(p, QuantizedTensor))
    return quantize(t, bits)
