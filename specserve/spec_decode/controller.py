"""Choose each request's k (0 = no speculation) every step from measured acceptance and measured cost.

Cost model (docs/speculative_decoding.md): a step with B decoding requests drafting k_i tokens each costs
``T_target(B + sum k_i tokens) + max k_i * T_draft(#drafting)``, versus ``T_target(B)`` without speculation.
With i.i.d. per-token acceptance a, a pass emits ``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens (Leviathan et
al. 2023, eq. 1). Acceptance is not i.i.d. in practice (an n-gram match that survives its first token tends to
survive the next four), so we track it *per draft position*: ``c_j`` = P(draft j accepted | drafts < j
accepted), and draft j adds ``m_j = c_1 ... c_j`` expected tokens. ``m_j`` falls with j, so the best
allocation is a prefix of all (request, position) pairs sorted by ``m``: we try every prefix length and keep
the one with the most tokens per second. ``T_target`` is measured online, a small table by token count over the
steps actually run; ``T_draft`` per draft step by batch size likewise. Speculation is therefore turned off by
measurement (large batches make the target compute-bound), never by a fixed batch threshold.

That maximises tokens per second, right for a server whose freed slots are refilled. A draining offline batch
(``SchedulerOutput.draining``: nothing waits and nothing will arrive) is instead done when its last request
is, so ``choose_ks`` with ``remaining`` plans for the batch's end (``_drain_plan``): drafts for the requests
with the most work left, worth what they shorten the batch in expectation, plus, for every other accepted
token, the share of a step its row costs (that request leaves a step earlier).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence

from specserve.spec_decode.proposer import ChainStop
from specserve.spec_decode.state import FREE_SOURCES, Acceptance, ConfidenceBins, Source, SpecStates


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
    """Measured step time by token count: a small table of the recent samples per exact count, interpolated
    between measured counts and extrapolated linearly past the largest ones.

    A count's time is the median of its recent samples; until it has ``CONFIRMED`` of them, read no higher
    than the table's greatest convex minorant (the highest convex, non-decreasing curve that no count's time
    lies below: a step's time is flat while the weights' bytes bound it, then rises by each row's compute).
    No count is read above a larger one. Until its samples confirm it, then, a count is read on the
    cheap side, on purpose: the controller only measures the counts it plans, so a count priced too high by
    one slow sample (a noisy neighbour, a page fault during start-up calibration) would never be planned,
    hence never measured again, while one priced too low is planned and its next samples correct it. A real
    step in the costs (a second pass of the CPU kernels' row tiles over the weights) is confirmed and kept.

    NOTE: a straight-line fit over all steps is dominated by prefill-sized counts and mispredicts the
    small decode/verify counts the controller compares; a table measures exactly those.
    """

    CONFIRMED = 3  # samples after which a count's time is its median, whatever its neighbours'
    # Counts kept: reading the table is O(counts), and a server sees a new total at almost every prefill; the
    # count sampled longest ago makes room.
    MAX_COUNTS = 256

    def __init__(self, per_count: int = 16) -> None:
        self.per_count = per_count
        self._samples: dict[int, deque[float]] = {}  # per count, the count sampled longest ago first
        self._stat: dict[int, float] = {}  # per count: the median of its samples
        self._time: dict[int, float] | None = None  # per count: the time predicted (None: read it again)
        self._keys: list[int] = []  # sorted measured counts
        # Predictions since the last sample: a step's decision asks for the same few counts thousands of times.
        self._memo: dict[float, float] = {}

    def add(self, tokens: int, seconds: float) -> None:
        self._memo.clear()
        self._time = None
        q = self._samples.pop(tokens, None)  # re-inserted last: the dict's order is the order last sampled
        if q is None:
            if len(self._keys) >= self.MAX_COUNTS:
                stale = next(iter(self._samples))
                del self._samples[stale], self._stat[stale]
                self._keys.remove(stale)
            q = deque(maxlen=self.per_count)
            bisect.insort(self._keys, tokens)
        self._samples[tokens] = q
        q.append(seconds)
        self._stat[tokens] = statistics.median(q)

    def _times(self) -> dict[int, float]:
        """Each count's predicted time, read once per sample (a step's many predictions share it)."""
        if self._time is None:
            hull = convex_minorant(self._keys, self._stat)
            low, self._time = math.inf, {}
            for n in reversed(self._keys):
                low = min(low, self._stat[n] if len(self._samples[n]) >= self.CONFIRMED else hull[n])
                self._time[n] = low
        return self._time

    def __len__(self) -> int:
        return sum(len(q) for q in self._samples.values())

    def distinct(self) -> int:
        return len(self._keys)

    def predict(self, tokens: float) -> float | None:
        hit = self._memo.get(tokens)
        if hit is not None:
            return hit
        keys = self._keys
        if not keys:
            return None
        out = self._interpolate(keys, tokens)
        self._memo[tokens] = out
        return out

    def _interpolate(self, keys: list[int], tokens: float) -> float:
        time = self._times()
        i = bisect.bisect_left(keys, tokens)
        if i < len(keys) and keys[i] == tokens:
            return time[keys[i]]
        if i == 0:  # below every measurement: the smallest measured count (costs only grow with tokens)
            return time[keys[0]]
        if i == len(keys):  # above: extend the slope of the two largest measurements (never negative)
            if len(keys) == 1:
                return time[keys[0]]
            x0, x1 = keys[-2], keys[-1]
            y0, y1 = time[x0], time[x1]
            return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (tokens - x1)
        x0, x1 = keys[i - 1], keys[i]
        y0, y1 = time[x0], time[x1]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def convex_minorant(keys: list[int], values: dict[int, float]) -> dict[int, float]:
    """The greatest convex, non-decreasing function under ``values`` (at the sorted ``keys``), at those keys."""
    low, mono = math.inf, {}
    for n in reversed(keys):  # non-decreasing: no count above a larger one
        low = mono[n] = min(low, values[n])
    hull: list[int] = []  # the lower hull's vertices, by count
    for n in keys:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (mono[b] - mono[a]) * (n - a) < (mono[n] - mono[a]) * (b - a):
                break  # b lies below the chord from a to n: it stays a vertex
            hull.pop()
        hull.append(n)
    out, v = {}, 0
    for n in keys:
        while hull[v] < n:
            v += 1
        if hull[v] == n:
            out[n] = mono[n]
        else:
            a, b = hull[v - 1], hull[v]
            out[n] = mono[a] + (mono[b] - mono[a]) * (n - a) / (b - a)
    return out


def catch_up_slope(samples: Sequence[tuple[int, float]]) -> float:
    """Seconds per token of (tokens, seconds) samples: the least-squares slope where the token counts spread
    (at least a 2x range), else the mean seconds per token. A slope that noise makes non-positive gives the
    cheapest sample's seconds per token instead (the largest call's: fixed cost included, an upper bound)."""
    if not samples:
        return 0.0
    xs = [float(t) for t, _ in samples]
    ys = [s for _, s in samples]
    if len(samples) >= 3 and max(xs) >= 2 * min(xs):
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        return slope if slope > 0 else min(y / x for x, y in zip(xs, ys))
    return sum(ys) / sum(xs)


def gains_over_prior(counts: Acceptance | None, prior: Sequence[float], weight: float,
                     scale: Sequence[float] | None = None) -> list[float]:
    """m_j = c_1 ... c_j for each position j of ``prior``, where c_j = (s_j accepted_j + weight * prior_j) /
    (s_j tried_j + weight): a position's decayed counts (weighted by ``scale``, s_j, default 1) over its prior
    (the prior alone where not counted)."""
    out, m = [], 1.0
    for j, p in enumerate(prior):
        s = 1.0 if scale is None else scale[j]
        c = p if counts is None or j >= len(counts.acc) else \
            (s * counts.acc[j] + weight * p) / (s * counts.tried[j] + weight)
        m *= c
        out.append(m)
    return out


PRIOR_ALPHA = 0.6  # acceptance of a draft position before it is measured
PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior in an estimate
# A request's own counts of a draft position fade by this factor per step in which its drafts did not reach
# that position (toward the source's global rates): one unlucky draft must not keep a request from drafting,
# or from drafting deeper, for the rest of its life.
IDLE_DECAY = 0.9
PROBE_SHARE = 0.02  # of the step time while the plan is "no drafts", what probing it may spend


class SpecController:
    """Per-position acceptance per request + measured costs -> each request's k for this step.

    A request can draft from several *sources* (``--prompt-lookup-first``: prompt lookup or the model
    proposer, decided per step before k is chosen). Acceptance is tracked per (request, source), in the
    request's ``SpecState`` (``states``), with one global prior per source, and drafts of ``FREE_SOURCES`` add
    verification tokens but no draft steps.
    """

    def __init__(self, max_k: int, adaptive: bool = True, prior_alpha: float = PRIOR_ALPHA,
                 explore_every: int = 16, prior_weight: float = PRIOR_WEIGHT, min_gain: float = 0.03,
                 states: SpecStates | None = None) -> None:
        self.max_k = max_k  # the most drafts a request gets in one step
        self.states = states if states is not None else SpecStates()
        self.adaptive = adaptive
        # Called with ("target" | "draft", count, seconds) for every cost sample (benchmarks read them).
        self.cost_observers: list[Callable[[str, int, float], None]] = []
        # Draft only when the model predicts at least this relative gain over not drafting: the estimates
        # are noisy, and a predicted +1% that turns out -5% breaks "never slower" for nothing.
        self.min_gain = min_gain
        self.explore_every = explore_every
        self.prior_weight = prior_weight  # pseudo-observations of the global rate in a request's estimate
        self.prior_alpha = prior_alpha
        self.target_cost = StepCost()
        self.draft_cost = StepCost()
        self._step = 0
        self._since_explore = 0
        self._explore_gap = explore_every
        self._probe_budget = 0.0  # seconds the next off-probe may cost (``_probe``)
        # Conditional acceptance per position over all recent passes, per source (decayed counts, and the
        # rates they give, cached): the prior of every request's estimate (a new request starts from it).
        self._global: dict[Source, Acceptance] = {}
        self._global_rates: dict[Source, list[float]] = {}
        self.last_k = max_k  # the largest k of the last step (the `spec_decode_k` gauge)
        # Draft trees: decayed sums of predicted (draft path probabilities of the verified nodes) and
        # accepted nodes, whose ratio calibrates the draft's confidence into expected accepted tokens.
        self._tree_pred = 0.0
        self._tree_acc = 0.0
        # Greedy chains: acceptance by the draft's confidence in its token, per source (``chain_stop``).
        self._confidence: dict[Source, ConfidenceBins] = {}
        self._chain_stop: ChainStop | None = None  # this step's, from ``choose_ks`` (None: chains run to k)
        self._made = 0.0  # decayed tokens made and seconds spent by the recent steps (``record_step``)
        self._spent = 0.0
        self._catch_up = 0.0  # seconds per token a draft spends catching up on a backlog (0: unmeasured)
        self._catch_samples: deque[tuple[int, float]] = deque(maxlen=32)  # (tokens, seconds) of catch-up calls

    @property
    def global_rates(self) -> list[float]:
        return self._global_of(Source.METHOD)

    def _global_of(self, source: Source) -> list[float]:
        """The prior c_1..c_K of a source: each position's decayed counts over all requests, on top of the
        position before it (position 1: ``prior_alpha``), with ``prior_weight`` pseudo-observations.

        A position is only observed when the controller drafts that deep, and it drafts that deep only when
        the position looks worth it; so an untried position is assumed to do as the one before it did (a flat
        prior would keep a source that is nearly always accepted from ever trying its deeper drafts), and the
        first passes that draft it correct that."""
        rates = self._global_rates.get(source)
        if rates is None:
            g = self._global.get(source)
            w, prev, rates = self.prior_weight, self.prior_alpha, []
            for j in range(max(1, self.max_k)):
                a, t = (g.acc[j], g.tried[j]) if g is not None else (0.0, 0.0)
                prev = (a + w * prev) / (t + w)
                rates.append(prev)
            self._global_rates[source] = rates
        return rates

    # -- measurements ---------------------------------------------------------------------------------------
    def record_acceptance(self, req_id: str, num_draft: int, num_accepted: int,
                          source: Source = Source.METHOD) -> None:
        """One verification pass: num_accepted of num_draft drafts accepted (it stops at the first rejection)."""
        if num_draft <= 0:
            return
        k = max(1, self.max_k)
        per = self.states.of(req_id).acceptance
        acc = per.get(source)
        if acc is None:
            acc = per[source] = Acceptance(k)
        acc.observe(num_draft, num_accepted, decay=0.8, step=self._step)
        g = self._global.get(source)
        if g is None:
            g = self._global[source] = Acceptance(k)
        g.observe(num_draft, num_accepted, decay=0.95)
        self._global_rates.pop(source, None)

    def record_confidence(self, source: Source, confs: list[float], num_accepted: int) -> None:
        """A verified greedy chain: its drafts' confidences, ``num_accepted`` of them accepted."""
        bins = self._confidence.get(source)
        if bins is None:
            bins = self._confidence[source] = ConfidenceBins()
        bins.observe(confs, num_accepted, decay=0.98)

    def confidence_rate(self, source: Source, p: float) -> float:
        """P(a greedy draft of confidence p is accepted | the drafts before it were): measured per confidence
        bin over the raw confidence (``ConfidenceBins``)."""
        bins = self._confidence.get(source)
        return p if bins is None else bins.rate(p, self.prior_weight)

    def record_step(self, tokens: int, seconds: float) -> None:
        """A step made ``tokens`` tokens in ``seconds`` (all of it: drafting, the target, sampling): the rate
        a chain's next draft must beat (``chain_stop``), decayed over about ten steps."""
        self._made = 0.9 * self._made + tokens
        self._spent = 0.9 * self._spent + seconds

    @property
    def chain_stop(self) -> ChainStop | None:
        """Where this step's greedy chains of a model source end (``choose_ks`` sets it; None: at k).

        Draft j is worth its calibrated path estimate (the product of ``confidence_rate`` over drafts 1..j) in
        expected tokens. At the rate R (tokens/s) the server makes, measured over the last steps, draft j is
        kept while that estimate is at least t_row(j) R, t_row(j) = (T_target(B + nj) - T_target(B)) / nj the
        measured price of a verification row when the step's n drafting chains are j deep, and the chain goes
        on while the estimate is at least (t_row(j + 1) + t_draft) R. So a chain runs as deep as the draft is
        sure of itself, up to ``max_k``, and ends where it is not: the Qwen2.5-Coder head drafts deep through
        a function's boilerplate and stops at a name it has to guess."""
        return self._chain_stop

    def _set_chain_stop(self, req_ids: list[str], sources: list[Source], other: int, produced: int, ks: list[int],
                        backlog: Sequence[float], source: Source) -> None:
        free = [s in FREE_SOURCES for s in sources]
        drafting = sum(1 for k, f in zip(ks, free) if k and not f)
        self._chain_stop = None
        if not drafting:
            return
        b = len(req_ids)
        rate = self._made / self._spent if self._spent > 0 else 0.0
        if rate <= 0.0:  # no step measured yet: the plan's prediction
            tokens = float(b + produced)
            tokens += sum(sum(self.gains(r, s)[:k]) for r, s, k in zip(req_ids, sources, ks) if k)
            k_max = max((k for k, f in zip(ks, free) if not f), default=0)
            extra = self._catch_up * sum(lag for lag, k, f in zip(backlog, ks, free) if k and not f)
            rate = self._rate(b, other, sum(ks), tokens, k_max, drafting, extra)
        if rate <= 0.0:
            return
        # the step's rows without the chains: one per request, the other tokens, and free (lookup) drafts
        base = other + b + sum(k for k, f in zip(ks, free) if f)
        t0 = self.target_cost.predict(base) or 0.0
        # every drafting chain j + 1 drafts deep adds drafting * (j + 1) rows: each row at that average, so a
        # batch's chains are priced where their rows together take the step (compute-bound past a few rows),
        # and one noisy table entry moves the price little (a chain that stops short never re-measures past it)
        added = [drafting * (j + 1) for j in range(self.max_k + 1)]
        rows = tuple(max((self.target_cost.predict(base + n) or 0.0) - t0, 0.0) / n for n in added)
        self._chain_stop = ChainStop(rows, self.draft_cost.predict(drafting) or 0.0, rate,
                                     lambda p: self.confidence_rate(source, p))

    def record_tree(self, predicted: float, accepted: int) -> None:
        """One verified tree: the sum of its nodes' draft path probabilities, and its accepted path's length."""
        self._tree_pred = 0.95 * self._tree_pred + predicted
        self._tree_acc = 0.95 * self._tree_acc + accepted

    @property
    def tree_calibration(self) -> float:
        """Accepted nodes per unit of draft path probability (1 until trees were measured)."""
        return (self._tree_acc + 1.0) / (self._tree_pred + 1.0)

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.add(num_tokens, seconds)
        for observer in self.cost_observers:
            observer("target", num_tokens, seconds)

    def record_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft call that caught up on ``tokens`` of backlog took ``seconds``. The price of a backlog token
        is the slope of seconds over tokens across recent calls: a call also pays a fixed cost (reading the
        draft's weights once) that a short backlog would otherwise spread over a few tokens, pricing a
        thousand-token prompt as a thousand decode steps. Until the calls differ in size, seconds / tokens."""
        self._catch_samples.append((tokens, seconds))
        self._catch_up = catch_up_slope(self._catch_samples)

    def record_draft(self, num_reqs: int, seconds_per_step: float) -> None:
        self.draft_cost.add(num_reqs, seconds_per_step)
        for observer in self.cost_observers:
            observer("draft", num_reqs, seconds_per_step)

    def rates(self, req_id: str, source: Source = Source.METHOD) -> list[float]:
        """Conditional acceptance c_1..c_K of a request: its decayed counts over the global prior (a position's
        counts fading by ``IDLE_DECAY`` per step since the request's drafts last reached it)."""
        g, w = self._global_of(source), self.prior_weight
        acc = self.states.acceptance(req_id, source)
        if acc is None:
            return list(g)
        return [(s * a + w * p) / (s * t + w) for a, t, p, s in zip(acc.acc, acc.tried, g, self._idle_scale(acc))]

    def gains(self, req_id: str, source: Source = Source.METHOD) -> list[float]:
        """m_j = c_1 ... c_j of ``rates``: expected tokens draft j adds (non-increasing in j)."""
        acc = self.states.acceptance(req_id, source)
        return gains_over_prior(acc, self._global_of(source)[:self.max_k], self.prior_weight,
                                self._idle_scale(acc) if acc is not None else None)

    def _idle_scale(self, acc: Acceptance) -> list[float]:
        # a position observed at the last step does not fade (its record comes after that step's plan)
        return [IDLE_DECAY ** max(self._step - last - 1, 0) for last in acc.last]

    # -- decision -------------------------------------------------------------------------------------------
    def choose_ks(self, req_ids: list[str], other_tokens: int = 0, sources: list[Source] | None = None,
                  remaining: list[int] | None = None, backlog: Sequence[float] | None = None,
                  hold: bool = False, other_decodes: int = 0) -> list[int]:
        """k per request for the next step of these decoding requests; ``other_tokens`` are rows of other
        requests sharing the step, ``other_decodes`` of them decode rows that yield a token each (the rest:
        prefill); ``sources[i]`` is where request i's drafts come from this step (default: one);
        ``remaining[i]``: tokens request i has left in a draining batch (None: a server's open batch), and
        ``backlog[i]`` the tokens its draft must catch up on before drafting (``record_catch_up``): a request
        whose model drafts first read a long backlog pays that in either plan.

        ``hold``: the step carries a new prompt's prefill (a server's arrival). Draft-model steps would run in
        series before its first token, so only sources that cost no draft step (``FREE_SOURCES``) may draft,
        planned as usual; no probe or first measurement is spent on such a step."""
        self._chain_stop = None
        produced = min(other_decodes, other_tokens)
        if not req_ids:
            return []
        srcs = sources if sources is not None else [Source.METHOD] * len(req_ids)
        if hold and self.adaptive and any(s not in FREE_SOURCES for s in srcs):
            ks = [0] * len(req_ids)
            if any(s in FREE_SOURCES for s in srcs) and self.target_cost.distinct() >= 2:
                ks = self._best(req_ids, srcs, other_tokens, produced, [0.0] * len(req_ids), free_only=True)
            self.last_k = max(ks)
            return ks
        if not self.adaptive:
            self.last_k = self.max_k
            return [self.max_k] * len(req_ids)
        self._step += 1
        lag = list(backlog) if backlog else [0.0] * len(req_ids)
        if self.target_cost.distinct() < 2 or (self.draft_cost.distinct() == 0 and self.max_k
                                               and any(s not in FREE_SOURCES for s in srcs)):
            # The cost slope (or the draft's cost) is unknown (no start-up calibration, worker/calibrate.py):
            # after a step without drafts, the request with the least to catch up on drafts max_k. That
            # measures T(B + k), the draft's step and every position's acceptance, at one request's price.
            ks = [0] * len(req_ids)
            if not self.last_k:
                ks[lag.index(min(lag))] = self.max_k
        else:
            planned = remaining is None or len(req_ids) == 1
            if remaining is None or planned:
                ks = self._best(req_ids, srcs, other_tokens, produced, lag)
            else:
                ks = self._drain_plan(req_ids, srcs, other_tokens, remaining, lag)
            unseen = [i for i, s in enumerate(srcs) if s not in self._global]
            if unseen and not any(ks):
                # A source never verified yet is priced at the prior (0.6, then falling), which a draft model's
                # cost can keep from ever drafting: its first drafts go to the request with the least to
                # catch up on, max_k of them, so every position gets measured; unless no plan could pay even
                # with every draft accepted (then the measurement waits for a batch where one could).
                if self._could_pay(srcs, other_tokens, produced, lag):
                    ks[min(unseen, key=lambda i: lag[i])] = self.max_k
            else:
                self._explore(ks, srcs, other_tokens, produced, lag)
            if planned:
                model = [s for s in srcs if s not in FREE_SOURCES]
                self._set_chain_stop(req_ids, srcs, other_tokens, produced, ks, lag,
                                     model[0] if model else Source.METHOD)
        self.last_k = max(ks)
        return ks

    def _explore(self, ks: list[int], sources: list[Source], other: int, produced: int, lag: Sequence[float]) -> None:
        """Every ``explore_every`` steps while drafting, each drafting request's k is nudged up or down by one
        (one not drafting stays at 0: starting it may mean a catch-up on its whole backlog, which is the
        plan's call, or a probe's); while the plan is "no drafts", a probe (``_probe``) at gaps that double
        while the plan stays off."""
        self._since_explore += 1
        off = not any(ks)
        if off:  # probes are paid from a budget that accrues while the plan is off
            self._probe_budget += PROBE_SHARE * (self.target_cost.predict(other + len(ks)) or 0.0)
        if self._since_explore < self._explore_gap:
            return
        self._since_explore = 0
        if off:
            self._probe(ks, sources, other, produced, lag)
            return
        self._explore_gap = self.explore_every
        step = 1 if self._step % 2 else -1
        ks[:] = [min(self.max_k, max(0, k + step)) if k else 0 for k in ks]

    def _probe(self, ks: list[int], sources: list[Source], other: int, produced: int, lag: Sequence[float]) -> None:
        """While the plan is "no drafts": one request drafts one token, which measures acceptance and T(B + 1)
        as well as all of them would. A draft model or head first catches up on every token since the request
        last drafted (a new request's whole prompt), so the probe goes to the request with the least to catch
        up on (in turn among equals). In a batch it waits until a budget (``PROBE_SHARE`` of the steps since
        the plan went off) covers its predicted cost: at a draft model's 1.5 ms a token, a 200-token catch-up
        is worth four steps of a 1.5B target at batch 8. A request alone delays nobody else, and drafting's
        upside is largest there: it probes at every gap.

        NOTE: exploring away from k = 0 costs real time when drafts keep failing, so the gap doubles each time
        the model still says "off" (and resets once speculation pays again)."""
        if not self._could_pay(sources, other, produced, lag):
            return  # nothing to learn that could change the plan here: the next gap asks again
        least = min(lag)
        cheapest = [i for i, n in enumerate(lag) if n == least]
        i = cheapest[self._step % len(cheapest)]
        b = other + len(ks)
        cost = max((self.target_cost.predict(b + 1) or 0.0) - (self.target_cost.predict(b) or 0.0), 0.0)
        if sources[i] not in FREE_SOURCES:
            cost += (self.draft_cost.predict(1) or 0.0) + self._catch_up * lag[i]
        if len(ks) > 1 and cost > self._probe_budget:
            return  # not yet: the next gap tries again
        self._probe_budget = max(self._probe_budget - cost, 0.0)
        self._explore_gap = min(self._explore_gap * 2, 64 * self.explore_every)
        ks[i] = min(self.max_k, 1)

    def _could_pay(self, sources: list[Source], other: int, produced: int, backlog: Sequence[float]) -> bool:
        """Whether some plan would beat no drafts if every draft were accepted: the upper bound of what drafting
        can give at this batch's measured costs, the catch-up on each request's backlog included. Where even
        that loses (a draft model at a large batch of short requests, each with a prompt to read), a first
        measurement or a probe of acceptance is spent for nothing. Two families of plans are tried: the
        requests with the least backlog drafting ``max_k`` each, one after another, and every request drafting
        one more position at a time."""
        free = [s in FREE_SOURCES for s in sources]
        catch_up = [0.0 if f else self._catch_up * n for f, n in zip(free, backlog)]
        order = sorted(range(len(sources)), key=lambda i: catch_up[i])
        by_request = [(1.0, i) for i in order for _ in range(self.max_k)]
        by_position = [(1.0, i) for _ in range(self.max_k) for i in order]
        return any(any(self._best_prefix(pairs, free, other, produced, catch_up))
                   for pairs in (by_request, by_position))

    def _best(self, req_ids: list[str], sources: list[Source], other: int, produced: int, backlog: Sequence[float],
              free_only: bool = False) -> list[int]:
        """The prefix of (request, position) pairs by falling gain that maximises predicted tokens/s (``free_only``:
        of the requests whose drafts cost no draft step)."""
        pairs = sorted(((m, i) for i, (r, s) in enumerate(zip(req_ids, sources))
                        if not free_only or s in FREE_SOURCES for m in self.gains(r, s)), key=lambda x: -x[0])
        free = [s in FREE_SOURCES for s in sources]
        return self._best_prefix(pairs, free, other, produced,
                                 catch_up=[0.0 if f else self._catch_up * n for f, n in zip(free, backlog)])

    def _drain_plan(self, req_ids: list[str], sources: list[Source], other: int, remaining: list[int],
                    backlog: Sequence[float]) -> list[int]:
        """Drafts that maximise how fast a draining batch approaches its end. The batch ends when
        ``max_i(remaining_i)`` reaches 0; with X_i accepted drafts this step it shrinks by
        ``sum_l P(remaining_i - X_i <= longest - l for all i)`` beyond the step itself, and request i must have
        accepted ``l - (longest - remaining_i)`` drafts for level l. Plan j drafts exactly what levels 1..j
        need (k_i = j - (longest - remaining_i)); its worth is that expected shrink, in steps, plus ``row`` per
        other accepted token (the share of the step's measured cost one row adds: its request leaves earlier),
        over the step's predicted time, against 1 step per step without drafts. The plans j = 0 .. max_k are
        compared as ``_best_prefix`` compares prefixes. A plan also pays for the backlog each newly drafting
        request's draft must catch up on (as the laggard changes, a head that has not drafted for a request
        first reads its whole context: about 65 us a token at batch 8 on the demo model).

        With B requests level with each other, a level needs all of them to accept, so moderate acceptance
        rarely pays at batch 8, and the plan is then no drafts rather than verification for requests that end
        no sooner."""
        b = len(req_ids)
        gains = [self.gains(r, s) for r, s in zip(req_ids, sources)]
        free = [s in FREE_SOURCES for s in sources]
        longest = max(remaining)
        t_b, t_less = self.target_cost.predict(other + b), self.target_cost.predict(other + b - 1)
        row = min(max((t_b - t_less) / t_b, 0.0), 1.0) if t_b and t_less is not None else 0.0
        best, best_rate = [0] * b, self._rate(b, other, 0, 1.0, 0, 0) * (1.0 + self.min_gain)
        for j in range(1, self.max_k + 1):
            # drafts beyond a request's last token cannot be proposed (the worker caps k by the room left)
            ks = [max(0, min(j - (longest - r), len(g), r - 1)) for r, g in zip(remaining, gains)]
            if not any(ks):
                continue
            shrink = 0.0
            for level in range(1, j + 1):
                p = 1.0
                for r, g, k in zip(remaining, gains, ks):
                    x = level - (longest - r)  # drafts request i must have accepted for this level
                    if x > 0:
                        p *= g[x - 1] if x <= k else 0.0
                shrink += p
            accepted = sum(sum(g[:k]) for g, k in zip(gains, ks))
            worth = 1.0 + shrink + row * max(accepted - shrink, 0.0)
            drafting = [k for k, f in zip(ks, free) if k and not f]
            rate = self._rate(b, other, sum(ks), worth, max(drafting, default=0), len(drafting),
                              self._catch_up * sum(n for n, k, f in zip(backlog, ks, free) if k and not f))
            if rate > best_rate * 1.0001:
                best, best_rate = ks, rate
        return best

    def _best_prefix(self, pairs: list[tuple[float, int]], free: list[bool], other: int, produced: int,
                     catch_up: list[float] | None = None) -> list[int]:
        """Drafts per request from the prefix of ``pairs`` (worth in expected tokens, request index; by falling
        worth) that maximises predicted tokens/s; ``free[i]``: request i's drafts cost no draft step; ``other``
        rows share the step, ``produced`` of them yield a token (decode rows; prefill rows yield none);
        ``catch_up[i]``: seconds request i's draft first spends on its backlog once it drafts at all.

        The catch-up price keeps a draft that has been idle for a request (prompt lookup drafted it, or nothing
        paid) from being picked for one draft worth half a token when it would first read a long backlog."""
        b = len(free)
        ks = [0] * b
        best_n, best_rate = 0, self._rate(b, other, 0, float(b + produced), 0, 0) * (1.0 + self.min_gain)
        tokens, k_max, drafting, extra = float(b + produced), 0, 0, 0.0
        for n, (m, i) in enumerate(pairs, start=1):
            if m <= 0.0:
                break
            if not free[i]:
                if ks[i] == 0:
                    drafting += 1
                    extra += catch_up[i] if catch_up is not None else 0.0
                k_max = max(k_max, ks[i] + 1)
            ks[i] += 1
            tokens += m
            rate = self._rate(b, other, n, tokens, k_max, drafting, extra)
            if rate > best_rate * 1.0001:
                best_n, best_rate = n, rate
        out = [0] * b
        for _, i in pairs[:best_n]:
            out[i] += 1
        return out

    def choose_tree_sizes(self, probs: list[list[float]], other_tokens: int = 0) -> list[int]:
        """How many of each request's tree nodes to verify (a prefix of its nodes ranked by draft path
        probability ``probs[i]``, descending; 0 = none). A node is worth its calibrated path probability in
        expected tokens; a step of T tokens costs the measured ``T_target(T)``, with ``other_tokens`` the
        step's rows outside these trees (the rest of a batch): the best prefix over all nodes by falling worth
        maximises predicted tokens/s, as ``choose_ks`` does for chains. The drafting is already paid for here."""
        if not self.adaptive or self.target_cost.distinct() < 2:
            return [len(p) for p in probs]
        c = self.tree_calibration
        items = sorted(((c * p, i) for i, ps in enumerate(probs) for p in ps), key=lambda x: -x[0])
        # the other rows are decode rows: each yields its token in every plan
        return self._best_prefix(items, [True] * len(probs), other_tokens, other_tokens)

    def best_rate(self, gains: list[float], free: bool, backlog: float = 0.0) -> float | None:
        """Predicted tokens/s of one request drafting from a source whose draft j adds ``gains[j - 1]``
        expected tokens, at its best k (0 included); ``free``: drafts cost no draft-model step; ``backlog``:
        tokens the draft first catches up on. None while the costs are not measured yet (or the controller is
        not adaptive)."""
        if not self.adaptive or self.target_cost.distinct() < 2 or (not free and self.draft_cost.distinct() == 0):
            return None
        best, tokens = 0.0, 1.0
        step = 0.0 if free else (self.draft_cost.predict(1) or 0.0)
        lag = 0.0 if free else self._catch_up * backlog
        for k in range(len(gains) + 1):
            if k:
                tokens += gains[k - 1]
            t = (self.target_cost.predict(1 + k) or 0.0) + (k * step + lag if k else 0.0)
            if t > 0:
                best = max(best, tokens / t)
        return best

    def _rate(self, b: int, other: int, drafts: int, tokens: float, k_max: int, drafting: int,
              extra: float = 0.0) -> float:
        t = (self.target_cost.predict(other + b + drafts) or 0.0) + extra
        if k_max:
            t += k_max * (self.draft_cost.predict(drafting) or 0.0)
        return tokens / t if t > 0 and math.isfinite(t) else 0.0
