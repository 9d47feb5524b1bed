"""The waiting queue's order (larger priority first, then FIFO; put-backs first among their
priority) and the planner admitting by it (no torch)."""

from __future__ import annotations

from policy_helpers import FakeRunner, make, params, prompt, rids

from meshlm.scheduler.engine.sequence import SamplingParams, Sequence
from meshlm.scheduler.engine.waiting import WaitingQueue


def seq(rid: str, priority: int = 0) -> Sequence:
    return Sequence.new(rid, [1, 2], SamplingParams(), priority)


def order(q: WaitingQueue) -> list[str]:
    return [s.rid for s in q]


def test_arrivals_go_by_priority_then_first_come_first_served() -> None:
    q = WaitingQueue()
    for rid, priority in (("a", 0), ("b", 5), ("c", 0), ("d", -2), ("e", 5), ("f", 1)):
        q.push(seq(rid, priority))
    assert order(q) == ["b", "e", "f", "a", "c", "d"]
    assert len(q) == 6 and q[0].rid == "b"
    assert q.popleft().rid == "b" and order(q) == ["e", "f", "a", "c", "d"]


def test_one_priority_is_a_plain_fifo() -> None:
    q = WaitingQueue()
    for rid in "abc":
        q.push(seq(rid))
    q.push_front(seq("x"), seq("y"))
    assert order(q) == ["x", "y", "a", "b", "c"]
    q.remove(q[1])
    assert order(q) == ["x", "a", "b", "c"]


def test_put_backs_go_first_among_their_priority_in_their_order() -> None:
    q = WaitingQueue()
    for rid, priority in (("hi", 9), ("mid", 3), ("lo", 0)):
        q.push(seq(rid, priority))
    q.push_front(seq("mid-back-1", 3), seq("mid-back-2", 3))
    q.push_front(seq("top", 10))
    q.push_front(seq("bottom", -1))
    assert order(q) == ["top", "hi", "mid-back-1", "mid-back-2", "mid", "lo", "bottom"]


def test_planner_admits_a_later_higher_priority_request_first() -> None:
    s = make(max_running=1)
    runner = FakeRunner(s)
    s.add("running", prompt(3), params(max_new_tokens=2))
    runner.step()
    s.add("early", prompt(3, 20), params(max_new_tokens=1))
    s.add("late-high", prompt(3, 30), params(max_new_tokens=1), priority=10)
    s.add("late-low", prompt(3, 40), params(max_new_tokens=1), priority=-1)
    assert [q.rid for q in s.waiting] == ["late-high", "early", "late-low"]
    admitted = []
    for _ in range(10):
        plan, _ = runner.step()
        admitted += [r for r in rids(plan) if r not in admitted and r != "running"]
    assert admitted == ["late-high", "early", "late-low"]
    assert not s.has_work()


def test_a_released_follower_queues_by_its_priority() -> None:
    s = make(max_running=1, max_batched_tokens=4)
    runner = FakeRunner(s)
    s.add("lead", prompt(8), params(max_new_tokens=2), priority=4)
    s.add("lead-1", prompt(8), params(max_new_tokens=2), after="lead", priority=4)
    runner.step()  # half the leader's prompt
    s.add("other-low", prompt(3, 40), params(max_new_tokens=1))
    s.add("other-high", prompt(3, 60), params(max_new_tokens=1), priority=9)
    assert [q.rid for q in s.waiting] == ["other-high", "other-low"]  # lead-1 is held
    runner.step()  # the leader's prompt is computed: its follower is released
    assert [q.rid for q in s.waiting] == ["other-high", "lead-1", "other-low"]
    runner.drain()
    firsts = [next(r for r in rids(plan)) for plan in runner.plans]
    assert list(dict.fromkeys(firsts)) == ["lead", "other-high", "lead-1", "other-low"]
