"""Engine: add_request / abort / step. A step is schedule -> execute -> update, nothing else."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.config import EngineConfig, SpecserveError
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import append_checked
from specserve.kv.kv_cache_manager import KVCacheManager
from specserve.model.checkpoint.loader import load_checkpoint
from specserve.outputs import CompletionOutput, ModelRunnerOutput, RequestOutput, SchedulerOutput
from specserve.platform import Platform, configure_threads, detect
from specserve.request import Request, RequestStatus, SpecStats
from specserve.sample.grammar import GrammarCompiler
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.state import Source
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer
from specserve.worker.model_runner import ModelRunner
from specserve.worker.tensor_parallel import WorkerGroup, start_tensor_parallel

log = logging.getLogger("specserve")


def _release(tp_group: WorkerGroup | None) -> None:
    """The engine's finalizer: holds the worker group only (never the engine, or it would never run)."""
    if tp_group is not None:
        tp_group.close()


@dataclass
class _Group:
    """A user request: n >= 1 sampled completions of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    completions: list[CompletionOutput]
    detoks: list[IncrementalDetokenizer]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    # SamplingParams.prompt_logprobs: an entry per prompt token (the first stays None), from the first child
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


@dataclass
class EngineStats:
    num_requests: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    # Speculation counters of finished requests; live ones are added on reading (``Engine.spec_stats``), so
    # each verification pass is recorded once, on its request (``Scheduler.update``).
    finished_spec: SpecStats = field(default_factory=SpecStats)
    finished_sources: dict[Source, SpecStats] = field(default_factory=dict)  # the same, per draft source


class Engine:
    def __init__(self, config: EngineConfig, platform: Platform | None = None) -> None:
        configure_threads(config.parallel.tensor_parallel_size)
        self.config = config
        self.platform = platform or detect(config.model.device)
        target = load_checkpoint(config.model.model, keep_quantized=config.model.quantization != "none")
        self.tokenizer = Tokenizer.from_checkpoint(config.model.model)
        # Tensor parallel: the other ranks start here, before this process builds its own slices.
        self.tp_group = start_tensor_parallel(config, self.platform, target) \
            if config.parallel.tensor_parallel_size > 1 else None
        # ``close()``, garbage collection of the engine and interpreter exit all release through this, once.
        self._finalizer = weakref.finalize(self, _release, self.tp_group)
        try:
            tp = self.tp_group
            self.runner = ModelRunner(config, self.platform, target, tp.comm if tp is not None else None,
                                      tp.msg_group if tp is not None else None, self.tokenizer.hf_tokenizer)
        except BaseException as e:
            if self.tp_group is None:
                raise
            better = self.tp_group.startup_error(e)  # a rank that died while loading, by name
            self.tp_group.close(stop=False)
            if better is None:
                raise
            raise better from e
        self.max_model_len = self.runner.max_model_len
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching)
        lookahead = config.speculative.lookahead_slots if self.runner.drafts_write_kv else 0
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, lookahead)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(target.arch.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer.hf_tokenizer, target.arch.vocab_size,
                                        sorted(self.eos_token_ids))
        self.model_name = target.name
        self.groups: dict[str, _Group] = {}
        self._child_group: dict[str, tuple[_Group, int]] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int] | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, speculative: bool = True,
                    grammar: Any = None) -> str:
        """Validate and queue. Raises ValueError (a 400 for the server) for bad input. ``grammar``: the
        compiled ``params.structured_outputs`` when the caller compiled it already (``compile_grammar``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.arch.vocab_size
        if any(type(t) is not int or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        max_tokens = params.check_context(len(prompt_token_ids), self.max_model_len)
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}, got {bad_bias[0]}")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params)
        if self.kv.blocks_needed(len(prompt_token_ids) + max_tokens) > self.kv.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens ({len(prompt_token_ids) + max_tokens} tokens) can never fit "
                             f"in the KV cache ({self.kv.pool.num_blocks * self.kv.block_size} tokens)")
        group = _Group(request_id, text, list(prompt_token_ids), [], [], [])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        for i in range(params.n):
            child_params = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, list(prompt_token_ids), child_params, max_tokens, self.eos_token_ids,
                          text, spec_enabled=speculative, group_id=request_id if params.n > 1 else None,
                          grammar=grammar, score_prompt=params.prompt_logprobs is not None and i == 0)
            group.children.append(req)
            group.completions.append(CompletionOutput(i, "", []))
            group.detoks.append(self.tokenizer.incremental(prompt_token_ids, params.skip_special_tokens))
            self._child_group[child_id] = (group, i)
            self.scheduler.add_request(req)
        self.groups[request_id] = group
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(prompt_token_ids)
        return request_id

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` (xgrammar caches repeated constraints; thread-safe, so the
        server compiles off the engine loop). Raises ValueError naming what is wrong."""
        assert params.structured_outputs is not None
        return self.grammars.compile(params.structured_outputs)

    def abort(self, request_id: str) -> None:
        """Drop a request now; its KV blocks are free when this returns."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for req, comp in zip(group.children, group.completions):
            self._retire_spec_stats(req)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            comp.finish_reason = comp.finish_reason or "abort"
            self._child_group.pop(req.request_id, None)

    def embed(self, prompt_token_ids: list[int], pooling: str = "LAST") -> list[float] | None:
        """The prompt's final hidden state pooled (``LAST`` / ``CLS`` token, or ``MEAN``; not normalised), for
        the server's ``/v1/embeddings``: one target forward over KV blocks taken from the free pool and given
        back before this returns; requests in flight keep theirs. Call it between steps (the engine loop's
        thread). None while too few blocks are free (retry later); ValueError when the prompt can never fit."""
        n = len(prompt_token_ids)
        need = self.kv.blocks_needed(n)
        if n == 0 or n > self.max_model_len or need > self.kv.pool.num_blocks:
            raise ValueError(f"input has {n} tokens; this model takes 1 to {self.max_model_len}"
                             + (f" (and the KV cache {self.kv.pool.num_blocks} blocks)" if n else ""))
        if need > self.kv.num_free_blocks:
            return None
        blocks = self.kv.pool.allocate(need)
        try:
            return self.runner.embed(prompt_token_ids, blocks, pooling, self.config.scheduler.max_num_batched_tokens)
        finally:
            self.kv.pool.free(blocks[::-1])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Release what outlives the object now: the other tensor-parallel ranks, their monitor thread and the
        process group (nothing without tensor parallel). Idempotent; the engine cannot step afterwards under
        tensor parallel. Without a call, garbage collection and interpreter exit do the same."""
        self._finalizer()

    def add_failure_listener(self, fn: Callable[[str], None]) -> None:
        """``fn(reason)``, from another thread, when a tensor-parallel rank is lost: the engine cannot step
        again (never called without tensor parallel)."""
        if self.tp_group is not None:
            self.tp_group.add_failure_listener(fn)

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        try:
            runner_out = self.runner.execute(sched_out)
        except Exception as e:
            if self.tp_group is None:
                raise
            reason = self.tp_group.failure or self.tp_group.lost()  # a collective failed: a lost rank?
            if reason is None:
                raise
            raise SpecserveError(reason) from e
        return self._update(sched_out, runner_out)

    def _update(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[RequestOutput]:
        self.stats.num_steps += 1
        for rid, (first, entries) in ro.prompt_logprobs.items():
            found = self._child_group.get(rid)
            if found is not None and found[0].prompt_logprobs is not None:
                found[0].prompt_logprobs[first:first + len(entries)] = entries
        touched: dict[str, _Group] = {}
        for req in self.scheduler.update(so, ro, self._append):
            group = self._child_group[req.request_id][0]
            group.first_token = group.first_token or time.monotonic()
            touched[group.request_id] = group
        return [self._output(g) for g in touched.values()]

    def _append(self, req: Request, emitted: list[int], logprobs: list[dict[str, Any]] | None
                ) -> RequestStatus | None:
        """Tokens -> text, with stop checks token by token (see engine/stop.py)."""
        group, idx = self._child_group[req.request_id]
        comp = group.completions[idx]
        before = len(comp.token_ids)
        status = append_checked(req, emitted, group.detoks[idx], comp, logprobs)
        self.stats.num_generated_tokens += len(comp.token_ids) - before
        return status

    def _output(self, group: _Group) -> RequestOutput:
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
            for req in group.children:
                self._child_group.pop(req.request_id, None)
                self._retire_spec_stats(req)
            self.stats.num_finished += 1
        spec_stats = SpecStats()
        by_source: dict[Source, SpecStats] = {}
        for req in group.children:
            spec_stats.merge(req.spec_stats)
            _merge_sources(by_source, req.spec_source_stats)
        now = time.monotonic()
        method = self.config.speculative.method or ""
        metrics: dict[str, Any] = {
            "speculative": spec_stats.as_dict(),
            # per draft source: "model", "lookup", "grammar", or the method's name for a one-source proposer
            "speculative_sources": {source.label(method): st.as_dict() for source, st in by_source.items()},
            "ttft_s": (group.first_token - group.arrival) if group.first_token else None,
            "elapsed_s": now - group.arrival,
            "num_preemptions": sum(r.num_preemptions for r in group.children),
        }
        outs = [replace(c, token_ids=list(c.token_ids), spec_accepted=list(c.spec_accepted),
                        logprobs=list(c.logprobs) if c.logprobs else c.logprobs) for c in group.completions]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished, metrics,
                             None if group.prompt_logprobs is None else list(group.prompt_logprobs))

    def _retire_spec_stats(self, req: Request) -> None:
        """A finished or aborted request's speculation counters join the engine's."""
        self.stats.finished_spec.merge(req.spec_stats)
        _merge_sources(self.stats.finished_sources, req.spec_source_stats)

    # -- introspection --------------------------------------------------------------------------------------
    def spec_source_stats(self) -> dict[Source, SpecStats]:
        """Speculation counters per draft source over every request so far (finished and live)."""
        total: dict[Source, SpecStats] = {}
        _merge_sources(total, self.stats.finished_sources)
        for group in self.groups.values():
            for req in group.children:
                _merge_sources(total, req.spec_source_stats)
        return total

    def spec_stats(self) -> SpecStats:
        """Speculation counters over every request so far (finished and live)."""
        total = SpecStats()
        total.merge(self.stats.finished_spec)
        for group in self.groups.values():
            for req in group.children:
                total.merge(req.spec_stats)
        return total

    def get_metrics(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "num_requests": self.stats.num_requests,
            "num_finished": self.stats.num_finished,
            "num_steps": self.stats.num_steps,
            "num_prompt_tokens": self.stats.num_prompt_tokens,
            "num_generated_tokens": self.stats.num_generated_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_usage": kv.usage(),
            "kv_num_blocks": kv.pool.num_blocks,
            "kv_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": kv.prefix_stats.queries,
            "prefix_cache_hits": kv.prefix_stats.hits,
            "speculative": self.spec_stats().as_dict(),
            "speculative_k": self.runner.drafter.controller.last_k if self.runner.drafter else 0,
            "speculative_method": self.config.speculative.method,
            # per draft source ("model", "lookup", "grammar"; "" for a one-source proposer)
            "speculative_sources": {"" if source is Source.METHOD else source.value: stats.as_dict()
                                    for source, stats in self.spec_source_stats().items()},
        }


def _merge_sources(into: dict[Source, SpecStats], other: dict[Source, SpecStats]) -> None:
    for source, stats in other.items():
        into.setdefault(source, SpecStats()).merge(stats)
