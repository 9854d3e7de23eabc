"""Sliding-window attention (``attend(..., window=w)``: a token at position i sees keys i - w < j <= i) in the
torch reference, the C++ CPU kernel and the Triton kernel, against a naive per-token loop.

On CPU the Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specserve.model.attention import CpuKernelAttention, TorchAttention, build_metadata  # noqa: E402
from specserve.model.kernels.cpu import load_cpu_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOWS = [1, 4, 7, 16]

# (query_len, seq_len) per request: every step shape, with contexts longer than the windows.
MIXED = [
    (5, 23),  # k+1 = 5 verification rows (positions 18..22): windows 4 and 7 start inside them
    (12, 40),  # prefill chunk starting mid-context (positions 28..39)
    (1, 33),  # decode token
    (1, 3),  # decode token with a context shorter than every window but 1
    (0, 12),  # a request with no new tokens this step
    (6, 6),  # prefill from position 0
]


def _case(reqs, device="cpu", block_size=8, num_kv_heads=2, group=2, head_dim=16, seed=0):
    """Random cache / query / metadata with shuffled block ids (block 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    nblks = [-(-s // block_size) for _, s in reqs]
    perm = (torch.randperm(sum(nblks), generator=g) + 1).tolist()
    tables, at = [], 0
    for nb in nblks:
        tables.append(perm[at:at + nb])
        at += nb
    kv_cache = torch.randn(2, sum(nblks) + 1, block_size, num_kv_heads, head_dim, generator=g)
    query = torch.randn(sum(q for q, _ in reqs), num_kv_heads * group, head_dim, generator=g)
    meta = build_metadata([q for q, _ in reqs], [s for _, s in reqs], tables, block_size, device=device)
    return query.to(device), kv_cache.to(device), meta, tables


def _naive(query, kv_cache, meta, tables, scale, window):
    """Each new token over its last ``window`` keys (all with None), straight from the paged cache (fp64)."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    cache, query = kv_cache.double().cpu(), query.double().cpu()
    out = torch.zeros(query.shape, dtype=torch.float64)
    t = 0
    for q_len, s_len, table in zip(meta.query_lens_host, meta.seq_lens_host, tables, strict=True):
        for i in range(q_len):
            pos = s_len - q_len + i
            keys = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            k = torch.stack([cache[0, table[p // block_size], p % block_size] for p in keys])
            v = torch.stack([cache[1, table[p // block_size], p % block_size] for p in keys])
            for h in range(query.shape[1]):
                w = torch.softmax(k[:, h // group] @ query[t, h] * scale, dim=0)
                out[t, h] = w @ v[:, h // group]
            t += 1
    return out


@pytest.fixture(params=["torch", "cpu", "triton"])
def backend(request):
    """(backend, device): the Triton backend runs on a GPU where there is one, the others on CPU."""
    if request.param == "torch":
        return TorchAttention(), "cpu"
    if request.param == "cpu":
        if not load_cpu_kernels():
            pytest.skip("C++ CPU kernels not built")
        return CpuKernelAttention(), "cpu"
    pytest.importorskip("triton")
    from specserve.model.kernels.triton_attention import TritonAttention

    return TritonAttention(), DEVICE


def _err(out, ref):
    return (out.double().cpu() - ref).abs().max().item()


@pytest.mark.parametrize("window", WINDOWS)
def test_matches_naive_mixed_batch(backend, window):
    attn, device = backend
    query, kv_cache, meta, tables = _case(MIXED, device)
    out = attn.attend(query, kv_cache, meta, 0.25, window)
    assert _err(out, _naive(query, kv_cache, meta, tables, 0.25, window)) < 1e-5


@pytest.mark.parametrize("reqs", [
    [(5, 23)],  # verification rows alone (window edge inside them)
    [(12, 40)],  # a mid-context prefill chunk alone
    [(1, 9), (1, 33), (1, 17)],  # a decode batch
    [(1, 150), (20, 170)],  # keys past the Triton kernel's first key blocks; 20 new tokens: two query tiles
], ids=["verify", "prefill-chunk", "decode", "long"])
def test_matches_naive_step_shapes(backend, reqs):
    attn, device = backend
    query, kv_cache, meta, tables = _case(reqs, device, block_size=16, num_kv_heads=1, group=4, head_dim=32, seed=1)
    for window in (4, 7, 70):
        out = attn.attend(query, kv_cache, meta, 32 ** -0.5, window)
        assert _err(out, _naive(query, kv_cache, meta, tables, 32 ** -0.5, window)) < 1e-5


def test_window_covering_the_context_is_full_attention(backend):
    attn, device = backend
    query, kv_cache, meta, _ = _case(MIXED, device, seed=2)
    full = attn.attend(query, kv_cache, meta, 0.25)
    for window in (40, 41, 1000):
        assert torch.equal(attn.attend(query, kv_cache, meta, 0.25, window), full)


def test_windows_of_layers_sharing_one_meta(backend):
    """Layers of one forward share ``meta`` (and so the reference's plan cache) but may differ in window."""
    attn, device = backend
    query, kv_cache, meta, tables = _case(MIXED, device, seed=3)
    windows = [4, None, 16, 4]
    outs = [attn.attend(query, kv_cache, meta, 0.25, w) for w in windows]
    for w, out in zip(windows, outs, strict=True):
        assert _err(out, _naive(query, kv_cache, meta, tables, 0.25, w)) < 1e-5
        fresh = _case(MIXED, device, seed=3)[2]
        assert torch.equal(out, attn.attend(query, kv_cache, fresh, 0.25, w))
    assert torch.equal(outs[0], outs[3])
    assert _err(outs[0], outs[2].double().cpu()) > 1e-3 and _err(outs[1], outs[2].double().cpu()) > 1e-3


def test_kernels_do_not_read_keys_before_the_window(backend):
    """NaN in every cached key before the window of a request's first new token changes nothing (the
    reference gathers and masks such keys, so only the kernels are checked)."""
    attn, device = backend
    if type(attn) is TorchAttention:
        pytest.skip("the reference gathers every key of a group's bucket")
    query, kv_cache, meta, tables = _case(MIXED, device, seed=4)
    window = 7
    clean = attn.attend(query, kv_cache, meta, 0.25, window)
    for (q_len, s_len), table in zip(MIXED, tables, strict=True):
        for p in range(max(0, s_len - q_len - window + 1)):
            kv_cache[:, table[p // 8], p % 8] = float("nan")
    assert torch.equal(attn.attend(query, kv_cache, meta, 0.25, window), clean)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gpu_realistic_shapes(dtype):
    pytest.importorskip("triton")
    from specserve.model.kernels.triton_attention import TritonAttention

    reqs = [(300, 700), (1, 2049), (1, 130), (6, 1024), (129, 129), (5, 37)]
    query, kv_cache, meta, _ = _case(reqs, "cuda", block_size=16, num_kv_heads=8, group=4, head_dim=128, seed=5)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    query, kv_cache = query.to(dtype), kv_cache.to(dtype)
    for window in (1, 100, 512, 4096):
        out = TritonAttention().attend(query, kv_cache, meta, 128 ** -0.5, window)
        ref = TorchAttention().attend(query.float(), kv_cache.float(), meta, 128 ** -0.5, window)
        assert (out.float() - ref).abs().max().item() < tol
