"""Frozen configuration dataclasses. All validation lives here."""

from __future__ import annotations

import json
import os
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

from specserve.errors import CheckpointError as CheckpointError  # re-exported: the usual import
from specserve.errors import SpecserveError as SpecserveError
from specserve.hub import resolve_model


def flag(help: str, *, kw: str | None = None, cli: str | None = None, short: str | None = None,
         choices: tuple[str, ...] | str | None = None, negative: str | None = None, positive: bool = True,
         ) -> dict[str, Any]:
    """Field metadata that makes a config field an engine flag: ``engine_args.py`` derives the CLI option
    (``--`` + the keyword with dashes, or ``cli``) and the ``LLM(**kwargs)`` keyword (the field's name, or
    ``kw``) from it. Booleans get ``--flag`` (unless ``positive`` is False) and/or ``negative`` (``--no-...``).
    ``choices`` "devices" stands for ``platform.DEVICE_CHOICES`` (platform imports this module)."""
    return {"flag": {"help": help, "kw": kw, "cli": cli, "short": short, "choices": choices,
                     "negative": negative, "positive": positive}}


def flag_keyword(f: Field[Any]) -> str:
    """The ``LLM(**kwargs)`` / ``EngineConfig.from_kwargs`` keyword of a flagged config field."""
    return f.metadata["flag"]["kw"] or f.name


def flag_type(f: Field[Any]) -> type:
    """The value type of a config field: bool, int, float or str (from its annotation, a type or its string
    form such as ``int | None``)."""
    if isinstance(f.type, type):
        return f.type
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if name in str(f.type).split(" | "):
            return kind
    return str


@dataclass(frozen=True)
class ModelArch:
    """Architecture hyper-parameters of a decoder-only transformer. The families (``model/families/``) map
    their checkpoints' configs onto these fields; the layer (``model/decoder.py``) is built from them."""

    architecture: str  # the family's name: "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "qwen3_moe" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    sliding_window: int | None = None  # keys a sliding layer sees: positions (i - window, i]
    # Per layer: True = sliding-window attention; () with a window = every layer slides (Mistral).
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # sliding layers' rope base, without scaling (Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # with qk_norm: over the whole q / k projection instead of per head (OLMoE)
    hidden_act: str = "silu"  # gated MLP activation: "silu" | "gelu_tanh" (GeGLU, Gemma)
    sandwich_norms: bool = False  # RMSNorm after attention and after the MLP too (Gemma 3)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Mixture of experts: num_experts > 0 makes every layer not in dense_layers a sparse MoE block.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"invalid {name}={getattr(self, name)} in model config")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise CheckpointError(f"unsupported hidden activation {self.hidden_act!r} (supported: silu, gelu_tanh)")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"invalid num_experts_per_tok={self.num_experts_per_tok} for "
                                  f"{self.num_experts} experts")

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (0-based), or None for full attention."""
        if self.sliding_window is None:
            return None
        if not self.sliding_layers:
            return self.sliding_window
        return self.sliding_window if self.sliding_layers[layer] else None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def with_layers(self, num_layers: int) -> ModelArch:
        return replace(self, num_layers=num_layers)


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # model/quant.py
KV_CACHE_DTYPES = DTYPES


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # path to an HF dir or a .gguf file; None = embedded demo model
    # What the user named (a hub id resolves to a local ``model`` in ``from_kwargs``): the served model's name.
    model_id: str | None = None
    revision: str | None = field(default=None, metadata=flag(
        "hub models: the branch, tag or commit to load (default: main)"))
    dtype: str = field(default="auto", metadata=flag(
        "compute dtype: auto = bf16 on GPUs and CPUs with bf16 hardware, fp32 elsewhere", choices=DTYPES))
    device: str = field(default="auto", metadata=flag("where to run",
                                                       choices="devices"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "longest context (prompt + output); default: the model's max_position_embeddings"))
    seed: int = 0
    enforce_eager: bool = field(default=False, metadata=flag(
        "never capture GPU graphs (used on GPUs for decode and verify steps)"))
    # auto keeps a quantized GGUF quantized and leaves float checkpoints float; none dequantizes; int8 / int4
    # (re)quantize every layer weight.
    quantization: str = field(default="auto", metadata=flag(
        "weight-only quantization: auto keeps a Q4_0/Q4_1/Q8_0 GGUF in its blocks and float checkpoints "
        "float; none dequantizes; int8/int4 quantize every layer weight (groups of 32)", short="-q",
        choices=QUANTIZATIONS))
    activation_bits: int = field(default=16, metadata=flag(
        "the grid the CPU kernels round activations to before their integer products, per group of 32: 16 "
        "(fidelity: 1/65534 of a group's largest value) or 8 (llama.cpp's Q8 activations: about half the "
        "work of each extra row, so verification and batches cost less, at a fidelity cost; see "
        "docs/quantization.md). A draft model follows the target. GPUs ignore it"))

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, got {self.activation_bits!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=flag("tokens per KV block (a power of two)"))
    kv_cache_memory: float | None = field(default=None, metadata=flag(
        "KV cache size: bytes (> 1) or a fraction of free memory (<= 1); default: a platform default"))
    num_blocks: int | None = field(default=None, metadata=flag("KV cache size as a block count",
                                                                cli="--num-kv-blocks"))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "KV cache dtype: auto = float16 on the C++ CPU attention with fp32 compute, else the compute dtype; "
        "float16 / bfloat16 halve the cache's memory and the bytes attention reads per step",
        choices=KV_CACHE_DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "prefix caching", positive=False, negative="--no-prefix-caching"))
    # On a GPU without kv_cache_memory / num_blocks: the KV cache gets this fraction of the device memory
    # that is free once the weights are loaded (the rest is headroom for activations and graphs).
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "GPU: fraction of the free device memory (after the weights) for the KV cache, in (0, 1]; "
        "--kv-cache-memory and --num-kv-blocks take precedence"))

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1] (the fraction of free device memory "
                             f"given to the KV cache), got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive (bytes, or a fraction <= 1)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = field(default=2048, metadata=flag("token budget of one step"))
    max_num_seqs: int = field(default=64, metadata=flag("most requests in one step"))
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "tensor-parallel ranks: every layer split over N processes (GPUs, or CPU processes over gloo)",
        short="-tp"))
    distributed_executor_backend: str = field(default="mp", metadata=flag(
        "how tensor-parallel workers start: mp (local processes) or ray (actors on a running Ray cluster, "
        "RAY_ADDRESS or auto; pip install 'specserve[ray]')", choices=EXECUTOR_BACKENDS))

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {EXECUTOR_BACKENDS}, got "
                             f"{self.distributed_executor_backend!r}")


SPEC_METHODS = ("draft", "ngram", "layer_skip", "eagle", "suffix")
LOOKUP_FIRST_MIN_N = 3  # --prompt-lookup-first: the shortest repeated suffix that lets lookup draft
MAX_TREE_TOPK = 8
MAX_TREE_NODES = 63  # tree-region keys per token are an int64 bitmask (model/attention_metadata.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = field(default=None, metadata=flag(  # None = speculation off
        "proposer (draft, or eagle for a head dir, is implied by --speculative-model)", kw="speculative_method",
        choices=SPEC_METHODS))
    model: str | None = field(default=None, metadata=flag(
        "draft checkpoint: HF dir, .gguf file or hub id (org/name, org/name:QUANT, org/name/file.gguf)",
        kw="speculative_model"))
    revision: str | None = field(default=None, metadata=flag(
        "a hub draft model's branch, tag or commit (default: main)", kw="speculative_model_revision"))
    num_speculative_tokens: int = field(default=0, metadata=flag(
        "k: drafts per step (the most; the controller may use fewer); default 5 for ngram, 4 otherwise"))
    # None: 1 for ngram, LOOKUP_FIRST_MIN_N with prompt_lookup_first
    prompt_lookup_min: int | None = field(default=None, metadata=flag(
        "shortest repeated suffix prompt lookup drafts from (ngram: 1; --prompt-lookup-first: 3)"))
    prompt_lookup_max: int = field(default=4, metadata=flag("longest suffix prompt lookup tries"))
    draft_layers: int | None = field(default=None, metadata=flag("layer_skip: target layers the draft uses"))
    adaptive: bool = field(default=True, metadata=flag(
        "choose k per step from measured acceptance and cost (default on)", kw="speculative_adaptive",
        negative="--no-speculative-adaptive"))
    # Start-up (worker/calibrate.py): timed steps on placeholder tokens seed the controller's cost tables.
    calibration_seconds: float = field(default=3.0, metadata=flag(
        "at start-up, spend up to this many seconds timing the target's decode/verification steps and the "
        "draft's steps, so the first requests are planned from measured costs (0: learn them from the first "
        "requests)", kw="speculative_calibration_seconds"))
    # A model proposer (draft, eagle, layer_skip) that lets prompt lookup draft whenever the context repeats
    # its last prompt_lookup_min tokens (spec_decode/lookup_first.py).
    prompt_lookup_first: bool = field(default=False, metadata=flag(
        "with a draft model, EAGLE head or layer_skip: draft by prompt lookup whenever the context repeats its "
        "last --prompt-lookup-min tokens, by the model otherwise"))
    prompt_lookup_source: str = field(default="prompt", metadata=flag(
        "--prompt-lookup-first: what lookup drafts from: the request's own prompt + output (prompt), or the "
        "suffix index, which adds earlier requests of the same user (suffix)", choices=("prompt", "suffix")))
    # Structured outputs (worker/drafter.py): a draft is cut at the first token the request's grammar forbids,
    # and tokens the grammar forces are drafted free, ahead of any model draft.
    grammar_drafts: bool = field(default=True, metadata=flag(
        "grammar-aware drafting for structured outputs (default on)", positive=False,
        negative="--no-grammar-drafts"))
    # Suffix decoding (spec_decode/suffix.py): finished requests' tokens kept for drafting, per user.
    suffix_cache_tokens: int = field(default=200_000, metadata=flag(
        "suffix: tokens of finished requests (prompt + output) kept for drafting, oldest evicted first"))
    # Draft trees (EAGLE-2's dynamic tree; spec_decode/eagle.py): each depth expands the eagle_topk best nodes
    # by cumulative draft probability into their eagle_topk best children; the best num_draft_tokens nodes
    # (fewer when the controller's measured costs say so) are verified in one pass. SGLang's flag names.
    eagle_topk: int = field(default=1, metadata=flag(
        "eagle: branching of the draft tree (1 = chains, the default)", kw="speculative_eagle_topk"))
    num_draft_tokens: int | None = field(default=None, metadata=flag(
        "eagle with --speculative-eagle-topk > 1: the most tree nodes verified per step (default 2k + 2)",
        kw="speculative_num_draft_tokens"))
    # A draft model's weights. None: 4-bit where the target runs on quantized kernels (a draft only proposes:
    # its precision moves acceptance a little, its bytes move every draft step), else as the target's.
    quantization: str | None = field(default=None, metadata=flag(
        "the draft model's weights: auto, none, int8 or int4 (default: int4 where the target runs quantized, "
        "else as the target)", kw="speculative_quantization", choices=QUANTIZATIONS))
    # A draft model's (or layer skip's) LM head read at a reduced vocabulary (worker/draft_vocab.py). None: auto
    # (32768 tokens + each request's prompt tokens where the vocabulary is above 65536), 0: the whole head.
    draft_vocab_size: int | None = field(default=None, metadata=flag(
        "draft model / layer_skip: the tokens the draft's LM head is read at (the most frequent ones, plus each "
        "request's prompt tokens); 0 = every token (default: 32768 where the vocabulary is above 65536)",
        kw="speculative_draft_vocab_size"))
    # Tensor parallel: the draft model on rank 0 alone (1) or split like the target (its size; None = that).
    draft_tensor_parallel_size: int | None = field(default=None, metadata=flag(
        "the draft model's tensor-parallel size: 1 (on rank 0 alone) or the target's (default)",
        cli="--speculative-draft-tensor-parallel-size"))

    def __post_init__(self) -> None:
        if self.prompt_lookup_min is None:
            object.__setattr__(self, "prompt_lookup_min", LOOKUP_FIRST_MIN_N if self.prompt_lookup_first else 1)
        if self.method is None:
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1 when speculation is on")
        if self.method in ("draft", "eagle") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a speculative model")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.prompt_lookup_source not in ("prompt", "suffix"):
            raise ValueError(f"prompt_lookup_source must be prompt or suffix, got {self.prompt_lookup_source!r}")
        if self.prompt_lookup_first and self.method in ("ngram", "suffix"):
            raise ValueError(f"prompt_lookup_first needs a model proposer (draft, eagle or layer_skip), "
                             f"not {self.method}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be >= 1")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError("draft_vocab_size must be >= 0")
        if self.suffix_cache_tokens < 0:
            raise ValueError("suffix_cache_tokens must be >= 0")
        if self.draft_tensor_parallel_size is not None and self.draft_tensor_parallel_size < 1:
            raise ValueError("draft_tensor_parallel_size must be >= 1")
        if not 1 <= self.eagle_topk <= MAX_TREE_TOPK:
            raise ValueError(f"eagle_topk must be in 1..{MAX_TREE_TOPK}")
        if self.eagle_topk > 1:
            if self.method != "eagle":
                raise ValueError(f"draft trees (eagle_topk > 1) need an EAGLE head, not method {self.method!r}")
            if self.num_draft_tokens is None:
                object.__setattr__(self, "num_draft_tokens", min(MAX_TREE_NODES, 2 * self.num_speculative_tokens + 2))
            assert self.num_draft_tokens is not None
            if not 1 <= self.num_draft_tokens <= MAX_TREE_NODES:
                raise ValueError(f"num_draft_tokens must be in 1..{MAX_TREE_NODES}")
            if self.eagle_topk * (self.num_speculative_tokens - 1) > MAX_TREE_NODES:
                raise ValueError(f"a tree of depth {self.num_speculative_tokens} with eagle_topk {self.eagle_topk} "
                                 f"expands more than {MAX_TREE_NODES} nodes: lower one of them")

    @property
    def lookahead_slots(self) -> int:
        """KV slots drafting writes past a request's tokens: k for chains; a tree's expansions and its nodes."""
        k = self.num_speculative_tokens
        if self.eagle_topk > 1:
            return max(k, self.num_draft_tokens or 0, self.eagle_topk * (k - 1))
        return k

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_args(cls, speculative_config: str | dict[str, Any] | None = None, **flags: Any) -> SpeculativeConfig:
        """Merge vLLM V0-style flags and a V1-style ``--speculative-config`` JSON into one config.

        ``flags`` are the fields' flag keywords (``flag_keyword``: ``speculative_model``, ``prompt_lookup_max``,
        ...); the JSON's keys are the field names. Per field, a flag that is given (not None) beats the JSON,
        and the JSON beats the field's default."""
        keywords = {flag_keyword(f): f for f in fields(cls)}
        unknown_flags = set(flags) - set(keywords)
        if unknown_flags:
            raise TypeError(f"unknown speculative arguments: {sorted(unknown_flags)}")
        json_cfg = _speculative_json(speculative_config, {f.name for f in fields(cls)})
        values: dict[str, Any] = {}
        for kw, f in keywords.items():
            value = flags.get(kw)
            if value is None:
                value = json_cfg.get(f.name)
            if value is not None:
                kind = flag_type(f)
                values[f.name] = kind(value) if kind in (int, bool) else value
        method, model = values.get("method"), values.get("model")
        if "[ngram]" in (method, model):  # vLLM V0 spelling: --speculative-model "[ngram]"
            method, model = "ngram", None
        model = resolve_model(model, values.get("revision"))  # a hub id -> its local snapshot or file
        if method is None and model:
            method = "eagle" if is_eagle_dir(model) else "draft"
        if method is None:
            return cls()
        values.update(method=method, model=model)
        values.setdefault("num_speculative_tokens", 5 if method in ("ngram", "suffix") else 4)
        return cls(**values)


def _speculative_json(speculative_config: str | dict[str, Any] | None, known: set[str]) -> dict[str, Any]:
    """``--speculative-config`` (JSON text or a dict) as a dict of known field names."""
    if not speculative_config:
        return {}
    if isinstance(speculative_config, str):
        try:
            cfg = json.loads(speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    else:
        cfg = dict(speculative_config)
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(cfg) - known
    if unknown:
        raise ValueError(f"unknown --speculative-config keys: {sorted(unknown)}")
    return cfg


def is_eagle_dir(path: str | None) -> bool:
    """A directory written by `specserve distill --kind head` (config.json says "specserve_draft": "eagle")."""
    try:
        with open(os.path.join(os.path.expanduser(path or ""), "config.json"), encoding="utf-8") as f:
            return json.load(f).get("specserve_draft") == "eagle"
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        tp, draft_tp = self.parallel.tensor_parallel_size, self.speculative.draft_tensor_parallel_size
        if draft_tp is not None and draft_tp not in (1, tp):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or the target's tensor-parallel size ({tp}), "
                             f"got {draft_tp}")

    @property
    def draft_tensor_parallel_size(self) -> int:
        d = self.speculative.draft_tensor_parallel_size
        return self.parallel.tensor_parallel_size if d is None else d

    @staticmethod
    def from_kwargs(model: str | None = None, **kw: Any) -> EngineConfig:
        """Build from flat keyword arguments (the names of the CLI flags, vLLM-style)."""
        def take(cls: type) -> dict[str, Any]:  # this config's fields, by name; None = its default
            picked = {f.name: kw.pop(f.name) for f in fields(cls) if f.name in kw}
            return {n: v for n, v in picked.items() if v is not None}

        model_kw = take(ModelConfig)
        # NOTE: hub ids become local paths here (and in SpeculativeConfig.from_args); model_id keeps the spelling.
        model_cfg = ModelConfig(model=resolve_model(model, model_kw.get("revision")), model_id=model, **model_kw)
        cache_kw, sched_kw, par_kw = take(CacheConfig), take(SchedulerConfig), take(ParallelConfig)
        spec_kws = [flag_keyword(f) for f in fields(SpeculativeConfig) if "flag" in f.metadata]
        spec_kw = {k: v for k in [*spec_kws, "speculative_config"] if (v := kw.pop(k, None)) is not None}
        spec_config = SpeculativeConfig.from_args(**spec_kw)
        if kw:
            raise TypeError(f"unknown engine arguments: {sorted(kw)}")
        return EngineConfig(model_cfg, CacheConfig(**cache_kw), SchedulerConfig(**sched_kw), spec_config,
                            ParallelConfig(**par_kw))
