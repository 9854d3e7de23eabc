"""EAGLE draft head (Li et al. 2024, arXiv 2401.15077): one decoder layer over fc([embedding ; feature]).

Entry ``p`` of a sequence reads the embedding of token ``t_p`` and the target's feature ``h_{p-1}`` (its last
decoder layer's output *before* the final norm; zeros for ``p = 0``) and predicts the feature ``h_p``; the
target's final norm and LM head turn that prediction into logits for ``t_{p+1}``. Drafting feeds the head
its own predicted features after the first step.

NOTE: entry ``p`` lives in KV slot ``p`` of the head's one-layer paged cache, which shares the target's block
tables; it depends on tokens ``<= p`` only, so a prefix-cached block's head entries are the ones this request
would compute. Embedding, final norm and LM head are the target's: a head directory stores only fc and the
layer (``config.json`` with ``"specserve_draft": "eagle"`` + ``model.safetensors``, fp16).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import CheckpointError, ModelArch, SpecserveError
from specserve.model.attention import AttentionBackend, AttentionMetadata
from specserve.model.decoder import DecoderLayer
from specserve.model.layers import RMSNorm, RotaryEmbedding
from specserve.model.ops import TorchOps
from specserve.model.quant import GROUP, CpuQuantWeight, PackedWeight, packed_linear, quantize

EAGLE_KIND = "eagle"
ROW_SCALE = ".row_scale"  # int8 storage: a matrix's per-row fp16 scales
_LAYER = "layers.0."


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape (its decoder layer is shaped like one of the target's) and the target it serves."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    target: str = ""  # display name of the target it was distilled from (informational)
    draft_vocab_size: int = 0  # > 0: drafts only among these most frequent tokens (EAGLE-3's reduced vocab)
    # RMS-normalise the embedding and the feature before fc (EAGLE-3 does the same). Without it a target
    # whose residual stream is ~200x the scale of its embeddings (SmolLM2: features RMS ~28 with outliers in
    # the thousands, embeddings RMS ~0.14) hides the token from the head. False only for heads saved before.
    input_norms: bool = False
    # Target layers whose outputs (pre-norm, 1-based: L = the last layer) make the feature, concatenated
    # (EAGLE-3, arXiv 2503.01840, fuses a low, a middle and a high layer). None: the last layer only.
    feature_layers: tuple[int, ...] | None = None

    @staticmethod
    def from_target(arch: ModelArch, name: str = "", feature_layers: tuple[int, ...] | None = None,
                    intermediate_size: int | None = None) -> EagleConfig:
        """The head for ``arch``; its MLP is the target's width unless ``intermediate_size`` narrows it."""
        return EagleConfig(arch.vocab_size, arch.hidden_size, intermediate_size or arch.intermediate_size, arch.num_heads,
                           arch.num_kv_heads, arch.head_dim, arch.rms_norm_eps, arch.rope_theta,
                           arch.rope_scaling, arch.max_position_embeddings, name, input_norms=True,
                           feature_layers=feature_layers)

    @property
    def num_feature_layers(self) -> int:
        return len(self.feature_layers) if self.feature_layers else 1

    def layer_arch(self) -> ModelArch:
        """One-layer arch (KV sizing reads ``num_layers``, ``num_kv_heads`` and ``head_dim``)."""
        return ModelArch("llama", self.vocab_size, self.hidden_size, self.intermediate_size, 1,
                         self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.rms_norm_eps,
                         self.rope_theta, self.rope_scaling, self.max_position_embeddings)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


class EagleHead(nn.Module):
    """fc([embedding ; feature]) ([hidden, 2 hidden] + bias) -> one Llama decoder layer -> predicted feature
    (pre-norm, on the scale of the target's residual stream). With ``cfg.input_norms`` the embedding and the
    feature each go through their own RMSNorm first."""

    def __init__(self, cfg: EagleConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend | None, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device, self.backend = cfg, dtype, device, backend
        self.arch = cfg.layer_arch()
        h = cfg.hidden_size
        n = cfg.num_feature_layers
        self.fc = _param(h, (1 + n) * h, dtype=dtype, device=device)
        self.fc_bias = _param(h, dtype=dtype, device=device)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device) if cfg.input_norms else None
        # One RMSNorm per feature layer (weight [n * hidden]): each layer's output has its own scale.
        self.feature_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device, chunks=n) if cfg.input_norms else None
        self.layer = DecoderLayer(self.arch, dtype, device)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                    torch.float32 if dtype == torch.float32 else dtype, device)
        # Reduced draft vocabulary: token ids [M] and the target's LM-head rows for them [M, hidden] (a copy,
        # counted with the head's weights): the LM head is most of a draft step's cost (49k x 576 on the demo).
        self.draft_vocab: torch.Tensor | None = None
        self.draft_lm_head: nn.Parameter | PackedWeight | None = None
        self.linear: Callable[..., torch.Tensor] = F.linear  # quant.packed_linear once ``pack_weights`` ran
        # Once ``pack_weights`` ran (n > 1): fc's columns for the embedding and the last feature layer, and the
        # last layer's feature norm, for drafting steps 2..k (``fuse``); a plain attribute, not a submodule.
        self._own: tuple[PackedWeight, RMSNorm | None] | None = None
        self.ops: TorchOps = TorchOps()  # the target's (fused C++ ops on CPU) once ``pack_weights`` ran

    def set_draft_vocab(self, ids: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.draft_vocab = ids.to(self.device, torch.long)
        self.draft_lm_head = nn.Parameter(lm_head[self.draft_vocab].detach().clone(), requires_grad=False)

    def reduced_logits(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[B, hidden] normed prediction -> ([B, M] float logits over the draft vocabulary, its [M] token ids);
        None without a reduced draft vocabulary."""
        if self.draft_lm_head is None or self.draft_vocab is None:
            return None
        return self.linear(normed, self.draft_lm_head).float(), self.draft_vocab

    def draft_logits(self, normed: torch.Tensor, target_logits: Callable[[torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
        """[B, hidden] normed prediction -> [B, vocab] float logits; -inf outside the draft vocabulary.
        ``target_logits``: the target's LM head (``DecoderModel.compute_logits``), for a full-vocabulary head."""
        reduced = self.reduced_logits(normed)
        if reduced is None:
            return target_logits(normed)
        out = torch.full((normed.shape[0], self.cfg.vocab_size), float("-inf"), device=normed.device)
        out[:, reduced[1]] = reduced[0]
        return out

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds [..., hidden]; features [..., n * hidden] (the target's layers) or [..., hidden] (the head's
        own prediction of the last layer, drafting step 2..k: the other layers' slots are zeros) -> [..., hidden]."""
        features = features.to(embeds.dtype)
        n, h = self.cfg.num_feature_layers, self.cfg.hidden_size
        if n > 1 and features.shape[-1] == h and self._own is not None:
            # The other layers' slots would be zeros: their norm chunks stay zero and their groups add exactly
            # 0 to every sum of the quantized matmul, so leaving them out gives the same bits at a third of
            # the work (tests/test_eagle.py, test_quantized_target_gets_an_8bit_head_and_stays_exact).
            fc_own, norm_own = self._own
            if self.embed_norm is not None and norm_own is not None:
                embeds = self.ops.add_norm(embeds, None, self.embed_norm)[1]
                features = self.ops.add_norm(features, None, norm_own)[1]
            return self.linear(torch.cat([embeds, features], dim=-1), fc_own, self.fc_bias)
        if n > 1 and features.shape[-1] == h:
            features = torch.cat([features.new_zeros(*features.shape[:-1], (n - 1) * h), features], dim=-1)
        if self.embed_norm is not None and self.feature_norm is not None:
            embeds = self.ops.add_norm(embeds, None, self.embed_norm)[1]
            features = self.ops.add_norm(features, None, self.feature_norm)[1]
        return self.linear(torch.cat([embeds, features], dim=-1), self.fc, self.fc_bias)

    def pack_weights(self, ops: TorchOps) -> bool:
        """Quantize the head's matmul weights (fc, the layer's four, the reduced LM head) to 8 bits in groups
        of 32 for the CPU kernels, so a draft step streams about a quarter of the bytes, and run its layer
        through ``ops`` (the target's: with fused CPU ops, one ``decoder_layer`` call). Drafts only propose (the
        target verifies every token), so this can change which tokens are drafted, never the output.
        False (nothing changed) where a weight's input size is not a multiple of the group."""
        a, m = self.layer.attn, self.layer.mlp
        slots: list[tuple[nn.Module, str]] = [(self, "fc"), (a, "qkv"), (a, "o"), (m, "gate_up"), (m, "down")]
        if self.draft_lm_head is not None:
            slots.append((self, "draft_lm_head"))
        if any(getattr(mod, attr).shape[-1] % GROUP for mod, attr in slots):
            return False
        n, h = self.cfg.num_feature_layers, self.cfg.hidden_size
        if n > 1:
            fc = self.fc.detach().float()
            own = CpuQuantWeight(quantize(torch.cat([fc[:, :h], fc[:, n * h:]], dim=1), 8, "fc"), self.device)
            norm = None
            if self.feature_norm is not None:
                norm = RMSNorm(h, self.cfg.rms_norm_eps, self.dtype, self.device)
                norm.weight.data.copy_(self.feature_norm.weight.detach()[(n - 1) * h:])
            self._own = (own, norm)
        for mod, attr in slots:
            w = getattr(mod, attr)
            delattr(mod, attr)  # a registered Parameter cannot be reassigned to a module
            setattr(mod, attr, CpuQuantWeight(quantize(w.detach().float(), 8, attr), self.device))
        self.linear = a.linear = m.linear = packed_linear
        self.ops = ops
        return True

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embeds [T, hidden] of t_p, features [T, hidden] of h_{p-1}, positions [T] -> predicted h_p."""
        assert self.backend is not None
        h, out = self.ops.layer(self.layer, self.fuse(embeds, features), None, positions, self.rope, kv_cache, meta,
                                self.backend)
        return h + out

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)

    # -- weights (HF-style, unfused names) -------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        a, m = self.layer.attn, self.layer.mlp

        def w(t: torch.Tensor | PackedWeight) -> torch.Tensor:
            return t.dequantize(self.dtype) if isinstance(t, PackedWeight) else t.detach()

        q, k, v = w(a.qkv).split([a.q_size, a.kv_size, a.kv_size], dim=0)
        gate, up = w(m.gate_up).split(m.inter, dim=0)
        p, sa = _LAYER, _LAYER + "self_attn."
        norms = {} if self.embed_norm is None or self.feature_norm is None else {
            "embed_norm.weight": self.embed_norm.weight.detach(), "feature_norm.weight": self.feature_norm.weight.detach()}
        return {**norms, "fc.weight": w(self.fc), "fc.bias": self.fc_bias.detach(),
                sa + "q_proj.weight": q, sa + "k_proj.weight": k, sa + "v_proj.weight": v,
                sa + "o_proj.weight": w(a.o), p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": w(m.down),
                p + "input_layernorm.weight": self.layer.input_norm.weight.detach(),
                p + "post_attention_layernorm.weight": self.layer.post_norm.weight.detach()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor], where: str) -> None:
        expected = {n: tuple(t.shape) for n, t in self.hf_state_dict().items()}
        if missing := [n for n in expected if n not in sd]:
            raise CheckpointError(f"{where}: missing tensor {missing[0]}")
        if extra := sorted(set(sd) - set(expected)):
            raise CheckpointError(f"{where}: unexpected tensor {extra[0]} in an EAGLE head")
        for n, shape in expected.items():
            if tuple(sd[n].shape) != shape:
                raise CheckpointError(f"{where}: tensor {n} has shape {list(sd[n].shape)}, the config implies "
                                      f"{list(shape)}")
        a, m, sa, p = self.layer.attn, self.layer.mlp, _LAYER + "self_attn.", _LAYER
        with torch.no_grad():
            self.fc.copy_(sd["fc.weight"])
            self.fc_bias.copy_(sd["fc.bias"])
            if self.embed_norm is not None and self.feature_norm is not None:
                self.embed_norm.weight.copy_(sd["embed_norm.weight"])
                self.feature_norm.weight.copy_(sd["feature_norm.weight"])
            a.qkv.copy_(torch.cat([sd[sa + x + "_proj.weight"] for x in "qkv"]))
            a.o.copy_(sd[sa + "o_proj.weight"])
            m.gate_up.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            m.down.copy_(sd[p + "mlp.down_proj.weight"])
            self.layer.input_norm.weight.copy_(sd[p + "input_layernorm.weight"])
            self.layer.post_norm.weight.copy_(sd[p + "post_attention_layernorm.weight"])


def save_eagle_head(head: EagleHead, out_dir: str, extra: dict[str, Any] | None = None,
                    draft_vocab: torch.Tensor | None = None, storage: str = "float16") -> None:
    """config.json + model.safetensors: the head's own weights only (``draft_vocab``: int64 ids).

    ``storage``: "float16", or "int8": each matrix as int8 codes with one fp16 scale per row (``NAME`` and
    ``NAME.row_scale``), half the bytes. Serving quantizes the head to 8 bits in groups of 32 anyway, and a
    draft only proposes, so the rounding can change which tokens are drafted, never the output."""
    from safetensors.torch import save_file

    if storage not in ("float16", "int8"):
        raise ValueError(f"storage {storage!r}: float16 or int8")
    os.makedirs(out_dir, exist_ok=True)
    cfg = {"specserve_draft": EAGLE_KIND, "model_type": "specserve_eagle", **asdict(head.cfg),
           "draft_vocab_size": 0 if draft_vocab is None else int(draft_vocab.numel()),
           "torch_dtype": "float16", "weight_storage": storage, **(extra or {})}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tensors: dict[str, torch.Tensor] = {}
    for n, t in head.hf_state_dict().items():
        t = t.float().cpu()
        if storage == "int8" and t.dim() == 2:
            scale = (t.abs().amax(dim=1) / 127.0).clamp_min(1e-8).to(torch.float16)
            tensors[n] = torch.round(t / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            tensors[n + ROW_SCALE] = scale.contiguous()
        else:
            tensors[n] = t.to(torch.float16).contiguous()
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous().cpu()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def dequantize_rows(sd: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A head state dict with ``NAME.row_scale`` entries (int8 storage) -> plain float tensors."""
    out = {n: t for n, t in sd.items() if not n.endswith(ROW_SCALE)}
    for n in [n[:-len(ROW_SCALE)] for n in sd if n.endswith(ROW_SCALE)]:
        codes, scale = out.get(n), sd[n + ROW_SCALE]
        if codes is None or codes.dtype != torch.int8 or codes.dim() != 2 or tuple(scale.shape) != (codes.shape[0],):
            raise CheckpointError(f"{where}: {n}{ROW_SCALE} needs an int8 matrix {n} with one scale per row")
        out[n] = codes.float() * scale.float()[:, None]
    return out


def read_eagle_config(path: str) -> EagleConfig:
    file = os.path.join(os.path.expanduser(path), "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read the EAGLE head config ({e})") from e
    if not isinstance(raw, dict) or raw.get("specserve_draft") != EAGLE_KIND:
        raise SpecserveError(f"{path} is not an EAGLE head (its config.json lacks \"specserve_draft\": "
                             f"\"eagle\"); make one with `specserve distill --kind head`, or use "
                             f"--speculative-method draft for a standalone draft model")
    fields = EagleConfig.__dataclass_fields__
    try:
        cfg = EagleConfig(**{k: v for k, v in raw.items() if k in fields})
    except TypeError as e:
        raise CheckpointError(f"{file}: incomplete EAGLE head config ({e})") from e
    layers = cfg.feature_layers
    if layers is not None:
        if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and i >= 1 for i in layers) \
                or layers != sorted(set(layers)):  # the target concatenates its layers in layer order
            raise CheckpointError(f"{file}: feature_layers must be increasing target layer numbers (1-based)")
        cfg = replace(cfg, feature_layers=tuple(layers))
    return cfg


def load_eagle_head(path: str, target: ModelArch, lm_head: torch.Tensor, dtype: torch.dtype, device: torch.device,
                    backend: AttentionBackend, max_positions: int) -> EagleHead:
    """Read a head dir and check it fits the target (same vocabulary and hidden size); ``lm_head`` is the
    target's [vocab, hidden] LM head (rows copied for a reduced draft vocabulary)."""
    from safetensors.torch import load_file

    cfg = read_eagle_config(path)
    if cfg.vocab_size != target.vocab_size:
        raise SpecserveError(f"EAGLE head {path} was trained for a vocabulary of {cfg.vocab_size} tokens but the "
                             f"target has {target.vocab_size}: the head must come from `specserve distill` on "
                             f"this target (same tokenizer)")
    if cfg.hidden_size != target.hidden_size:
        raise SpecserveError(f"EAGLE head {path} reads features of size {cfg.hidden_size} but the target's hidden "
                             f"size is {target.hidden_size}: it was distilled for another target")
    if cfg.feature_layers and cfg.feature_layers[-1] != target.num_layers:
        raise SpecserveError(f"EAGLE head {path} reads target layers {list(cfg.feature_layers)}, ending with the "
                             f"last, but the target has {target.num_layers} layers: it was distilled for another "
                             f"target")
    file = os.path.join(os.path.expanduser(path), "model.safetensors")
    try:
        sd = load_file(file)
    except Exception as e:
        raise CheckpointError(f"{file}: cannot read the EAGLE head weights ({type(e).__name__}: {e})") from e
    head = EagleHead(cfg, dtype, device, backend, max_positions)
    sd = dequantize_rows(sd, file)
    vocab = sd.pop("draft_vocab", None)
    head.load_hf_state_dict(sd, file)
    if vocab is not None:
        if vocab.dim() != 1 or vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= target.vocab_size:
            raise CheckpointError(f"{file}: draft_vocab must be token ids below {target.vocab_size}")
        head.set_draft_vocab(vocab, lm_head)
    return head.eval()
