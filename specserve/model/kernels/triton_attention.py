"""Triton paged-attention backend: KV write (reshape_and_cache) and flat-batch paged attention.

Same contract as ``TorchAttention`` in ``attention.py`` (the reference these kernels are tested against):
request ``r`` owns new tokens ``query_start_loc[r] : query_start_loc[r + 1]``, new token ``i`` sits at
position ``seq_lens[r] - query_len[r] + i`` and attends to keys ``0 .. that position`` (with a sliding
``window``: the last ``window`` of them). One launch covers prefill chunks, single decode tokens and k+1
verification tokens in any mix.

Kernel design (flash-attention 2 style online softmax, Dao 2023, arXiv 2307.08691):
- grid ``(num_reqs, cdiv(max_query_len, BLOCK_M), num_kv_heads)``; a program owns ``BLOCK_M`` new tokens of
  one request and *all* query heads of one KV head's GQA group, folded into the rows of one tile
  (``BLOCK_M * GROUP_PAD`` rows), so K/V are read once per group and a decode step still feeds ``tl.dot``
  at least 16 rows.
- it walks the request's keys ``BLOCK_N`` at a time, from the first key its first token sees (0 without a
  window) up to the causal limit of its last token, gathering each key's page through the block table (any
  page size), with fp32 running max / sum / accumulator.
- plain ``tl.*`` only (no vendor intrinsics), so the same source compiles for NVIDIA and AMD GPUs; on CPU the
  tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the 'triton' attention backend needs Triton: `pip install triton` "
        "(or `pip install specserve[triton]`), or use the 'torch' backend"
    ) from exc

from specserve.model.attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h, stride_c_d,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per token: K and V of all KV heads into cache slot ``slot_mapping[t]`` (< 0: padding)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)  # [H_PAD, D_PAD]
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_slot + h * stride_c_h + d * stride_c_d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _popcount(x):
    """Set bits of each int64 (SWAR)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((x * 0x0101010101010101) >> 56) & 0xFF


@triton.jit
def _tree_rows(tree_base_ptr, tree_mask_ptr, tok, q_len, q_pos):
    """Per row of a tile: its draft-tree base and mask (attention_metadata.TREE_DOC; mask 0: a chain token)
    and its logical position (rope / window). A tree token sees keys below its base, and the base + j of its
    mask's bits j."""
    t_base = tl.load(tree_base_ptr + tok, mask=tok < q_len, other=0)
    t_mask = tl.load(tree_mask_ptr + tok, mask=tok < q_len, other=0)
    logical = tl.where(t_mask != 0, t_base + _popcount(t_mask) - 1, q_pos)
    return t_base, t_mask, logical


@triton.jit
def _tree_visible(k_pos, k_ok, q_pos, k_lo, t_base, t_mask):
    """[ROWS, BLOCK_N]: the keys each row sees with draft trees: causal, at or after the row's first key
    ``k_lo`` in logical positions, and for a tree row's keys at or above its base, the bits of its mask."""
    is_tree = t_mask != 0
    rel = k_pos[None, :].to(tl.int64) - t_base[:, None]  # [ROWS, BLOCK_N]
    in_tree = is_tree[:, None] & (rel >= 0)
    bit = (t_mask[:, None] >> tl.maximum(tl.minimum(rel, 62), 0)) & 1
    below = t_mask[:, None] & ((tl.full([1, 1], 1, tl.int64) << tl.maximum(tl.minimum(rel, 62), 0)) - 1)
    k_logical = tl.where(in_tree, t_base[:, None] + _popcount(below), k_pos[None, :])
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_logical >= k_lo[:, None]) & k_ok[None, :]
    return visible & (~in_tree | ((bit != 0) & (rel < 63)))


@triton.jit
def _kv_tile_ptrs(head_base, bt_row, k_pos, k_ok, d, stride_bt_b, stride_c_blk, stride_c_slot, stride_c_d,
                  BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N, D_PAD] pointers to the keys ``k_pos`` of one KV head, each through its page in the block
    table row ``bt_row`` (the values are ``stride_c_kv`` further)."""
    page = tl.load(bt_row + (k_pos // BLOCK_SIZE) * stride_bt_b, mask=k_ok, other=0).to(tl.int64)
    kv_off = page * stride_c_blk + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot  # [BLOCK_N]
    return head_base + kv_off[:, None] + d[None, :] * stride_c_d


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc):
    """One tile of scores ``s`` (log2 units, hidden keys -inf) and values ``v`` into the running max ``m_i``,
    sum ``l_i`` and fp32 accumulator ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    tree_base_ptr, tree_mask_ptr,  # draft trees (attention_metadata.TREE_DOC); read only with HAS_TREE
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h, stride_c_d,
    stride_bt_r, stride_bt_b,
    head_dim,
    window,  # sliding window (a row at q_pos sees keys q_pos - window < k_pos <= q_pos); 0: none
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, HAS_TREE: tl.constexpr,
):
    req = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Rows of the tile: (new token, query head of this KV head's group), head fastest.
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = m_start + rows // GROUP_PAD  # index among the request's new tokens
    head_in_group = rows % GROUP_PAD
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = ctx_len + tok  # absolute (chain) position of each row's token
    if HAS_TREE:
        t_base, t_mask, logical = _tree_rows(tree_base_ptr + q_start, tree_mask_ptr + q_start, tok, q_len, q_pos)
    d = tl.arange(0, D_PAD)
    d_ok = d < head_dim
    q_row = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, D_PAD]

    # NOTE: a finite initial max keeps fully masked (padding) rows NaN-free: exp2(-inf - m) == 0.
    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], dtype=tl.float32)

    # Keys the tile reads: kv_lo .. kv_end - 1, from the first key its first token sees (0 without a window)
    # to its last real token's position; each row then masks the keys outside its own window.
    k_lo = tl.where(window > 0, q_pos - window + 1, 0)  # [ROWS] first key of each row
    if HAS_TREE:
        k_lo = tl.where(window > 0, logical - window + 1, 0)  # logical positions; tree keys mapped below
    kv_lo = tl.maximum(tl.where(window > 0, ctx_len + m_start - window + 1, 0), 0)
    if HAS_TREE:  # a tree row's logical position is below its chain position, but never below ctx_len
        kv_lo = tl.maximum(tl.where(window > 0, ctx_len - window + 1, 0), 0)
    kv_end = ctx_len + tl.minimum(m_start + BLOCK_M, q_len)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    head_base = cache_ptr + kv_head.to(tl.int64) * stride_c_h
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        k_pos = start + n
        k_ok = (k_pos >= kv_lo) & (k_pos < kv_end)
        kv_ptrs = _kv_tile_ptrs(head_base, bt_row, k_pos, k_ok, d, stride_bt_b, stride_c_blk, stride_c_slot,
                                stride_c_d, BLOCK_SIZE)  # [BLOCK_N, D_PAD]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [ROWS, BLOCK_N] fp32
        if HAS_TREE:
            visible = _tree_visible(k_pos, k_ok, q_pos, k_lo, t_base, t_mask)
        else:
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= k_lo[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(kv_ptrs + stride_c_kv, mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc)

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_row[:, None] + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _tile_sizes(max_query_len: int, group_pad: int, d_pad: int) -> tuple[int, int]:
    """(BLOCK_M new tokens, BLOCK_N keys) per tile; rows = BLOCK_M * group_pad stay in [16, 64] when possible."""
    # NOTE: tl.dot needs every dimension >= 16 on GPUs, hence the floors.
    block_m = min(triton.next_power_of_2(max(max_query_len, 1)), max(1, 64 // group_pad))
    block_m = max(block_m, max(1, 16 // group_pad))
    block_n = 64 if d_pad <= 128 else 32
    return block_m, block_n


class TritonAttention:
    """Paged attention with Triton kernels (NVIDIA and AMD alike; CPU only under the interpreter)."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # key/value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens], < 0 = skip
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        if key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache's "
                             f"[num_kv_heads={num_kv_heads}, head_dim={head_dim}]")
        if key.shape[0] < num_tokens or value.shape[0] < num_tokens:
            raise ValueError(f"{num_tokens} slots but only {key.shape[0]} key / {value.shape[0]} value rows")
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, kv_cache, slot_mapping,
            *key.stride(), *value.stride(), *kv_cache.stride(),
            num_kv_heads, head_dim,
            BLOCK_SIZE=block_size,
            H_PAD=triton.next_power_of_2(num_kv_heads),
            D_PAD=triton.next_power_of_2(head_dim),
        )

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> out: same shape and dtype
        num_tokens, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
        if cache_head_dim != head_dim or num_heads % num_kv_heads:
            raise ValueError(f"query {tuple(query.shape)} does not fit a cache with {num_kv_heads} KV heads "
                             f"of dim {cache_head_dim} (num_heads must be a multiple of num_kv_heads)")
        if head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} > {_MAX_HEAD_DIM} is not supported by the Triton kernel")
        out = torch.empty_like(query)
        if num_tokens == 0 or meta.num_reqs == 0 or meta.max_query_len == 0:
            return out
        group = num_heads // num_kv_heads
        group_pad = triton.next_power_of_2(group)
        d_pad = max(16, triton.next_power_of_2(head_dim))
        block_m, block_n = _tile_sizes(meta.max_query_len, group_pad, d_pad)
        # NOTE: grid and constexprs depend only on num_reqs and max_query_len, which are constants of a graph
        # bucket (worker/graphs.py captures this launch); seq_lens and block tables are read on the device.
        # Never add a per-step host value (max_seq_len, ...) here: a captured graph would bake it in (the
        # window is a per-layer constant).
        grid = (meta.num_reqs, triton.cdiv(meta.max_query_len, block_m), num_kv_heads)
        has_tree = meta.tree_mask is not None
        _paged_attention_kernel[grid](
            out, query, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            meta.tree_base if has_tree else meta.seq_lens, meta.tree_mask if has_tree else meta.seq_lens,
            scale * _LOG2E,
            *query.stride(), *out.stride(), *kv_cache.stride(), *meta.block_tables.stride(),
            head_dim, window or 0,
            GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size,
            BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad, HAS_TREE=has_tree,
        )
        return out
