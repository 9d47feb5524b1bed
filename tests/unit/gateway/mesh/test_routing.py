"""The routing policy: affinity keys, rendezvous stickiness, load fallback."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from meshlm.gateway.mesh.routing import PREFIX_CHARS, PREFIX_IDS, Load, Router, affinity_key

LIVE = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]


def idle(_: str) -> int:
    return 0


def test_affinity_key_prefers_routing_key_then_prompt_prefix():
    assert affinity_key("user-7", "hello", None) == "k:user-7"
    shared = "s" * PREFIX_CHARS
    assert affinity_key(None, shared + "a", None) == affinity_key(None, shared + "b", None)
    assert affinity_key(None, "a", None) != affinity_key(None, "b", None)
    ids = list(range(PREFIX_IDS))
    assert affinity_key(None, None, ids + [1]) == affinity_key(None, None, ids + [2])
    assert affinity_key(None, "1", None) != affinity_key(None, None, [1])


def test_session_id_keys_affinity_when_no_routing_key_is_given():
    assert affinity_key(None, "hello", None, "conv-1") == "s:conv-1"
    assert affinity_key(None, "one prompt", None, "conv-1") == affinity_key(
        None, None, [5, 6], "conv-1")  # whatever the prompt
    assert affinity_key("user-7", "hello", None, "conv-1") == "k:user-7"  # routing_key first
    assert affinity_key(None, "hello", None, "") == affinity_key(None, "hello", None)


def test_same_key_sticks_and_keys_spread():
    router = Router()
    picks = {router.pick(LIVE, idle, {}, f"k:{i}") for _ in range(3) for i in [5]}
    assert len(picks) == 1
    spread = Counter(router.pick(LIVE, idle, {}, f"k:{i}") for i in range(300))
    assert set(spread) == set(LIVE) and min(spread.values()) > 60, spread


def test_only_the_keys_of_a_leaving_replica_move():
    router = Router()
    before = {i: router.pick(LIVE, idle, {}, f"k:{i}") for i in range(200)}
    after = {i: router.pick(LIVE[:2], idle, {}, f"k:{i}") for i in range(200)}
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == LIVE[2] for i in moved)


def test_overloaded_preferred_replica_gives_way_to_the_least_loaded():
    router = Router(imbalance=0.5)
    key = "k:hot"
    preferred = router.pick(LIVE, idle, {}, key)
    busy = {a: Load(running=0, max_running=8) for a in LIVE}
    busy[preferred] = Load(running=4, waiting=0, max_running=8)  # 0.5 over: still preferred
    assert router.pick(LIVE, idle, busy, key) == preferred
    busy[preferred] = Load(running=8, waiting=2, max_running=8)
    choice = router.pick(LIVE, idle, busy, key)
    assert choice != preferred


def test_without_a_key_the_least_loaded_serves_counting_own_inflight():
    router = Router()
    counts = {LIVE[0]: 3, LIVE[1]: 1, LIVE[2]: 2}
    assert router.pick(LIVE, counts.__getitem__, {}, None) == LIVE[1]
    # A report of more work than this gateway knows of wins over its own count.
    loads = {LIVE[1]: Load(running=10, max_running=4)}
    assert router.pick(LIVE, counts.__getitem__, loads, None) == LIVE[2]
    # KV usage weighs in.
    loads = {a: Load(max_running=4) for a in LIVE}
    loads[LIVE[1]] = Load(max_running=4, token_usage=0.9)
    assert router.pick(LIVE, lambda a: 0, loads, None) != LIVE[1]


@given(st.lists(st.integers(0, 50), min_size=3, max_size=3), st.text(max_size=20))
def test_never_exceeds_the_imbalance_bound(counts, key):
    router = Router(imbalance=0.5)
    loads = {a: Load(running=c, max_running=8) for a, c in zip(LIVE, counts, strict=True)}
    choice = router.pick(LIVE, idle, loads, "k:" + key)
    scores = {a: router.score(a, 0, loads) for a in LIVE}
    assert scores[choice] - min(scores.values()) <= 0.5
