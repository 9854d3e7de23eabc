"""The drafter: the worker's side of speculative decoding, behind one call per step.

It wires what only speculation needs: the draft model or EAGLE head and its KV, the proposer, the adaptive
controller, the timing of draft steps (the controller's cost model) and every request's ``SpecState``
(spec_decode/state.py: acceptance, drafts in flight, the target features an EAGLE head reads, the proposer's
own state). The model runner runs the target, verifies, reports what it measured (``record_target``,
``record_acceptance``) and asks ``propose(candidates)`` once per step.

``--speculative-method`` is resolved here, once, at start-up (``_load_draft_model``, ``_make_proposer``);
nothing on the hot path branches on it. See docs/speculative_decoding.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specserve.config import EngineConfig, ModelArch, SpecserveError
from specserve.model.attention import make_backend
from specserve.model.checkpoint.loader import load_checkpoint
from specserve.model.decoder import DecoderModel
from specserve.model.eagle_head import EagleHead, load_eagle_head
from specserve.model.quant import packed_linear
from specserve.model.sharding import TensorParallel
from specserve.platform import Platform
from specserve.spec_decode.controller import SpecController
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.eagle import EagleProposer, EagleSteps
from specserve.spec_decode.lookup_first import LookupFirstProposer
from specserve.spec_decode.ngram import NgramProposer, lookup
from specserve.spec_decode.proposer import Draft, Proposer, ProposeRequest
from specserve.spec_decode.proposer import backlog as proposer_backlog
from specserve.spec_decode.state import FREE_SOURCES, Source, SpecState, SpecStates
from specserve.spec_decode.suffix import SUFFIX_KEY_N, SuffixProposer
from specserve.worker.calibrate import Calibration
from specserve.worker.draft_steps import eagle_steps, logits_step
from specserve.worker.draft_vocab import ReducedVocab, auto_size, reduced_vocab
from specserve.worker.graphs import GraphPlan
from specserve.worker.mirror import Mirror

# Builds a model the way the target was built (dtype, quantization, attention backend, kernels).
ModelBuilder = Callable[..., DecoderModel]
KvAllocator = Callable[[DecoderModel | EagleHead], list[torch.Tensor]]


def mirrors_draft_calls(config: EngineConfig) -> bool:
    """Whether drafting makes model calls on sharded models (tensor parallel: the other ranks need a drafter
    to run them): layer-skip and EAGLE steps, and a draft model split over the ranks."""
    method = config.speculative.method
    return method in ("layer_skip", "eagle") or (method == "draft" and config.draft_tensor_parallel_size > 1)


class Drafter:
    """Speculation on the worker. Start-up is two calls: the constructor loads the draft weights (the KV
    budget needs their size), ``start`` gets the KV tensors and the graph plan and builds the proposer."""

    def __init__(self, config: EngineConfig, platform: Platform, dtype: torch.dtype, target: DecoderModel,
                 max_positions: int, build: ModelBuilder, mirror: Mirror | None = None, tokenizer: Any = None
                 ) -> None:
        self.config = config
        self.tokenizer = tokenizer  # the HF tokenizer: it picks a reduced draft vocabulary (worker/draft_vocab.py)
        # Tensor parallel (worker/tensor_parallel.py): model calls on sharded models are mirrored to the
        # other ranks; a draft model at draft_tensor_parallel_size 1 runs on rank 0 alone.
        self.mirror = mirror or Mirror(None)
        self.spec_config = config.speculative
        self.platform = platform
        self.dtype = dtype
        self.target = target
        self.max_positions = max_positions
        self.build = build
        self.model: DecoderModel | EagleHead | None = self._load_draft_model()
        # Whether the proposer reads the target's features (the runner then hands each step's over).
        self.reads_features = isinstance(self.model, EagleHead)
        # Model drafts (a draft model or head reads the whole prompt before its first draft; layer skip runs
        # the target's first layers k times): the runner leaves a request out of the proposals of the step
        # that gives its first token, so none of that is part of the TTFT. Lookups cost nothing and draft.
        self.defers_first_draft = self.spec_config.method in ("draft", "eagle", "layer_skip")
        if isinstance(self.model, EagleHead):
            target.feature_layers = self.model.cfg.feature_layers  # the layers the head reads
        self.states = SpecStates()  # every request's speculation state, created and dropped here
        self.controller = SpecController(self.spec_config.num_speculative_tokens, self.spec_config.adaptive,
                                         states=self.states)
        self.kv_caches: list[torch.Tensor] = []
        self.proposer: Proposer | None = None
        self._plan: GraphPlan | None = None
        self.timer = DraftTimer()
        self._suffix: SuffixProposer | None = None  # suffix decoding's index of finished requests
        self._router: LookupFirstProposer | None = None  # --prompt-lookup-first
        self._eagle: EagleProposer | None = None  # sizes its trees with the controller
        self.vocab: ReducedVocab | None = None  # a draft model's / layer skip's reduced LM head, if any
        # One draft model step (tokens, starts, block ids), for the start-up calibration; None: no model steps.
        self.calibration_step: Callable[..., Any] | None = None
        self.calibration: Calibration | None = None  # its samples: they seed every controller

    # -- start-up -------------------------------------------------------------------------------------------
    def _load_draft_model(self) -> DecoderModel | EagleHead | None:
        spec_config, arch = self.spec_config, self.target.arch
        target_quantized = getattr(self.target, "linear", None) is packed_linear
        if spec_config.method == "draft":
            mode = spec_config.quantization or ("int4" if target_quantized else self.config.model.quantization)
            ckpt = load_checkpoint(spec_config.model or "", keep_quantized=mode != "none")
            check_draft_vocabulary(spec_config.model or "", arch, ckpt.arch)
            tp = self.target.tp
            if tp is not None and self.config.draft_tensor_parallel_size > 1:
                return self.build(ckpt, TensorParallel.create(ckpt.arch, tp.comm), quantization=mode,
                                  quantize_head=True)
            return self.build(ckpt, quantization=mode, quantize_head=True)
        if spec_config.method == "eagle":
            head = load_eagle_head(spec_config.model or "", arch, self.target.lm_head_weight, self.dtype,
                                   self.platform.device, make_backend(self.platform.attention_backend),
                                   self.max_positions)
            # A quantized target on the CPU kernels: the head's weights go 8-bit too and its layer runs through
            # the target's fused ops (drafts are verified, so the output cannot change).
            if target_quantized and self.platform.quant_kernels == "cpu":
                head.pack_weights(self.target.ops)
            return head
        return None

    def start(self, alloc_kv: KvAllocator, target_kv: list[torch.Tensor], block_size: int,
              plan: GraphPlan | None) -> None:
        self._plan = plan
        self.kv_caches = alloc_kv(self.model) if self.model is not None else []
        self.proposer = self._make_proposer(target_kv, block_size)

    @property
    def writes_kv(self) -> bool:
        """Whether drafting writes KV ahead of the verified tokens (the scheduler reserves lookahead slots)."""
        return bool(self.proposer and self.proposer.writes_kv)

    def _make_proposer(self, target_kv: list[torch.Tensor], block_size: int) -> Proposer:
        spec_config = self.spec_config
        assert spec_config.prompt_lookup_min is not None
        if spec_config.method == "ngram":
            return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)
        # Suffix decoding's index: the method itself, or the lookup side of --prompt-lookup-first.
        suffix = None
        if spec_config.method == "suffix" or spec_config.prompt_lookup_source == "suffix":
            suffix = self._suffix = SuffixProposer(SUFFIX_KEY_N, spec_config.suffix_cache_tokens)
        if spec_config.method == "suffix":
            assert suffix is not None
            return suffix
        model = self._make_model_proposer(target_kv, block_size)
        if spec_config.prompt_lookup_first:
            self._router = LookupFirstProposer(
                model, spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, self.controller, suffix=suffix,
                grammar_cut=spec_config.grammar_drafts)
            return self._router
        return model

    def _make_model_proposer(self, target_kv: list[torch.Tensor], block_size: int) -> Proposer:
        spec_config, arch, device = self.spec_config, self.target.arch, self.platform.device
        if spec_config.method == "draft":
            assert isinstance(self.model, DecoderModel)
            vocab = self.vocab = self._reduced_vocab(self.model)
            step = logits_step(self.model, self.kv_caches, block_size, device, None, self._plan, vocab)
            if self.model.tp is not None:
                step = self.mirror.wrap("draft", step)
            self.calibration_step = step
            return DraftModelProposer(self.timer.timed(step), shares_target_kv=False, vocab_size=arch.vocab_size,
                                      grammar=spec_config.grammar_drafts,
                                      vocab_extra=vocab.extra if vocab is not None else None)
        if spec_config.method == "eagle":
            assert isinstance(self.model, EagleHead)
            steps = eagle_steps(self.target, self.model, self.kv_caches[0], block_size, device)
            timed = EagleSteps(*(self.timer.timed(self.mirror.wrap(key, fn)) for key, fn in (
                ("eagle", steps.logits), ("eagle_vocab", steps.vocab_logits), ("eagle_top", steps.top))))
            width = arch.hidden_size * self.model.cfg.num_feature_layers  # the features the head reads
            self._eagle = EagleProposer(timed, width, arch.vocab_size, spec_config.eagle_topk,
                                        spec_config.num_draft_tokens or 0, self.controller,
                                        grammar=spec_config.grammar_drafts)
            self.calibration_step = lambda toks, starts, blocks: steps.logits(
                toks, torch.zeros(sum(map(len, toks)), width, device=device), starts, blocks)
            return self._eagle
        if spec_config.method == "layer_skip":
            layers = spec_config.draft_layers or max(1, arch.num_layers // 4)
            if layers >= arch.num_layers:
                raise SpecserveError(f"--draft-layers {layers} must be below the target's {arch.num_layers} layers")
            vocab = self.vocab = self._reduced_vocab(self.target)
            step = self.mirror.wrap("layer_skip", logits_step(self.target, target_kv[:layers], block_size, device,
                                                              layers, self._plan, vocab))
            self.calibration_step = step
            return DraftModelProposer(self.timer.timed(step), shares_target_kv=True, vocab_size=arch.vocab_size,
                                      grammar=spec_config.grammar_drafts,
                                      vocab_extra=vocab.extra if vocab is not None else None)
        raise SpecserveError(f"speculative method {spec_config.method!r} is not available in this build")

    def _reduced_vocab(self, model: DecoderModel) -> ReducedVocab | None:
        """The drafting model's LM head at a reduced vocabulary (--speculative-draft-vocab-size), or None: the
        whole head (size 0, a split model, or no tokenizer to count with)."""
        size = auto_size(self.spec_config.draft_vocab_size, model.arch.vocab_size)
        if size == 0 or model.tp is not None:
            return None
        return reduced_vocab(model.lm_head, model.arch.vocab_size, size, self.tokenizer)

    # -- per request ----------------------------------------------------------------------------------------
    def keep_features(self, req_id: str, pos: int, h: torch.Tensor, owned: bool = False) -> None:
        """The target's features of positions pos.. (a feature sink; ``owned``: views of the step's own copy),
        buffered in the request's ``SpecState`` until its next model proposal."""
        self.states.of(req_id).features.add(pos, h, owned)

    def state(self, req_id: str) -> SpecState:
        """The request's speculation state (created on first use; ``drop`` forgets it)."""
        return self.states.of(req_id)

    def drop(self, req_id: str, token_ids: list[int] | None = None, user: str | None = None) -> None:
        """Forget a finished or aborted request (``token_ids``: its prompt + output when it speculated, for
        suffix decoding's index, partitioned by ``user``)."""
        if self._suffix is not None and token_ids is not None:
            self._suffix.finish(token_ids, user)
        self.states.drop(req_id)

    def backlog(self, req_id: str) -> int:
        """Target features an EAGLE head must read for this request before it drafts (0 for other drafts)."""
        state = self.states.get(req_id)
        return len(state.features) if state is not None else 0

    def forget_kv(self, req_id: str) -> None:
        """A preempted request resumes: its draft KV was freed with its blocks."""
        self.states.forget_kv(req_id)

    # -- per step -------------------------------------------------------------------------------------------
    def record_target(self, num_tokens: int, seconds: float) -> None:
        """One target step's cost (the runner skips steps that captured a graph)."""
        self.controller.record_target(num_tokens, seconds)

    def record_step(self, tokens: int, seconds: float) -> None:
        """A whole step (target, sampling, the next drafts) made ``tokens`` tokens in ``seconds``."""
        self.controller.record_step(tokens, seconds)

    def record_acceptance(self, req_id: str, num_draft: int, num_accepted: int,
                          parents: tuple[int, ...] | None = None) -> Source | None:
        """One verification: ``num_accepted`` of ``num_draft`` drafts (a tree: its nodes, ``parents``), for the
        controller and the router. Returns the drafts' source (None: the request had no drafts in flight)."""
        state = self.states.get(req_id)
        if state is None:  # it never drafted
            return None
        source, predicted, confs = state.source, state.tree_predicted, state.confs
        state.source, state.tree_predicted, state.confs = None, None, None
        if self._router is not None:
            self._router.observe(state, source, num_draft, num_accepted)
        if source is None:
            return None
        if parents is not None:  # the controller's positions are depths
            depth: list[int] = []
            for p in parents:
                depth.append(depth[p] + 1 if p >= 0 else 1)
            self.controller.record_acceptance(req_id, max(depth), num_accepted, source)
            if predicted is not None:
                self.controller.record_tree(predicted, num_accepted)
        else:
            self.controller.record_acceptance(req_id, num_draft, num_accepted, source)
            if confs is not None and len(confs) == num_draft:
                self.controller.record_confidence(source, confs, num_accepted)
        return source

    def propose(self, cands: list[ProposeRequest], draining: bool = False, hold: bool = False,
                others: int = 0) -> dict[str, Draft]:
        """Drafts for the next step. ``cands``: the speculating requests after this step, each with ``room`` the
        most drafts it has room for; the controller sets each one's ``k`` within that (0: no drafts), pricing
        the features an EAGLE head must catch up on before it drafts (``backlog``). ``others``: the step's rows
        of requests that are not candidates (one each: a request whose first token was just sampled, one that
        does not speculate), priced with the step and counted as the batch a draft model's catch-up shares.
        ``draining``: an offline batch that only drains; the controller then plans for the batch's end
        (``SpecController.choose_ks``' ``remaining``: ``room`` + 1 tokens each). ``hold``: the next step carries a
        new prompt's prefill, so only drafts that cost no draft step (prompt lookup, grammar) are made.

        Structured outputs (``--no-grammar-drafts`` turns this off): where the request's grammar forces the
        next tokens, those are its drafts (free, source "grammar"); a draft model or head drafts among the
        tokens the grammar allows (its ``DraftSampler``); any draft is cut at the first token the grammar
        forbids, before the target spends a verification slot on it."""
        assert self.proposer is not None, "Drafter.start was not called"
        proposer, controller = self.proposer, self.controller
        use_grammar = self.spec_config.grammar_drafts
        forced = [c.state.grammar.forced_tokens(min(controller.max_k, c.room))
                  if use_grammar and c.state.grammar is not None else [] for c in cands]
        sources = [Source.GRAMMAR if f else proposer.source(c, controller.max_k) for c, f in zip(cands, forced)]
        remaining = [c.room + 1 for c in cands] if draining else None
        backlog = [proposer_backlog(proposer, c, controller.max_k) for c in cands]
        # (a proposer that writes no KV runs no model: its drafts delay nobody's first token)
        ks = controller.choose_ks([c.req_id for c in cands], other_tokens=others, other_decodes=others,
                                  sources=sources, remaining=remaining, backlog=backlog,
                                  hold=hold and proposer.writes_kv)
        out: dict[str, Draft] = {}
        reqs, req_sources = [], []
        stop = controller.chain_stop
        for c, k, source, f in zip(cands, ks, sources, forced):
            c.k = min(k, c.room)
            c.stop = None
            if c.k < 1:
                continue
            if stop is not None and not f and source not in FREE_SOURCES and c.state.params.greedy:
                # a greedy chain goes as deep as its confidence pays for (``SpecController.chain_stop``)
                c.k, c.stop = min(controller.max_k, c.room), stop
            if f:
                out[c.req_id] = Draft(self._grammar_draft(c, f))
                c.spec.source, c.spec.confs = source, None
                continue
            # NOTE: lookup drafts read no features; they stay buffered for the model's next proposal.
            c.features = c.spec.features.take() if source not in FREE_SOURCES else None
            reqs.append(c)
            req_sources.append(source)
        if not reqs:
            return out
        # the step's rows outside the model's drafts: requests not drafting, and grammar drafts (tree sizes
        # are priced against the whole step, not as if the trees were alone in it)
        other_rows = others + len(cands) - len(reqs) + sum(len(d.token_ids) for d in out.values())
        t0, captures = time.perf_counter(), self.num_captures()
        self.timer.start()
        drafts = proposer.propose(reqs, other_rows)
        calls = self.timer.calls
        stepped = [r.k for r, s in zip(reqs, req_sources) if s not in FREE_SOURCES]  # drafts costing model steps
        step_cost = draft_step_cost(calls, time.perf_counter() - t0, max(stepped, default=1))
        if stepped and self.num_captures() == captures:  # a step that captured a graph is no cost sample
            controller.record_draft(len(stepped), step_cost)
            rows, tokens, first = calls[0] if calls else (0, 0, 0.0)
            if tokens >= 2 * rows > 0:  # the first call caught the draft up on a backlog: its cost per token
                controller.record_catch_up(tokens, first)
        for r, d, source in zip(reqs, drafts, req_sources):
            if use_grammar and r.state.grammar is not None and d.token_ids and d.parents is None:
                n = r.state.grammar.valid_prefix(d.token_ids)
                d = Draft(d.token_ids[:n], d.probs[:n] if d.probs is not None and n else None,
                          confs=d.confs[:n] if d.confs is not None else None)
            if d.token_ids:
                out[r.req_id] = d
                r.spec.source = source
                r.spec.confs = d.confs
                if d.parents is not None:
                    r.spec.tree_predicted = d.predicted
        return out

    def _grammar_draft(self, c: ProposeRequest, forced: list[int]) -> list[int]:
        """The tokens the grammar forces, then (room left) what followed the same tokens earlier in the
        request's history (prompt lookup over history + forced), cut where the grammar stops allowing it."""
        toks = forced[:c.k]
        if len(toks) < c.k:
            cfg = self.spec_config
            assert cfg.prompt_lookup_min is not None and c.state.grammar is not None
            more = lookup(np.asarray(c.token_ids + toks, dtype=np.int64), c.k - len(toks), cfg.prompt_lookup_min,
                          cfg.prompt_lookup_max)
            if more:
                toks = toks + more
                toks = toks[:c.state.grammar.valid_prefix(toks)]
        return toks

    def num_captures(self) -> int:
        return self._plan.capture.num_captures if self._plan is not None else 0

    # -- per run (benchmarks, `specserve distill`) ----------------------------------------------------------
    def reset_controller(self, *, adaptive: bool | None = None, max_k: int | None = None) -> SpecController:
        """A fresh controller (no acceptance history; its costs only the start-up calibration's): adaptive or a
        fixed k, up to the configured ``--num-speculative-tokens`` (the graphs and lookahead slots are sized
        for it)."""
        k = self.spec_config.num_speculative_tokens if max_k is None else max_k
        if not 1 <= k <= self.spec_config.num_speculative_tokens:
            raise ValueError(f"k={k} is outside 1..{self.spec_config.num_speculative_tokens} (--num-speculative-tokens)")
        old = self.controller
        self.controller = SpecController(k, old.adaptive if adaptive is None else adaptive, states=self.states)
        if self.calibration is not None:
            self.calibration.apply(self.controller)
        self.controller.cost_observers = old.cost_observers
        self.states.forget_acceptance()
        for user in (self._router, self._eagle):  # the proposers that ask the controller
            if user is not None:
                user.controller = self.controller
        return self.controller


class DraftTimer:
    """The model calls of one proposal, each as (rows, tokens, seconds): the controller's draft cost."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []

    def start(self) -> None:
        """A proposal begins: its calls are recorded from here."""
        self.calls = []

    def timed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step``, recording each call's rows (requests), tokens and seconds."""
        def timed(token_ids: list[list[int]], *args: Any) -> Any:
            t0 = time.perf_counter()
            out = step(token_ids, *args)
            self.calls.append((len(token_ids), sum(len(t) for t in token_ids), time.perf_counter() - t0))
            return out
        return timed


def draft_step_cost(calls: list[tuple[int, int, float]], total: float, k: int) -> float:
    """Seconds one more draft step costs, from one proposal: ``total`` seconds, at most ``k`` drafts per
    request, ``calls`` its model calls as (rows, tokens, seconds).

    NOTE: a proposal's first model call also catches the draft up on every token since that request last
    drafted (many, after the controller paused it). Charging that to each step would make drafting look
    expensive, so the controller would draft less and the catch-ups would grow. A step is one token per
    drafting row plus one sampling: the time after the first call measures that; a single-call proposal
    scales its call by rows / tokens.
    """
    if not calls:
        return total / k  # a proposer without model steps (n-gram)
    rows, tokens, first = calls[0]
    if len(calls) > 1:
        return (total - first) / (len(calls) - 1)
    return first * rows / max(tokens, 1) + (total - first)


def check_draft_vocabulary(path: str, target: ModelArch, draft: ModelArch) -> None:
    """A draft model must share the target's tokenizer: the same vocabulary size and special tokens."""
    if draft.vocab_size != target.vocab_size:
        raise SpecserveError(f"draft model {path} has a vocabulary of {draft.vocab_size} tokens but the target has "
                             f"{target.vocab_size}: speculative decoding needs the same tokenizer")
    if (draft.bos_token_id, set(draft.eos_token_ids)) != (target.bos_token_id, set(target.eos_token_ids)):
        raise SpecserveError(f"draft model {path} has special tokens bos={draft.bos_token_id} "
                             f"eos={sorted(draft.eos_token_ids)} but the target has bos={target.bos_token_id} "
                             f"eos={sorted(target.eos_token_ids)}")
