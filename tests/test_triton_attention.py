"""Triton paged-attention kernels vs the pure-torch reference, and the reference vs a naive per-token loop.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported);
shapes are kept tiny because the interpreter executes every program instance in Python.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specserve.model.attention import TorchAttention, build_metadata  # noqa: E402

pytest.importorskip("triton")

from specserve.model.kernels.triton_attention import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")

# (query_len, seq_len) per request; every batch mixes the step shapes the engine produces.
MIXED = [
    (20, 45),  # prefill chunk starting mid-context (> 16 new tokens: the reference's per-request path)
    (1, 33),  # single decode token
    (5, 29),  # k+1 = 5 verification tokens
    (3, 32),  # seq_len an exact multiple of the block size (8 and 16)
    (7, 7),  # prefill from position 0
    (0, 12),  # a request with no new tokens this step
    (1, 1),  # first decode-like token of a 1-token context
]


def _case(reqs, block_size, num_kv_heads, group, head_dim, *, dtype=torch.float32, seed=0, spare=3):
    """Random cache / query / metadata with shuffled, non-contiguous block ids."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in reqs]
    s_lens = [s for _, s in reqs]
    nblks = [-(-s // block_size) for s in s_lens]
    num_blocks = sum(nblks) + spare  # spare blocks hold garbage nobody may read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for nb in nblks:
        tables.append(perm[at:at + nb])
        at += nb
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    meta = build_metadata(q_lens, s_lens, tables, block_size, device=DEVICE)
    return query.to(DEVICE), kv_cache.to(DEVICE), meta, tables


def _naive_attention(query, kv_cache, q_lens, s_lens, tables, scale):
    """Dense attention, one token at a time, straight from the definition (fp64)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    cache = kv_cache.double().cpu()
    out = torch.zeros(query.shape, dtype=torch.float64)
    t = 0
    for q_len, s_len, table in zip(q_lens, s_lens, tables, strict=True):
        for i in range(q_len):
            pos = s_len - q_len + i
            keys = torch.stack([cache[0, table[p // block_size], p % block_size] for p in range(pos + 1)])
            vals = torch.stack([cache[1, table[p // block_size], p % block_size] for p in range(pos + 1)])
            for h in range(query.shape[1]):
                k, v = keys[:, h // group], vals[:, h // group]  # [pos + 1, D]
                w = torch.softmax(k @ query[t, h].double().cpu() * scale, dim=0)
                out[t, h] = w @ v
            t += 1
    return out


@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim", [
    (16, 2, 1, 16),
    (8, 1, 2, 32),
    (16, 1, 4, 64),
    (8, 2, 3, 24),  # GQA group not a power of two, head_dim padded to 32
    (16, 2, 2, 96),  # head_dim 96 padded to 128
])
def test_paged_attention_matches_reference(block_size, num_kv_heads, group, head_dim):
    query, kv_cache, meta, _ = _case(MIXED, block_size, num_kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    ref = TorchAttention().attend(query, kv_cache, meta, scale)
    out = TritonAttention().attend(query, kv_cache, meta, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max().item() < 1e-3


def test_paged_attention_decode_only_and_single_long_prefill():
    # Pure decode batch (BLOCK_M floor + GQA folding) and one prefill spanning several query tiles.
    for reqs in ([(1, 9), (1, 16), (1, 40)], [(64, 64)]):
        query, kv_cache, meta, _ = _case(reqs, 8, 2, 2, 16, seed=1)
        ref = TorchAttention().attend(query, kv_cache, meta, 0.25)
        out = TritonAttention().attend(query, kv_cache, meta, 0.25)
        assert (out - ref).abs().max().item() < 1e-3


def test_paged_attention_ignores_garbage_outside_context():
    # NaNs in unused blocks and past seq_len inside the last block must never reach the output.
    reqs = [(3, 13), (1, 5)]
    query, kv_cache, meta, tables = _case(reqs, 8, 1, 2, 16, seed=2)
    clean = TritonAttention().attend(query, kv_cache, meta, 0.25)
    used = {(t[p // 8], p % 8) for (_, s), t in zip(reqs, tables, strict=True) for p in range(s)}
    for b in range(kv_cache.shape[1]):
        for o in range(8):
            if (b, o) not in used:
                kv_cache[:, b, o] = float("nan")
    out = TritonAttention().attend(query, kv_cache, meta, 0.25)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)


@pytest.mark.parametrize("dtype", [
    torch.float16,
    # The interpreter has no bf16 arithmetic: its tl.dot multiplies the raw uint16 bit patterns
    # (triton-lang/triton#11584, "not supported yet"), so bf16 is checked on a device only.
    pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, gpu]),
])
def test_paged_attention_half_precision(dtype):
    reqs = [(6, 21), (1, 16), (3, 3)]
    query, kv_cache, meta, _ = _case(reqs, 8, 2, 2, 32, dtype=dtype, seed=3)
    out = TritonAttention().attend(query, kv_cache, meta, 32 ** -0.5)
    ref = TorchAttention().attend(query.float(), kv_cache.float(), meta, 32 ** -0.5)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(cache_dtype):
    block_size, num_kv_heads, head_dim = 8, 2, 24
    reqs = [(5, 13), (1, 8), (3, 3)]
    _, _, meta, _ = _case(reqs, block_size, num_kv_heads, 1, head_dim)
    g = torch.Generator().manual_seed(4)
    n = meta.slot_mapping.shape[0]
    # Non-contiguous key/value, as from a fused qkv projection split.
    kv = torch.randn(n + 2, 2, num_kv_heads, head_dim, generator=g).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]
    # Two padding tokens (slot -1) at the end must be skipped.
    slots = torch.cat([meta.slot_mapping, torch.full((2,), -1, dtype=torch.int64, device=DEVICE)])
    num_blocks = int(meta.block_tables.max()) + 2
    base = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    ref_cache, tri_cache = base.clone().to(DEVICE), base.clone().to(DEVICE)
    TorchAttention().write_kv(key[:n], value[:n], ref_cache, meta.slot_mapping)
    TritonAttention().write_kv(key, value, tri_cache, slots)
    assert torch.equal(tri_cache, ref_cache)


def test_write_then_attend_roundtrip():
    # The model's order: write this step's K/V, then attend over cache incl. the new tokens.
    reqs = [(4, 11), (1, 17)]
    query, kv_cache, meta, _ = _case(reqs, 8, 2, 2, 16, seed=5)
    g = torch.Generator().manual_seed(6)
    key = torch.randn(query.shape[0], 2, 16, generator=g).to(DEVICE)
    value = torch.randn(query.shape[0], 2, 16, generator=g).to(DEVICE)
    ref_cache, tri_cache = kv_cache.clone(), kv_cache.clone()
    TorchAttention().write_kv(key, value, ref_cache, meta.slot_mapping)
    tri = TritonAttention()
    tri.write_kv(key, value, tri_cache, meta.slot_mapping)
    ref = TorchAttention().attend(query, ref_cache, meta, 0.25)
    out = tri.attend(query, tri_cache, meta, 0.25)
    assert (out - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("block_size,num_kv_heads,group", [(8, 2, 2), (16, 1, 4)])
def test_reference_matches_naive_loop(block_size, num_kv_heads, group):
    # Validates the oracle: both of TorchAttention's paths (batched <= 16 new tokens, per-request above).
    query, kv_cache, meta, tables = _case(MIXED, block_size, num_kv_heads, group, 16, seed=7)
    ref = TorchAttention().attend(query, kv_cache, meta, 0.25)
    naive = _naive_attention(query, kv_cache, meta.query_lens_host, meta.seq_lens_host, tables, 0.25)
    assert (ref.double().cpu() - naive).abs().max().item() < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_gpu_realistic_shapes(dtype):
    reqs = [(300, 700), (1, 2049), (1, 130), (6, 1024), (129, 129), (5, 37)]
    query, kv_cache, meta, _ = _case(reqs, 16, 8, 4, 128, dtype=dtype, seed=8, spare=64)
    out = TritonAttention().attend(query, kv_cache, meta, 128 ** -0.5)
    ref = TorchAttention().attend(query.float(), kv_cache.float(), meta, 128 ** -0.5)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.gpu  # also on CPU, under the interpreter; the mark puts it in benchmarks/gpu_check.sh
@pytest.mark.parametrize("window", [None, 4])
def test_tree_rows_match_the_reference(window):
    """Draft trees (attention_metadata.TREE_DOC): a tree next to a chain and a prefill chunk, against the
    torch reference (which computes each tree token exactly as its path decoded as a chain)."""
    from specserve.worker.input_batch import flat_batch

    parents = [-1, -1, 0, 0, 1, 2, 5, 3, -1]
    masks = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 12, 8, 2, 16, generator=g)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    rows, starts = [7, 3, 1 + len(parents)], [5, 13, 20]
    query = torch.randn(sum(rows), 4, 16, generator=g)
    fb = flat_batch([[0] * n for n in rows], starts, tables, 8, torch.device(DEVICE),
                    [None, None, (21, [0] + masks)])
    ref = TorchAttention().attend(query.to(DEVICE), kv.to(DEVICE), fb.meta, 0.25, window)
    out = TritonAttention().attend(query.to(DEVICE), kv.to(DEVICE), fb.meta, 0.25, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
