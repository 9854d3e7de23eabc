"""Shared test helpers: tiny random HF models built locally (no downloads)."""

from __future__ import annotations

import torch

from specserve.config import ModelArch
from specserve.model.attention import TorchAttention, build_metadata
from specserve.model.decoder import DecoderModel


def tiny_hf_model(family: str = "llama", seed: int = 0, layers: int = 2, vocab: int = 256, **over):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family in ("qwen3", "qwen3_moe", "gemma3"):
        common["head_dim"] = 16  # their configs' default is 128 or 256, not hidden / heads
    if family == "gemma3":  # a window of 16 so sliding layers matter at test lengths; the last layer global
        common |= dict(sliding_window=16, query_pre_attn_scalar=24, pad_token_id=0, tie_word_embeddings=True,
                       layer_types=["sliding_attention"] * max(layers - 1, 1) + ["full_attention"] * (layers > 1))
    if family in ("qwen3_moe", "mixtral", "olmoe"):  # 8 experts, 2 per token (Qwen3-MoE renormalises, as its
        common |= dict(num_experts_per_tok=2)  # releases do; OLMoE does not)
        common |= {"qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, norm_topk_prob=True),
                   "mixtral": dict(num_local_experts=8, intermediate_size=48, router_jitter_noise=0.0),
                   "olmoe": dict(num_experts=8, intermediate_size=48, norm_topk_prob=False)}[family]
    common.update(over)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
    }[family]
    model = model_cls(cfg_cls(**common)).eval()
    # Random init of biases/norms so they matter in parity checks.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def arch_of(hf_model, family: str) -> ModelArch:
    c = hf_model.config
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1e4)
    return ModelArch(
        architecture=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta), max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings), attention_bias=family == "qwen2",
        bos_token_id=1, eos_token_ids=(2,), qk_norm=family == "qwen3",
    )


def our_model(hf_model, family: str) -> DecoderModel:
    arch = arch_of(hf_model, family)
    m = DecoderModel(arch, torch.float32, torch.device("cpu"), TorchAttention(), 1024)
    m.load_weights({k: v for k, v in hf_model.state_dict().items()})
    return m


def run_chunks(model: DecoderModel, tokens: list[int], chunks: list[int], block_size: int = 4,
               num_blocks: int = 64) -> torch.Tensor:
    """Feed ``tokens`` in chunks through a paged cache (shuffled block ids); logits at every position."""
    arch = model.arch
    kv = [torch.zeros(model.kv_cache_shape(num_blocks, block_size)) for _ in range(arch.num_layers)]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    out, pos = [], 0
    for n in chunks:
        ids = tokens[pos:pos + n]
        meta = build_metadata([n], [pos + n], [table], block_size)
        h = model(torch.tensor(ids), torch.arange(pos, pos + n), kv, meta)
        out.append(model.compute_logits(h))
        pos += n
    return torch.cat(out)


def byte_tokenizer(vocab: int = 260):
    """A byte-level tokenizer: ids 0..255 are bytes, 256 = <s>, 257 = </s>, 258 = <pad>; no merges."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab_map = {table[b]: b for b in range(256)}
    raw = RawTokenizer(models.BPE(vocab=vocab_map, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    assert len(tok) <= vocab, len(tok)
    return tok


def save_tiny_checkpoint(path, family: str = "llama", seed: int = 0, layers: int = 2, vocab: int = 260,
                         **over) -> str:
    """A tiny random model + byte-level tokenizer saved as an HF dir the loader and tokenizer read."""
    tok = byte_tokenizer(vocab)
    over.setdefault("bos_token_id", tok.bos_token_id)
    over.setdefault("eos_token_id", tok.eos_token_id)
    model = tiny_hf_model(family, seed=seed, layers=layers, vocab=vocab, **over)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def save_tiny_eagle_head(target: DecoderModel, path: str, gen: torch.Generator,
                         feature_layers: tuple[int, ...] | None = None) -> str:
    """An EAGLE head for ``target``: its first layer over fc([embedding ; features]) = embedding + 0.3 R
    features, input norms at the embedding's scale: it agrees with the target often (drafts get accepted)
    and depends on the features."""
    from specserve.model.eagle_head import EagleConfig, EagleHead, save_eagle_head

    h = target.arch.hidden_size
    cfg = EagleConfig.from_target(target.arch) if feature_layers is None else \
        EagleConfig.from_target(target.arch, feature_layers=feature_layers)
    head = EagleHead(cfg, torch.float32, torch.device("cpu"), None, 1024)  # type: ignore[arg-type]
    with torch.no_grad():
        head.layer.load_state_dict(target.layers[0].state_dict())
        head.fc[:, :h] = torch.eye(h)
        width = head.fc.shape[1] - h
        head.fc[:, h:] = 0.3 * torch.randn(h, width, generator=gen) / h ** 0.5
        head.fc_bias.zero_()
        for norm in (head.embed_norm, head.feature_norm):
            assert norm is not None
            norm.weight.fill_(float(target.embed.pow(2).mean().sqrt()))
    save_eagle_head(head, path)
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel pre-tokenization emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_char_tokenizer(path: str, vocab: int) -> None:
    """0 <unk>, 1 <s>, 2 </s>, then one token per character (printable ASCII, newline, Latin letters)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(0x20, 0x7F)] + ["\n"]
    chars += [chr(c) for c in range(0xC0, 0xC0 + vocab - 3 - len(chars))]
    table = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: 3 + i for i, c in enumerate(chars)}
    raw = RawTokenizer(models.WordLevel(table, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
