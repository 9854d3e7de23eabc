"""Token-budget continuous batching with chunked prefill, draft lookahead and preemption by recompute.

There are no phases: each step gives every running request ``num_tokens + len(drafts) - num_computed`` new
tokens (the rest of its prompt, its last sampled token, its drafts) as far as the token budget allows, then
admits waiting requests FCFS. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and ``num_computed_tokens`` goes back to 0 (recompute on resume).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from specserve.config import SchedulerConfig
from specserve.kv.kv_cache_manager import KVCacheManager
from specserve.outputs import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from specserve.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_lookahead_tokens: int = 0) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens  # slots the draft model writes ahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._unseen: set[str] = set()  # requests the worker has not been told about yet
        self.num_preemptions = 0
        # Offline (``LLM.generate``): every request was added before the first step, so once none waits the
        # running batch only drains (``SchedulerOutput.draining``). A server never sets it.
        self.closed_batches = False

    # -- queue ----------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self._unseen.add(req.request_id)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort: frees the request's blocks now."""
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._unseen:
            self._unseen.discard(req.request_id)
        else:
            self._finished_ids.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted = False
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while not self.kv.allocate_slots(req, n, self._lookahead(req, n)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                num_new[req.request_id] = n
                budget -= n
        if not preempted:
            budget = self._admit(budget, num_new)
        return self._build_output(num_new)

    def _admit(self, budget: int, num_new: dict[str, int]) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if self._sibling_prefilling(req):
                skipped.append(req)  # n > 1: wait for the first sibling's prompt to be cached
                continue
            blocks, hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 and not req.score_prompt \
                else ([], 0)
            n = req.num_tokens - hit
            if n > budget and not self.config.enable_chunked_prefill:
                self.waiting.appendleft(req)
                break
            n = min(n, budget)
            req.num_computed_tokens = hit
            if not self.kv.allocate_slots(req, n, self._lookahead(req, n), blocks):
                req.num_computed_tokens = 0
                self.waiting.appendleft(req)
                break
            req.resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new[req.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Draft slots to reserve past this step's tokens. Drafts never go past prompt + max_tokens (the worker
        caps k), so neither do the slots: a request that fits the pool alone is never refused for lookahead it
        cannot use."""
        if not req.spec_enabled:
            return 0
        room = req.num_prompt_tokens + req.max_tokens - req.num_computed_tokens - num_new
        return max(0, min(self.num_lookahead_tokens, room))

    def _sibling_prefilling(self, req: Request) -> bool:
        if req.group_id is None or not self.kv.enable_prefix_caching:
            return False
        full = req.num_prompt_tokens // self.kv.block_size * self.kv.block_size
        return any(r.group_id == req.group_id and r.num_computed_tokens < full for r in self.running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_parents = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _build_output(self, num_new: dict[str, int]) -> SchedulerOutput:
        rows, new_reqs = [], []
        for req in self.running:
            n = num_new.get(req.request_id)
            if not n:
                continue
            start = req.num_computed_tokens
            known = req.all_token_ids[start:start + n]
            drafts = req.spec_token_ids[:n - len(known)]  # a tree's first nodes are a tree too
            parents = tuple(req.spec_parents[:len(drafts)]) if req.spec_parents is not None and drafts else None
            if req.request_id in self._unseen:
                self._unseen.discard(req.request_id)
                new_reqs.append(NewRequestData(req.request_id, list(req.prompt_token_ids),
                                               req.sampling_params, req.max_tokens, req.spec_enabled,
                                               req.min_tokens_stop_ids, req.grammar, req.stop_ids))
            rows.append(ScheduledRequest(
                req_id=req.request_id,
                token_ids=tuple(known) + tuple(drafts),
                num_computed_tokens=start,
                num_spec_tokens=len(drafts),
                block_ids=tuple(self.kv.block_ids(req)),
                needs_sample=start + len(known) == req.num_tokens,
                resumed=req.resumed,
                spec_parents=parents,
                score_prompt=req.score_prompt,
            ))
            req.resumed = False
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(rows, new_reqs, finished, sum(r.num_tokens for r in rows),
                               self.closed_batches and not self.waiting,
                               prefill_ahead=any(not r.needs_sample for r in rows) or self._admissible())

    def _admissible(self) -> bool:
        """The first waiting request would be admitted next step if nothing changed: a free batch slot and KV
        blocks for its prompt (a queue held back by a full cache or batch is no prefill ahead)."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        head = self.waiting[0]
        return self.kv.blocks_needed(head.num_tokens) <= self.kv.num_free_blocks

    # -- after the step -------------------------------------------------------------------------------------
    def update(self, so: SchedulerOutput, ro: ModelRunnerOutput,
               append: Callable[[Request, list[int], list[dict[str, Any]] | None], RequestStatus | None]
               ) -> list[Request]:
        """Advance counters, roll back rejected drafts, record acceptance on the request, hand emitted tokens
        to ``append`` (which applies stop conditions and returns a finishing status), take the next drafts.
        Returns the requests that emitted tokens."""
        progressed = []
        for row in so.rows:
            req = self.requests.get(row.req_id)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += row.num_tokens
            if req.score_prompt and req.num_computed_tokens >= req.num_prompt_tokens:
                req.score_prompt = False  # every prompt token is scored: a recompute may hit the prefix cache
            req.spec_token_ids = []
            req.spec_parents = None
            emitted = ro.sampled.get(row.req_id)
            if emitted is None:  # a prefill chunk that does not reach the end of the prompt
                continue
            # NOTE: rejected drafts' KV is stale; moving the counter back is the whole rollback (a tree's
            # accepted path was moved into the first slots by the worker).
            num_accepted = len(emitted) - 1
            req.num_computed_tokens -= row.num_spec_tokens - num_accepted
            req.record_verification(row.num_spec_tokens, num_accepted, ro.spec_sources.get(row.req_id))
            self.kv.cache_full_blocks(req)
            status = append(req, emitted, ro.logprobs.get(row.req_id))
            progressed.append(req)
            if status is not None:
                self.finish(req, status)
            else:
                req.spec_token_ids = ro.spec_token_ids.get(row.req_id, [])
                req.spec_parents = ro.spec_parents.get(row.req_id)
        return progressed
