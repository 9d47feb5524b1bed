"""BlockManager (no torch): verb pairs, ref counts, the hash-chain prefix cache, LRU eviction,
and a property test that blocks never leak and cached blocks keep their contents."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshlm.scheduler.engine import block_manager
from meshlm.scheduler.engine.block_manager import BlockManager, BlockTable

BS = 4


def table_for(bm: BlockManager, tokens: list[int], reuse: bool = True) -> BlockTable:
    """Allocate a table for `tokens`, reusing their cached prefix (up to the last token)."""
    reused, hashes = bm.match_prefix(tokens, len(tokens) - 1 if reuse else 0)
    table = BlockTable()
    assert bm.can_allocate(bm.blocks_for(len(tokens)) - len(reused), reused)
    bm.allocate(table, reused, hashes, len(tokens))
    return table


def computed(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """A table whose tokens all have KV, its full blocks registered."""
    table = table_for(bm, tokens)
    bm.register_full_blocks(table, tokens, len(tokens))
    return table


def test_block_manager_does_not_import_torch() -> None:
    code = "import sys, meshlm.scheduler.engine.block_manager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_grow_free_figures() -> None:
    bm = BlockManager(8, BS)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    t = BlockTable()
    bm.allocate(t, [], [], 5)
    assert t.blocks == [0, 1] and (bm.num_used, bm.num_free) == (2, 6)
    assert bm.can_grow(t, 8) and bm.can_grow(t, 32) and not bm.can_grow(t, 33)
    bm.grow(t, 8)  # still fits in two blocks
    assert len(t.blocks) == 2
    bm.grow(t, 9)
    assert t.blocks == [0, 1, 2] and bm.num_used == 3
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(t, 33)
    assert len(t.blocks) == 3 and bm.num_used == 3  # a refused grow takes nothing
    with pytest.raises(RuntimeError, match="empty block table"):
        bm.allocate(t, [], [], 1)
    copy = BlockTable(list(t.blocks))
    bm.free(t)
    assert t.blocks == [] and (bm.num_used, bm.num_free, bm.num_cached) == (0, 8, 0)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(copy)
    bm.check()


def test_prefix_match_is_whole_blocks_chained_and_capped() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    a = computed(bm, tokens)
    assert len(a.hashes) == 2  # the partial third block is not registered
    ids, hashes = bm.match_prefix(tokens, len(tokens))
    assert ids == a.blocks[:2] and hashes == a.hashes
    assert bm.match_prefix(tokens, 7)[0] == a.blocks[:1]  # capped, whole blocks only
    assert bm.match_prefix(tokens, 3)[0] == []
    assert bm.match_prefix(tokens[:6], 100)[0] == a.blocks[:1]
    # Same second block after a different first block: the chain does not match.
    other = [99, 98, 97, 96] + tokens[4:8]
    assert bm.match_prefix(other, 100)[0] == []
    # Diverging in the second block: only the first matches.
    assert bm.match_prefix(tokens[:4] + [0, 0, 0, 0], 100)[0] == a.blocks[:1]


def test_a_salted_chain_is_shared_only_under_its_salt() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10, 19))
    plain = computed(bm, tokens)
    root = block_manager.salt_root("tenant-a")
    assert block_manager.salt_root("") is None and root != block_manager.salt_root("tenant-b")
    assert bm.match_prefix(tokens, 100, root)[0] == []  # the unsalted blocks: not for a salt
    salted = table_for(bm, tokens, reuse=False)
    salted.root = root
    bm.register_full_blocks(salted, tokens, len(tokens))
    assert bm.match_prefix(tokens, 100, root)[0] == salted.blocks[:2]
    assert bm.match_prefix(tokens, 100)[0] == plain.blocks[:2]
    assert bm.match_prefix(tokens, 100, block_manager.salt_root("tenant-b"))[0] == []
    bm.check()


def test_register_only_computed_full_blocks_and_incrementally() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10, 22))
    t = table_for(bm, tokens)
    bm.register_full_blocks(t, tokens, 3)
    assert t.hashes == [] and bm.match_prefix(tokens, 100)[0] == []
    bm.register_full_blocks(t, tokens, 9)
    assert len(t.hashes) == 2 and bm.match_prefix(tokens, 100)[0] == t.blocks[:2]
    bm.register_full_blocks(t, tokens, 12)
    assert bm.match_prefix(tokens, 100)[0] == t.blocks
    bm.check()


def test_shared_prefix_ref_counts_and_duplicate_stays_private() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(10, 19))  # 9 tokens: 2 full blocks
    a = computed(bm, tokens)
    b = computed(bm, tokens)  # reuses a's two full blocks, never the last token's block
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [bm.blocks[i].ref_count for i in a.blocks] == [2, 2, 1]
    assert bm.num_used == 4
    # A table computed without reuse holds the same contents privately.
    c = table_for(bm, tokens, reuse=False)
    bm.register_full_blocks(c, tokens, 9)
    assert len(c.hashes) == 2 and bm.blocks[c.blocks[0]].hash is None
    assert bm.match_prefix(tokens, 100)[0] == a.blocks[:2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.blocks[:2]] == [1, 1]
    bm.free(c)
    assert bm.num_cached == 0  # c's duplicates were uncached: plain free blocks
    bm.free(b)
    assert bm.num_used == 0 and bm.num_cached == 2
    bm.check()


def test_can_allocate_counts_idle_reused_blocks() -> None:
    bm = BlockManager(4, BS)
    tokens = list(range(10, 19))
    bm.free(computed(bm, tokens))  # 3 blocks, 2 of them cached; all unreferenced
    reused, _ = bm.match_prefix(tokens, 8)
    assert len(reused) == 2 and bm.num_free == 4
    # Taking the 2 cached blocks leaves 2 for fresh ones, not 4.
    assert bm.can_allocate(2, reused) and not bm.can_allocate(3, reused)
    held = table_for(bm, tokens[:5])  # now referenced: reusing them costs nothing more
    assert held.blocks[0] == reused[0]
    assert bm.can_allocate(bm.num_free, reused[:1])


def test_uncached_free_blocks_go_before_cached_ones() -> None:
    bm = BlockManager(4, BS)
    cached = computed(bm, list(range(10, 18)))  # 2 blocks, both cached
    bm.free(cached)
    fresh = BlockTable()
    bm.allocate(fresh, [], [], 8)
    assert set(fresh.blocks) == {2, 3} and bm.num_cached == 2  # no eviction needed
    assert len(bm.match_prefix(list(range(10, 18)), 8)[0]) == 2


def test_eviction_is_lru_tail_before_head() -> None:
    bm = BlockManager(6, BS)
    a_tokens, b_tokens = list(range(10, 22)), list(range(30, 42))  # 3 full blocks each
    a, b = computed(bm, a_tokens), computed(bm, b_tokens)
    a_blocks, b_blocks = list(a.blocks), list(b.blocks)
    bm.free(a)  # released first: evicted first, its tail before its head
    bm.free(b)
    assert bm.num_free == 6 and bm.num_cached == 6
    order = []
    for _ in range(6):
        t = BlockTable()
        bm.allocate(t, [], [], 1)
        order += t.blocks
    assert order == a_blocks[::-1] + b_blocks[::-1]
    assert bm.match_prefix(a_tokens, 100)[0] == [] and bm.num_cached == 0
    bm.check()


def test_eviction_breaks_the_chain_at_the_evicted_block() -> None:
    bm = BlockManager(4, BS)
    tokens = list(range(10, 22))
    bm.free(computed(bm, tokens))  # 3 cached blocks, plus 1 uncached free
    taken = BlockTable()
    bm.allocate(taken, [], [], 8)  # the free block, then the tail of the chain
    assert bm.match_prefix(tokens, 100)[0] == bm.match_prefix(tokens, 8)[0]
    assert len(bm.match_prefix(tokens, 100)[0]) == 2


def test_reuse_refreshes_recency() -> None:
    bm = BlockManager(4, BS)
    a_tokens, b_tokens = list(range(10, 14)), list(range(20, 24))
    a, b = computed(bm, a_tokens + [0]), computed(bm, b_tokens + [0])
    a_head, b_head = a.blocks[0], b.blocks[0]
    bm.free(a)
    bm.free(b)  # LRU (oldest first): a tail, a head, b tail, b head
    again = table_for(bm, a_tokens + [1])  # re-references a's head, a fresh tail
    assert again.blocks[0] == a_head and bm.blocks[a_head].ref_count == 1
    bm.free(again)  # a's head is now the most recently released
    order = []
    for _ in range(4):
        t = BlockTable()
        bm.allocate(t, [], [], 1)
        order += t.blocks
    assert order[-1] == a_head and order.index(b_head) < order.index(a_head)
    bm.check()


def test_hash_collision_is_caught_by_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(8, BS)
    a = computed(bm, [1, 2, 3, 4, 5])
    assert bm.match_prefix([1, 2, 3, 4, 9], 4)[0] == a.blocks[:1]
    assert bm.match_prefix([5, 6, 7, 8, 9], 4)[0] == []  # same hash, other tokens
    b = computed(bm, [5, 6, 7, 8, 9])
    assert bm.blocks[b.blocks[0]].hash is None  # the hash was taken: b's block stays private
    bm.check()


def test_reset_prefix_cache() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10, 19))
    a = computed(bm, tokens)
    assert not bm.reset_prefix_cache()  # a block is referenced
    assert bm.match_prefix(tokens, 8)[0] == a.blocks[:2]
    bm.free(a)
    assert bm.num_cached == 2
    assert bm.reset_prefix_cache()
    assert bm.num_cached == 0 and bm.num_free == 8 and bm.match_prefix(tokens, 8)[0] == []
    assert all(b.hash is None for b in bm.blocks)
    bm.check()


# -- property test ------------------------------------------------------------------------

BASES = [list(range(10, 30)), list(range(40, 60))]


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / grow / compute+register / free / reset over 10 blocks of 4: blocks
    never leak, ref counts match the live tables, and a reused block holds the tokens it
    was found for (tracked in a fake KV store: slot -> token)."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, BS)
        self.live: list[tuple[BlockTable, list[int], list[int]]] = []  # table, tokens, [computed]
        self.kv: dict[int, int] = {}

    def slot(self, table: BlockTable, pos: int) -> int:
        return table.blocks[pos // BS] * BS + pos % BS

    @rule(
        base=st.sampled_from(BASES),
        shared=st.integers(0, 20),
        extra=st.integers(0, 6),
        reuse=st.booleans(),
    )
    def allocate(self, base: list[int], shared: int, extra: int, reuse: bool) -> None:
        tokens = base[:shared] + [70 + len(self.live) % 5] * extra
        if not tokens:
            return
        bm = self.bm
        reused, hashes = bm.match_prefix(tokens, len(tokens) - 1 if reuse else 0)
        need = bm.blocks_for(len(tokens)) - len(reused)
        idle = sum(1 for b in reused if bm.blocks[b].ref_count == 0)
        assert bm.can_allocate(need, reused) == (bm.num_free - idle >= need)
        if not bm.can_allocate(need, reused):
            return
        table = BlockTable()
        bm.allocate(table, reused, hashes, len(tokens))
        assert table.blocks[: len(reused)] == reused and len(set(table.blocks)) == len(table.blocks)
        n = len(reused) * BS
        for pos in range(n):  # reused blocks hold the right tokens
            assert self.kv.get(self.slot(table, pos)) == tokens[pos]
        self.live.append((table, tokens, [n]))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), n=st.integers(1, 9))
    def compute(self, pick: int, n: int) -> None:
        table, tokens, done = self.live[pick % len(self.live)]
        end = min(done[0] + n, len(tokens))
        for pos in range(done[0], end):
            self.kv[self.slot(table, pos)] = tokens[pos]
        done[0] = end
        self.bm.register_full_blocks(table, tokens, end)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100), n=st.integers(1, 6))
    def grow(self, pick: int, n: int) -> None:
        table, tokens, _ = self.live[pick % len(self.live)]
        want = len(tokens) + n
        if self.bm.can_grow(table, want):
            tokens.extend([80] * n)
            self.bm.grow(table, want)
            assert len(table.blocks) == self.bm.blocks_for(want)
        else:
            with pytest.raises(RuntimeError):
                self.bm.grow(table, want)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def free(self, pick: int) -> None:
        table, _, _ = self.live.pop(pick % len(self.live))
        self.bm.free(table)
        assert table.blocks == []

    @rule()
    def reset(self) -> None:
        done = self.bm.reset_prefix_cache()
        assert done == (not self.live)
        if done:
            assert self.bm.num_cached == 0

    @invariant()
    def no_leak(self) -> None:
        bm = self.bm
        bm.check()
        assert bm.num_free + bm.num_used == bm.num_blocks
        refs = Counter(b for table, _, _ in self.live for b in table.blocks)
        assert refs == Counter({b.block_id: b.ref_count for b in bm.blocks if b.ref_count})
        assert bm.num_used == len(refs)

    def teardown(self) -> None:
        for table, _, _ in self.live:
            self.bm.free(table)
        assert self.bm.num_used == 0 and self.bm.num_free == self.bm.num_blocks
        assert self.bm.reset_prefix_cache() and self.bm.num_cached == 0
        self.bm.check()


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Passing takes seconds; a failure is shrunk for up to Hypothesis's 5 minutes, so give it
# time to print the minimal example instead of hitting the suite's 300 s timeout.
TestBlockMachine.pytestmark = [pytest.mark.timeout(900)]  # type: ignore[attr-defined]
