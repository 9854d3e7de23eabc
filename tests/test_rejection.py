"""Verification (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): unit cases on constructed
logits, chi-square tests of the emitted distribution against the target p (and broken samplers that must
fail them), and seed reproducibility across batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specserve.sample import rejection_sampler as rejection
from specserve.sample.rejection_sampler import verify
from specserve.sample.sampler import RequestSamplingState, probs_from_logits, process_logits
from specserve.sampling_params import SamplingParams

INF = float("inf")
V = 12


def st(seed: int | None = None, output: list[int] | None = None, **kw: Any) -> RequestSamplingState:
    params = SamplingParams(seed=seed, **kw)
    return RequestSamplingState.create(params, [], "cpu") if seed is not None else \
        RequestSamplingState(params, [], list(output or []), None)


def peaked(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[len(tokens), V] processed logits whose distribution is a point mass on each token."""
    x = torch.full((len(tokens), vocab), -INF)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return x


def argmax_rows(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[len(tokens), V] finite logits with the given argmax per row."""
    x = torch.linspace(-1.0, 1.0, vocab).repeat(len(tokens), 1)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


def run(logits: torch.Tensor, states: list[RequestSamplingState], drafts: list[list[int]],
        probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
    return verify(logits, states, [len(d) + 1 for d in drafts], drafts, probs or [None] * len(drafts))


# ------------------------------------------------------------------------------------------------ unit cases
def test_greedy_all_accepted_plus_bonus() -> None:
    assert run(argmax_rows([2, 4, 1, 5]), [st(temperature=0)], [[2, 4, 1]]) == [[2, 4, 1, 5]]


def test_greedy_first_rejected() -> None:
    assert run(argmax_rows([2, 4, 1]), [st(temperature=0)], [[3, 4]]) == [[2]]


def test_greedy_middle_rejected() -> None:
    assert run(argmax_rows([2, 0, 1, 7]), [st(temperature=0)], [[2, 4, 1]]) == [[2, 0]]


def test_greedy_k0_is_argmax() -> None:
    assert run(argmax_rows([9]), [st(temperature=0)], [[]]) == [[9]]


def test_sampled_all_accepted_plus_bonus() -> None:
    q = torch.softmax(torch.randn(3, V), dim=-1)
    assert run(peaked([2, 4, 1, 5]), [st()], [[2, 4, 1]], [q]) == [[2, 4, 1, 5]]
    assert run(peaked([2, 4, 1, 5]), [st()], [[2, 4, 1]], [None]) == [[2, 4, 1, 5]]


def test_sampled_first_rejected_recovers_from_residual() -> None:
    q = torch.softmax(torch.randn(2, V), dim=-1)
    assert run(peaked([7, 4, 0]), [st()], [[3, 4]], [q]) == [[7]]
    assert run(peaked([7, 4, 0]), [st()], [[3, 4]], [None]) == [[7]]


def test_one_hot_rejection_never_resamples_the_draft() -> None:
    # p = {3: 0.5, 8: 0.5}, draft 3 with q = one-hot: accepted w.p. 0.5, else the residual is exactly e_8.
    p = torch.full((2, V), -INF)
    p[0, 3] = p[0, 8] = 0.0
    p[1, 6] = 0.0
    outs = run(p.repeat(400, 1), [st()] * 400, [[3]] * 400)
    assert {tuple(o) for o in outs} == {(3, 6), (8,)}


def test_sampled_k0_point_mass() -> None:
    assert run(peaked([11]), [st(temperature=0.8)], [[]]) == [[11]]


def test_mixed_batch_greedy_and_sampled_different_k() -> None:
    q2 = torch.softmax(torch.randn(2, V), dim=-1)
    cases = [  # (state, rows, drafts, draft_probs, expected)
        (st(temperature=0), argmax_rows([1, 2, 3]), [1, 2], None, [1, 2, 3]),
        (st(), peaked([5]), [], None, [5]),
        (st(temperature=0.5), peaked([0, 9, 4, 6]), [0, 9, 5], None, [0, 9, 4]),
        (st(temperature=0), argmax_rows([8]), [], None, [8]),
        (st(top_k=3), peaked([2, 10, 1]), [2, 10], q2, [2, 10, 1]),
        (st(temperature=0), argmax_rows([3, 3]), [4], torch.softmax(torch.randn(1, V), -1), [3]),
        (st(seed=3), peaked([6, 7]), [1], q2[:1], [6]),
    ]
    logits = torch.cat([c[1] for c in cases])
    out = run(logits, [c[0] for c in cases], [c[2] for c in cases], [c[3] for c in cases])
    assert out == [c[4] for c in cases]


def test_frequency_penalty_on_draft_changes_next_argmax() -> None:
    # Row 0 argmax is 2 (draft 2 accepted). Row 1 raw: token 2 = 3.0, token 3 = 2.5; drafts count as generated,
    # so the frequency penalty 1.0 lowers token 2 to 2.0 and the argmax at row 1 becomes 3.
    raw = torch.zeros(2, 5)
    raw[0, 2] = 3.0
    raw[1, 2], raw[1, 3] = 3.0, 2.5
    states = [st(temperature=0, frequency_penalty=1.0)]
    processed = process_logits(raw, states, [2], [[2]])
    assert run(processed, states, [[2]]) == [[2, 3]]
    plain = [st(temperature=0)]
    assert run(process_logits(raw, plain, [2], [[2]]), plain, [[2]]) == [[2, 2]]


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = torch.softmax(torch.randn(3, V), dim=-1)
    assert torch.equal(rejection._residual(p, p.clone()), p)
    q = torch.zeros_like(p)
    assert torch.equal(rejection._residual(p, q), p)


def test_accept_rule_edges() -> None:
    u = torch.tensor([0.0, 0.99, 0.5, 0.5])
    p = torch.tensor([0.0, 0.3, 0.2, 0.1])
    q = torch.tensor([0.5, 0.3, 0.0, 0.4])  # p = 0 rejects even at u = 0; p >= q accepts; q = 0 < p accepts
    assert rejection._accept(u, p, q).tolist() == [False, True, True, False]


def test_empty_batch_and_bad_inputs() -> None:
    assert verify(torch.zeros(0, V), [], [], [], []) == []
    with pytest.raises(ValueError, match="row_counts"):
        verify(torch.zeros(2, V), [st()], [2], [[1, 2]], [None])
    with pytest.raises(ValueError, match="draft_probs shape"):
        verify(torch.zeros(2, V), [st()], [2], [[1]], [torch.zeros(2, V)])
    with pytest.raises(ValueError, match="out of range"):
        verify(torch.zeros(2, V), [st()], [2], [[V]], [None])


# -------------------------------------------------------------------------------------------- statistics
N_CALLS, BATCH = 4, 25_000  # 10^5 draws per distribution


def chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of observed tokens [n] to p [V]; p = 0 bins must be empty.

    p-value = P(chi2_dof > stat) = Q(dof / 2, stat / 2), the regularised upper incomplete gamma function."""
    observed = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    assert observed[~support].sum() == 0, f"tokens outside the target's support: {observed[~support]}"
    expected = p.double()[support] / p.double()[support].sum() * tokens.numel()
    stat = ((observed[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
    print(f"chi2 = {float(stat):.1f} (dof {dof}, n = {tokens.numel()}) -> p-value {pvalue:.3g}")
    return pvalue


def spec_draws(target_logits: torch.Tensor, draft_dist: torch.Tensor, reported_q: torch.Tensor | None,
               seed: int) -> list[list[int]]:
    """N_CALLS x BATCH identical sampled requests; drafts x_j ~ draft_dist[j], reported q = reported_q."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = draft_dist.shape[0]
    state = st()
    outs: list[list[int]] = []
    for _ in range(N_CALLS):
        drafts = torch.multinomial(draft_dist, BATCH, replacement=True, generator=gen).T.tolist()  # [B, k]
        outs += verify(target_logits.repeat(BATCH, 1), [state] * BATCH, [k + 1] * BATCH, drafts,
                       [reported_q] * BATCH)
    return outs


def position(outs: list[list[int]], j: int) -> torch.Tensor:
    """Emitted token at position j among outputs that reached it (positions < j were accepted drafts)."""
    return torch.tensor([o[j] for o in outs if len(o) > j])


def target_and_draft(seed: int, t_target: float, t_draft: float, k: int, **kw: Any) -> tuple[torch.Tensor, ...]:
    """Processed target logits [k+1, V], its p [k+1, V] and the draft's q [k, V] (different raw logits)."""
    gen = torch.Generator().manual_seed(seed)
    raw_t, raw_d = torch.randn(k + 1, V, generator=gen) * 1.5, torch.randn(k, V, generator=gen) * 1.5
    tgt = process_logits(raw_t, [st(temperature=t_target, **kw)], [k + 1], [[0] * k])
    q = probs_from_logits(process_logits(raw_d, [st(temperature=t_draft)], [k], [[0] * (k - 1)]))
    return tgt, probs_from_logits(tgt), q


def test_chi2_temperature_with_draft_probs() -> None:
    tgt, p, q = target_and_draft(1, t_target=0.7, t_draft=1.3, k=3)
    assert (p[:3] - q).abs().sum(-1).min() > 0.3  # q really differs from p
    outs = spec_draws(tgt, q, q, seed=10)
    pv0, pv1 = chi2_pvalue(position(outs, 0), p[0]), chi2_pvalue(position(outs, 1), p[1])
    print(f"temperature: first-token p-value {pv0:.3g}, second-token p-value {pv1:.3g} "
          f"(n2 = {len(position(outs, 1))})")
    assert pv0 > 0.01 and pv1 > 0.01


def test_chi2_top_k_top_p() -> None:
    tgt, p, q = target_and_draft(2, t_target=0.9, t_draft=1.0, k=2, top_k=6, top_p=0.92)
    # Independent reference for the masks: top-6 of the tempered logits, then the smallest mass-0.8 prefix.
    raw = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 1.5
    for row in range(3):
        probs = torch.softmax(raw[row] / 0.9, dim=-1)
        order = probs.argsort(descending=True)[:6]
        mass = probs[order] / probs[order].sum()
        keep = order[: int((mass.cumsum(0) < 0.92).sum()) + 1]
        ref = torch.zeros(V)
        ref[keep] = mass[: len(keep)] / mass[: len(keep)].sum()
        assert torch.allclose(p[row], ref, atol=1e-6)
    assert ((p[0] == 0) & (q[0] > 0)).any() and ((p[0] > 0) & (q[0] < p[0])).any()
    outs = spec_draws(tgt, q, q, seed=20)
    pv0, pv1 = chi2_pvalue(position(outs, 0), p[0]), chi2_pvalue(position(outs, 1), p[1])
    print(f"top-k/top-p: first-token p-value {pv0:.3g}, second-token p-value {pv1:.3g}")
    assert pv0 > 0.01 and pv1 > 0.01


def test_chi2_one_hot_proposer() -> None:
    tgt, p, q = target_and_draft(3, t_target=1.0, t_draft=0.9, k=2, top_k=9)
    outs = spec_draws(tgt, q, None, seed=30)  # drafts drawn from q, but the proposer reports no probabilities
    pv0, pv1 = chi2_pvalue(position(outs, 0), p[0]), chi2_pvalue(position(outs, 1), p[1])
    print(f"one-hot: first-token p-value {pv0:.3g}, second-token p-value {pv1:.3g}")
    assert pv0 > 0.01 and pv1 > 0.01


def test_chi2_k0_plain_sampling() -> None:
    tgt, p, _ = target_and_draft(4, t_target=0.8, t_draft=1.0, k=1, min_p=0.05)
    torch.manual_seed(40)
    state = st()
    tokens = torch.cat([torch.tensor(verify(tgt[:1].repeat(BATCH, 1), [state] * BATCH, [1] * BATCH,
                                            [[]] * BATCH, [None] * BATCH)).flatten() for _ in range(N_CALLS)])
    pv = chi2_pvalue(tokens, p[0])
    print(f"k=0: p-value {pv:.3g}")
    assert pv > 0.01


@pytest.mark.parametrize(("broken", "one_hot"),
                         [("always_accept", False), ("resample_from_p", False), ("resample_from_p", True)])
def test_chi2_detects_broken_samplers(broken: str, one_hot: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check must fail for wrong samplers, or it would prove nothing."""
    if broken == "always_accept":
        monkeypatch.setattr(rejection, "_accept", lambda u, p_x, q_x: torch.ones_like(u, dtype=torch.bool))
    else:  # a classic bug: on rejection sample p again (one-hot: x not removed) instead of norm(max(p - q, 0))
        monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    tgt, p, q = target_and_draft(1, t_target=0.7, t_draft=1.3, k=3)
    outs = spec_draws(tgt, q, None if one_hot else q, seed=10)
    pv = chi2_pvalue(position(outs, 0), p[0])
    print(f"broken sampler {broken} (one-hot {one_hot}): first-token p-value {pv:.3g}")
    assert pv < 1e-6


# ------------------------------------------------------------------------------------------------- seeds
def seeded_case(gen: torch.Generator) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    raw = torch.randn(4, V, generator=gen)
    q = torch.softmax(torch.randn(3, V, generator=gen), dim=-1)
    drafts = torch.multinomial(q, 1, generator=gen).flatten().tolist()
    return raw, drafts, q


def run_processed(raws: list[torch.Tensor], states: list[RequestSamplingState], drafts: list[list[int]],
                  probs: list[torch.Tensor | None]) -> list[list[int]]:
    counts = [len(d) + 1 for d in drafts]
    processed = process_logits(torch.cat(raws), states, counts, drafts)
    return verify(processed, states, counts, drafts, probs)


def test_seeded_request_is_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(123)
    diverse = set()
    for seed in range(20):
        raw, drafts, q = seeded_case(gen)
        kw: dict[str, Any] = {"temperature": 1.3, "top_k": 8, "frequency_penalty": 0.3}

        def target(seed: int = seed, kw: dict[str, Any] = kw) -> RequestSamplingState:
            s = st(seed=seed, **kw)
            s.output_token_ids[:] = [1, 2, 2]
            return s

        torch.manual_seed(1000 + seed)
        alone = run_processed([raw], [target()], [drafts], [q])[0]
        others = [torch.randn(c, V, generator=gen) for c in (2, 1, 5, 3)]
        torch.manual_seed(2000 + seed)  # the default generator's state must not matter
        batch = run_processed(
            [others[0], others[1], raw, others[2], others[3]],
            [st(), st(seed=7, top_p=0.9), target(), st(temperature=0), st(seed=seed, temperature=0.5)],
            [[3], [], drafts, [1, 2, 3, 4], [5, 6]],
            [torch.softmax(torch.randn(1, V), -1), None, q, None, torch.softmax(torch.randn(2, V), -1)],
        )[2]
        again = run_processed([raw], [target()], [drafts], [q])[0]
        assert alone == batch == again, (seed, alone, batch, again)
        diverse.add(tuple(alone))
    assert len(diverse) > 5  # seeds do change the outcome


def test_seeded_k0_matches_alone_and_consumes_own_stream() -> None:
    raw = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    a = st(seed=42)
    b = st(seed=42)
    seq_a = [run_processed([raw], [a], [[]], [None])[0][0] for _ in range(10)]
    seq_b = [run_processed([torch.randn(2, V), raw], [st(), b], [[1], []], [None, None])[1][0]
             for _ in range(10)]
    assert seq_a == seq_b and len(set(seq_a)) > 1
