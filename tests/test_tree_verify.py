"""Draft-tree verification (sample/rejection_sampler.verify_tree / tree_walk): the greedy path, and
chi-square tests that sampled trees emit exactly the target's (processed) distribution -- with temperature,
top-k and top-p -- while a deliberately broken tree sampler fails the same test."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specserve.sample.rejection_sampler import tree_children, tree_walk, verify_tree
from specserve.sample.sampler import probs_from_logits, process_logits
from tests.test_rejection import V, chi2_pvalue, st

# Root with three candidate children (tokens 2, 5, 7); token 2 has children 1 and 3; token 5 has child 4.
TOKENS = [2, 5, 7, 1, 3, 4]
PARENTS = [-1, -1, -1, 0, 0, 1]
DRAWS = 100_000


def _children(parents: list[int]) -> torch.Tensor:
    kids = tree_children(parents)
    width = max(map(len, kids))
    return torch.tensor([k + [-1] * (width - len(k)) for k in kids])


def _target(seed: int, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed logits [N + 1, V] of a request with sampling parameters ``kw`` and their probabilities."""
    raw = torch.randn(len(TOKENS) + 1, V, generator=torch.Generator().manual_seed(seed)) * 1.5
    for i, par in enumerate(PARENTS):  # candidates as likely as a good draft makes them (inside top-k / top-p)
        raw[par + 1, TOKENS[i]] += 1.5
    processed = process_logits(raw, [st(**kw)], [len(TOKENS) + 1], [TOKENS])
    return processed, probs_from_logits(processed)


def _draws(p: torch.Tensor, seed: int, zero_rejected: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(DRAWS, len(TOKENS), generator=g)
    noise = torch.empty(DRAWS, V).exponential_(generator=g).clamp_min_(torch.finfo(torch.float32).tiny)
    return tree_walk(p, torch.tensor(TOKENS), _children(PARENTS), uniforms, noise, zero_rejected)


def _second_token_dists(p: torch.Tensor) -> dict[int, int]:
    """First token -> the tree row whose distribution the second token follows (candidates only)."""
    return {TOKENS[i]: i + 1 for i, par in enumerate(PARENTS) if par == -1}


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=0.9, top_k=6), dict(temperature=1.1, top_p=0.9)],
                         ids=["temperature", "top-k", "top-p"])
def test_chi2_tree_sampling(kw: dict[str, Any]) -> None:
    _, p = _target(3, **kw)
    emitted, path = _draws(p, seed=7)
    first = emitted[:, 0]
    assert chi2_pvalue(first, p[0]) > 1e-3  # 12 p-values over the file: a Bonferroni-style bound
    for tok, row in _second_token_dists(p).items():
        second = emitted[first == tok, 1]
        if second.numel() > 200:
            assert chi2_pvalue(second, p[row]) > 1e-3, f"second token after {tok}"
    # A path only ever follows accepted candidates, and a non-candidate first token ends the walk.
    non_cand = ~torch.isin(first, torch.tensor([2, 5, 7]))
    assert (emitted[non_cand, 1] == -1).all() and (path[non_cand, 0] == -1).all()
    assert (torch.tensor(TOKENS)[path[~non_cand, 0]] == first[~non_cand]).all()


def test_chi2_catches_a_broken_tree_sampler() -> None:
    """Keeping a rejected candidate in the residual (w(x) not zeroed) over-samples the candidates."""
    _, p = _target(3, temperature=0.7)
    emitted, _ = _draws(p, seed=7, zero_rejected=False)
    assert chi2_pvalue(emitted[:, 0], p[0]) < 1e-6


def test_greedy_tree_follows_the_argmax_path() -> None:
    logits = torch.full((len(TOKENS) + 1, V), -5.0)
    logits[0, 5] = 3.0  # the root's argmax: node 1 (token 5)
    logits[2, 4] = 3.0  # node 1's argmax: node 5 (token 4)
    logits[6, 9] = 3.0  # node 5 (a leaf): the bonus token 9
    greedy = st(temperature=0.0)
    assert greedy.params.greedy
    assert verify_tree(logits, greedy, TOKENS, PARENTS) == ([5, 4, 9], [1, 5])
    logits[0, 5], logits[0, 8] = -5.0, 3.0  # no candidate matches the root's argmax
    assert verify_tree(logits, greedy, TOKENS, PARENTS) == ([8], [])


def test_seeded_tree_sampling_is_reproducible() -> None:
    processed, _ = _target(5, temperature=1.0)
    a = [verify_tree(processed, st(seed=11), TOKENS, PARENTS) for _ in range(3)]
    b = [verify_tree(processed, st(seed=11), TOKENS, PARENTS) for _ in range(3)]
    assert a == b
    for emitted, path in a:
        assert emitted[:len(path)] == [TOKENS[i] for i in path]
        assert all(PARENTS[path[j]] == (path[j - 1] if j else -1) for j in range(len(path)))


def test_bad_trees_are_refused() -> None:
    processed, _ = _target(5)
    with pytest.raises(ValueError):
        verify_tree(processed, st(), TOKENS, [-1, 3, -1, 0, 0, 1])  # a parent after its child
    with pytest.raises(ValueError):
        verify_tree(processed[:3], st(), TOKENS, PARENTS)
