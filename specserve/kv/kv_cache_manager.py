"""Per-request block tables on top of the block pool: allocation with lookahead, prefix hits, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.kv.block_pool import BlockPool
from specserve.request import Request


def block_hashes(token_ids: list[int], block_size: int, num_full: int, start: int = 0,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of full blocks ``start .. num_full - 1``: h_i = hash((h_{i-1}, tokens of block i))."""
    out = []
    for i in range(start, num_full):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's blocks registered in the cache
        self.prefix_stats = PrefixStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute (the last
        position's logits are needed)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_full = (req.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        parent = None
        for i in range(max_full):
            parent = hash((parent, tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])))
            b = self.pool.lookup(parent)
            if b is None:
                break
            blocks.append(b)
        self.prefix_stats.queries += req.num_tokens
        self.prefix_stats.hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` after ``req.num_computed_tokens`` (plus lookahead slots the
        draft model may write into). All or nothing: returns False, changing nothing, when blocks run out."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        computed_blocks = computed_blocks or []
        total = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        # Cached blocks with ref 0 sit in the free queue: touching them uses up free capacity too.
        reuse_free = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free_blocks - reuse_free:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.req_hashes[req.request_id] = block_hashes(
                req.all_token_ids, self.block_size, len(computed_blocks))
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks whose every slot holds KV of a verified token (position < num_computed)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(req.request_id, [])
        num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if num_full <= len(hashes):
            return
        new = block_hashes(req.all_token_ids, self.block_size, num_full, len(hashes),
                           hashes[-1] if hashes else None)
        blocks = self.req_blocks[req.request_id]
        for i, h in enumerate(new, start=len(hashes)):
            self.pool.cache(blocks[i], h)
        hashes.extend(new)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_hashes.pop(req.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def block_ids(self, req: Request) -> list[int]:
        return self.req_blocks.get(req.request_id, [])
