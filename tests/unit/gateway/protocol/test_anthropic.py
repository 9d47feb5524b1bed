"""Anthropic's Messages requests read as chats (`protocol/anthropic.py`) and their answers
shaped back (`protocol/anthropic_output.py`)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.anthropic import parse_messages
from meshlm.gateway.protocol.anthropic_output import MessageShape, error_object

TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {
    "zone": {"type": "string"}}, "required": ["zone"]}}
USER = [{"role": "user", "content": "time?"}]


def _parse(**doc: Any) -> Any:
    return parse_messages(orjson.dumps({"model": "m", "max_tokens": 9, **doc})).chat


def test_system_messages_and_their_blocks_become_the_chats() -> None:
    chat = _parse(system=[{"type": "text", "text": "Be brief."}], stop_sequences=["\n\n"],
                  top_k=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "time?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "12:00"},
            {"type": "text", "text": "And in Paris?"}]}], tools=[TOOL])
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assistant = chat.messages[2]
    assert assistant["content"] == "Let me look." and assistant["reasoning_content"] == "hm"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "12:00"}
    assert chat.sampling.max_new_tokens == 9 and list(chat.sampling.stop) == ["\n\n"]
    assert chat.sampling.top_k == 3
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_time", "parameters": TOOL["input_schema"]}}]


def test_tool_choice_and_thinking() -> None:
    assert _parse(messages=USER, tools=[TOOL], tool_choice={"type": "any"}).tool_choice.named \
        is None
    named = _parse(messages=USER, tools=[TOOL], tool_choice={
        "type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
    assert named.tool_choice.named == "get_time"
    assert _parse(messages=USER, tools=[TOOL], tool_choice={"type": "none"}).tool_choice is None
    assert _parse(messages=USER, thinking={"type": "disabled"}).template_kwargs == {
        "enable_thinking": False}
    assert _parse(messages=USER, stream=True).include_usage
    # budget_tokens: a thinking budget, kept where the gateway reads the thinking.
    budgeted = _parse(messages=USER, thinking={"type": "enabled", "budget_tokens": 2048})
    assert (budgeted.thinking_budget, budgeted.budget_if_read) == (2048, True)
    assert budgeted.names["max_thinking_tokens"] == "thinking.budget_tokens"
    assert _parse(messages=USER, thinking={"type": "enabled"}).thinking_budget is None


@pytest.mark.parametrize(("doc", "start"), [
    ({"max_tokens": None, "messages": USER}, "max_tokens: is required"),
    ({"messages": []}, "messages: must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role: must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0].type: must be text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                 "name": "f"}]}]},
     "messages[0].content[0].type: must be text"),  # a user's tool use
    ({"messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools[0].type: only client tools"),
    ({"messages": USER, "tools": [{**TOOL, "input_schema": 5}]},
     "tools[0].input_schema: must be a JSON schema"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "no"}},
     "tool_choice.name:"),
    ({"messages": USER, "tool_choice": {"type": "sometimes"}}, "tool_choice.type: must be"),
    ({"messages": USER, "thinking": {"type": "on"}}, "thinking.type: must be"),
    ({"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens: must be a positive integer"),
    ({"messages": USER, "stop_sequences": "x"}, "stop_sequences:"),
    ({"messages": USER, "max_completion_tokens": 5}, "max_completion_tokens: unknown field"),
])
def test_refusals_name_the_messages_fields(doc: dict[str, Any], start: str) -> None:
    with pytest.raises(MeshError) as err:
        parse_messages(orjson.dumps({"model": "m", "max_tokens": 9, **doc}))
    assert err.value.message.startswith(start), err.value.message


def _chat(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_a_whole_message() -> None:
    out = MessageShape("m").whole(_chat({"role": "assistant", "content": "Hi",
                                         "reasoning_content": "hm"}))
    assert out["type"] == "message" and out["stop_reason"] == "end_turn"
    assert out["content"] == [{"type": "thinking", "thinking": "hm", "signature": ""},
                              {"type": "text", "text": "Hi"}]
    assert out["usage"]["input_tokens"] == 3 and out["usage"]["output_tokens"] == 2
    calls = MessageShape("m").whole(_chat({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls"))
    assert calls["content"] == [{"type": "tool_use", "id": "c1", "name": "f",
                                 "input": {"a": 1}}]
    assert calls["stop_reason"] == "tool_use"
    cut = MessageShape("m").whole(_chat({"role": "assistant", "content": "a"}, "length"))
    assert cut["stop_reason"] == "max_tokens"


def test_a_stream_as_anthropics_events() -> None:
    shape = MessageShape("m")
    events = shape.start()
    for delta, finish in (({"role": "assistant", "content": ""}, None),
                          ({"reasoning_content": "hm"}, None), ({"content": "Hi"}, None),
                          ({"tool_calls": [{"index": 0, "id": "c1", "function": {
                              "name": "f", "arguments": '{"a"'}}]}, None),
                          ({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                           "tool_calls")):
        events += shape.chunk({"choices": [{"index": 0, "delta": delta,
                                            "finish_reason": finish}]})
    events += shape.chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                    "total_tokens": 7}})
    events += shape.end()
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] == 4
    assert MessageShape.sse(events[-1]) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def test_errors_in_anthropics_shape() -> None:
    err = MeshError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: bad")
    assert error_object(err, 400) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: bad"}}
    assert error_object(err, 500)["error"]["type"] == "api_error"
    assert error_object(err, 503)["error"]["type"] == "overloaded_error"
