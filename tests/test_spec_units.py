"""Small unit tests of the speculation pieces: n-gram lookup, SpeculativeConfig merging, draft vocabulary check,
controller math."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specserve.config import EngineConfig, SpecserveError, SpeculativeConfig
from specserve.spec_decode.controller import SpecController, StepCost, expected_tokens, ideal_speedup
from specserve.spec_decode.ngram import NgramProposer, lookup
from specserve.spec_decode.proposer import ProposeRequest
from specserve.spec_decode.state import Acceptance, Source
from tests.helpers import tiny_hf_model


# -- n-gram lookup ---------------------------------------------------------------------------------------------
def lk(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    return lookup(np.asarray(tokens, dtype=np.int64), k, min_n, max_n)


@pytest.mark.parametrize("tokens,k,min_n,max_n,expected", [
    ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4]),  # suffix [1, 2] seen at 0: propose what followed
    ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2]),  # fewer than k tokens follow the match: all of them
    ([5, 1, 9, 1, 7, 1], 2, 1, 1, [7, 1]),  # several matches: the most recent earlier occurrence
    ([1, 2, 8, 3, 2, 9, 1, 2], 1, 1, 2, [8]),  # the longest suffix wins over a more recent shorter one
    ([1, 2, 8, 3, 2, 9, 1, 2], 1, 1, 1, [9]),  # ... which max_n = 1 takes
    ([1, 2, 3, 1], 3, 2, 4, []),  # only a 1-gram matches, below min_n
    ([1, 2, 3, 4], 3, 1, 4, []),  # nothing repeats
    ([7], 3, 1, 4, []),  # too short to hold a match
    ([7, 7], 3, 1, 4, [7]),
    ([4, 4, 4, 4], 2, 1, 2, [4]),  # overlapping match: [4, 4] at 1 is followed by the last token only
    ([1, 2, 3, 9, 9, 1, 2, 3], 4, 3, 3, [9, 9, 1, 2]),
])
def test_ngram_lookup(tokens, k, min_n, max_n, expected):
    assert lk(tokens, k, min_n, max_n) == expected


def test_ngram_lookup_never_matches_the_suffix_itself():
    tokens = list(range(10, 30))  # all distinct: the suffix's only occurrence is itself
    for n in range(1, 5):
        assert lk(tokens, 4, 1, n) == []


def test_ngram_proposer_per_request_k():
    reqs = [ProposeRequest("a", [1, 2, 3, 4, 5, 1, 2], 7, 3, (), None),  # type: ignore[arg-type]
            ProposeRequest("b", [1, 2, 3, 4, 5, 1, 2], 7, 1, (), None),  # type: ignore[arg-type]
            ProposeRequest("c", [6, 7, 8], 3, 3, (), None)]  # type: ignore[arg-type]
    drafts = NgramProposer(1, 4).propose(reqs)
    assert [d.token_ids for d in drafts] == [[3, 4, 5], [3], []]
    assert all(d.probs is None for d in drafts)  # one-hot q
    assert NgramProposer.writes_kv is False


# -- SpeculativeConfig.from_args: V0 flags + V1 JSON ---------------------------------------------------------------
def test_config_off_by_default():
    cfg = SpeculativeConfig.from_args()
    assert not cfg.enabled and cfg.method is None
    assert not EngineConfig.from_kwargs(None).speculative.enabled


def test_config_v0_ngram_spelling():
    cfg = SpeculativeConfig.from_args(speculative_model="[ngram]", num_speculative_tokens=3,
                                      prompt_lookup_max=6, prompt_lookup_min=2)
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("ngram", None, 3)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 6)
    assert SpeculativeConfig.from_args(speculative_method="[ngram]").method == "ngram"


def test_config_v0_draft_model_implies_draft():
    cfg = SpeculativeConfig.from_args(speculative_model="/models/draft", num_speculative_tokens=2)
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft", "/models/draft", 2)


def test_config_default_k_per_method():
    assert SpeculativeConfig.from_args(speculative_method="ngram").num_speculative_tokens == 5
    assert SpeculativeConfig.from_args(speculative_model="/d").num_speculative_tokens == 4
    assert SpeculativeConfig.from_args(speculative_method="layer_skip").num_speculative_tokens == 4


def test_config_v1_json():
    cfg = SpeculativeConfig.from_args(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, '
                                                         '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == \
        ("ngram", 4, 2, 5)
    assert cfg.adaptive
    cfg = SpeculativeConfig.from_args(speculative_config={"model": "/d", "num_speculative_tokens": 3,
                                                          "adaptive": False})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens, cfg.adaptive) == ("draft", "/d", 3, False)
    cfg = SpeculativeConfig.from_args(speculative_config='{"method": "layer_skip", "draft_layers": 2}')
    assert (cfg.method, cfg.draft_layers) == ("layer_skip", 2)
    assert SpeculativeConfig.from_args(speculative_config='{"model": "[ngram]"}').method == "ngram"


def test_config_flags_override_json():
    cfg = SpeculativeConfig.from_args(num_speculative_tokens=2, prompt_lookup_max=7, draft_layers=3,
                                      speculative_config='{"method": "ngram", "num_speculative_tokens": 6, '
                                                         '"prompt_lookup_max": 3}')
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.draft_layers) == ("ngram", 2, 7, 3)
    cfg = SpeculativeConfig.from_args(speculative_method="draft", speculative_model="/flag",
                                      speculative_config='{"method": "ngram", "model": "/json"}')
    assert (cfg.method, cfg.model) == ("draft", "/flag")


def test_config_flag_beats_json_for_every_field():
    # adaptive too: an explicit --no-speculative-adaptive beats the JSON's "adaptive": true
    cfg = SpeculativeConfig.from_args(speculative_adaptive=False,
                                      speculative_config='{"method": "ngram", "adaptive": true}')
    assert not cfg.adaptive
    cfg = SpeculativeConfig.from_args(speculative_adaptive=True,
                                      speculative_config='{"method": "ngram", "adaptive": false}')
    assert cfg.adaptive
    assert not SpeculativeConfig.from_args(speculative_config='{"method": "ngram", "adaptive": false}').adaptive
    cfg = SpeculativeConfig.from_args(speculative_method="ngram", suffix_cache_tokens=7, speculative_eagle_topk=1,
                                      prompt_lookup_source="suffix", grammar_drafts=False,
                                      speculative_config='{"suffix_cache_tokens": 9, "prompt_lookup_source": '
                                                         '"prompt", "grammar_drafts": true}')
    assert (cfg.suffix_cache_tokens, cfg.prompt_lookup_source, cfg.grammar_drafts) == (7, "suffix", False)


def test_config_defaults_come_from_the_fields():
    cfg = SpeculativeConfig.from_args(speculative_method="ngram")
    for f in dataclasses.fields(SpeculativeConfig):
        if f.name not in ("method", "num_speculative_tokens", "prompt_lookup_min"):
            assert getattr(cfg, f.name) == f.default, f.name
    with pytest.raises(TypeError, match="unknown speculative arguments"):
        SpeculativeConfig.from_args(speculative_method="ngram", num_spec_tokens=3)


def test_config_through_engine_kwargs():
    cfg = EngineConfig.from_kwargs(None, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
                                   speculative_adaptive=False).speculative
    assert (cfg.method, cfg.num_speculative_tokens, cfg.adaptive) == ("ngram", 3, False)


@pytest.mark.parametrize("bad,match", [
    ('{"method": "ngram", "num_spec_tokens": 3}', r"unknown --speculative-config keys: \['num_spec_tokens'\]"),
    ('{"method": "ngram", "x": 1, "y": 2}', r"\['x', 'y'\]"),
    ("{method: ngram}", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "medusa"}', "speculative method must be one of"),
    ('{"method": "draft"}', "needs a speculative model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "layer_skip", "draft_layers": 0}', "draft_layers must be >= 1"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_args(speculative_config=bad)


# -- draft model checks at start-up -----------------------------------------------------------------------------
def test_draft_vocab_mismatch_refused(tmp_path):
    from specserve.llm import LLM
    from tests.helpers import write_char_tokenizer

    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    tiny_hf_model("llama", seed=0, layers=2, vocab=256).save_pretrained(target)
    write_char_tokenizer(target, 256)
    tiny_hf_model("llama", seed=1, layers=1, vocab=300).save_pretrained(draft)
    with pytest.raises(SpecserveError) as e:
        LLM(target, dtype="float32", device="cpu", num_blocks=8, speculative_model=draft,
            num_speculative_tokens=2)
    assert "300" in str(e.value) and "256" in str(e.value)
    assert "vocabulary" in str(e.value)


# -- controller math ---------------------------------------------------------------------------------------------
def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=1e-4)  # alpha clamped just below 1
    assert expected_tokens(0.8, 4) == pytest.approx(sum(0.8 ** i for i in range(5)))
    ks = [expected_tokens(0.7, k) for k in range(8)]
    assert ks == sorted(ks) and ks[-1] < 1 / (1 - 0.7)


def test_ideal_speedup():
    assert ideal_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens(0.8, 4))
    assert ideal_speedup(0.8, 4, 0.1) == pytest.approx(expected_tokens(0.8, 4) / 1.4)
    assert ideal_speedup(0.5, 0, 0.3) == 1.0
    assert ideal_speedup(0.1, 5, 0.5) < 1.0  # bad drafts that cost something: slower


def test_step_cost_table():
    cost = StepCost()
    assert cost.predict(10) is None
    for n in (1, 8, 32, 64):
        cost.add(n, 0.002 + 0.0005 * n)
    assert cost.predict(100) == pytest.approx(0.052)
    assert cost.distinct() == 4
    flat = StepCost()
    flat.add(5, 0.01)
    flat.add(5, 0.03)
    assert flat.predict(1000) == pytest.approx(0.02)  # one token count: flat around it
    assert cost.predict(20) == pytest.approx(0.002 + 0.0005 * 20)  # interpolated between 8 and 32
    assert cost.predict(0) == pytest.approx(0.0025)  # below the smallest: its cost
    cost.add(20, 0.009)  # a new sample replaces the remembered predictions around it
    assert cost.predict(20) == pytest.approx(0.009) and cost.predict(26) < 0.002 + 0.0005 * 26


def test_one_slow_sample_does_not_price_a_count_out_of_the_plan():
    """The controller measures only the counts it plans. A count priced by one slow sample (calibration on
    a busy machine) would never be planned nor measured again: the table is read through its greatest convex
    minorant (a step's time is flat, then rises by each row's compute) until three samples confirm it; a
    count's time is the median of its samples."""
    cost = StepCost()
    for n, ms in ((1, 30), (2, 32), (3, 34), (4, 80), (5, 38), (6, 40)):
        cost.add(n, ms / 1000)
    assert cost.predict(4) == pytest.approx(0.036)  # the 80 ms outlier, read on the curve
    assert [cost.predict(n) for n in (1, 2, 3, 5, 6)] == pytest.approx([0.030, 0.032, 0.034, 0.038, 0.040])
    cost.add(6, 0.090)  # a second, slow sample of the largest count: no larger count bounds it
    assert cost.predict(6) == pytest.approx(0.065)
    cost.add(6, 0.070)  # three samples: their median, a real corner the curve keeps
    assert cost.predict(6) == pytest.approx(0.070) and cost.predict(5) == pytest.approx(0.038)
    for _ in range(3):
        cost.add(5, 0.045)  # a count planned and measured again: its median moves the curve
    assert cost.predict(5) == pytest.approx(0.045) and cost.predict(4) == pytest.approx(0.0395)
    assert cost.predict(3) == pytest.approx(0.034)


def test_the_cost_table_keeps_the_counts_sampled_last():
    """A server sees a new token total at almost every prefill; the table keeps ``MAX_COUNTS`` counts, the
    count sampled longest ago making room, so a busy server's decode and verification counts stay."""
    cost = StepCost()
    for i in range(3 * StepCost.MAX_COUNTS):
        cost.add(1000 + i, 1.0 + i / 1000)  # prefills of ever new lengths
        cost.add(1 + i % 6, 0.030 + 0.002 * (i % 6))  # one request's decode and verifications
    assert cost.distinct() == StepCost.MAX_COUNTS
    assert [cost.predict(n) for n in range(1, 7)] == pytest.approx([0.030 + 0.002 * j for j in range(6)])
    assert cost.predict(1000 + 3 * StepCost.MAX_COUNTS - 1) == pytest.approx(1.0 + (3 * StepCost.MAX_COUNTS - 1) / 1000)
    assert cost.predict(1000) != pytest.approx(1.0)  # evicted: read between the counts still kept


def test_acceptance_per_position():
    c = SpecController(max_k=4, prior_alpha=0.6, prior_weight=2.0)
    assert c.rates("r") == [0.6] * 4
    c.record_acceptance("r", 4, 2)  # drafts 1, 2 accepted, 3 rejected, 4 never verified
    # the global prior: each position's counts over the position before it (2 pseudo-observations)
    g1 = (1 + 2 * 0.6) / 3
    g2 = (1 + 2 * g1) / 3
    g3 = (0 + 2 * g2) / 3
    g = [g1, g2, g3, g3]  # position 4 was never verified: it follows position 3
    assert c.global_rates == pytest.approx(g)
    assert c.rates("r") == pytest.approx([(1 + 2 * g[0]) / 3, (1 + 2 * g[1]) / 3, (0 + 2 * g[2]) / 3, g[3]])
    before = c.rates("r")
    c.record_acceptance("r", 0, 0)  # no drafts: no observation
    assert c.rates("r") == before
    assert c.gains("r") == pytest.approx([before[0], before[0] * before[1], before[0] * before[1] * before[2],
                                          before[0] * before[1] * before[2] * before[3]])
    c.states.drop("r")
    # A forgotten (or new) request starts from the recent acceptance over all requests.
    assert c.rates("r") == c.global_rates


def test_untried_positions_follow_the_one_before():
    """A source accepted 19 times in 20 at k = 3 (positions 4, 5 never verified) with a verification cost that
    pays for more: its fourth and fifth drafts are priced like its third, so the controller tries them. With a
    flat prior (0.6 for an unseen position) k stayed at 3 for good: never tried, never measured."""
    c = SpecController(max_k=5, explore_every=10**6)
    for n in range(1, 7):
        c.record_target(n, 0.006 + 0.0006 * (n - 1))
    for i in range(40):
        c.record_acceptance("r", 3, 3 if i % 20 else 0, "lookup")
    g = c._global_of("lookup")
    assert g[0] > 0.9 and g[3] == pytest.approx(g[2]) and g[4] == pytest.approx(g[2])
    assert c.choose_ks(["r"], sources=["lookup"]) == [5]
    for _ in range(40):  # the deeper drafts turn out to fail: measured, they are priced as they are
        c.record_acceptance("r", 5, 3, "lookup")
    assert c.rates("r", "lookup")[3] < 0.2 and c.choose_ks(["r"], sources=["lookup"]) == [3]


def test_bursty_acceptance_drafts_deeper_than_iid():
    """n-gram-like acceptance: the first draft is a coin flip, but a match that survives it survives the rest.
    Per-position rates see that drafts 2..K are nearly free tokens; a single i.i.d. alpha would not."""
    c = SpecController(max_k=5)
    for n in range(1, 7):
        c.record_target(n, 0.010 + 0.0015 * (n - 1))
    c.record_draft(1, 0.0001)
    for i in range(40):
        c.record_acceptance("r", 5, 5 if i % 2 else 0)
    rates = c.rates("r")
    assert rates[0] == pytest.approx(0.5, abs=0.1) and min(rates[1:]) > 0.8
    assert c.choose_ks(["r"]) == [5]


def test_sources_keep_their_own_acceptance_and_lookup_drafts_are_free():
    """--prompt-lookup-first: one request drafts from prompt lookup on some steps and from the model on others.
    Each source has its own acceptance; lookup drafts cost verification tokens but no draft-model step."""
    c = SpecController(max_k=5, explore_every=10**6)
    for n in range(1, 12):
        c.record_target(n, 0.010 + 0.0004 * (n - 1))  # verification cost nearly flat in tokens
    c.record_draft(1, 0.004)  # one model draft step: 40% of a target step
    for _ in range(30):
        c.record_acceptance("r", 5, 5, "lookup")  # a long match survives all five drafts
        c.record_acceptance("r", 5, 1, "model")  # the model's second draft keeps failing
    assert c.rates("r", "lookup")[0] > 0.9 and c.rates("r", "model")[1] < 0.2
    assert c.rates("r") == c.global_rates  # the default source saw nothing
    assert c.choose_ks(["r"], sources=["lookup"]) == [5]
    assert c.choose_ks(["r"], sources=["model"]) == [1]
    assert c.choose_ks(["r", "r"], sources=["lookup", "model"]) == [5, 1]
    c.states.drop("r")
    assert c.rates("r", "lookup") == c._global_of("lookup")


def test_tree_sizes_are_priced_with_the_rest_of_the_batch():
    """A tree probed by one request of a batch of 32 pays for its nodes at the batch's cost curve: where each
    row past the batch costs more than its node is worth, fewer nodes (or none) are verified than when the
    tree is alone in the step."""
    c = SpecController(max_k=5)
    for n in range(1, 48):
        c.record_target(n, 0.006 + 0.0002 * min(n, 8) + 0.0012 * max(n - 8, 0))  # flat to 8 rows, then steep
    probs = [[0.7, 0.5, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02]]
    alone, in_batch = c.choose_tree_sizes(probs), c.choose_tree_sizes(probs, other_tokens=31)
    assert alone == [6] and in_batch == [0], (alone, in_batch)


def test_per_request_k_in_one_batch():
    """One request whose drafts are always accepted, one whose drafts never are: only the first drafts."""
    c = SpecController(max_k=4)
    for n in (2, 3, 4, 5, 6, 7, 8, 9, 10):
        c.record_target(n, 0.010 + 0.002 * n)
    c.record_draft(1, 0.0002)
    c.record_draft(2, 0.0003)
    for _ in range(20):
        c.record_acceptance("good", 4, 4)
        c.record_acceptance("bad", 4, 0)
    assert c.choose_ks(["good", "bad"]) == [4, 0]
    assert max(c.choose_ks(["good", "bad"]), default=0) == 4 and c.last_k == 4


def test_exploration_backs_off_while_drafts_keep_losing():
    c = SpecController(max_k=4, explore_every=4)
    for n in (8, 40):  # rows cheap (drafting could pay), but alpha ~ 0: speculation loses
        c.record_target(n, 0.05 + 0.001 * n)
    c.record_draft(8, 0.005)
    c.record_acceptance("r", 4, 0)
    for _ in range(20):
        c.record_acceptance("r", 1, 0)
    ks = [max(c.choose_ks(["r"] * 8), default=0) for _ in range(400)]
    explored = [i for i, k in enumerate(ks) if k > 0]
    assert 0 < len(explored) <= 8  # 4, 8, 16, ... steps apart instead of every 4th step
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_choose_k_not_adaptive_is_max_k():
    c = SpecController(max_k=5, adaptive=False)
    assert max(c.choose_ks(["a", "b"]), default=0) == 5
    assert max(c.choose_ks([]), default=0) == 0


def test_choose_k_off_when_speculation_loses():
    """Compute-bound target (time proportional to tokens) and poor acceptance: k = 0."""
    c = SpecController(max_k=6)
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        c.record_target(n, 0.001 * n)
    c.record_draft(4, 0.0005)
    for r in "abcd":
        for _ in range(10):
            c.record_acceptance(r, 6, 0)
    assert all(c.rates(r)[0] < 0.05 for r in "abcd")
    assert max(c.choose_ks(list("abcd")), default=0) == 0


def test_choose_k_max_when_costs_flat_and_acceptance_high():
    """Memory-bound target (flat cost), cheap drafts, drafts nearly always accepted: k = max_k."""
    c = SpecController(max_k=6)
    for n in (1, 2, 4, 7, 14, 28):
        c.record_target(n, 0.010)
    c.record_draft(1, 0.0002)
    for _ in range(5):
        c.record_acceptance("a", 6, 6)
    assert max(c.choose_ks(["a"]), default=0) == 6


def test_choose_k_depends_on_batch_through_measured_cost():
    """Same acceptance, target time a + b * tokens: speculation at batch 1, none at batch 64."""
    c = SpecController(max_k=4)
    for n in (1, 5, 64, 128, 256, 320):
        c.record_target(n, 0.010 + 0.001 * n)
    c.record_draft(1, 0.0005)
    c.record_draft(64, 0.002)
    reqs = [f"r{i}" for i in range(64)]
    for i in range(8):
        for r in reqs:
            c.record_acceptance(r, 4, (0, 2, 0, 4)[i % 4])  # first draft accepted every other pass
    assert max(c.choose_ks(reqs[:1]), default=0) > 0
    assert max(c.choose_ks(reqs), default=0) == 0


def test_decode_rows_of_other_requests_are_tokens_the_plan_weighs():
    """A draft model's steps run in series before the whole step, so they stall every row in it. One request
    drafting next to three decode rows that draft nothing: counted as rows that yield tokens, those rows make a
    3-draft chain (30 ms of draft steps) cost more than it gains; counted as prefill rows (no tokens) or left
    out, it looks as good as alone."""
    c = SpecController(max_k=4)
    for n in (1, 2, 4, 8, 16, 32):
        c.record_target(n, 0.040 + 0.006 * n)
    c.record_draft(1, 0.010)
    for _ in range(8):
        c.record_acceptance("a", 4, 3)
    assert c.choose_ks(["a"]) == [3]
    assert c.choose_ks(["a"], 3) == [3]
    assert c.choose_ks(["a"], 3, other_decodes=3) == [0]


def test_choose_k_measures_the_other_extreme_first():
    """With one token count measured the slope is unknown: alternate between max_k and 0 to measure it."""
    c = SpecController(max_k=3)
    c.record_target(4, 0.01)
    assert max(c.choose_ks(["a"]), default=0) == 0  # last_k starts at max_k
    assert max(c.choose_ks(["a"]), default=0) == 3


def test_draft_step_cost_excludes_catch_up():
    """The controller's draft cost is one more draft step, not the first call's catch-up over every token
    since the request last drafted (charging that made the controller draft ever less; see worker/drafter)."""
    from specserve.worker.drafter import draft_step_cost as cost

    # 8 rows: a catch-up over 80 tokens (0.8 s), then two one-token steps; 1.1 s in all (sampling included)
    assert cost([(8, 80, 0.8), (8, 8, 0.1), (8, 8, 0.1)], 1.1, 3) == pytest.approx(0.15)
    # k = 1: the call scaled to one token per row, plus the sampling after it
    assert cost([(8, 80, 0.8)], 0.85, 1) == pytest.approx(0.8 * 8 / 80 + 0.05)
    assert cost([], 0.01, 5) == pytest.approx(0.002)  # n-gram: no model calls


@pytest.mark.parametrize("alpha,min_gain,drafts", [(0.07, 0.03, False), (0.07, 0.0, True), (0.20, 0.03, True)])
def test_marginal_predicted_gain_does_not_draft(alpha, min_gain, drafts):
    """Flat verification cost and a draft step costing 5% of a target step, k = 1: the predicted gain is
    (1 + alpha) / 1.05 - 1, i.e. +1.9% at alpha 0.07 (drafts only without the 3% margin) and +14% at 0.2."""
    c = SpecController(max_k=1, prior_alpha=alpha, explore_every=10**6, min_gain=min_gain)
    for n in (1, 2):
        c.record_target(n, 0.010)
    c.record_draft(1, 0.0005)
    c._global[Source.METHOD] = Acceptance(1)  # verified before, counts faded out (else its first drafts probe)
    assert c.rates("new request")[0] == pytest.approx(alpha)
    assert c.choose_ks(["new request"]) == ([1] if drafts else [0])


def test_a_never_verified_source_gets_one_full_probe():
    """Priced at the prior alone, a draft model can look too dear to ever try; the first plan of a source never
    verified drafts max_k for the request with the least to catch up on, then the plan decides. Where no plan
    could pay even with every draft accepted, that first measurement waits."""
    c = SpecController(max_k=4, explore_every=10**6)
    for n in range(1, 11):
        c.record_target(n, 0.010 + 0.004 * n)  # at the prior's 0.6 the plan alone would never draft
    c.record_draft(1, 0.006)
    assert c.choose_ks(["a", "b"], backlog=[50.0, 3.0]) == [0, 4]
    c.record_acceptance("b", 4, 4)
    assert c.choose_ks(["a", "b"], backlog=[50.0, 0.0]) == [0, 0]
    dear = SpecController(max_k=4, explore_every=10**6)
    for n in range(1, 11):
        dear.record_target(n, 0.010 * n)  # a row as dear as a decode step: no acceptance could pay
    dear.record_draft(1, 0.006)
    assert dear.choose_ks(["a", "b"], backlog=[50.0, 3.0]) == [0, 0]


def test_a_requests_stale_rejections_fade():
    """One rejected draft at position 2 stops deeper drafts only for a while: a position's counts fade by
    IDLE_DECAY per step its request's drafts do not reach it, back toward the source's global rates."""
    from specserve.spec_decode.controller import IDLE_DECAY

    c = SpecController(max_k=4, explore_every=10**6)
    for _ in range(20):
        c.record_acceptance("others", 4, 4)
    c.record_acceptance("r", 4, 1)
    fresh = c.rates("r")
    assert fresh[1] < 0.7 * c.global_rates[1]
    c._step += 11  # ten steps without reaching position 2
    assert c.rates("r")[1] > fresh[1] and c.rates("r")[1] == pytest.approx(
        (2 * c.global_rates[1]) / (IDLE_DECAY ** 10 + 2), rel=1e-6)


def test_cost_observers_see_every_sample():
    """Benchmarks read the controller's cost samples through ``cost_observers`` (no monkey-patching)."""
    from specserve.bench.offline import cost_tap

    c = SpecController(4)
    with cost_tap(c) as (target, draft):
        c.record_target(5, 0.02)
        c.record_draft(1, 0.004)
    c.record_target(1, 0.01)  # after the run: not recorded, and the observer is gone
    assert target == [(5, 0.02)] and draft == [(1, 0.004)] and c.cost_observers == []
    assert c.target_cost.predict(5) == pytest.approx(0.02)


def test_incremental_ngram_index_equals_the_numpy_lookup():
    """NgramIndex (incremental, per request) drafts exactly what the numpy pass over the whole history does,
    step after step as the history grows."""
    import random

    import numpy as np

    from specserve.spec_decode.ngram import NgramIndex, lookup_match

    rng = random.Random(0)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 4), (3, 4), (2, 2)])
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
        idx = NgramIndex(tokens, min_n, max_n)
        for _ in range(60):
            k = rng.randint(1, 6)
            assert idx.match(k) == lookup_match(np.asarray(tokens, dtype=np.int64), k, min_n, max_n), trial
            tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))


def _drain_controller(alpha: float, per_token: float) -> SpecController:
    """Target time 10 ms + ``per_token`` per token, cheap draft steps, every draft position accepted with
    conditional probability ``alpha`` (the prior every request starts from)."""
    c = SpecController(max_k=4, explore_every=10**6, prior_alpha=alpha)
    for n in range(1, 41):
        c.record_target(n, 0.010 + per_token * n)
    for n in range(1, 9):
        c.record_draft(n, 0.0001)
    c._global[Source.METHOD] = Acceptance(4)  # verified before, no counts left: the plans price the prior
    return c


def test_a_draining_batch_drafts_for_its_laggard():
    """Open batch: every request with good acceptance drafts. Draining batch (offline, nothing waits): only the
    request that decides when the batch ends drafts; the others would end no sooner."""
    c = _drain_controller(0.95, 0.0005)
    reqs = ["r0", "r1", "r2", "r3"]
    assert all(k > 0 for k in c.choose_ks(reqs))
    ks = c.choose_ks(reqs, remaining=[30, 40, 25, 31])
    assert ks[1] > 0 and ks[0] == ks[2] == ks[3] == 0
    # within max_k + 1 of the longest, a request must accept too for the deeper levels
    ks = c.choose_ks(reqs, remaining=[30, 40, 38, 10])
    assert ks[1] > ks[2] > 0 and ks[0] == ks[3] == 0
    # one request: the same plan as an open batch
    assert c.choose_ks(["r0"], remaining=[20]) == c.choose_ks(["r0"])


def test_a_level_draining_batch_needs_every_request_to_accept():
    """Eight requests level with each other and moderate acceptance: an open batch drafts (tokens per second
    rise), a draining one does not (it ends only when all eight advance: 0.6^8 per level)."""
    c = _drain_controller(0.6, 0.0005)
    reqs = [f"r{i}" for i in range(8)]
    assert max(c.choose_ks(reqs)) > 0
    assert c.choose_ks(reqs, remaining=[40] * 8) == [0] * 8
    c = _drain_controller(0.99, 0.0001)  # near-certain acceptance and flat costs: drafting all of them pays
    assert min(c.choose_ks(reqs, remaining=[40] * 8)) > 0


def test_an_open_batch_pays_for_the_drafts_catch_up():
    """In a server's open batch too, a request whose head has not read its last few hundred tokens drafts only
    when what the drafts bring outweighs that catch-up; lookup drafts read nothing first."""
    c = _drain_controller(0.8, 0.0005)
    reqs = ["r0", "r1", "r2", "r3"]
    c.record_catch_up(100, 0.0065)  # 65 us a token
    assert c.choose_ks(reqs, backlog=[0, 2, 0, 0])[1] > 0
    assert c.choose_ks(reqs, backlog=[0, 400, 0, 0])[1] == 0
    assert c.choose_ks(reqs, sources=["lookup"] * 4, backlog=[0, 400, 0, 0])[1] > 0
    assert c.best_rate(c.gains("r1"), False, 400) < c.best_rate(c.gains("r1"), False, 0)


def test_a_draining_batch_pays_for_the_drafts_catch_up():
    """A laggard whose head has a long backlog to read first (it has not drafted for a while) costs that
    catch-up too: measured per token, it can outweigh what the drafts would save."""
    c = _drain_controller(0.6, 0.0005)
    reqs = ["r0", "r1", "r2", "r3"]
    c.record_catch_up(100, 0.0065)  # 65 us a token
    assert c.choose_ks(reqs, remaining=[30, 40, 25, 31], backlog=[0, 2, 0, 0])[1] > 0
    assert c.choose_ks(reqs, remaining=[30, 40, 25, 31], backlog=[0, 400, 0, 0]) == [0, 0, 0, 0]
    # drafts that cost no model step (prompt lookup) catch up on nothing
    assert c.choose_ks(reqs, sources=["lookup"] * 4, remaining=[30, 40, 25, 31], backlog=[0, 400, 0, 0])[1] > 0
