"""Physical KV blocks: a free queue (LRU order for eviction), reference counts and the prefix-hash map."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Blocks are ids ``0 .. num_blocks - 1``. A block is *free* when its ref count is 0; a free block may
    still hold a cached full prefix block (found through its hash) until it is handed out again."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks, least recently freed first (evicted first). Values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (caller checked there are enough), evicting cached content if needed."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on (cached) blocks found by prefix lookup."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference each; blocks reaching 0 go to the free queue (pass them tail-first so a
        request's last blocks are evicted before its shared prefix)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} freed twice"
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache(self, block: int, h: int) -> None:
        if self.block_hash[block] is None:
            self.block_hash[block] = h
            self.cached.setdefault(h, block)

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
