"""The worker: owns the target (and draft) model and the KV tensors; runs one step.

execute(step) = prepare flat inputs -> target forward -> logits at the positions that need them ->
verify/sample (k = 0 is ordinary decoding) -> propose drafts for the next step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.model.attention import make_backend
from specserve.model.eagle_head import EagleHead, load_eagle_head
from specserve.model.llama import LlamaModel
from specserve.model.loader import Checkpoint, load_checkpoint
from specserve.model.ops import make_ops
from specserve.model.quant import describe_weights, make_packer, packed_linear
from specserve.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from specserve.platform import Platform, resolve_dtype, to_device
from specserve.sample.rejection_sampler import verify
from specserve.sample.sampler import RequestSamplingState, compute_logprobs, process_logits
from specserve.spec_decode.controller import FREE_SOURCE, SpecController
from specserve.spec_decode.draft_model import DraftModelProposer
from specserve.spec_decode.eagle import EagleProposer
from specserve.spec_decode.lookup_first import LookupFirstProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.proposer import Proposer, ProposeRequest
from specserve.worker.features import FeatureBuffer, FeatureSink, eagle_step, sink_features
from specserve.worker.graphs import CaptureBackend, GraphPlan, ModelStep, batch_buckets, select_capture

log = logging.getLogger("specserve")

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass(slots=True)
class CachedRequest:
    """The worker's row for a request: sampling state, full token history, drafts in flight."""

    state: RequestSamplingState
    token_ids: list[int]  # prompt + output (what proposers read)
    max_tokens: int
    spec_enabled: bool
    draft_probs: torch.Tensor | None = None  # [k, V] q of the drafts proposed last step (None: one-hot)
    draft_source: str = ""  # which of the proposer's sources drafted them (the controller's acceptance key)
    features: FeatureBuffer = field(default_factory=FeatureBuffer)  # EAGLE: target features to hand over


def build_model(ckpt: Checkpoint, platform: Platform, dtype: torch.dtype, max_positions: int,
                quantization: str = "none") -> LlamaModel:
    """The model with its weights; with ``quantization`` (model/quant.py) its matmuls on packed weights."""
    packer = make_packer(quantization, platform.quant_kernels, ckpt.state_dict, platform.device, dtype,
                         platform.linear(dtype))
    model = LlamaModel(ckpt.arch, dtype, platform.device, make_backend(platform.attention_backend),
                       max_positions, platform.linear(dtype) if packer is None else packed_linear,
                       make_ops(platform.device, dtype, platform.attention_backend))
    model.load_weights(ckpt.state_dict, packer)
    log.info("weights: %s", describe_weights(model))
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: Platform, target: Checkpoint) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = resolve_dtype(platform, config.model.dtype)
        log.info("compute dtype: %s (%s on %s)", str(self.dtype).removeprefix("torch."),
                 "--dtype auto" if config.model.dtype == "auto" else "--dtype", platform.kind)
        self.arch = target.arch
        self.max_model_len = config.model.max_model_len or target.arch.max_position_embeddings
        self.block_size = config.cache.block_size
        self.model = build_model(target, platform, self.dtype, self.max_model_len + 64, config.model.quantization)
        self.weights_note = describe_weights(self.model)  # e.g. "210 int4 matmuls 61 MiB, 1 int8 matmuls 27 MiB"
        self.draft_model: LlamaModel | EagleHead | None = None
        spec = config.speculative
        if spec.enabled and spec.method == "draft":
            self.draft_model = self._load_draft(spec.model or "")
        if spec.enabled and spec.method == "eagle":
            self.draft_model = load_eagle_head(spec.model or "", self.arch, self.model.lm_head_weight, self.dtype,
                                               self.device, make_backend(platform.attention_backend),
                                               self.max_model_len + 64)
            self.model.feature_layers = self.draft_model.cfg.feature_layers  # the layers the head reads
        # Receives the target's pre-norm features of every row (EAGLE; `specserve distill` sets its own).
        self.feature_sink: FeatureSink | None = self._keep_features if spec.method == "eagle" else None
        self.num_blocks = self._num_blocks()
        capture, graphs_note = select_capture(platform, config.model.enforce_eager)
        self.graph_plan = self._graph_plan(capture) if capture is not None else None
        self.kv_caches = self._alloc_kv(self.model)
        self.draft_kv_caches = self._alloc_kv(self.draft_model) if self.draft_model else []
        self.target_step = ModelStep(self.model, self.kv_caches, self.block_size, self.device,
                                     plan=self.graph_plan)
        log.info("graphs: %s%s", graphs_note, f"; {self.graph_plan.describe()}" if self.graph_plan else "")
        self._draft_calls: list[tuple[int, int, float]] = []  # (rows, tokens, seconds) of one proposal's steps
        self.proposer: Proposer | None = self._make_proposer() if spec.enabled else None
        self.controller = SpecController(spec.num_speculative_tokens, spec.adaptive) if spec.enabled else None
        self.requests: dict[str, CachedRequest] = {}

    # -- start-up -------------------------------------------------------------------------------------------
    def _load_draft(self, path: str) -> LlamaModel:
        ckpt = load_checkpoint(path, keep_quantized=self.config.model.quantization != "none")
        t, d = self.arch, ckpt.arch
        if d.vocab_size != t.vocab_size:
            raise SpecserveError(f"draft model {path} has a vocabulary of {d.vocab_size} tokens but the target has "
                                 f"{t.vocab_size}: speculative decoding needs the same tokenizer")
        if (d.bos_token_id, set(d.eos_token_ids)) != (t.bos_token_id, set(t.eos_token_ids)):
            raise SpecserveError(f"draft model {path} has special tokens bos={d.bos_token_id} "
                                 f"eos={sorted(d.eos_token_ids)} but the target has bos={t.bos_token_id} "
                                 f"eos={sorted(t.eos_token_ids)}")
        return build_model(ckpt, self.platform, self.dtype, self.max_model_len + 64, self.config.model.quantization)

    def kv_bytes_per_block(self) -> int:
        per = 0
        for m in (self.model, self.draft_model):
            if m is not None:
                per += 2 * m.arch.num_layers * m.arch.num_kv_heads * m.arch.head_dim * self.dtype.itemsize
        return per * self.block_size

    def _num_blocks(self) -> int:
        cache = self.config.cache
        per_block = self.kv_bytes_per_block()
        if cache.num_blocks:
            n = cache.num_blocks
        else:
            mem = cache.kv_cache_memory
            if mem is None or mem <= 1:
                avail = _available_memory(self.platform)
                if mem is not None:
                    budget = avail * mem
                elif self.platform.is_gpu:  # free device memory, now that the weights are loaded
                    budget = cache.gpu_memory_utilization * avail
                else:
                    budget = min(_DEFAULT_CPU_KV_BYTES, 0.25 * avail)
            else:
                budget = mem
            n = int(budget // per_block)
        if n * self.block_size < self.block_size * 2:
            raise SpecserveError(f"KV cache too small: {n} blocks of {self.block_size} tokens")
        draft_note = ""
        if self.draft_model is not None:
            w = sum(p.numel() * p.element_size() for p in self.draft_model.parameters())
            draft_note = f" (including the draft's KV; draft weights {w / 2**20:.1f} MiB)"
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB%s", n, self.block_size,
                 n * self.block_size, n * per_block / 2**20, draft_note)
        return n

    def _graph_plan(self, capture: CaptureBackend) -> GraphPlan:
        """Graphs for decode (q = 1) and verification (q = k + 1) steps of the target and the draft.

        NOTE: with graphs the KV tensors get one block more than the pool hands out (index ``num_blocks``):
        the scratch block the padding rows write to.
        """
        k = self.config.speculative.num_speculative_tokens
        max_blocks = -(-(self.max_model_len + k + 1) // self.block_size)
        return GraphPlan(capture, batch_buckets(self.config.scheduler.max_num_seqs), k + 1, max_blocks,
                         scratch_block=self.num_blocks)

    def _alloc_kv(self, model: LlamaModel | EagleHead | None) -> list[torch.Tensor]:
        if model is None:
            return []
        num_blocks = self.num_blocks + (1 if self.graph_plan is not None else 0)
        shape = model.kv_cache_shape(num_blocks, self.block_size)
        # zeros, not empty: padded reads of unused slots must never see NaN/Inf garbage.
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(model.arch.num_layers)]

    def set_feature_layers(self, layers: tuple[int, ...] | None) -> None:
        """The target layers (1-based) whose outputs are concatenated into the features a feature sink
        receives (None: the last layer's output); an EAGLE-3-style head reads three."""
        self.model.feature_layers = layers

    @contextlib.contextmanager
    def observe_features(self, sink: FeatureSink) -> Iterator[None]:
        """For the duration: every step hands the target's pre-norm features of each row (the layers of
        ``set_feature_layers``) to ``sink`` instead of the EAGLE proposer (``specserve distill`` collects its
        training features this way)."""
        prev, self.feature_sink = self.feature_sink, sink
        try:
            yield
        finally:
            self.feature_sink = prev

    @property
    def drafts_write_kv(self) -> bool:
        """Whether drafting writes KV ahead of the verified tokens (the scheduler reserves lookahead slots)."""
        return bool(self.proposer and self.proposer.writes_kv)

    def _make_proposer(self) -> Proposer:
        spec = self.config.speculative
        assert spec.prompt_lookup_min is not None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        model = self._make_model_proposer()
        if spec.prompt_lookup_first:
            return LookupFirstProposer(model, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return model

    def _make_model_proposer(self) -> Proposer:
        spec = self.config.speculative
        if spec.method == "draft":
            assert isinstance(self.draft_model, LlamaModel)
            return DraftModelProposer(self._timed(self._draft_step(self.draft_model, self.draft_kv_caches, None)),
                                      shares_target_kv=False, vocab_size=self.arch.vocab_size)
        if spec.method == "eagle":
            assert isinstance(self.draft_model, EagleHead)
            return EagleProposer(self._timed(eagle_step(self.model, self.draft_model, self.draft_kv_caches[0],
                                                        self.block_size, self.device)),
                                 self.arch.hidden_size * self.draft_model.cfg.num_feature_layers,
                                 self.arch.vocab_size)
        if spec.method == "layer_skip":
            layers = spec.draft_layers or max(1, self.arch.num_layers // 4)
            if layers >= self.arch.num_layers:
                raise SpecserveError(f"--draft-layers {layers} must be below the target's "
                                     f"{self.arch.num_layers} layers")
            return DraftModelProposer(self._timed(self._draft_step(self.model, self.kv_caches[:layers], layers)),
                                      shares_target_kv=True, vocab_size=self.arch.vocab_size)
        raise SpecserveError(f"speculative method {spec.method!r} is not available in this build")

    def _timed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The proposer's model step, timed per call (rows, tokens, seconds) for the controller's draft cost."""
        def timed(token_ids: list[list[int]], *args: Any) -> Any:
            t0 = time.perf_counter()
            out = step(token_ids, *args)
            self._draft_calls.append((len(token_ids), sum(len(t) for t in token_ids), time.perf_counter() - t0))
            return out
        return timed

    def _draft_step_cost(self, total: float, k: int) -> float:
        """Seconds one more draft step costs, from the last proposal (``total`` seconds, ``k`` drafts max).

        NOTE: a proposal's first model call also catches the draft up on every token since that request
        last drafted (many, after the controller paused it); charging that to each step made drafting look
        expensive, so the controller drafted less, so catch-ups grew (eagle at batch 8: c measured 0.89 vs
        0.10 with a fixed k). A step is one token per drafting row plus one sampling: the time after the
        first call measures that; a single-call proposal scales its call by rows / tokens.
        """
        calls, self._draft_calls = self._draft_calls, []
        if not calls:
            return total / k  # a proposer without model steps (n-gram)
        rows, tokens, first = calls[0]
        if len(calls) > 1:
            return (total - first) / (len(calls) - 1)
        return first * rows / max(tokens, 1) + (total - first)

    def _draft_step(self, model: LlamaModel, kv: list[torch.Tensor], layers: int | None):
        forward = ModelStep(model, kv, self.block_size, self.device, layers, self.graph_plan)

        def step(token_ids: list[list[int]], starts: list[int], block_ids: list[tuple[int, ...]]) -> torch.Tensor:
            return model.compute_logits(forward(token_ids, starts, block_ids).last_hidden())  # [B, V]
        return step

    def _num_captures(self) -> int:
        return self.graph_plan.capture.num_captures if self.graph_plan is not None else 0

    # -- one step -------------------------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._sync_requests(so)
        rows = so.rows
        if not rows:
            return ModelRunnerOutput({}, {})
        t0, captures = time.perf_counter(), self._num_captures()
        sink = self.feature_sink
        out = self.target_step([r.token_ids for r in rows], [r.num_computed_tokens for r in rows],
                               [r.block_ids for r in rows], prenorm=sink is not None)
        hidden, prenorm = out.hidden, out.prenorm  # [T, hidden]; prenorm: the last layer's output, pre-norm
        sample_rows = [r for r in rows if r.needs_sample]
        if not sample_rows:
            if sink is not None and prenorm is not None:
                sink_features(rows, {}, prenorm, sink)
            return ModelRunnerOutput({}, {})
        idx = to_device(self._logits_indices(rows), self.device, torch.int64)
        logits = self.model.compute_logits(hidden[idx])  # [sum(k_i + 1), V]
        cached = [self.requests[r.req_id] for r in sample_rows]
        states = [c.state for c in cached]
        counts = [r.num_spec_tokens + 1 for r in sample_rows]
        drafts = [list(r.token_ids[r.num_tokens - r.num_spec_tokens:]) for r in sample_rows]
        qs = [c.draft_probs[:r.num_spec_tokens] if c.draft_probs is not None and r.num_spec_tokens else None
              for c, r in zip(cached, sample_rows)]
        processed = process_logits(logits, states, counts, drafts)
        emitted = verify(processed, states, counts, drafts, qs)
        logprobs = self._logprobs(logits, sample_rows, cached, counts, emitted)
        if self.controller is not None and self._num_captures() == captures:  # a capture step is no cost sample
            self.controller.record_target(so.total_tokens, time.perf_counter() - t0)
        for r, c, em in zip(sample_rows, cached, emitted):
            c.state.output_token_ids.extend(em)
            c.token_ids.extend(em)
            c.draft_probs = None
            if self.controller is not None:
                self.controller.record_acceptance(r.req_id, r.num_spec_tokens, len(em) - 1, c.draft_source)
        sampled = {r.req_id: em for r, em in zip(sample_rows, emitted)}
        if sink is not None and prenorm is not None:
            sink_features(rows, sampled, prenorm, sink)
        spec = self._propose(sample_rows, emitted)
        return ModelRunnerOutput(sampled, spec, logprobs)

    def _keep_features(self, req_id: str, pos: int, h: torch.Tensor) -> None:
        c = self.requests.get(req_id)
        if c is not None and c.spec_enabled:
            c.features.add(pos, h)

    def _sync_requests(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            if self.proposer is not None:
                self.proposer.drop(rid)
            if self.controller is not None:
                self.controller.drop(rid)
        for nr in so.new_requests:
            state = RequestSamplingState.create(nr.sampling_params, nr.prompt_token_ids, self.device)
            self.requests[nr.req_id] = CachedRequest(state, list(nr.prompt_token_ids), nr.max_tokens,
                                                     nr.spec_enabled)
        for r in so.rows:
            if r.resumed and self.proposer is not None:
                self.proposer.drop(r.req_id)  # its draft KV was freed with its blocks

    @staticmethod
    def _logits_indices(rows: list[ScheduledRequest]) -> list[int]:
        idx: list[int] = []
        end = 0
        for r in rows:
            end += r.num_tokens
            if r.needs_sample:
                idx.extend(range(end - r.num_spec_tokens - 1, end))
        return idx

    def _logprobs(self, logits: torch.Tensor, rows: list[ScheduledRequest], cached: list[CachedRequest],
                  counts: list[int], emitted: list[list[int]]) -> dict[str, list[dict]]:
        want = [c.state.params.logprobs for c in cached]
        if all(w is None for w in want):
            return {}
        top_n = max(w or 0 for w in want)
        row_idx: list[int] = []
        toks: list[int] = []
        start = 0
        for n, em in zip(counts, emitted):
            row_idx.extend(range(start, start + len(em)))
            toks.extend(em)
            start += n
        lp = compute_logprobs(logits[row_idx], torch.tensor(toks, device=logits.device), top_n)
        chosen, ids, vals = lp.token_logprobs.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()
        out: dict[str, list[dict]] = {}
        j = 0
        for r, w, em in zip(rows, want, emitted):
            entries = []
            for tok in em:
                if w is not None:
                    entries.append({"token_id": tok, "logprob": chosen[j],
                                    "top": list(zip(ids[j][:w], vals[j][:w]))})
                j += 1
            if w is not None:
                out[r.req_id] = entries
        return out

    def _propose(self, rows: list[ScheduledRequest], emitted: list[list[int]]) -> dict[str, list[int]]:
        if self.proposer is None or self.controller is None:
            return {}
        cands = [(r, em) for r, em in zip(rows, emitted) if self.requests[r.req_id].spec_enabled]
        max_k = self.controller.max_k
        sources = [self.proposer.source(r.req_id, self.requests[r.req_id].token_ids, max_k) for r, _ in cands]
        ks = self.controller.choose_ks([r.req_id for r, _ in cands], sources=sources)
        reqs, req_sources = [], []
        for (r, em), k, source in zip(cands, ks, sources):
            c = self.requests[r.req_id]
            cap = min(k, c.max_tokens - len(c.state.output_token_ids) - 1, self.max_model_len - len(c.token_ids))
            if cap >= 1:
                valid = r.num_computed_tokens + r.num_tokens - r.num_spec_tokens + len(em) - 1
                # NOTE: lookup drafts read no features; they stay buffered for the model's next proposal.
                feats = c.features.take() if source != FREE_SOURCE else None
                reqs.append(ProposeRequest(r.req_id, c.token_ids, valid, cap, r.block_ids, c.state, feats))
                req_sources.append(source)
        if not reqs:
            return {}
        t0, captures = time.perf_counter(), self._num_captures()
        self._draft_calls = []
        drafts = self.proposer.propose(reqs)
        stepped = [pr.k for pr, s in zip(reqs, req_sources) if s != FREE_SOURCE]  # drafts that cost model steps
        step_cost = self._draft_step_cost(time.perf_counter() - t0, max(stepped, default=1))
        if stepped and self._num_captures() == captures:  # a step that captured a graph is no cost sample
            self.controller.record_draft(len(stepped), step_cost)
        out = {}
        for pr, d, source in zip(reqs, drafts, req_sources):
            if d.token_ids:
                out[pr.req_id] = d.token_ids
                self.requests[pr.req_id].draft_probs = d.probs
                self.requests[pr.req_id].draft_source = source
        return out


def _available_memory(platform: Platform) -> float:
    if platform.is_gpu:
        free, _ = torch.cuda.mem_get_info(platform.device)
        return float(free)
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float(8 << 30)


__all__ = ["ModelRunner"]
