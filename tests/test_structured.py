"""Structured outputs, logit_bias and min_tokens as logits processing: the masks themselves, exactness under
speculation (greedy equality with every proposer and grammar-aware drafting on and off; a chi-square test of
a grammar-constrained position), and bad constraints as clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from specserve import SamplingParams
from specserve.llm import LLM
from specserve.model.checkpoint.loader import load_checkpoint
from specserve.model.decoder import DecoderModel
from specserve.sample.grammar import GrammarCompiler, GrammarState, bitmask_words
from specserve.sample.rejection_sampler import verify
from specserve.sample.sampler import RequestSamplingState, probs_from_logits, process_logits
from specserve.sampling_params import StructuredOutputsParams as SO
from tests.helpers import byte_tokenizer, save_tiny_checkpoint, save_tiny_eagle_head

V = 260  # the byte tokenizer: ids 0..255 are bytes, 256 <s>, 257 </s>, 258 <pad>
EOS = 257


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer(V), V, [EOS])


def state(params: SamplingParams, output: list[int] | None = None, grammar: GrammarState | None = None,
          stop_ids: tuple[int, ...] = ()) -> RequestSamplingState:
    return RequestSamplingState(params, [1, 2, 3], list(output or []), None, stop_ids, grammar)


def allowed(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


# -- the masks ------------------------------------------------------------------------------------------------
def test_min_tokens_masks_stop_ids_on_early_rows_only():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    s = state(params, output=[65], stop_ids=(7, EOS))
    logits = torch.zeros(3, V)
    out = process_logits(logits, [s], [3], [[66, 67]])  # rows see 1, 2, 3 outputs before them
    for row in (0, 1):
        assert out[row, EOS] == -torch.inf and out[row, 7] == -torch.inf
    assert torch.isfinite(out[2]).all()  # the third output exists: nothing masked
    assert torch.isfinite(out[:, :7]).all() and torch.isfinite(out[:2, 8:EOS]).all()


def test_logit_bias_is_added_per_row():
    params = SamplingParams(temperature=0, logit_bias={5: 100.0, 9: -50.0})
    logits = torch.randn(2, V)
    out = process_logits(logits, [state(params)], [2], [[3]])
    assert torch.allclose(out[:, 5], logits[:, 5] + 100) and torch.allclose(out[:, 9], logits[:, 9] - 50)
    assert out.argmax(dim=-1).tolist() == [5, 5]


def test_grammar_rows_follow_the_drafts_and_the_matcher_rolls_back(compiler):
    g = GrammarState(compiler.compile(SO(regex="[a-f][0-9]x")))
    s = state(SamplingParams(temperature=0), grammar=g)
    drafts = [ord("c"), ord("5"), ord("x")]
    out = process_logits(torch.zeros(4, V), [s], [4], [drafts])
    assert allowed(out[0]) == list(range(ord("a"), ord("f") + 1))
    assert allowed(out[1]) == list(range(ord("0"), ord("9") + 1))
    assert allowed(out[2]) == [ord("x")]
    assert allowed(out[3]) == [EOS]  # complete: only the stop token
    # rolled back: the next step starts from the same state
    again = process_logits(torch.zeros(1, V), [s], [1], [[]])
    assert allowed(again[0]) == allowed(out[0])
    # a forbidden draft: its row masks it out, the rows after it are never reached
    bad = process_logits(torch.zeros(3, V), [s], [3], [[ord("z"), ord("1")]])
    assert not torch.isfinite(bad[0, ord("z")])
    g.accept([ord("c")])
    assert g.valid_prefix([ord("5"), ord("x"), ord("y")]) == 2 and g.valid_prefix([ord("q")]) == 0
    assert g.forced_tokens(4) == []
    g.accept([ord("5")])
    assert g.forced_tokens(4) == [ord("x")]


def test_forced_tokens_take_the_spelling_the_target_used_before(demo_tokenizer):
    """The grammar forces ' {"name": ' before each array item; xgrammar spells it with the longest tokens, but
    once the output spelled the same text with other tokens on token boundaries (as the masked target does),
    the latest such spelling is the draft."""
    hf = demo_tokenizer.hf_tokenizer
    comp = GrammarCompiler(hf, len(hf), sorted(demo_tokenizer.eos_token_ids))
    ids = hf.convert_tokens_to_ids
    item = {"type": "object", "properties": {"name": {"type": "integer"}}, "required": ["name"]}
    g = GrammarState(comp.compile(SO(json={"type": "array", "items": item})))
    longest = ids(['Ġ{"', "name", '":'])
    pieces = ids(["Ġ{", '"', "n", "am", "e", '":'])
    g.accept(ids(["[", '{"', "name", '":', "Ġ", "1", "},"]))  # no ' {"name":' in the output yet
    assert g.forced_tokens(8) == longest and hf.decode(longest) == ' {"name":'
    g.accept(pieces + ids(["Ġ", "2", "},"]))
    assert g.forced_tokens(8) == pieces and g.forced_tokens(3) == pieces[:3]
    assert g.forced_tokens(8) == pieces and g.valid_prefix(pieces) == len(pieces)  # the matcher is unchanged
    g.accept(longest + ids(["Ġ", "3", "},"]))  # the latest spelling wins
    assert g.forced_tokens(8) == longest
    # an occurrence that starts inside a token is passed over for the next one to its left
    assert g._last_spelling(b'ame":') == ids(["am", "e", '":']) and g._last_spelling(b'me":') is None
    g.accept(ids(["Ġ{", '"', "name"]))  # inside an item: ' {"name":' is not forced here
    assert hf.decode(g.forced_tokens(8)) == '":'


def test_draft_sampler_drafts_what_the_grammar_allows(compiler):
    """Grammar-aware drafting masks the draft's own distribution by the grammar after the drafts so far: a
    draft that prefers forbidden tokens proposes the best allowed one (greedy), and its q (sampled) puts no
    mass on forbidden tokens; without it the draft proposes its raw argmax, which the drafter would cut."""
    from types import SimpleNamespace

    from specserve.spec_decode.draft_model import DraftSampler
    from specserve.spec_decode.state import SpecState

    logits = torch.zeros(1, V)
    logits[0, ord("z")] = 9.0  # the draft's favourite, forbidden everywhere
    logits[0, ord("y")] = 5.0  # allowed only after "x"
    logits[0, ord("b")] = 4.0  # allowed only after "a"
    logits[0, ord("a")] = 1.0

    def req(temperature: float) -> SimpleNamespace:
        g = GrammarState(compiler.compile(SO(choice=("ab", "xy"))))
        return SimpleNamespace(req_id="r", state=state(SamplingParams(temperature=temperature, seed=1), grammar=g),
                               spec=SpecState())

    masked, raw = DraftSampler(V, grammar=True), DraftSampler(V, grammar=False)
    assert masked.sample(logits, [req(0.0)], [[]])[0] == [ord("a")]  # "x" scores 0: "a" is the best start
    assert masked.sample(logits, [req(0.0)], [[ord("x")]])[0] == [ord("y")]
    assert masked.sample(logits, [req(0.0)], [[ord("a")]])[0] == [ord("b")]
    assert raw.sample(logits, [req(0.0)], [[ord("a")]])[0] == [ord("z")]
    toks, q = masked.sample(logits, [req(1.0)], [[ord("x")]])
    assert toks == [ord("y")] and q is not None and allowed(q[0].log()) == [ord("y")]
    assert logits[0, ord("z")] == 9.0  # masking works on a copy: the draft's logits are not modified


def test_greedy_argmax_equals_the_argmax_of_the_processed_logits(compiler):
    """The greedy fast path masks only the rows whose raw argmax the grammar forbids: its tokens must be the
    argmaxes of ``process_logits``' rows in every case (allowed and forbidden argmaxes, free and grammar rows,
    drafts the grammar rejects), and anything else that processes logits leaves it to process_logits."""
    from specserve.sample.sampler import greedy_argmax, row_argmax

    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    drafts = [[ord("c"), ord("5")], [], [ord("a"), ord("z")], [9, 9]]  # the third: "z" is forbidden
    counts = [len(d) + 1 for d in drafts]
    forbidden = allowed_argmax = 0
    for trial in range(40):
        states = [state(greedy, grammar=GrammarState(compiler.compile(SO(regex="[a-f][0-9]x")))),
                  state(greedy, grammar=GrammarState(compiler.compile(SO(choice=("yes", "no"))))),
                  state(greedy, grammar=GrammarState(compiler.compile(SO(regex="[a-f]+")))),
                  state(greedy)]
        logits = torch.randn(sum(counts), V, generator=gen)
        if trial % 2:  # favour an allowed token in some rows
            logits[[0, 3, 5], [ord("b"), ord("n"), ord("e")]] += 10.0
        raw = row_argmax(logits)
        want = row_argmax(process_logits(logits, states, counts, drafts))
        forbidden += sum(a != b for a, b in zip(raw, want))
        allowed_argmax += sum(a == b for a, b in zip(raw[:8], want[:8]))
        assert greedy_argmax(logits, states, counts, drafts) == want
    assert forbidden > 0 and allowed_argmax > 0  # both kinds of rows were exercised
    g = GrammarState(compiler.compile(SO(regex="[a-f]+")))
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logit_bias={5: 1.0}),
                  SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, min_tokens=2)):
        assert greedy_argmax(torch.zeros(1, V), [state(other, grammar=g)], [1], [[]]) is None


def test_grammar_outranks_min_tokens_where_only_eos_is_left(compiler):
    g = GrammarState(compiler.compile(SO(choice=("ab",))))
    g.accept([ord("a"), ord("b")])
    s = state(SamplingParams(temperature=0, min_tokens=10), output=[97, 98], grammar=g, stop_ids=(EOS,))
    out = process_logits(torch.zeros(1, V), [s], [1], [[]])
    assert allowed(out[0]) == [EOS]


def test_mixed_batch_rows_with_and_without_grammars(compiler):
    g = GrammarState(compiler.compile(SO(choice=("yes", "no"))))
    free = state(SamplingParams(temperature=0))
    constrained = state(SamplingParams(temperature=0), grammar=g)
    logits = torch.randn(5, V)
    out = process_logits(logits, [free, constrained, free], [2, 1, 2], [[4], [], [6]])
    assert torch.equal(out[[0, 1, 3, 4]], logits[[0, 1, 3, 4]])
    assert allowed(out[2]) == [ord("n"), ord("y")]


def test_bitmask_sized_to_the_logits():
    assert bitmask_words(260) == 9 and bitmask_words(49152) == 1536


# -- exactness: a chi-square test of a grammar-constrained position ---------------------------------------------
def test_chi2_grammar_position_with_and_without_speculation(compiler):
    """Position 0 and 1 under the regex [a-f][0-9]: drafts from an unconstrained q (often forbidden), verified
    against the masked target, emit exactly the masked target's distribution; k = 0 does too."""
    from tests.test_rejection import BATCH, N_CALLS, chi2_pvalue, position

    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(3, V, generator=gen) * 2.0
    letters, digits = list(range(ord("a"), ord("f") + 1)), list(range(ord("0"), ord("9") + 1))
    ref = torch.zeros(2, V)  # independent reference: softmax over the allowed tokens only
    ref[0, letters] = torch.softmax(raw[0, letters] / 0.8, dim=-1)
    ref[1, digits] = torch.softmax(raw[1, digits] / 0.8, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
    q[0, letters] += 0.2  # some drafts allowed, most forbidden
    q = q / q.sum(-1, keepdim=True)
    g = GrammarState(compiler.compile(SO(regex="[a-f][0-9]")))
    s = state(SamplingParams(temperature=0.8), grammar=g)
    torch.manual_seed(6)
    spec_outs: list[list[int]] = []
    plain: list[torch.Tensor] = []
    for _ in range(N_CALLS):
        drafts = torch.multinomial(q, BATCH, replacement=True, generator=gen).T.tolist()  # [B, 2]
        # The grammar's state is the same for every request: rows processed once per distinct draft prefix
        # would be the same, so one state serves the batch (fill_rows rolls back after each).
        processed = process_logits(raw.repeat(BATCH, 1), [s] * BATCH, [3] * BATCH, drafts)
        spec_outs += verify(processed, [s] * BATCH, [3] * BATCH, drafts, [q] * BATCH)
        p0 = process_logits(raw[:1].repeat(BATCH, 1), [s] * BATCH, [1] * BATCH, [[]] * BATCH)
        plain.append(torch.tensor(verify(p0, [s] * BATCH, [1] * BATCH, [[]] * BATCH, [None] * BATCH)).flatten())
    pv_spec0 = chi2_pvalue(position(spec_outs, 0), ref[0])
    pv_spec1 = chi2_pvalue(position(spec_outs, 1), ref[1])
    pv_plain = chi2_pvalue(torch.cat(plain), ref[0])
    print(f"grammar chi2: speculative p-values {pv_spec0:.3g} / {pv_spec1:.3g}, plain {pv_plain:.3g}")
    assert pv_spec0 > 0.01 and pv_spec1 > 0.01 and pv_plain > 0.01
    assert len(position(spec_outs, 1)) > 1000  # the second position was reached often enough to test


def test_chi2_grammar_check_detects_an_unmasked_target(compiler):
    """The same check fails when the verifier sees the unmasked target (the mask skipped at row 0)."""
    from tests.test_rejection import BATCH, chi2_pvalue

    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(1, V, generator=gen) * 2.0
    letters = list(range(ord("a"), ord("f") + 1))
    ref = torch.zeros(V)
    ref[letters] = torch.softmax(raw[0, letters], dim=-1)
    p = probs_from_logits(raw)[0]
    draws = torch.multinomial(p, BATCH, replacement=True, generator=gen)
    with pytest.raises(AssertionError, match="outside the target's support"):
        chi2_pvalue(draws, ref)


# -- end to end on a tiny model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = save_tiny_checkpoint(root / "target", seed=3, layers=2)
    draft = save_tiny_checkpoint(root / "draft", seed=4, layers=1)
    ckpt = load_checkpoint(target)
    model = DecoderModel(ckpt.arch, torch.float32, torch.device("cpu"), None, 1024)  # type: ignore[arg-type]
    model.load_weights(ckpt.state_dict)
    head = save_tiny_eagle_head(model, str(root / "head"), torch.Generator().manual_seed(0))
    return target, draft, head


PROMPTS = ["name: Bob, age 7 ->", "hello hello hello", "abc abc abc abc", "{\"x\": 1} {\"x\":", "list: a, b, c, d"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
CONSTRAINTS = [SO(json=SCHEMA), SO(regex=r"(ab|cd)[0-9]{2,4}!"), SO(choice=("alpha", "beta", "gamma")),
               SO(grammar='root ::= "[" item ("," item)* "]"\nitem ::= [a-c]+'), SO(json_object=True)]
METHODS = ["ngram", "draft", "layer_skip", "draft+lookup", "eagle", "eagle+lookup"]


def engine(path: str, draft: str, method: str | None, bs: int, grammar_drafts: bool = True, head: str = ""
           ) -> LLM:
    args: dict = dict(dtype="float32", device="cpu", num_blocks=256, max_num_seqs=bs)
    if method is not None:
        args.update(speculative_method=method.split("+")[0], num_speculative_tokens=4, speculative_adaptive=False,
                    grammar_drafts=grammar_drafts)
        if method.startswith("draft"):
            args["speculative_model"] = draft
        if method.startswith("eagle"):
            args["speculative_model"] = head
        if method == "layer_skip":
            args["draft_layers"] = 1
        if method.endswith("+lookup"):
            args.update(prompt_lookup_first=True, prompt_lookup_min=1)
    return LLM(path, **args)


def generate(llm: LLM, bs: int) -> tuple[list[list[int]], list[str], list[str | None]]:
    """Every constraint on every prompt, plus free rows, at once (mixed batches): token ids, texts, finishes."""
    outs = []
    for p in PROMPTS:
        for c in [*CONSTRAINTS, None]:
            outs.append((p, SamplingParams(temperature=0, max_tokens=24 if c is not None else 12,
                                           structured_outputs=c, ignore_eos=c is None)))
    results = []
    for start in range(0, len(outs), bs * 2):
        chunk = outs[start:start + bs * 2]
        results += [o.outputs[0] for o in llm.generate([p for p, _ in chunk], [sp for _, sp in chunk])]
    return [list(r.token_ids) for r in results], [r.text for r in results], [r.finish_reason for r in results]


@pytest.fixture(scope="module")
def reference(paths):
    return {bs: generate(engine(paths[0], paths[1], None, bs), bs) for bs in (1, 8)}


def check_constraint(c: SO | None, text: str, finish: str) -> None:
    if c is None or finish != "stop":
        return
    if c.kind == "json":
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "ok"} and isinstance(obj["age"], int) and isinstance(obj["ok"], bool)
    elif c.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif c.kind == "regex":
        assert re.fullmatch(c.regex or "", text), text
    elif c.kind == "choice":
        assert text in (c.choice or ()), text
    else:
        assert re.fullmatch(r"\[[a-c]+(,[a-c]+)*\]", text), text


def test_outputs_follow_their_constraints(reference):
    toks, texts, finishes = reference[8]
    cons = [c for _ in PROMPTS for c in [*CONSTRAINTS, None]]
    assert sum(f == "stop" for f, c in zip(finishes, cons) if c is not None) >= len(PROMPTS) * 3
    for c, text, finish in zip(cons, texts, finishes):
        check_constraint(c, text, finish)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bs", [1, 8])
def test_greedy_equal_with_grammars(paths, reference, method, bs):
    for grammar_drafts in (True, False):
        llm = engine(paths[0], paths[1], method, bs, grammar_drafts, head=paths[2])
        toks, _, _ = generate(llm, bs)
        assert toks == reference[bs][0], (method, bs, grammar_drafts)
        sources = llm.get_metrics()["speculative_sources"]
        assert llm.get_metrics()["speculative"]["draft_tokens"] > 0
        if grammar_drafts:  # the grammar forced tokens (JSON keys, the rest of a choice) and they were drafted
            assert sources["grammar"]["draft_tokens"] > 0
            assert sources["grammar"]["acceptance_rate"] > 0.5
        else:
            assert "grammar" not in sources


def test_grammar_drafts_cut_forbidden_model_drafts(paths, compiler):
    """With grammar-aware drafting no draft token the grammar forbids reaches verification."""
    llm = engine(paths[0], paths[1], "draft", 1)
    drafter = llm.engine.runner.drafter
    seen: list[tuple[list[int], bool]] = []
    original = drafter.propose

    def spy(cands, draining=False, hold=False, others=0):
        out = original(cands, draining, hold, others)
        for c in cands:
            d = out.get(c.req_id)
            if d is not None and c.state.grammar is not None:
                seen.append((d.token_ids, c.state.grammar.valid_prefix(d.token_ids) == len(d.token_ids)))
        return out

    drafter.propose = spy
    llm.generate(["abc abc"], SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(json=SCHEMA)))
    assert seen and all(ok for _, ok in seen)


def test_min_tokens_end_to_end(paths):
    """EOS pushed up by logit_bias: without min_tokens the request ends at once; with min_tokens=6 it never
    emits EOS in its first 6 tokens (the mask, not the stop check, holds it back), with speculation too."""
    for method in (None, "ngram"):
        llm = engine(paths[0], paths[1], method, 2)
        short = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, logit_bias={EOS: 100}))[0]
        assert short.outputs[0].token_ids == [EOS] or short.outputs[0].token_ids == []
        out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                                                     logit_bias={EOS: 100}))[0].outputs[0]
        assert EOS not in out.token_ids[:6] and len(out.token_ids) >= 6
        sampled = llm.generate(["hi"] * 4, SamplingParams(temperature=1.0, seed=3, max_tokens=10, min_tokens=5,
                                                         logit_bias={EOS: 8}))
        assert all(EOS not in o.outputs[0].token_ids[:5] for o in sampled)


def test_unsatisfiable_within_max_tokens_finishes_with_length(paths):
    llm = engine(paths[0], paths[1], "ngram", 1)
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=5, structured_outputs=SO(regex="a{20}")))
    assert out[0].outputs[0].finish_reason == "length" and out[0].outputs[0].text == "a" * 5


@pytest.mark.parametrize(("constraint", "message"), [
    (SO(json={"type": "objec"}), "invalid JSON schema"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(regex="a("), "invalid regex"),
    (SO(grammar="root ::= foo"), "invalid EBNF grammar"),
])
def test_bad_constraints_are_clear_errors(paths, constraint, message):
    llm = engine(paths[0], paths[1], None, 1)
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks  # nothing was queued or leaked


def test_bad_params_are_clear_errors(paths):
    with pytest.raises(ValueError, match="exactly one of"):
        SO(json={}, regex="a")
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 101})
    llm = engine(paths[0], paths[1], None, 1)
    with pytest.raises(ValueError, match="below the vocabulary size"):
        llm.generate(["x"], SamplingParams(max_tokens=4, logit_bias={V + 5: 1.0}))


def test_grammars_compile_off_the_engine_loop(paths, monkeypatch):
    """A slow compile does not hold up other requests' steps, and past the cap it is a clear error."""
    import asyncio
    import threading

    from specserve.config import EngineConfig
    from specserve.engine import async_engine
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import Engine
    from specserve.sample.grammar import GrammarError

    eng = Engine(EngineConfig.from_kwargs(paths[0], dtype="float32", num_blocks=64))
    real, started, release = eng.compile_grammar, threading.Event(), threading.Event()

    def slow(params):
        started.set()
        release.wait(60)
        return real(params)

    monkeypatch.setattr(eng, "compile_grammar", slow)
    aeng = AsyncEngine(eng)

    async def last(rid: str, params: SamplingParams):
        outs = [out async for out in aeng.generate(rid, "abc", params)]
        return outs[-1]

    async def main():
        constrained = asyncio.create_task(last("g", SamplingParams(max_tokens=4, structured_outputs=SO(regex="xy"))))
        assert await asyncio.to_thread(started.wait, 60)
        free = await last("f", SamplingParams(max_tokens=6, ignore_eos=True))  # steps while the compile waits
        assert len(free.outputs[0].token_ids) == 6 and not constrained.done()
        release.set()
        return (await constrained).outputs[0].text

    try:
        assert asyncio.run(main()) == "xy"
        started.clear()
        release.clear()
        monkeypatch.setattr(async_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 0.3)
        threading.Timer(1.0, release.set).start()  # the abandoned compile ends (asyncio.run waits for it)
        with pytest.raises(GrammarError, match="did not compile within"):
            asyncio.run(last("t", SamplingParams(max_tokens=4, structured_outputs=SO(regex="zz"))))
        assert aeng.num_requests == 0
    finally:
        release.set()
        aeng.shutdown()
