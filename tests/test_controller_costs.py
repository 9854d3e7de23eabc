"""The controller's cost inputs: what a draft's catch-up on a backlog costs per token."""

import pytest

from specserve.spec_decode.controller import catch_up_slope


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
    for n in (1, 2, 3, 4, 5):  # verification rows as dear as the step: the model says off
        c.record_target(n, 0.010 * n)
    c.record_draft(1, 0.005)
    probes = [c.choose_ks(["a", "b", "c"], backlog=[400, 3, 250]) for _ in range(6)]
    assert all(ks[0] == 0 and ks[2] == 0 for ks in probes) and any(ks[1] for ks in probes)
