"""Scheduler + KV cache manager on CPU with a fake model runner (no model).

The fake runner keeps a fake KV store (slot -> (position, token)) and, before "sampling", checks that every
position the request attends to holds exactly that request's token: block tables, prefix sharing,
preemption and draft rollback are all validated by that one invariant.
"""

from __future__ import annotations

import random

import pytest

from specserve.config import SchedulerConfig
from specserve.engine.scheduler import Scheduler
from specserve.kv.kv_cache_manager import KVCacheManager
from specserve.outputs import ModelRunnerOutput, SchedulerOutput
from specserve.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams

V = 97


def true_next(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % V


class FakeRunner:
    def __init__(self, sched: Scheduler, draft_k: int = 0, seed: int = 0) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, int]] = {}
        self.draft_k = draft_k
        self.rng = random.Random(seed)
        self.max_tokens_seen = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.sched.kv.block_size
        sampled, spec = {}, {}
        cfg = self.sched.config
        assert so.total_tokens <= cfg.max_num_batched_tokens
        assert len(so.rows) <= cfg.max_num_seqs
        self.max_tokens_seen = max(self.max_tokens_seen, so.total_tokens)
        for row in so.rows:
            req = self.sched.requests[row.req_id]
            start = row.num_computed_tokens
            for i, tok in enumerate(row.token_ids):
                p = start + i
                self.kv[row.block_ids[p // bs] * bs + p % bs] = (p, tok)
            seq = req.all_token_ids[:start] + list(row.token_ids)
            for p in range(start + len(row.token_ids)):  # the attention "reads"
                assert self.kv[row.block_ids[p // bs] * bs + p % bs] == (p, seq[p]), (row.req_id, p)
            if not row.needs_sample:
                continue
            real = seq[:len(seq) - row.num_spec_tokens]
            drafts = seq[len(real):]
            out = []
            for d in drafts:  # greedy verification against the deterministic "model"
                t = true_next(real + out)
                out.append(t)
                if d != t:
                    break
            else:
                out.append(true_next(real + out))
            sampled[row.req_id] = out
            if self.draft_k:
                hist = real + out
                guess = []
                for _ in range(self.draft_k):
                    t = true_next(hist + guess)
                    guess.append(t if self.rng.random() < 0.7 else (t + 1) % V)
                spec[row.req_id] = guess
        return ModelRunnerOutput(sampled, spec)


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, lookahead=0, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(budget, max_seqs), kv, 4096, lookahead)


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int, group: str | None = None) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                  group_id=group)
    sched.add_request(req)
    return req


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    def append(req, emitted, _lp):
        for t in emitted:
            req.output_token_ids.append(t)
            req.all_token_ids.append(t)
            if req.num_output_tokens >= req.max_tokens:
                del req.output_token_ids[req.max_tokens:]
                return RequestStatus.FINISHED_LENGTH
        return None

    steps = 0
    while sched.has_unfinished():
        so = sched.schedule()
        sched.update(so, runner.execute(so), append)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def reference(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(true_next(prompt + out))
    return out


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(V) for _ in range(r.randint(lo, hi))] for _ in range(n)]


def assert_pool_full(sched: Scheduler) -> None:
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.kv.req_blocks


def test_budget_and_chunked_prefill():
    sched = make(budget=16)
    runner = FakeRunner(sched)
    req = add(sched, "a", list(range(50)), 5)
    steps = run(sched, runner)
    assert req.output_token_ids == reference(list(range(50)), 5)
    assert steps == 4 + 4  # 50 prompt tokens in chunks of 16 (4 steps, the last one samples), then 4 decodes
    assert runner.max_tokens_seen == 16
    assert_pool_full(sched)


@pytest.mark.parametrize("draft_k", [0, 3])
def test_many_requests_match_reference(draft_k):
    sched = make(budget=48, max_seqs=6, lookahead=draft_k)
    runner = FakeRunner(sched, draft_k)
    ps = prompts(20)
    reqs = [add(sched, f"r{i}", p, 12) for i, p in enumerate(ps)]
    run(sched, runner)
    for p, r in zip(ps, reqs):
        assert r.output_token_ids == reference(p, 12)
    if draft_k:
        assert sum(r.spec_stats.accepted_tokens for r in reqs) > 0
        assert sum(r.spec_stats.draft_tokens - r.spec_stats.accepted_tokens for r in reqs) > 0  # rollbacks
    assert_pool_full(sched)


@pytest.mark.parametrize("draft_k", [0, 2])
def test_preemption_and_resume_give_same_outputs(draft_k):
    sched = make(num_blocks=14, block_size=4, budget=64, max_seqs=8, lookahead=draft_k)
    runner = FakeRunner(sched, draft_k)
    ps = prompts(10, seed=1, lo=5, hi=20)
    reqs = [add(sched, f"r{i}", p, 16) for i, p in enumerate(ps)]
    run(sched, runner)
    assert sched.num_preemptions > 0
    for p, r in zip(ps, reqs):
        assert r.output_token_ids == reference(p, 16)
    assert_pool_full(sched)


def test_abort_frees_blocks_immediately():
    sched = make()
    runner = FakeRunner(sched)
    a = add(sched, "a", list(range(30)), 50)
    b = add(sched, "b", list(range(5)), 50)
    for _ in range(3):
        so = sched.schedule()
        sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e), None)[1])
    assert sched.kv.num_free_blocks < sched.kv.pool.num_blocks
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert_pool_full(sched)
    assert not sched.has_unfinished()
    assert sorted(sched.schedule().finished_req_ids) == ["a", "b"]


def test_abort_waiting_request_is_never_sent_to_worker():
    sched = make()
    a = add(sched, "a", [1, 2, 3], 4)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    assert so.empty and so.finished_req_ids == [] and so.new_requests == []


def test_prefix_hits_counted_and_shared():
    sched = make(num_blocks=64, block_size=4)
    runner = FakeRunner(sched)
    shared = list(range(40))
    first = add(sched, "a", shared + [1, 2], 3)
    run(sched, runner)
    before = sched.kv.prefix_stats.hits
    second = add(sched, "b", shared + [7, 8, 9], 3)
    so = sched.schedule()
    assert sched.kv.prefix_stats.hits - before == 40  # ten full blocks of the shared prefix
    assert so.rows[0].num_computed_tokens == 40 and len(so.rows[0].token_ids) == 3
    sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e),
                                                           r.output_token_ids.extend(e), None)[2])
    run(sched, runner)
    assert first.output_token_ids == reference(shared + [1, 2], 3)
    assert second.output_token_ids == reference(shared + [7, 8, 9], 3)
    assert_pool_full(sched)


def test_identical_prompt_recomputes_last_token():
    sched = make(block_size=4)
    runner = FakeRunner(sched)
    p = list(range(16))
    add(sched, "a", p, 2)
    run(sched, runner)
    add(sched, "b", p, 2)
    so = sched.schedule()
    assert so.rows[0].num_computed_tokens == 12  # never the whole prompt: the last position needs logits
    run(sched, runner)
    assert_pool_full(sched)


def test_n_siblings_wait_for_first_prefill_then_share():
    sched = make(block_size=4)
    runner = FakeRunner(sched)
    p = list(range(33))
    reqs = [add(sched, f"g#{i}", p, 4, group="g") for i in range(3)]
    so = sched.schedule()
    assert [r.req_id for r in so.rows] == ["g#0"]
    sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e),
                                                           r.output_token_ids.extend(e), None)[2])
    so = sched.schedule()
    rows = {r.req_id: r for r in so.rows}
    assert rows["g#1"].num_computed_tokens == 32 and rows["g#2"].num_computed_tokens == 32
    sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e),
                                                           r.output_token_ids.extend(e), None)[2])
    run(sched, runner)
    assert all(r.output_token_ids[:4] == reference(p, 4) for r in reqs)
    assert_pool_full(sched)


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(4, 4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1), 1)
    assert kv.allocate_slots(a, 10, 2)  # 12 slots -> 3 blocks
    b = Request("b", list(range(8)), SamplingParams(max_tokens=1), 1)
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.free(a)
    assert kv.num_free_blocks == 4


def test_cached_free_blocks_are_evicted_when_needed():
    sched = make(num_blocks=8, block_size=4)
    runner = FakeRunner(sched)
    add(sched, "a", list(range(20)), 1)
    run(sched, runner)
    assert sched.kv.pool.cached  # blocks of "a" stay cached while free
    add(sched, "b", list(range(50, 80)), 2)  # needs all 8 blocks: cached ones get evicted
    run(sched, runner)
    assert_pool_full(sched)


def test_a_closed_batch_drains_once_nothing_waits():
    """Offline batches (``closed_batches``, set by ``LLM``) report ``draining`` once no request waits, so the
    speculation controller plans for the batch's end; a server's scheduler never does."""
    for closed in (False, True):
        sched = make(max_seqs=2)
        sched.closed_batches = closed
        runner = FakeRunner(sched)
        for i in range(3):
            add(sched, f"r{i}", list(range(5 + i)), 4)
        seen = []
        while sched.has_unfinished():
            so = sched.schedule()
            seen.append((so.draining, bool(sched.waiting)))
            sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e), r.output_token_ids.extend(e),
                                                                   None if r.num_output_tokens < 4 else
                                                                   RequestStatus.FINISHED_LENGTH)[2])
        assert any(w for _, w in seen) and any(not w for _, w in seen)
        assert all(d == (closed and not w) for d, w in seen)



def test_prefill_ahead_names_a_prefill_the_next_step_will_carry():
    """``prefill_ahead``: a prompt chunked over steps continues, or a waiting request fits the batch and the
    free blocks; a queue held back by a full batch or a full cache is no prefill ahead."""
    sched = make(budget=16)
    runner = FakeRunner(sched)
    add(sched, "long", list(range(40)), 3)
    flags = []
    while sched.has_unfinished():
        so = sched.schedule()
        flags.append(so.prefill_ahead)
        sched.update(so, runner.execute(so), lambda r, e, lp: (r.all_token_ids.extend(e), r.output_token_ids.extend(e),
                                                               None if r.num_output_tokens < 3 else
                                                               RequestStatus.FINISHED_LENGTH)[2])
    assert flags == [True, True, False, False, False]  # chunks of 16, 16, then 8 that samples; 2 decodes

    sched = make(budget=64, max_seqs=1)  # the batch is full: the waiting request cannot be admitted next step
    add(sched, "a", list(range(5)), 4)
    add(sched, "b", list(range(6)), 4)
    assert not sched.schedule().prefill_ahead and sched.waiting
    sched = make(budget=64, max_seqs=2)  # b's prompt is cut by the budget: its next chunk is ahead
    add(sched, "a", list(range(60)), 4)
    add(sched, "b", list(range(30)), 4)
    so = sched.schedule()
    assert so.prefill_ahead and [r.needs_sample for r in so.rows] == [True, False]
    sched = make(num_blocks=20, budget=64, max_seqs=4)  # a slot, the budget spent, and blocks for c's prompt
    add(sched, "a", list(range(40)), 4)
    add(sched, "b", list(range(24)), 4)
    add(sched, "c", list(range(8)), 4)
    so = sched.schedule()
    assert [r.req_id for r in so.rows] == ["a", "b"] and so.prefill_ahead
    sched = make(num_blocks=20, budget=64, max_seqs=4)  # 4 blocks left, too few for c's prompt: none ahead
    add(sched, "a", list(range(40)), 4)
    add(sched, "b", list(range(24)), 4)
    add(sched, "c", list(range(30)), 4)
    so = sched.schedule()
    assert [r.req_id for r in so.rows] == ["a", "b"] and not so.prefill_ahead
