"""Start-up calibration of the speculation controller's costs: a few timed target and draft steps on
placeholder tokens before the first request, so the first requests are planned from measured costs.

Without it the controller knows no cost until it has stepped, and learns the other end of its table by
drafting: a server's first busy steps then pay for a draft model's catch-up on every waiting prompt and a
verification at full k for the whole batch, which a short burst of requests never earns back. The samples
are ordinary cost samples (``SpecController.record_target`` / ``record_draft`` / ``record_catch_up``): the
steps that follow replace them count by count. See docs/speculative_decoding.md ("The controller").

The placeholder rows sit at ``context`` tokens of (never read back) KV in blocks no request owns yet: the
KV pool hands them out later and every request writes its KV before reading it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.spec_decode.controller import SpecController

# (tokens per request, start position per request, block ids per request) -> anything; one model call.
Step = Callable[[list[list[int]], list[int], list[tuple[int, ...]]], object]

CONTEXT = 256  # placeholder context of each row (attention reads it)
CATCH_UP = (32, 96, 256)  # prompt lengths the draft reads at once (the slope of its catch-up cost)
MAX_TOKENS = 64  # the largest target step measured; larger ones are extrapolated until measured


@dataclass
class Calibration:
    """The samples taken, as (count, seconds): target steps by tokens, draft steps by requests, catch-ups
    by tokens; ``seconds`` is the wall time it all took."""
    target: list[tuple[int, float]] = field(default_factory=list)
    draft: list[tuple[int, float]] = field(default_factory=list)
    catch_up: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    def apply(self, controller: SpecController) -> None:
        """Seed ``controller``'s cost tables with these samples (a fresh controller after a reset too)."""
        for n, s in self.target:
            controller.record_target(n, s)
        for b, s in self.draft:
            controller.record_draft(b, s)
        for n, s in self.catch_up:
            controller.record_catch_up(n, s)

    def describe(self) -> str:
        return (f"{len(self.target)} target step sizes, {len(self.draft)} draft batch sizes, "
                f"{len(self.catch_up)} catch-ups in {self.seconds:.1f} s")


def target_counts(max_k: int, max_seqs: int) -> list[int]:
    """Token counts to time, most useful first: a decode or verification of one request (1 .. k + 1), then
    whole batches of decodes and of verifications, up to ``MAX_TOKENS``."""
    counts = list(range(1, max_k + 2))
    b = 2
    while b <= max_seqs:
        counts += [b, b * (max_k + 1)]
        b *= 2
    out: list[int] = []
    for n in counts:
        if n <= MAX_TOKENS and n not in out:
            out.append(n)
    return out


def draft_batches(max_seqs: int) -> list[int]:
    """Requests per draft step to time: 1, 2, 4, ... up to ``max_seqs`` (at most 16)."""
    out, b = [], 1
    while b <= min(max_seqs, 16):
        out.append(b)
        b *= 2
    return out


def calibrate(target: Step, draft: Step | None, *, max_k: int, max_seqs: int, num_blocks: int, block_size: int,
              max_model_len: int, vocab_size: int, budget_s: float, captures: Callable[[], int] = lambda: 0
              ) -> Calibration:
    """Time ``target`` at the counts of ``target_counts`` and ``draft`` (None: no draft model steps) at the
    batches of ``draft_batches`` and its catch-up over the prompt lengths ``CATCH_UP``, until ``budget_s``
    seconds have gone. A call that captured a graph (``captures`` grew: GPU) is repeated before it is timed.
    The first call of each step warms it up (allocations, kernel builds) and is not a sample."""
    cal = Calibration()
    context = max(0, min(CONTEXT, max_model_len - max_k - 2))
    per_req = -(-(context + max_k + 1) // block_size)
    t_start = time.perf_counter()

    def rows(reqs: int, tokens: int, start: int) -> tuple[list[list[int]], list[int], list[tuple[int, ...]]]:
        toks = [[(7919 * (i * tokens + j) + 13) % vocab_size for j in range(tokens)] for i in range(reqs)]
        need = -(-(start + tokens) // block_size)
        blocks = [tuple((i * per_req + j) % num_blocks for j in range(need)) for i in range(reqs)]
        return toks, [start] * reqs, blocks

    def timed(step: Step, reqs: int, tokens: int, start: int) -> float:
        args = rows(reqs, tokens, start)
        for _ in range(3):
            before = captures()
            t0 = time.perf_counter()
            step(*args)
            seconds = time.perf_counter() - t0
            if captures() == before:
                break
        return seconds

    def left() -> bool:
        return time.perf_counter() - t_start < budget_s

    plan: list[tuple[str, int]] = [("target", n) for n in target_counts(max_k, max_seqs)]
    if draft is not None:
        # the draft's batches right after the single-request verifications: the first plans need both
        plan[max_k + 1:max_k + 1] = [("draft", b) for b in draft_batches(max_seqs)] + \
            [("catch_up", n) for n in CATCH_UP if n <= max_model_len]
    # Every step is timed twice, as the budget allows: one slow sample (another process, a page fault) would
    # otherwise price its count for good (``StepCost`` reads an unconfirmed count on its cheap side). The second
    # samples of a single request's decode and verifications come before the batches' first ones.
    again = [p for p in plan if p[0] != "catch_up"]
    plan[:0] = plan[:max_k + 1]
    plan += again[max_k + 1:]
    warmed: set[str] = set()
    for kind, n in plan:
        if not left():
            break
        step = target if kind == "target" else draft
        assert step is not None
        if kind != "catch_up" and kind not in warmed:
            timed(step, 1, 1, context)
            warmed.add(kind)
        if kind == "target":  # n tokens as requests of up to k + 1 tokens each (verifications, decodes)
            reqs = -(-n // (max_k + 1))
            tok = -(-n // reqs)
            cal.target.append((reqs * tok, timed(step, reqs, tok, context)))
        elif kind == "draft":
            cal.draft.append((n, timed(step, n, 1, context)))
        else:
            cal.catch_up.append((n, timed(step, 1, n, 0)))
    cal.seconds = time.perf_counter() - t_start
    return cal
