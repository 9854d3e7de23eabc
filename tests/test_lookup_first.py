"""--prompt-lookup-first (spec_decode/lookup_first.py): routing between prompt lookup and the model proposer, and the
target features of lookup-drafted steps reaching the model proposer later, in order (the worker's
FeatureBuffer). Engine exactness with it is in test_eagle.py (greedy equality, drafts equal to the dense
forward)."""

from __future__ import annotations

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.sample.sampler import RequestSamplingState
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.lookup_first import LookupFirstProposer
from specserve.spec_decode.proposer import Draft, ProposeRequest
from specserve.spec_decode.state import Acceptance, FeatureBuffer, SpecState


class FakeModel:
    writes_kv = True

    def __init__(self) -> None:
        self.calls: list[list[ProposeRequest]] = []
        self.dropped: list[str] = []

    def propose(self, reqs: list[ProposeRequest], other_rows: int = 0) -> list[Draft]:
        self.calls.append(reqs)
        return [Draft([7] * r.k) for r in reqs]

    def drop(self, req_id: str) -> None:
        self.dropped.append(req_id)


def _req(rid: str, tokens: list[int], feats: tuple[int, torch.Tensor] | None, k: int = 3) -> ProposeRequest:
    state = RequestSamplingState.create(SamplingParams(temperature=0), tokens[:1], torch.device("cpu"))
    return ProposeRequest(rid, tokens, len(tokens) - 1, k, (0,), state, feats)


def _feats(first: int, n: int) -> tuple[int, torch.Tensor]:
    return first, torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, 2).clone()


def test_routes_repeats_to_lookup_and_the_rest_to_the_model():
    model = FakeModel()
    p = LookupFirstProposer(model, min_n=3, max_n=4)
    repeat = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # "1 2 3" occurred before: lookup drafts "4 5 6"
    fresh = [1, 2, 3, 4, 5, 6, 9, 2, 3]  # only "2 3" repeats: shorter than min_n
    drafts = p.propose([_req("a", repeat, _feats(0, 8)), _req("b", fresh, _feats(0, 8))])
    assert drafts[0].token_ids == [4, 5, 6] and drafts[0].probs is None
    assert drafts[1].token_ids == [7, 7, 7]
    assert [r.req_id for r in model.calls[0]] == ["b"]
    assert (p.num_lookup, p.num_model) == (1, 1)


@pytest.mark.parametrize("cut", [True, False])
def test_grammar_cuts_lookup_before_routing(cut):
    """With grammar-aware drafting a structured-output request's lookup continuation is cut where its grammar
    stops allowing it, and one the grammar forbids from its first token leaves the step to the model."""
    from specserve.sample.grammar import GrammarCompiler, GrammarState
    from specserve.sampling_params import StructuredOutputsParams
    from tests.helpers import byte_tokenizer

    compiler = GrammarCompiler(byte_tokenizer(260), 260, [257])

    def req(rid: str, text: str) -> ProposeRequest:
        r = _req(rid, [ord(c) for c in text], None)
        r.state.grammar = GrammarState(compiler.compile(StructuredOutputsParams(regex="ab[a-z]*")))
        return r

    model = FakeModel()
    p = LookupFirstProposer(model, min_n=3, max_n=4, grammar_cut=cut)
    drafts = p.propose([req("a", "xyzab9xyz"), req("b", "xyz9xyz")])  # "xyz" was followed by "ab9", "9xy"
    if cut:
        assert drafts[0].token_ids == [ord("a"), ord("b")] and drafts[1].token_ids == [7, 7, 7]
        assert [r.req_id for c in model.calls for r in c] == ["b"]
    else:
        assert drafts[0].token_ids == [ord(c) for c in "ab9"] and drafts[1].token_ids == [ord(c) for c in "9xy"]
        assert not model.calls


def test_features_of_lookup_steps_stay_buffered_for_the_model_in_order():
    """The worker takes a request's features only for a model proposal: the chunks of lookup-drafted steps
    stay in its FeatureBuffer and reach the model together, in order; a restart keeps only the newer."""
    buf = FeatureBuffer()
    for first, n in ((0, 6), (6, 4), (10, 2)):  # two lookup steps, then the model's
        buf.add(*_feats(first, n))
    assert len(buf) == 12  # the backlog the controller prices
    first, f = buf.take()
    assert first == 0 and f[:, 0].tolist() == list(range(12)) and len(buf) == 0
    buf.add(*_feats(12, 2))
    assert buf.take()[0] == 12  # nothing older left
    buf.add(*_feats(14, 4))
    buf.add(*_feats(30, 2))  # not contiguous (preemption, prefix hit): the newer wins
    assert len(buf) == 2
    first, f = buf.take()
    assert first == 30 and f.shape[0] == 2


def test_feature_views_of_a_step_copy_are_compacted():
    """Rows handed over as views of a step's copy (``owned``) are kept without a copy of their own, until
    ``COMPACT_AT`` of them: those become one joined chunk of the buffer's own, which no longer holds the steps'
    copies alive (and is not copied again by later compactions). Rows not ``owned`` are copied at once (the
    forward's output may be reused)."""
    buf = FeatureBuffer()
    steps = [torch.arange(i * 16, i * 16 + 16, dtype=torch.float32).view(8, 2) for i in range(FeatureBuffer.COMPACT_AT)]
    for i, step in enumerate(steps[:-1]):
        buf.add(i, step[3:4], owned=True)
    def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    assert all(shares(c, s) for c, s in zip(buf.chunks, steps))  # views, no copies
    buf.add(FeatureBuffer.COMPACT_AT - 1, steps[-1][3:4], owned=True)
    assert len(buf.chunks) == 1 and not any(shares(buf.chunks[0], s) for s in steps) and len(buf) == FeatureBuffer.COMPACT_AT
    joined = buf.chunks[0]
    for i, step in enumerate(steps):
        buf.add(FeatureBuffer.COMPACT_AT + i, step[5:6], owned=True)
    assert len(buf.chunks) == 2 and buf.chunks[0] is joined
    first, f = buf.take()
    assert first == 0 and f.tolist() == [s[3].tolist() for s in steps] + [s[5].tolist() for s in steps]
    out = torch.zeros(4, 2)
    buf.add(16, out[1:2])
    out.fill_(7.0)  # the forward's buffer reused by the next step
    assert buf.take()[1].tolist() == [[0.0, 0.0]]


def test_forget_kv_forgets_the_routing():
    from specserve.spec_decode.state import SpecStates

    model = FakeModel()
    p = LookupFirstProposer(model, min_n=3, max_n=4)
    states = SpecStates()
    req = _req("a", [1, 2, 3, 4, 1, 2, 3], None)
    req.spec = states.of("a")
    assert p.source(req, 3) == "lookup"
    assert req.spec.draft.routed is not None
    states.forget_kv("a")
    assert states.of("a").draft.routed is None


def test_config():
    cfg = SpeculativeConfig.from_args(speculative_method="eagle", speculative_model="x", prompt_lookup_first=True)
    assert cfg.prompt_lookup_first and cfg.prompt_lookup_min == 3
    assert SpeculativeConfig.from_args(speculative_method="ngram").prompt_lookup_min == 1
    cfg = SpeculativeConfig.from_args(speculative_config='{"method": "layer_skip", "prompt_lookup_first": true, '
                                                         '"prompt_lookup_min": 2}')
    assert cfg.prompt_lookup_first and cfg.prompt_lookup_min == 2
    with pytest.raises(ValueError, match="needs a model proposer"):
        SpeculativeConfig.from_args(speculative_method="ngram", prompt_lookup_first=True)


def test_routes_by_expected_gain_once_costs_are_measured():
    """A match goes to lookup only when its match length's measured acceptance predicts more tokens/s than the
    model's acceptance (with its draft steps): a short repeat that keeps failing goes to the model, a long one
    that keeps holding stays with lookup."""
    from specserve.spec_decode.controller import SpecController

    ctl = SpecController(max_k=4)
    model = FakeModel()
    p = LookupFirstProposer(model, min_n=3, max_n=4, controller=ctl)
    short = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]  # suffix "1 2 3" (n = 3) occurred before
    long = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 5]  # suffix "2 3 4 5" (n = 4)
    assert p.source(_req("a", short, None), 4) == "lookup"  # costs unmeasured: any match goes to lookup
    for n, s in ((1, 0.010), (3, 0.011), (5, 0.012)):
        ctl.record_target(n, s)
    ctl.record_draft(1, 0.002)
    for _ in range(20):
        ctl.record_acceptance("a", 4, 3, "model")  # the model is usually right for this request
        x = SpecState()
        x.draft.match_in_flight = 3
        p.observe(x, "lookup", 4, 0)  # 3-token matches keep failing
        x.draft.match_in_flight = 4
        p.observe(x, "lookup", 4, 4)  # 4-token matches hold
    assert p.source(_req("a", short, None), 4) == "model"
    assert p.source(_req("a", long, None), 4) == "lookup"
    req = _req("a", long, None, k=3)
    drafts = p.propose([req])
    assert drafts[0].token_ids == [6, 9, 2] and req.spec.draft.match_in_flight == 4
    # the model's drafts first catch up on what it has not read: a long backlog makes lookup the better route
    p = LookupFirstProposer(model, min_n=3, max_n=4, controller=ctl)
    p._by_n[3] = Acceptance(4)
    for _ in range(20):
        p._by_n[3].observe(4, 1, decay=0.95)  # 3-token matches: one draft in four holds
    ctl.record_catch_up(100, 0.004)  # 40 us a token
    assert p.source(_req("a", short, None), 4) == "model"
    lagging = _req("a", short, None)
    lagging.spec.features.add(0, torch.zeros(300, 2))  # 300 target features the model has not read
    assert p.source(lagging, 4) == "lookup"


def _user_req(rid: str, tokens: list[int], user: str | None) -> ProposeRequest:
    state = RequestSamplingState.create(SamplingParams(temperature=0, user=user), tokens[:1], torch.device("cpu"))
    return ProposeRequest(rid, tokens, len(tokens) - 1, 4, (0,), state)


def test_lookup_from_the_suffix_index_drafts_from_the_same_users_earlier_requests():
    """--prompt-lookup-source suffix: a context seen only in an earlier request of the same user drafts by
    lookup; another user's request with the same context goes to the model."""
    from specserve.spec_decode.suffix import SuffixProposer

    model = FakeModel()
    suffix = SuffixProposer(2, 10_000)
    p = LookupFirstProposer(model, min_n=3, max_n=4, suffix=suffix)
    suffix.finish([5, 6, 7, 8, 20, 21, 22, 23], "alice")  # an earlier answer
    ctx = [1, 2, 6, 7, 8]  # "6 7 8" never occurred in this request itself
    assert p.source(_user_req("a", ctx, "alice"), 4) == "lookup"
    assert p.propose([_user_req("a", ctx, "alice")])[0].token_ids == [20, 21, 22, 23]
    assert p.source(_user_req("b", ctx, "bob"), 4) == "model"
    assert p.propose([_user_req("b", ctx, "bob")])[0].token_ids == [7, 7, 7, 7]
    own = LookupFirstProposer(FakeModel(), min_n=3, max_n=4)  # the default: the request's own history only
    assert own.source(_user_req("c", ctx, "alice"), 4) == "model"
