"""BlockManager: the paged KV cache's bookkeeping (which block holds what), without torch.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table
(block ids, in order); token position p lives in slot `block_table[p // block_size] *
block_size + p % block_size`. Blocks are reference-counted so that sequences can share them.

Prefix cache (vLLM's hash chain over full blocks): once a block is full and its KV computed,
it is registered under the hash of (previous block's hash, its tokens). A new sequence whose
leading full blocks hash the same reuses them instead of recomputing. A block nobody
references keeps its contents and stays findable until it is needed for something else:
free blocks are handed out uncached first, then cached ones least recently released first
(LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


def chain_hash(parent: int | None, tokens: Seq[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((parent, tuple(tokens)))


def salt_root(cache_salt: str) -> int | None:
    """Where a request's chain of block hashes starts: None, or (vLLM's cache_salt) a root of
    its salt's own, so that only requests with the same salt share cached blocks."""
    return hash(("cache_salt", cache_salt)) if cache_salt else None


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while registered in the prefix cache
    tokens: tuple[int, ...] = ()  # the registered block's tokens (guards against collisions)


@dataclass
class BlockTable:
    """A sequence's view of its KV blocks: ids, and the hashes of its leading full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # one per registered (full) block
    root: int | None = None  # the hash its first block chains from (`salt_root`)


class BlockManager:
    """Allocates and frees KV blocks, reference-counted, with a prefix cache over full blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached (LRU)
        self._cached: dict[int, int] = {}  # hash -> block id

    # -- figures ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached ones by eviction)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def figures(self, unused_slots: int) -> dict[str, int | float]:
        """The cache's figures for stats(); `unused_slots`: slots of used blocks that hold no
        token yet (the running sequences' last blocks)."""
        used = self.num_used
        return {
            "kv_block_size": self.block_size,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": used,
            "kv_blocks_cached": self.num_cached,
            "kv_tokens_used": used * self.block_size - max(unused_slots, 0),
            "token_usage": used / self.num_blocks,
        }

    # -- prefix cache -----------------------------------------------------------------------

    def match_prefix(self, token_ids: Seq[int], max_tokens: int, root: int | None = None
                     ) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest prefix of `token_ids`, at most `max_tokens`
        long, whole blocks only, on the chain from `root`: (block ids, their hashes). Takes no
        reference."""
        ids: list[int] = []
        hashes: list[int] = []
        parent = root
        bs = self.block_size
        for i in range(min(max_tokens, len(token_ids)) // bs):
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tuple(tokens):
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return ids, hashes

    def register_full_blocks(self, table: BlockTable, token_ids: Seq[int], computed: int) -> None:
        """Enter the table's blocks that are full and computed (`computed` tokens have KV)
        into the prefix cache. A block whose contents are cached already (another block got
        there first) stays private; the chain goes on with the same hash."""
        bs = self.block_size
        for i in range(len(table.hashes), min(computed // bs, len(table.blocks))):
            parent = table.hashes[-1] if table.hashes else table.root
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(parent, tokens)
            table.hashes.append(h)
            block = self.blocks[table.blocks[i]]
            if h not in self._cached and block.hash is None:
                block.hash, block.tokens = h, tokens
                self._cached[h] = block.block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only when no block is referenced. True if done."""
        if self.num_used:
            return False
        for block_id in list(self._evictable):
            self._uncache(self.blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        return True

    # -- allocation -------------------------------------------------------------------------

    def can_allocate(self, num_new: int, reused: Seq[int] = ()) -> bool:
        """Whether `num_new` fresh blocks can be had while `reused` (cached blocks about to be
        referenced) are held too: reused blocks that are now unreferenced leave the pool."""
        idle = sum(1 for b in reused if self.blocks[b].ref_count == 0)
        return self.num_free - idle >= num_new

    def allocate(self, table: BlockTable, reused: Seq[int], reused_hashes: Seq[int],
                 num_tokens: int) -> None:
        """Give an empty table the `reused` prefix blocks, then fresh blocks up to
        `num_tokens` slots. The caller checked can_allocate."""
        if table.blocks:
            raise RuntimeError("allocate() needs an empty block table")
        for block_id in reused:
            self._ref(block_id)
        table.blocks.extend(reused)
        table.hashes.extend(reused_hashes)
        self.grow(table, num_tokens)

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.num_free >= self.blocks_for(num_tokens) - len(table.blocks)

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Extend the table with fresh blocks until it holds `num_tokens` slots."""
        need = self.blocks_for(num_tokens) - len(table.blocks)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            table.blocks.append(self._take())

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, last block first (so a sequence's tail is evicted
        before its head), and empty it."""
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        table.blocks.clear()
        table.hashes.clear()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently released
            self._uncache(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.hash, block.tokens = None, ()

    def check(self) -> None:
        """Assert the invariants (tests): every block is exactly one of referenced, free or
        evictable; cached hashes point at blocks that carry them."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for block in self.blocks:
            referenced = block.ref_count > 0
            assert referenced + (block.block_id in free) + (block.block_id in evictable) == 1
            assert block.ref_count >= 0
            if block.block_id in free:
                assert block.hash is None
            if block.block_id in evictable:
                assert block.hash is not None
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h
