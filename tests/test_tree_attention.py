"""Draft-tree attention (model/attention_metadata.TREE_DOC): a tree token computes exactly what the same token
computes when its path is decoded as a chain -- bit for bit on the CPU backends, which is what keeps greedy
tree speculation equal to plain decoding."""

import pytest
import torch

from specserve.model.attention import CpuKernelAttention, TorchAttention
from specserve.model.kernels.cpu import load_cpu_kernels
from specserve.worker.input_batch import flat_batch

BLOCK = 8
# A tree under a root at position L - 1: node i's parent (-1 = the root).
PARENTS = [-1, -1, 0, 0, 1, 2, 5, 3, -1]


def backends():
    out = [pytest.param(TorchAttention(), id="torch")]
    if load_cpu_kernels():
        out.append(pytest.param(CpuKernelAttention(), id="cpu-kernel"))
    return out


def path_of(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def masks_of(parents):
    return [sum(1 << j for j in path_of(parents, i)) for i in range(len(parents))]


def _run(backend, query, kv, rows, starts, tables, trees=None, window=None):
    fb = flat_batch([[0] * n for n in rows], starts, tables, BLOCK, torch.device("cpu"), trees=trees)
    return backend.attend(query, kv, fb.meta, 0.3, window), fb


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("ctx", [5, 21])
def test_tree_token_equals_its_path_as_a_chain(backend, window, ctx):
    g = torch.Generator().manual_seed(ctx)
    heads, kv_heads, dim = 4, 2, 16
    n = len(PARENTS)
    table = [3, 0, 5, 1, 4]  # 40 slots, shuffled blocks
    other = [2, 6]  # a second request decoding in the same batch
    kv = torch.randn(2, 7, BLOCK, kv_heads, dim, generator=g)
    query = torch.randn(1 + n + 1, heads, dim, generator=g)
    root = ctx - 1
    tree = (ctx, [0] + masks_of(PARENTS))  # the root is an ordinary token; nodes follow at chain positions ctx..
    out, fb = _run(backend, query, kv, [1 + n, 1], [root, 9], [table, other], [tree, None], window)
    # Rope positions: the root at ctx - 1, node i at ctx - 1 + depth(i).
    assert fb.positions[:1 + n].tolist() == [root] + [root + len(path_of(PARENTS, i)) for i in range(n)]
    for i in range(n):
        path = path_of(PARENTS, i)
        chain_kv = kv.clone()
        flat = chain_kv.view(2, -1, kv_heads, dim)
        slot = lambda p: table[p // BLOCK] * BLOCK + p % BLOCK  # noqa: E731
        src = [slot(ctx + j) for j in path]
        flat[:, [slot(ctx + d) for d in range(len(path))]] = kv.view(2, -1, kv_heads, dim)[:, src]
        q = torch.cat([query[:1], query[1:1 + n][path], query[-1:]])
        ref, _ = _run(backend, q, chain_kv, [1 + len(path), 1], [root, 9], [table, other], None, window)
        assert torch.equal(out[1 + i], ref[len(path)]), f"node {i} (path {path})"
        assert torch.equal(out[0], ref[0]) and torch.equal(out[-1], ref[-1])


@pytest.mark.parametrize("backend", backends())
def test_tree_rows_mix_with_prefill_and_chains(backend):
    """A prefill chunk, a chain verification and a tree in one step: the ordinary rows are unchanged by the tree."""
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 12, BLOCK, 1, 8, generator=g)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    rows, starts = [11, 4, 1 + len(PARENTS)], [3, 14, 20]
    query = torch.randn(sum(rows), 2, 8, generator=g)
    tree = (21, [0] + masks_of(PARENTS))
    with_tree, _ = _run(backend, query, kv, rows, starts, tables, [None, None, tree])
    plain, _ = _run(backend, query, kv, rows, starts, tables)
    assert torch.equal(with_tree[:15], plain[:15])  # prefill + chain rows
    assert torch.equal(with_tree[15], plain[15])  # the tree's root
    assert torch.equal(with_tree[16], plain[16])  # node 0 is the first chain token too
    assert not torch.equal(with_tree[17], plain[17])  # node 1 is a sibling: it must not see node 0
