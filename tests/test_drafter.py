"""The drafter owns speculation on the worker: the model runner never branches on the speculative method, and
per-run overrides (benchmarks, `specserve distill`) go through the drafter's public calls."""

from __future__ import annotations

import ast
import pathlib

import pytest

from specserve import SamplingParams
from specserve.config import SPEC_METHODS
from specserve.llm import LLM
from tests.helpers import save_tiny_checkpoint

RUNNER = pathlib.Path(__file__).parents[1] / "specserve" / "worker" / "model_runner.py"


def test_model_runner_holds_no_proposer_specific_code():
    tree = ast.parse(RUNNER.read_text(encoding="utf-8"))
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & set(SPEC_METHODS), "the runner branches on a speculative method"
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    # the request type proposers take is the one spec_decode name the runner needs
    assert {m for m in imported if m.startswith("specserve.spec_decode")} <= {"specserve.spec_decode.proposer"}
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"SpecController", "NgramProposer", "DraftModelProposer", "EagleProposer",
                        "LookupFirstProposer"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    return LLM(path, speculative_method="ngram", num_speculative_tokens=4, max_num_seqs=2, dtype="float32",
               num_blocks=64)


def test_reset_controller_fixed_k_drafts_exactly_k(llm):
    drafter = llm.engine.runner.drafter
    seen: list[tuple[str, int, float]] = []
    drafter.controller.cost_observers.append(lambda kind, n, s: seen.append((kind, n, s)))
    controller = drafter.reset_controller(adaptive=False, max_k=2)
    assert drafter.controller is controller and controller.max_k == 2 and not controller.adaptive
    prompt = "ab ab ab ab ab ab ab ab ab ab ab ab"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    spec = out.metrics["speculative"]
    assert spec["num_drafts"] > 0
    assert len(spec["accepted_per_position"]) <= 2  # no position beyond k = 2 was drafted
    assert spec["draft_tokens"] <= 2 * spec["num_drafts"]
    assert any(kind == "target" for kind, _, _ in seen)  # the observers moved to the fresh controller
    with pytest.raises(ValueError, match="outside 1..4"):
        drafter.reset_controller(max_k=5)
    drafter.reset_controller(adaptive=True)
    assert drafter.controller.max_k == 4


def test_no_drafter_without_speculation(tmp_path):
    path = save_tiny_checkpoint(tmp_path)
    llm = LLM(path, dtype="float32", num_blocks=16)
    assert llm.engine.runner.drafter is None and not llm.engine.runner.drafts_write_kv
    assert llm.get_metrics()["speculative_k"] == 0


def test_engine_counters_are_the_requests_counters(llm):
    """Acceptance is recorded once, on the request; the engine's totals add finished and live requests."""
    keys = ("num_drafts", "draft_tokens", "accepted_tokens")
    llm.engine.runner.drafter.reset_controller(adaptive=False)  # drafts every step, whatever the timings say
    before = llm.get_metrics()["speculative"]
    outs = llm.generate(["xy xy xy xy xy xy xy", "hello hello hello hello"],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    after = llm.get_metrics()["speculative"]
    for key in keys:
        assert after[key] - before[key] == sum(o.metrics["speculative"][key] for o in outs)
    assert after["num_drafts"] > before["num_drafts"]
    llm.engine.runner.drafter.reset_controller(adaptive=True)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_draft_model_reads_the_prompt_after_the_first_token(tmp_path, method):
    """The step that gives a request its first token makes no draft-model call for it (the draft's catch-up on
    the prompt, or layer skip's partial forwards, are not in the time to first token); the next step drafts.
    Lookup proposers cost nothing and draft at once."""
    path = save_tiny_checkpoint(tmp_path)
    kw = dict(speculative_model=path) if method == "draft" else dict(speculative_method="ngram", prompt_lookup_min=1)
    llm = LLM(path, num_speculative_tokens=3, speculative_adaptive=False, dtype="float32", num_blocks=64, **kw)
    engine, calls = llm.engine, []
    proposer = engine.runner.drafter.proposer
    real = proposer.propose
    proposer.propose = lambda reqs, *rest: calls.append([r.req_id for r in reqs]) or real(reqs, *rest)
    engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = engine.step()
    assert len(first[0].outputs[0].token_ids) == 1
    assert calls == ([] if method == "draft" else [["r"]])
    engine.step()
    assert calls and calls[-1] == ["r"]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_prefill_ahead_holds_draft_model_steps(tmp_path, method):
    """While a server's request waits to be scheduled (``arrivals_pending``), the controller is told to hold
    draft-model steps (they would delay that request's first token) and the draft model is not called; a
    proposer that runs no model (n-gram) is never held. ``AsyncEngine`` wires its queued adds to the hint."""
    from specserve.engine.async_engine import AsyncEngine

    path = save_tiny_checkpoint(tmp_path)
    kw = dict(speculative_model=path) if method == "draft" else dict(speculative_method="ngram", prompt_lookup_min=1)
    llm = LLM(path, num_speculative_tokens=3, dtype="float32", num_blocks=64, **kw)
    engine, drafter = llm.engine, llm.engine.runner.drafter
    engine.scheduler.closed_batches = False  # a server's open batch (an offline batch draining never holds)
    holds, calls, pending = [], [], [False]
    choose, propose = drafter.controller.choose_ks, drafter.proposer.propose
    drafter.controller.choose_ks = lambda *a, **k: holds.append(k["hold"]) or choose(*a, **k)
    drafter.proposer.propose = lambda reqs, *rest: calls.append(len(holds)) or propose(reqs, *rest)
    engine.runner.arrivals_pending = lambda: pending[0]
    engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6] * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    pending[0] = True
    for _ in range(6):
        engine.step()
    held = [i + 1 for i, h in enumerate(holds) if h]
    assert held == ([] if method == "ngram" else list(range(len(holds) - 5, len(holds) + 1)))
    assert not set(calls) & set(held)  # no draft-model call on a held step
    ae = AsyncEngine(engine)
    assert engine.runner.arrivals_pending() is False
    ae._adds_pending = 1
    assert engine.runner.arrivals_pending() is True


def test_rows_without_drafts_count_in_the_step_the_plan_prices(tmp_path):
    """A request that has just had its first token drafts nothing in the next step, but its row is in that step:
    the controller is told of it (one more row, yielding a token), and a draft model that has not read a
    candidate's prompt reads it a chunk at a time, as in any batch, instead of whole before everyone's step."""
    from specserve.spec_decode.draft_model import CATCH_UP_CHUNK

    path = save_tiny_checkpoint(tmp_path)
    llm = LLM(path, speculative_model=path, num_speculative_tokens=2, speculative_adaptive=False, dtype="float32",
              num_blocks=64)
    engine, drafter = llm.engine, llm.engine.runner.drafter
    plans, reads = [], []
    choose, step = drafter.controller.choose_ks, drafter.proposer.step
    drafter.controller.choose_ks = lambda ids, **k: plans.append((list(ids), k.get("other_tokens"),
                                                                  k.get("other_decodes"))) or choose(ids, **k)
    drafter.proposer.step = lambda toks, *rest: reads.append([len(t) for t in toks]) or step(toks, *rest)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8] * 20, params)
    engine.step()  # a's prefill and first token: its draft reads nothing yet
    assert plans == [] and reads == []
    engine.add_request("b", [9, 10, 11], params)
    engine.step()  # a decodes, b's prefill: b's first token, a drafts
    assert plans == [(["a"], 1, 1)]
    assert reads[0] == [CATCH_UP_CHUNK]  # a's 80-token prompt: one chunk in a batch of two
    while engine.has_unfinished():
        engine.step()
    assert all(n <= CATCH_UP_CHUNK for r in reads for n in r)


def test_a_request_that_samples_a_stop_token_gets_no_drafts_for_a_step_it_will_not_run(tmp_path):
    """The step whose tokens include a stop token (EOS, stop_token_ids) ends the request: the draft model is
    not asked for drafts that would be thrown away; until then it drafts every step; the output is unchanged."""
    path = save_tiny_checkpoint(tmp_path)
    llm = LLM(path, speculative_model=path, num_speculative_tokens=2, speculative_adaptive=False, dtype="float32",
              num_blocks=64)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    free = llm.generate(None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), prompt_token_ids=[prompt])
    toks = free[0].outputs[0].token_ids
    stop = toks[6]
    engine, calls = llm.engine, []
    proposer = engine.runner.drafter.proposer
    real = proposer.propose
    proposer.propose = lambda reqs, *rest: calls.append({r.req_id for r in reqs}) or real(reqs, *rest)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop]))
    steps = []
    while engine.has_unfinished():
        n = len(calls)
        out = engine.step()
        steps.append(("r" in set().union(*calls[n:]), bool(out) and out[0].finished))
    assert steps[-1] == (False, True)  # the stop token's step proposed nothing for it
    assert all(proposed for proposed, _ in steps[1:-1])  # every step between the first and the last did
    assert out[0].outputs[0].token_ids == toks[:toks.index(stop) + 1]


def _leak_configs(root: pathlib.Path) -> list[dict]:
    import torch

    from specserve.model.checkpoint.loader import load_checkpoint
    from specserve.platform import detect
    from specserve.worker.model_runner import build_model
    from tests.helpers import save_tiny_eagle_head

    target = save_tiny_checkpoint(root / "target")
    draft = save_tiny_checkpoint(root / "draft", seed=1)
    model = build_model(load_checkpoint(target), detect("cpu"), torch.float32, 1024)
    head = save_tiny_eagle_head(model, str(root / "head"), torch.Generator().manual_seed(0))
    return [dict(model=target, speculative_method=m, **extra) for m, extra in (
        ("ngram", {}), ("suffix", {}), ("draft", {"speculative_model": draft}), ("layer_skip", {}),
        ("eagle", {"speculative_model": head}), ("eagle", {"speculative_model": head, "speculative_eagle_topk": 2,
                                                             "speculative_num_draft_tokens": 6}),
        ("layer_skip", {"prompt_lookup_first": True}))]


def test_no_speculation_state_left_after_finished_and_aborted_requests(tmp_path):
    """With each proposer: after a mix of finished and aborted requests (seeded and greedy), the drafter holds
    no per-request state (``SpecStates`` is empty)."""
    for kwargs in _leak_configs(tmp_path):
        llm = LLM(**kwargs, num_speculative_tokens=3, max_num_seqs=4, dtype="float32", num_blocks=128)
        engine, drafter = llm.engine, llm.engine.runner.drafter
        prompt = "ab ab ab ab ab ab ab ab ab ab ab ab"
        ids = [engine.add_request(None, prompt, SamplingParams(temperature=t, seed=s, max_tokens=n, ignore_eos=True))
               for t, s, n in ((0, None, 12), (1.0, 7, 40), (0.8, None, 40), (0, None, 6))]
        for _ in range(6):
            engine.step()
        assert len(drafter.states) > 0, kwargs
        engine.abort(ids[1])
        engine.abort(ids[2])
        while engine.has_unfinished():
            engine.step()
        engine.step()  # the last finished requests reach the worker with the next step
        assert len(drafter.states) == 0, (kwargs, list(drafter.states))
        llm.close()


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_greedy_chain_ends_where_its_confidence_stops_paying(tmp_path, method):
    """With a chain stop (here fixed: every draft worth half the path before it, kept from 0.2, continued
    from 0.3), a request the plan gives k = 1 drafts up to max_k and ends after its second draft; with a
    keep price above the first draft's worth it drafts nothing. The drafts' confidences reach the
    controller, and the output is the target's own."""
    import torch

    from specserve.spec_decode.proposer import ChainStop

    path = save_tiny_checkpoint(tmp_path / "target")
    if method == "draft":
        kw = dict(speculative_model=path)
    else:
        from specserve.model.checkpoint.loader import load_checkpoint
        from specserve.model.decoder import DecoderModel
        from tests.helpers import save_tiny_eagle_head

        ck = load_checkpoint(path)
        target = DecoderModel(ck.arch, torch.float32, torch.device("cpu"), None, 1024)  # type: ignore[arg-type]
        target.load_weights(ck.state_dict)
        save_tiny_eagle_head(target, str(tmp_path / "head"), torch.Generator().manual_seed(0))
        kw = dict(speculative_method="eagle", speculative_model=str(tmp_path / "head"))
    llm = LLM(path, num_speculative_tokens=4, dtype="float32", num_blocks=64, **kw)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = llm.generate(None, sp, prompt_token_ids=[prompt], speculative=False)[0].outputs[0].token_ids
    drafter = llm.engine.runner.drafter
    ctl = drafter.controller
    chains: list[tuple[int, int]] = []
    recorded: list[tuple[list[float], int]] = []
    real_propose, real_record = drafter.proposer.propose, ctl.record_confidence

    def propose(reqs, *rest):
        out = real_propose(reqs, *rest)
        chains.extend((r.k, len(d.token_ids)) for r, d in zip(reqs, out))
        return out

    current: list[ChainStop] = []

    def choose(ids, **kw):
        ctl._chain_stop = current[-1]
        return [1] * len(ids)

    drafter.proposer.propose = propose
    ctl.choose_ks = choose
    ctl.record_confidence = lambda source, confs, n: recorded.append((list(confs), n)) or real_record(source, confs, n)
    half = lambda p: 0.5  # noqa: E731
    for stop, drafted in ((ChainStop((0.2,) * 5, 0.1, 1.0, half), 2), (ChainStop((0.6,) * 5, 0.1, 1.0, half), 0)):
        chains.clear()
        recorded.clear()
        current.append(stop)
        out = llm.generate(None, sp, prompt_token_ids=[prompt])[0].outputs[0].token_ids
        assert out == ref
        assert chains and any(k == 4 for k, _ in chains)  # the plan's k = 1, raised to max_k
        assert all(n == min(k, drafted) for k, n in chains)
        if drafted:
            assert sorted(len(c) for c, _ in recorded) == sorted(n for _, n in chains if n)  # one per verified chain
            assert all(0.0 < p <= 1.0 for c, _ in recorded for p in c)
        else:
            assert not recorded
