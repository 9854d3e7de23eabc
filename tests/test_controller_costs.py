"""The controller's cost inputs: what a draft's catch-up on a backlog costs per token."""

import pytest

from specserve.spec_decode.controller import StepCost, catch_up_slope


def test_catch_up_price_is_the_slope_not_the_fixed_cost_spread_over_few_tokens():
    # a call costs 50 ms to read the draft's weights plus 2 ms a token
    samples = [(n, 0.050 + 0.002 * n) for n in (2, 4, 40, 300, 800)]
    assert catch_up_slope(samples) == pytest.approx(0.002)
    assert samples[0][1] / samples[0][0] > 10 * 0.002  # what seconds / tokens of a short call would say


def test_catch_up_price_without_spread_is_seconds_per_token_and_never_negative():
    assert catch_up_slope([]) == 0.0
    assert catch_up_slope([(10, 0.1), (12, 0.12)]) == pytest.approx(0.01)
    # noise that falls with size: the cheapest per-token sample, not zero
    assert catch_up_slope([(10, 0.5), (100, 0.2), (400, 0.1)]) == pytest.approx(0.1 / 400)


def test_an_off_probe_goes_to_the_request_with_the_least_backlog():
    from specserve.spec_decode.controller import SpecController

    c = SpecController(3, explore_every=1)
    for n in range(1, 13):  # rows cheap, but the source's drafts failed (below): the model says off
        c.record_target(n, 0.010 + 0.002 * n)
    c.record_draft(1, 0.005)
    c.record_acceptance("x", 3, 0)  # the source was verified before (its first plan would probe anyway)
    probes = [c.choose_ks(["a", "b", "c"], backlog=[400, 3, 250]) for _ in range(60)]
    assert all(ks[0] == 0 and ks[2] == 0 for ks in probes) and any(ks[1] for ks in probes)


def test_off_probes_spend_at_most_their_share_of_the_time():
    """A probe's predicted cost (its extra row, a draft step and the catch-up on its backlog) is paid from a
    budget of PROBE_SHARE of the off steps' time: a draft model behind on every request is probed less often
    than one with nothing to catch up on (limited by the gap alone); one so far behind that no plan could pay
    even with every draft accepted is never probed."""
    from specserve.spec_decode.controller import PROBE_SHARE, SpecController

    def run(backlog: float, steps: int) -> tuple[int, float]:
        c = SpecController(3, explore_every=4)
        for n in range(2, 12):
            c.record_target(n, 0.030 + 0.001 * (n - 2))  # rows cheap next to the step
        c.record_draft(1, 0.003)
        c.record_catch_up(100, 0.15)
        c.record_catch_up(300, 0.45)
        c.record_acceptance("x", 3, 0)  # the source was verified, and failed: the plan is off
        probes = sum(any(c.choose_ks(["a", "b"], backlog=[backlog] * 2)) for _ in range(steps))
        return probes, c._catch_up

    rare, per_token = run(20.0, 2000)
    assert per_token == pytest.approx(0.0015)
    cost = 0.001 + 0.003 + 20 * per_token  # the extra row, the draft step, the catch-up
    assert 1 <= rare <= 2000 * PROBE_SHARE * 0.030 / cost + 1
    cheap, _ = run(0.0, 2000)
    assert cheap > rare
    never, _ = run(100.0, 2000)  # 150 ms of catch-up per request against 30 ms steps: nothing could pay
    assert never == 0


def test_a_draft_models_backlog_is_priced_and_its_prompt_spread_over_the_request():
    """A draft model reads a new request's whole prompt before its first drafts (a one-off: it then drafts for
    the rest of the request), so the controller is charged the share one step covers; tokens it missed while
    prompt lookup drafted recur, and are charged whole. Before, a draft model's backlog was priced as none."""
    from specserve.spec_decode.draft_model import DraftModelProposer
    from specserve.spec_decode.proposer import ProposeRequest, backlog

    prop = DraftModelProposer(lambda *a: None, shares_target_kv=False, vocab_size=8)
    req = ProposeRequest("a", list(range(301)), 301, 1, (), None, room=63)  # type: ignore[arg-type]
    assert backlog(prop, req, 5) == pytest.approx(300 * 6 / 64)  # never read: 6 of the 64 tokens left
    req.spec.draft.fed = (280, [7])  # read up to 280, then a draft that was not accepted
    assert backlog(prop, req, 5) == 20.0
    req.spec.draft.fed = (300, [])  # the usual step: only the last token to feed
    assert backlog(prop, req, 5) == 0.0
    assert backlog(DraftModelProposer(lambda *a: None, True, 8), req, 5) == 0.0  # layer skip: the target's KV
    req.room = 3
    req.spec.draft.fed = None
    assert backlog(prop, req, 5) == 300.0  # near the end a step covers all that is left: charged whole
    req.room = -1  # a row with no room left still counts in the controller's batch
    assert backlog(prop, req, 5) == 300.0


def test_a_spread_prompt_catch_up_still_pays_alone_where_a_whole_one_never_would():
    """A request whose draft has not read its prompt still gets drafts at batch 1: the share of the prompt one
    step is charged is small against what its drafts gain; charged whole, no single step could pay for it."""
    from specserve.spec_decode.controller import SpecController

    c = SpecController(3, explore_every=10**6)
    for n in range(1, 40):  # 40 ms a step plus 4 ms a row: rows are cheap next to the step
        c.record_target(n, 0.040 + 0.004 * (n - 1))
    c.record_draft(1, 0.010)
    for req in ("a", "b", "c", "d"):
        c.record_acceptance(req, 3, 3)
    c.record_catch_up(300, 0.6)
    c.record_catch_up(30, 0.06)  # 2 ms a token
    assert c.choose_ks(["a"], backlog=[0.0]) != [0]
    assert c.choose_ks(["a"], backlog=[300 * 4 / 64]) != [0]  # alone: the spread prompt still pays
    assert c.choose_ks(["a"], backlog=[300.0]) == [0]  # charged whole, one step could never pay for it


def test_a_step_carrying_a_prefill_gets_no_draft_model_steps_but_keeps_free_drafts():
    """``hold`` (a new prompt's prefill shares the next step): draft-model sources get k = 0, with no first
    measurement or probe spent on them; prompt-lookup drafts are planned as usual; without it, the same
    requests draft."""
    from specserve.spec_decode.controller import SpecController
    from specserve.spec_decode.state import Source

    c = SpecController(4, explore_every=1000)  # no nudges of k between the plans compared
    for n in range(1, 12):  # rows nearly free next to the step, a draft step cheap: drafting pays
        c.record_target(n, 0.030 + 0.0005 * n)
    c.record_draft(1, 0.001)
    c.record_draft(2, 0.0012)
    for _ in range(20):
        c.record_acceptance("a", 4, 4, Source.MODEL)
        c.record_acceptance("b", 4, 4, Source.LOOKUP)
    ids, srcs = ["a", "b"], [Source.MODEL, Source.LOOKUP]
    assert c.choose_ks(ids, sources=srcs) == [4, 4]
    for _ in range(40):  # every step holds: never a model draft, never a probe
        assert c.choose_ks(ids, sources=srcs, hold=True) == [0, 4]
    assert c.choose_ks(["new"], sources=[Source.METHOD], hold=True) == [0]  # an unseen source waits too
    assert c.choose_ks(ids, sources=srcs) == [4, 4]


def test_a_chain_stop_prices_rows_and_a_draft_step_at_the_measured_rate():
    """``chain_stop`` (one request): at the rate R the recent steps made (tokens/s), draft j is kept while its
    calibrated path estimate is at least t_row(j) R, t_row(j) = (T(B + j) - T(B)) / j the measured price of a
    row in a chain that long (one dear count -- noise, or a second pass over the weights -- moves it by its
    share), and the chain goes on while it is at least (t_row(j + 1) + t_draft) R; before any step was
    measured, R is the plan's predicted rate. The calibration by confidence starts at the raw confidence and
    moves to what verification measured."""
    from specserve.spec_decode.controller import SpecController
    from specserve.spec_decode.state import Source

    c = SpecController(5)
    costs = {n: 0.026 + 0.0044 * (n - 1) for n in range(1, 6)} | {6: 0.058, 7: 0.0624}  # the 5th draft's row: dear
    for n, t in costs.items():
        for _ in range(StepCost.CONFIRMED):  # measured often enough to be a real step in the costs
            c.record_target(n, t)
    c.record_draft(1, 0.001)  # a head's step
    for _ in range(20):
        c.record_acceptance("a", 2, 2)
    ks = c.choose_ks(["a"])
    assert ks[0] >= 1
    stop = c.chain_stop
    assert stop is not None
    k = ks[0]
    predicted = (1 + sum(c.gains("a")[:k])) / (costs[1 + k] + 0.001 * k)
    assert stop.rate == pytest.approx(predicted, rel=1e-6)  # nothing measured yet: the plan's rate
    assert stop.rows == pytest.approx([0.0044] * 4 + [0.032 / 5, 0.0364 / 6])
    assert stop.draft == pytest.approx(0.001)
    for _ in range(30):
        c.record_step(3, 0.050)  # the server makes 60 tokens/s
    stop = (c.choose_ks(["a"]), c.chain_stop)[1]
    assert stop.rate == pytest.approx(60.0)
    assert stop.accept(0.4) == pytest.approx(0.4)  # nothing measured: the raw confidence
    # keep draft 0 from 0.0044 * 60 = 0.264, go on from (0.0044 + 0.001) * 60 = 0.324
    assert stop.more(0, 1.0, 0.3) == (pytest.approx(0.3), True, False)
    assert stop.more(0, 1.0, 0.25)[1:] == (False, False)
    assert stop.more(0, 1.0, 0.33)[1:] == (True, True)
    # a chain of 5 pays 6.4 ms a row: its 5th draft is worth keeping from 0.384 tokens at 60 tokens/s
    assert stop.more(4, 1.0, 0.38)[1:] == (False, False) and stop.more(4, 1.0, 0.39)[1] is True
    assert stop.more(3, 1.0, 0.4)[1:] == (True, False)  # the 4th is kept, but a 5th would not pay (0.444)
    for _ in range(50):  # drafts of confidence 0.4 are accepted far more often than that
        c.record_confidence(Source.METHOD, [0.42, 0.41], 2)
    assert c.confidence_rate(Source.METHOD, 0.45) > 0.9
    assert stop.accept(0.45) > 0.9  # a step's stop reads the calibration as it is now


def test_a_batch_of_chains_is_priced_where_their_rows_together_take_the_step():
    """In a batch, every drafting chain adds its rows to the same step: with 4 chains j + 1 drafts deep the
    step has 4 (j + 1) rows more, so a row costs (T(B + 4 (j + 1)) - T(B)) / (4 (j + 1)), and rows dearer
    past 8 (a compute-bound kernel's second pass) raise the price of the second draft already, where one
    chain alone would not reach them."""
    from specserve.spec_decode.controller import SpecController

    c = SpecController(5)
    for n in range(1, 29):
        c.record_target(n, 0.040 + 0.002 * min(n, 8) + 0.006 * max(n - 8, 0))
    c.record_draft(4, 0.001)
    reqs = ["a", "b", "c", "d"]
    for r in reqs:
        for _ in range(20):
            c.record_acceptance(r, 2, 2)
    ks = c.choose_ks(reqs)
    assert all(k >= 1 for k in ks)
    stop = c.chain_stop
    assert stop is not None
    assert stop.rows[0] == pytest.approx(0.002)  # rows 5-8: 2 ms each
    assert stop.rows[1] == pytest.approx((4 * 0.002 + 4 * 0.006) / 8)  # rows 9-12 cost 6 ms each
    assert stop.rows[4] == pytest.approx((4 * 0.002 + 16 * 0.006) / 20)


def test_no_chain_stop_without_the_adaptive_plan_or_without_model_drafts():
    from specserve.spec_decode.controller import SpecController
    from specserve.spec_decode.state import Source

    fixed = SpecController(4, adaptive=False)
    assert fixed.choose_ks(["a"]) == [4] and fixed.chain_stop is None  # a fixed k is exactly k drafts
    c = SpecController(4)
    for n in range(1, 8):
        c.record_target(n, 0.010 + 0.001 * n)
    c.record_draft(1, 0.001)
    c.record_acceptance("a", 4, 4, Source.LOOKUP)
    assert c.choose_ks(["a"], sources=[Source.LOOKUP])[0] > 0 and c.chain_stop is None  # lookup: no chain
    c.record_acceptance("a", 4, 4, Source.MODEL)
    assert c.choose_ks(["a"], sources=[Source.MODEL], hold=True) == [0] and c.chain_stop is None
