"""The worker: owns the target model and the KV tensors (speculation: its drafter); runs one step.

execute(step) = prepare flat inputs -> target forward -> logits at the positions that need them ->
verify/sample (``sample/verification.verify_step``; k = 0 is ordinary decoding) -> propose drafts for the
next step (the drafter).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.model.attention import make_backend
from specserve.model.checkpoint.loader import Checkpoint
from specserve.model.decoder import DecoderModel
from specserve.model.eagle_head import EagleHead
from specserve.model.ops import make_ops
from specserve.model.quant import (
    describe_weights,
    make_packer,
    packed_linear,
    quantizes,
    set_activation_bits,
    weight_bytes,
)
from specserve.model.sharding import Comm, TensorParallel
from specserve.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from specserve.platform import (
    Platform,
    bf16_rows_invariant,
    cpu_class,
    resolve_dtype,
    resolve_kv_dtype,
    to_device,
)
from specserve.sample.grammar import GrammarState
from specserve.sample.sampler import Logprobs, RequestSamplingState, compute_logprobs
from specserve.sample.verification import Verification, verify_step
from specserve.spec_decode.proposer import ProposeRequest, Source
from specserve.worker.calibrate import calibrate
from specserve.worker.drafter import Drafter, mirrors_draft_calls
from specserve.worker.features import FeatureSink, sink_features
from specserve.worker.graphs import (
    CaptureBackend,
    GraphPlan,
    ModelStep,
    StepOutput,
    batch_buckets,
    select_capture,
)
from specserve.worker.input_batch import RowTree
from specserve.worker.mirror import Mirror

log = logging.getLogger("specserve")

_DEFAULT_CPU_KV_BYTES = 2 << 30
SCORE_ROWS = 256  # prompt positions whose logits (and log_softmax) exist at once while scoring a prompt


def prompt_entries(scores: Logprobs, ids: list[int], scored: list[tuple[str, int, int, int]]
                   ) -> dict[str, tuple[int, list[dict[str, Any]]]]:
    """``ModelRunnerOutput.prompt_logprobs`` from the scores of the tokens ``ids``, in ``_prompt_scores``'
    order."""
    chosen, ranks = scores.token_logprobs.tolist(), scores.token_ranks.tolist()
    top_ids, top_vals = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    out: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    j = 0
    for req_id, first, n, want in scored:
        out[req_id] = (first, [{"token_id": ids[i], "logprob": chosen[i], "rank": ranks[i],
                                "top": list(zip(top_ids[i][:want], top_vals[i][:want]))} for i in range(j, j + n)])
        j += n
    return out


@dataclass(slots=True)
class CachedRequest:
    """The worker's row for a request: sampling state, full token history, drafts in flight."""

    state: RequestSamplingState
    token_ids: list[int]  # prompt + output (what proposers read)
    max_tokens: int
    spec_enabled: bool
    draft_probs: torch.Tensor | None = None  # [k, V] q of the drafts proposed last step (None: one-hot)
    num_prompt: int = 0
    stop_ids: frozenset[int] = frozenset()  # sampling one ends the request (``NewRequestData.stop_ids``)


def build_model(ckpt: Checkpoint, platform: Platform, dtype: torch.dtype, max_positions: int,
                quantization: str = "none", tp: TensorParallel | None = None, quantize_head: bool = False,
                activation_bits: int = 16) -> DecoderModel:
    """The model with its weights; with ``quantization`` (model/quant.py) its matmuls on packed weights
    (``quantize_head``: the LM head at that width too; ``activation_bits``: the CPU kernels' activation grid);
    with ``tp`` one rank's slice of it."""
    packer = make_packer(quantization, platform.quant_kernels, ckpt.state_dict, platform.device, dtype,
                         platform.linear(dtype), quantize_head)
    model = DecoderModel(ckpt.arch, dtype, platform.device, make_backend(platform.attention_backend),
                       max_positions, platform.linear(dtype) if packer is None else packed_linear,
                       make_ops(platform.device, dtype, platform.attention_backend), platform.moe_kernel,
                       platform.linear(dtype), tp)
    model.load_weights(ckpt.state_dict, packer)
    set_activation_bits(model, activation_bits)
    log.info("weights: %s%s", describe_weights(model), f" ({weight_bytes(model) / ckpt.file_tensor_bytes:.2f}x "
             f"the file's {ckpt.file_tensor_bytes / 2**20:.0f} MiB)" if ckpt.file_tensor_bytes else "")
    return model.eval()


class ModelRunner:
    """One rank's runner. With ``comm`` (tensor parallel, ``worker/tensor_parallel.py``) it holds its rank's
    slices; rank 0 mirrors its model calls to the other ranks (``worker/mirror.py``), which run them in
    ``self.mirror.follow()``."""

    def __init__(self, config: EngineConfig, platform: Platform, target: Checkpoint, comm: Comm | None = None,
                 msg_group: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.comm = comm
        self.mirror = Mirror(comm, msg_group, platform.device)
        self.tp = TensorParallel.create(target.arch, comm) if comm is not None else None
        self.platform = platform
        self.device = platform.device
        self.dtype = resolve_dtype(platform, config.model.dtype, quantizes(config.model.quantization, target.state_dict))
        self.kv_dtype = resolve_kv_dtype(platform, config.cache.kv_cache_dtype, self.dtype)
        log.info("compute dtype: %s (%s on %s), KV cache %s", str(self.dtype).removeprefix("torch."),
                 "--dtype auto" if config.model.dtype == "auto" else "--dtype", platform.kind,
                 str(self.kv_dtype).removeprefix("torch."))
        if platform.kind == "cpu" and self.dtype == torch.bfloat16 and not bf16_rows_invariant():
            log.warning("bf16 matmul rows are not bit-identical at every row count on this CPU (%s): greedy "
                        "speculation follows the near-tie rule here, not bit-exactness", cpu_class())
        self.arch = target.arch
        self.max_model_len = config.model.max_model_len or target.arch.max_position_embeddings
        self.block_size = config.cache.block_size
        self.model = self._build(target, self.tp)
        self.weights_note = describe_weights(self.model)  # e.g. "210 int4 matmuls 61 MiB, 1 int8 matmuls 27 MiB"
        # Speculation (draft weights, proposer, controller): None when --speculative-* is off, and on a
        # follower rank that mirrors no draft call (ngram; a draft model on rank 0 alone).
        self.drafter = Drafter(config, platform, self.dtype, self.model, self.max_model_len + 64, self._build,
                               self.mirror, tokenizer) if config.speculative.enabled and self._drafts_here() else None
        # Receives the target's pre-norm features of every row (a drafter that reads them; `specserve distill`
        # sets its own through observe_features).
        self.feature_sink: FeatureSink | None = \
            self._keep_features if self.drafter is not None and self.drafter.reads_features else None
        self.num_blocks = self._num_blocks()
        # NOTE: graphs are not captured under tensor parallel (collectives inside a captured graph are not
        # set up); the ranks run eager.
        capture, graphs_note = select_capture(platform, config.model.enforce_eager or comm is not None)
        self.graph_plan = self._graph_plan(capture) if capture is not None else None
        self.kv_caches = self._alloc_kv(self.model)
        self.target_step = ModelStep(self.model, self.kv_caches, self.block_size, self.device,
                                     plan=self.graph_plan)
        log.info("graphs: %s%s", graphs_note, f"; {self.graph_plan.describe()}" if self.graph_plan else "")
        if self.drafter is not None:
            self.drafter.start(self._alloc_kv, self.kv_caches, self.block_size, self.graph_plan)
        self.requests: dict[str, CachedRequest] = {}
        # Requests queued by a server and not yet handed to the scheduler (``AsyncEngine``): like
        # ``SchedulerOutput.prefill_ahead``, a prefill the next step will most likely carry.
        self.arrivals_pending: Callable[[], bool] | None = None
        self._target_call = self.mirror.wrap("target", self._forward)
        self._move_kv_call = self.mirror.wrap("move_kv", self._move_kv)
        self.embed = self.mirror.wrap("embed", self._embed)
        if self.drafter is not None and comm is None and config.speculative.adaptive \
                and config.speculative.calibration_seconds > 0:
            self._calibrate(self.drafter)

    def _calibrate(self, drafter: Drafter) -> None:
        """Seed the controller's cost tables with timed steps on placeholder tokens (worker/calibrate.py)."""
        spec = self.config.speculative

        def target(toks: list[list[int]], starts: list[int], blocks: list[tuple[int, ...]]) -> None:
            n = sum(map(len, toks))
            with torch.inference_mode():
                self._forward([tuple(t) for t in toks], starts, blocks, self.feature_sink is not None,
                              list(range(n)))

        def draft(toks: list[list[int]], starts: list[int], blocks: list[tuple[int, ...]]) -> None:
            assert drafter.calibration_step is not None
            with torch.inference_mode():
                drafter.calibration_step(toks, starts, blocks)

        cal = calibrate(target, draft if drafter.calibration_step is not None else None,
                        max_k=drafter.controller.max_k, max_seqs=self.config.scheduler.max_num_seqs,
                        num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len,
                        vocab_size=self.arch.vocab_size, budget_s=spec.calibration_seconds,
                        captures=drafter.num_captures)
        drafter.calibration = cal
        cal.apply(drafter.controller)
        log.info("speculation: calibrated the controller's costs (%s)", cal.describe())

    # -- start-up -------------------------------------------------------------------------------------------
    def _build(self, ckpt: Checkpoint, tp: TensorParallel | None = None, quantization: str | None = None,
               quantize_head: bool = False) -> DecoderModel:
        """A model built as the target is; ``quantization`` overrides the target's mode (a draft model's)."""
        return build_model(ckpt, self.platform, self.dtype, self.max_model_len + 64,
                           quantization or self.config.model.quantization, tp, quantize_head,
                           self.config.model.activation_bits)

    def _drafts_here(self) -> bool:
        """Whether this rank needs a drafter: always on rank 0; on a follower only for mirrored draft calls."""
        return self.mirror.leader or mirrors_draft_calls(self.config)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on this rank, target and draft (a tensor-parallel rank holds its KV heads)."""
        per = 0
        for m in (self.model, self.drafter.model if self.drafter is not None else None):
            if m is not None:
                shape = m.kv_cache_shape(1, 1)
                per += m.arch.num_layers * math.prod(shape) * self.kv_dtype.itemsize
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
        if self.comm is not None:  # every rank the same count: the smallest any rank can hold
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            n = int(t.item())
        if n * self.block_size < self.block_size * 2:
            raise SpecserveError(f"KV cache too small: {n} blocks of {self.block_size} tokens")
        draft_note = ""
        if self.drafter is not None and self.drafter.model is not None:
            w = weight_bytes(self.drafter.model)  # packed weights are buffers, not parameters
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

    def _alloc_kv(self, model: DecoderModel | EagleHead) -> list[torch.Tensor]:
        num_blocks = self.num_blocks + (1 if self.graph_plan is not None else 0)
        shape = model.kv_cache_shape(num_blocks, self.block_size)
        # zeros, not empty: padded reads of unused slots must never see NaN/Inf garbage.
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(model.arch.num_layers)]

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
        return self.drafter is not None and self.drafter.writes_kv

    # -- one step -------------------------------------------------------------------------------------------
    def _forward(self, token_ids: list[tuple[int, ...]], starts: list[int], block_ids: list[tuple[int, ...]],
                 prenorm: bool, logits_at: list[int], trees: list[RowTree | None] | None = None,
                 score: tuple[list[int], list[int], int] | None = None
                 ) -> tuple[StepOutput, torch.Tensor | None, Logprobs | None]:
        """The target forward and the logits at ``logits_at`` (flat token indices): one mirrored call. With
        ``score`` = (flat token indices, the token each one's logits score, top n): those tokens' logprobs
        (``prompt_logprobs``), a slice of rows at a time, so a long prompt never holds [T, vocab] logits."""
        out = self.target_step(token_ids, starts, block_ids, prenorm=prenorm, trees=trees)
        scores = None
        if score is not None:
            at, ids, top = score
            parts = [compute_logprobs(self.model.compute_logits(out.hidden[to_device(at[i:i + SCORE_ROWS],
                                                                                       self.device, torch.int64)]),
                                      to_device(ids[i:i + SCORE_ROWS], self.device, torch.int64), top)
                     for i in range(0, len(at), SCORE_ROWS)]
            scores = Logprobs(*(torch.cat(t) for t in zip(*parts)))
        if not logits_at:
            return out, None, scores
        return out, self.model.compute_logits(out.hidden[to_device(logits_at, self.device, torch.int64)]), scores

    @torch.inference_mode()
    def _embed(self, token_ids: list[int], block_ids: list[int], pooling: str, chunk: int) -> list[float]:
        """One prompt's final (normed) hidden states pooled: the ``LAST`` token's, the ``CLS`` (first) token's or
        their ``MEAN``; the target forward over ``block_ids`` (the caller's, given back after), ``chunk`` tokens
        at a time. Nothing else is touched: no request state, no drafter, no features."""
        total: torch.Tensor | None = None
        first = last = None
        for start in range(0, len(token_ids), chunk):
            piece = tuple(token_ids[start:start + chunk])
            hidden = self.target_step([piece], [start], [tuple(block_ids)], prenorm=False).hidden.float()  # [t, H]
            first = hidden[0] if first is None else first
            last = hidden[-1]
            total = hidden.sum(0) if total is None else total + hidden.sum(0)
        assert total is not None and first is not None and last is not None
        pooled = {"LAST": last, "CLS": first}.get(pooling, total / len(token_ids))  # [H]
        return pooled.tolist()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._sync_requests(so)
        rows = so.rows
        if not rows:
            return ModelRunnerOutput({}, {})
        drafter = self.drafter
        t0, captures = time.perf_counter(), drafter.num_captures() if drafter is not None else 0
        sink = self.feature_sink
        sample_rows = [r for r in rows if r.needs_sample]
        trees = [_row_tree(r) for r in rows]
        score, scored = self._prompt_scores(rows)
        out, logits, scores = self._target_call(
            [r.token_ids for r in rows], [r.num_computed_tokens for r in rows], [r.block_ids for r in rows],
            sink is not None, self._logits_indices(rows), trees if any(t is not None for t in trees) else None, score)
        prompt_logprobs = prompt_entries(scores, score[1], scored) if scores is not None and score else {}
        prenorm = out.prenorm  # [T, hidden]: the last layer's output, pre-norm (when a sink wants it)
        if logits is None:  # no row samples this step (prefill chunks only)
            if sink is not None and prenorm is not None:
                sink_features(rows, {}, prenorm, sink)
            return ModelRunnerOutput({}, {}, prompt_logprobs=prompt_logprobs)
        cached = [self.requests[r.req_id] for r in sample_rows]
        qs = [c.draft_probs[:r.num_spec_tokens] if c.draft_probs is not None and r.num_spec_tokens else None
              for c, r in zip(cached, sample_rows)]
        verified = verify_step(logits, rows, [c.state for c in cached], qs, self.block_size)
        emitted, paths = verified.emitted, verified.paths
        self._settle(verified, prenorm)
        counts = [r.num_spec_tokens + 1 for r in sample_rows]
        logprobs = self._logprobs(logits, sample_rows, cached, counts, emitted, paths)
        if drafter is not None and drafter.num_captures() == captures:  # a capture step is no cost sample
            drafter.record_target(so.total_tokens, time.perf_counter() - t0)
        sources: dict[str, Source] = {}
        for r, c, em in zip(sample_rows, cached, emitted):
            if c.state.grammar is not None:
                c.state.grammar.accept(em)
            c.state.output_token_ids.extend(em)
            c.token_ids.extend(em)
            c.draft_probs = None
            if drafter is not None:
                source = drafter.record_acceptance(r.req_id, r.num_spec_tokens, len(em) - 1, r.spec_parents)
                if r.num_spec_tokens and source is not None:
                    sources[r.req_id] = source
        sampled = {r.req_id: em for r, em in zip(sample_rows, emitted)}
        if sink is not None and prenorm is not None:
            sink_features(rows, sampled, prenorm, sink)
        spec_token_ids, spec_parents = self._propose(sample_rows, emitted, so) if drafter is not None \
            else ({}, {})
        if drafter is not None and drafter.num_captures() == captures:
            drafter.record_step(sum(len(em) for em in emitted), time.perf_counter() - t0)
        return ModelRunnerOutput(sampled, spec_token_ids, logprobs, spec_parents, sources, prompt_logprobs)

    def _prompt_scores(self, rows: list[ScheduledRequest]
                       ) -> tuple[tuple[list[int], list[int], int] | None, list[tuple[str, int, int, int]]]:
        """For rows with ``score_prompt``: (flat indices of their prompt positions that precede another prompt
        token, those next tokens, the largest top n asked), and per row (req_id, the prompt index of its first
        scored token, how many, its top n)."""
        at: list[int] = []
        ids: list[int] = []
        scored: list[tuple[str, int, int, int]] = []
        top, off = 0, 0
        for r in rows:
            if r.score_prompt:
                c = self.requests[r.req_id]
                start = r.num_computed_tokens
                end = min(start + r.num_tokens - r.num_spec_tokens, c.num_prompt - 1)  # positions start..end-1
                if end > start:
                    want = c.state.params.prompt_logprobs or 0
                    at.extend(range(off, off + end - start))
                    ids.extend(c.token_ids[start + 1:end + 1])
                    scored.append((r.req_id, start + 1, end - start, want))
                    top = max(top, want)
            off += r.num_tokens
        return ((at, ids, top) if at else None), scored

    def _settle(self, verified: Verification, prenorm: torch.Tensor | None) -> None:
        """Apply a verification's tree settling: the target's KV (one mirrored call) and the step's features."""
        if prenorm is not None and verified.feature_moves:
            src, dst = zip(*verified.feature_moves)
            with torch.inference_mode():  # the step's features are inference tensors
                prenorm[list(dst)] = prenorm[list(src)]
        if verified.kv_src:
            self._move_kv_call(verified.kv_src, verified.kv_dst)

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        """KV slots ``src`` -> ``dst`` in every target layer (each dst is before or at its src, and no dst is a
        later src: a tree's path moves forward in slot order)."""
        s, d = to_device(src, self.device, torch.long), to_device(dst, self.device, torch.long)
        with torch.inference_mode():
            for kv in self.kv_caches:
                flat = kv.view(2, -1, *kv.shape[3:])
                flat[:, d] = flat[:, s]

    def _keep_features(self, req_id: str, pos: int, h: torch.Tensor, owned: bool) -> None:
        c = self.requests.get(req_id)
        if c is not None and c.spec_enabled and self.drafter is not None:
            self.drafter.keep_features(req_id, pos, h, owned)

    def _sync_requests(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            c = self.requests.pop(rid, None)
            if self.drafter is not None:
                self.drafter.drop(rid, c.token_ids if c is not None and c.spec_enabled else None,
                                  c.state.params.user if c is not None else None)
        for nr in so.new_requests:
            state = RequestSamplingState.create(nr.sampling_params, nr.prompt_token_ids, self.device,
                                                nr.min_tokens_stop_ids,
                                                GrammarState(nr.grammar) if nr.grammar is not None else None)
            self.requests[nr.req_id] = CachedRequest(state, list(nr.prompt_token_ids), nr.max_tokens,
                                                     nr.spec_enabled, num_prompt=len(nr.prompt_token_ids),
                                                     stop_ids=frozenset(nr.stop_ids))
        for r in so.rows:
            if r.resumed and self.drafter is not None:
                self.drafter.forget_kv(r.req_id)

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
                  counts: list[int], emitted: list[list[int]], paths: dict[int, list[int]]
                  ) -> dict[str, list[dict]]:
        want = [c.state.params.logprobs for c in cached]
        if all(w is None for w in want):
            return {}
        top_n = max(w or 0 for w in want)
        row_idx: list[int] = []
        toks: list[int] = []
        start = 0
        for i, (n, em) in enumerate(zip(counts, emitted)):
            path = paths.get(i)  # a tree: the root's row, then the accepted nodes' rows
            row_idx.extend(range(start, start + len(em)) if path is None else [start] + [start + 1 + p for p in path])
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

    def _propose(self, rows: list[ScheduledRequest], emitted: list[list[int]], so: SchedulerOutput
                 ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The drafter's drafts for the speculating rows, each capped by the room left (max_tokens, context;
        a row without room still counts in the controller's batch), and the parents of those that are trees.
        When the next step carries a prefill (``so.prefill_ahead``, or a server's request not yet scheduled),
        the drafter holds its draft-model steps: they would delay that request's first token (TTFT)."""
        assert self.drafter is not None
        cands = []
        others = 0  # the next step's rows of requests that go on without drafts (a first token just sampled)
        defer = self.drafter.defers_first_draft
        for r, em in zip(rows, emitted):
            c = self.requests[r.req_id]
            room = min(c.max_tokens - len(c.state.output_token_ids) - 1, self.max_model_len - len(c.token_ids))
            # NOTE: a draft model's catch-up on the prompt waits for the next step: it is not in the TTFT. A row
            # that sampled a stop token ends here (the engine stops at it): drafts for it would be thrown away.
            if not c.stop_ids.isdisjoint(em):
                continue
            if c.spec_enabled and not (defer and len(c.state.output_token_ids) == len(em)):
                valid = r.num_computed_tokens + r.num_tokens - r.num_spec_tokens + len(em) - 1
                slots = min(room, len(r.block_ids) * self.block_size - len(c.token_ids))
                cands.append(ProposeRequest(r.req_id, c.token_ids, valid, 0, r.block_ids, c.state, slots=slots,
                                            room=room, spec=self.drafter.state(r.req_id)))
            else:
                others += 1
        hold = not so.draining and (so.prefill_ahead or (self.arrivals_pending is not None and self.arrivals_pending()))
        drafts = self.drafter.propose(cands, so.draining, hold, others) if cands else {}
        for req_id, d in drafts.items():
            self.requests[req_id].draft_probs = d.probs
        return ({req_id: d.token_ids for req_id, d in drafts.items()},
                {req_id: d.parents for req_id, d in drafts.items() if d.parents is not None})


def _row_tree(r: ScheduledRequest) -> RowTree | None:
    """A tree row's attention layout (``model/attention_metadata.TREE_DOC``): node i sits at chain position
    base + i and sees its ancestors' (mask bits) on top of the context."""
    if r.spec_parents is None:
        return None
    known = r.num_tokens - r.num_spec_tokens
    masks: list[int] = []
    for i, p in enumerate(r.spec_parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return r.num_computed_tokens + known, [0] * known + masks


def _available_memory(platform: Platform) -> float:
    if platform.is_gpu:
        free, _ = torch.cuda.mem_get_info(platform.device)
        return float(free)
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float(8 << 30)


__all__ = ["ModelRunner"]
