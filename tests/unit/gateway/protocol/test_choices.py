"""n > 1 samples: child requests of one request, and folding their updates for the client."""

from __future__ import annotations

from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.choices import Choices, child_rids, fan_out, merge_updates
from meshlm.v1 import common_pb2, gateway_pb2


def _update(ids: list[int], reason: str | None = None, text: str = "") -> Update:
    final = gateway_pb2.TextOutput(finished=True, finish_reason=reason) if reason else None
    return Update(text=text or "".join(map(str, ids)), token_ids=ids, final=final, error=None,
                  prompt_tokens=4, completion_tokens=len(ids), cached_tokens=0)


def test_one_sample_is_the_request_itself() -> None:
    sampling = common_pb2.SamplingParams(temperature=0.5, seed=9)
    [child] = fan_out("r", 1, sampling)
    assert (child.index, child.rid, child.after) == (0, "r", "")
    assert child.sampling is sampling and child_rids("r", 1) == ["r"]


def test_children_follow_the_leader_with_their_own_seeds() -> None:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=7, seed=100)
    children = fan_out("r", 3, sampling)
    assert [c.rid for c in children] == ["r-0", "r-1", "r-2"] == child_rids("r", 3)
    assert [c.index for c in children] == [0, 1, 2]
    assert [c.after for c in children] == ["", "r-0", "r-0"]
    assert [c.sampling.seed for c in children] == [100, 101, 102]
    assert all(c.sampling.max_new_tokens == 7 for c in children)
    assert sampling.seed == 100  # the request's own params are not touched
    # The largest public seed still fits the internal uint64 field.
    assert fan_out("r", 16, common_pb2.SamplingParams(seed=2**63 - 1))[15].sampling.seed == (
        2**63 + 14)


def test_unseeded_children_stay_unseeded() -> None:
    children = fan_out("r", 2, common_pb2.SamplingParams(temperature=1.0))
    assert not any(c.sampling.HasField("seed") for c in children)


def test_streaming_passes_every_update_through() -> None:
    choices = Choices(2, stream=True)
    assert choices.add(1, _update([1])) == [(1, _update([1]))]
    assert not choices.done
    choices.add(0, _update([2], "stop"))
    choices.add(1, _update([3], "length"))
    assert choices.done and choices.finish_reason() == "stop,length"


def test_not_streaming_gives_all_choices_merged_in_order_at_the_end() -> None:
    choices = Choices(3, stream=False)
    assert choices.add(2, _update([7], "stop")) == []
    assert choices.add(0, _update([1, 2])) == []
    assert choices.add(0, _update([3], "length")) == []
    due = choices.add(1, _update([4], "abort"))
    assert [i for i, _ in due] == [0, 1, 2]
    assert [u.token_ids for _, u in due] == [[1, 2, 3], [4], [7]]
    assert [u.text for _, u in due] == ["123", "4", "7"]
    assert [u.final.finish_reason for _, u in due if u.final] == ["length", "abort", "stop"]
    assert choices.finish_reason() == "length,abort,stop"


def test_merge_keeps_the_embedding() -> None:
    u = _update([], "stop")
    u.embedding = [0.6, 0.8]
    assert merge_updates([u]).embedding == [0.6, 0.8]


def test_merge_keeps_the_prompt_ids_of_the_first_update() -> None:
    first, later = _update([1]), _update([2], "stop")
    first.prompt_ids = [9, 8]
    assert merge_updates([first, later]).prompt_ids == [9, 8]
    assert merge_updates([later]).prompt_ids is None


def test_done_counts_each_child_once() -> None:
    choices = Choices(2, stream=True)
    choices.add(0, _update([1], "stop"))
    choices.add(0, _update([2], "stop"))  # a second final of the same child
    assert not choices.done
    choices.add(1, _update([3], "length"))
    assert choices.done
