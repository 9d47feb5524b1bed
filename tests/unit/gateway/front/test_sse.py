"""NativeOutput.event: /generate's streamed event written around the text and ids kept as
JSON fragments is, byte for byte, the event of the whole object encoded at once."""

from __future__ import annotations

from typing import Any

import pytest

from meshlm.gateway.api.generation import Generated
from meshlm.gateway.front import sse
from meshlm.gateway.front.sse import NativeOutput, sse_event

# Deltas that JSON must escape, split anywhere a character may end: quotes, backslashes, control
# characters, non-ASCII and a character outside the BMP.
TEXTS = ['He said "hi"', "\\", "\n\t\x00", "", "é€", "😀 ok", "</script>", " end"]


def _messages(ids_per_message: int, extra: dict[str, str] | None = None) -> list[Generated]:
    messages = []
    for i, text in enumerate(TEXTS):
        meta = {"id": "r1", "prompt_tokens": "5", "cached_tokens": "0",
                "completion_tokens": str((i + 1) * ids_per_message), **(extra or {})}
        ids = [100 + i * ids_per_message + k for k in range(ids_per_message)]
        last = i == len(TEXTS) - 1
        if last:
            meta |= {"finish_reason": "stop", "matched_stop": "2", "matched_stop_type": "token"}
        messages.append(Generated(text, ids, meta, last))
    return messages


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse.time, "monotonic", lambda: 12.5)  # e2e_latency the same in both


@pytest.mark.parametrize("ids_per_message", [0, 1, 3])
@pytest.mark.parametrize("return_text", [True, False])
@pytest.mark.parametrize("index", [None, 2])
@pytest.mark.parametrize("extra", [None, {"weight_version": "v2"}])
def test_each_event_is_the_whole_objects_event(ids_per_message: int, return_text: bool,
                                               index: int | None,
                                               extra: dict[str, Any] | None) -> None:
    out = NativeOutput(return_text=return_text, max_new_tokens=16, started=10.0, index=index)
    for message in _messages(ids_per_message, extra):
        out.add(message)
        assert out.event() == sse_event(out.to_dict())


def test_logprobs_are_encoded_whole_and_cumulative() -> None:
    out = NativeOutput(return_text=True, max_new_tokens=16, started=10.0)
    for i in range(3):
        out.add(Generated(f"t{i}", [i], {"id": "r1", "completion_tokens": str(i + 1),
                                         "output_token_logprobs": f"[[-0.5, {i}, null]]"},
                          False))
        assert out.event() == sse_event(out.to_dict())
    assert out.to_dict()["meta_info"]["output_token_logprobs"] == [
        [-0.5, 0, None], [-0.5, 1, None], [-0.5, 2, None]]


@pytest.mark.parametrize("ids_per_message", [0, 1, 3])
@pytest.mark.parametrize("return_text", [True, False])
@pytest.mark.parametrize("index", [None, 2])
def test_a_running_event_is_the_event_of_its_message(ids_per_message: int, return_text: bool,
                                                     index: int | None) -> None:
    """The direct writes' running events (made from the inbox's tuple) are the events of the
    messages the handler would have folded in; the last message, through `add`, finds the
    same state."""
    messages = _messages(ids_per_message)
    handled = NativeOutput(return_text=return_text, max_new_tokens=16, started=10.0, index=index)
    direct = NativeOutput(return_text=return_text, max_new_tokens=16, started=10.0, index=index)
    for i, message in enumerate(messages):
        handled.add(message)
        if i == 0 or message.finished:  # the first and last go through the handler
            direct.add(message)
            assert direct.event() == handled.event()
            continue
        meta = message.meta_info
        item = (meta["id"], message.output_ids, int(meta["prompt_tokens"]),
                int(meta["completion_tokens"]), int(meta["cached_tokens"]), message.text)
        assert direct.running_event(item) == handled.event()
    assert direct.to_dict() == handled.to_dict()


@pytest.mark.parametrize("extra", [{"weight_version": "v2"},
                                   {"output_token_logprobs": "[[-0.5, 1, null]]"}])
def test_a_running_event_declines_what_is_not_the_plain_event(extra: dict[str, str]) -> None:
    out = NativeOutput(return_text=True, max_new_tokens=16, started=10.0)
    out.add(Generated("a", [1], {"id": "r1", "completion_tokens": "1", **extra}, False))
    before = out.to_dict()
    assert out.running_event(("r1", [2], 5, 2, 0, "b")) is None
    assert out.to_dict() == before  # nothing folded in
