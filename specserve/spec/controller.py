"""Choose k (0 = no speculation) each step from measured acceptance and measured cost.

Cost model (SPECULATION.md): a step with B decoding requests and k drafts each costs
``T_target(B (k + 1) tokens) + k T_draft(B)``, versus ``T_target(B)`` without speculation; it emits
``sum_i E(alpha_i, k)`` tokens with ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` (Leviathan et al. 2023, eq. 1).
We pick the k that maximises tokens per second. ``T_target`` is measured online, a small table by token
count over the steps actually run; ``T_draft`` per draft step by batch size likewise. Speculation is therefore turned off by
measurement (large batches make the target compute-bound), never by a fixed batch threshold.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per verification pass with k drafts and per-token acceptance alpha."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def ideal_speedup(alpha: float, k: int, c: float) -> float:
    """Ideal speedup with draft/target cost ratio c: E(alpha, k) / (1 + k c)."""
    return expected_tokens(alpha, k) / (1 + k * c)


class StepCost:
    """Measured step time by token count: a small table (mean of the recent samples per exact count),
    interpolated between measured counts and extrapolated linearly past the largest ones.

    NOTE: a straight-line fit over all steps is dominated by prefill-sized counts and mispredicts the
    small decode/verify counts the controller compares; a table measures exactly those.
    """

    def __init__(self, per_count: int = 16) -> None:
        self.per_count = per_count
        self._samples: dict[int, deque[float]] = {}
        self._mean: dict[int, float] = {}
        self._keys: list[int] = []  # sorted measured counts

    def add(self, tokens: int, seconds: float) -> None:
        q = self._samples.get(tokens)
        if q is None:
            q = self._samples[tokens] = deque(maxlen=self.per_count)
            bisect.insort(self._keys, tokens)
        q.append(seconds)
        self._mean[tokens] = sum(q) / len(q)

    def __len__(self) -> int:
        return sum(len(q) for q in self._samples.values())

    def distinct(self) -> int:
        return len(self._keys)

    def predict(self, tokens: float) -> float | None:
        keys = self._keys
        if not keys:
            return None
        i = bisect.bisect_left(keys, tokens)
        if i < len(keys) and keys[i] == tokens:
            return self._mean[keys[i]]
        if i == 0:  # below every measurement: the smallest measured count (costs only grow with tokens)
            return self._mean[keys[0]]
        if i == len(keys):  # above: extend the slope of the two largest measurements (never negative)
            if len(keys) == 1:
                return self._mean[keys[0]]
            x0, x1 = keys[-2], keys[-1]
            y0, y1 = self._mean[x0], self._mean[x1]
            return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (tokens - x1)
        x0, x1 = keys[i - 1], keys[i]
        y0, y1 = self._mean[x0], self._mean[x1]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class SpecController:
    """Acceptance per request (running average) + measured costs -> k for this step."""

    def __init__(self, max_k: int, adaptive: bool = True, prior_alpha: float = 0.6,
                 explore_every: int = 16) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.prior_alpha = prior_alpha
        self.explore_every = explore_every
        self.target_cost = StepCost()
        self.draft_cost = StepCost()
        self._alpha: dict[str, float] = {}
        self._step = 0
        self._since_explore = 0
        self._explore_gap = explore_every
        # Acceptance of recent passes over all requests: the starting estimate for a new request.
        self.global_alpha = prior_alpha
        self.last_k = max_k

    # -- measurements ---------------------------------------------------------------------------------------
    def record_acceptance(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        """Running average of per-position acceptance; a pass that stops at the first rejection observes
        num_accepted successes and (num_draft > num_accepted) one failure."""
        if num_draft <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        rate = num_accepted / trials
        a = self._alpha.get(req_id, self.global_alpha)
        w = min(1.0, 0.3 * trials)
        self._alpha[req_id] = (1 - w) * a + w * rate
        self.global_alpha = 0.95 * self.global_alpha + 0.05 * rate

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.add(num_tokens, seconds)

    def record_draft(self, num_reqs: int, seconds_per_step: float) -> None:
        self.draft_cost.add(num_reqs, seconds_per_step)

    def drop(self, req_id: str) -> None:
        self._alpha.pop(req_id, None)

    def alpha(self, req_id: str) -> float:
        return self._alpha.get(req_id, self.global_alpha)

    # -- decision -------------------------------------------------------------------------------------------
    def choose_k(self, req_ids: list[str], other_tokens: int = 0) -> int:
        """k for the next step of these decoding requests; ``other_tokens`` are prefill tokens sharing it."""
        if not req_ids:
            return 0
        if not self.adaptive:
            return self.max_k
        b = len(req_ids)
        self._step += 1
        if self.target_cost.distinct() < 2:
            # One token count measured so far: the cost slope is unknown, so measure the other extreme.
            best_k = 0 if self.last_k else self.max_k
        else:
            best_k, best_rate = 0, -1.0
            for k in range(self.max_k + 1):
                rate = self._rate(req_ids, b, k, other_tokens)
                if rate is None:  # no draft-cost data yet: try it
                    best_k = k
                    break
                if rate > best_rate * 1.0001:
                    best_k, best_rate = k, rate
            self._since_explore += 1
            if self._since_explore >= self._explore_gap:  # keep the estimates honest around the optimum
                self._since_explore = 0
                # NOTE: exploring away from k = 0 costs real time when drafts keep failing, so the gap
                # doubles each time the model still says "off", and resets once speculation pays again.
                self._explore_gap = min(self._explore_gap * 2, 64 * self.explore_every) if best_k == 0 \
                    else self.explore_every
                best_k = min(self.max_k, best_k + 1) if best_k == 0 or self._step % 2 else best_k - 1
        self.last_k = best_k
        return best_k

    def _rate(self, req_ids: list[str], b: int, k: int, other: int) -> float | None:
        t_target = self.target_cost.predict(other + b * (k + 1))
        if t_target is None:
            return None
        t_draft = 0.0
        if k:
            d = self.draft_cost.predict(b)
            if d is None:
                return None
            t_draft = k * d
        tokens = sum(expected_tokens(self.alpha(r), k) for r in req_ids)
        total = t_target + t_draft
        return tokens / total if total > 0 and math.isfinite(total) else None
