"""The Responses API's requests read as chats (`protocol/responses.py`) and their answers
shaped back (`protocol/responses_output.py`)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.responses import parse_responses
from meshlm.gateway.protocol.responses_output import ResponseShape

TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


def _parse(**doc: Any) -> Any:
    return parse_responses(orjson.dumps({"model": "m", **doc}))


def test_input_and_instructions_become_the_chats_messages() -> None:
    req = _parse(input="Hi", instructions="Be brief.", max_output_tokens=7, top_logprobs=2,
                 temperature=0.5, top_k=3, stream=True)
    chat = req.chat
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]
    assert chat.sampling.max_new_tokens == 7 and chat.top_logprobs == 2
    assert chat.sampling.top_k == 3 and chat.stream and chat.include_usage
    assert req.echo["instructions"] == "Be brief." and req.echo["max_output_tokens"] == 7
    assert _parse(input="x", include=["message.output_text.logprobs"]).chat.top_logprobs == 0
    assert _parse(input="x").chat.top_logprobs is None
    assert _parse(input="x", stream=True, stream_options={"include_obfuscation": False}).chat.stream


def test_input_items_calls_and_their_outputs() -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                               "text": "time?"}]},
             {"type": "reasoning", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "get_time",
              "arguments": '{"zone": "UTC"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time",
              "arguments": '{"zone": "CET"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Noon."}]}]
    chat = _parse(input=items, tools=[TOOL]).chat
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool", "assistant"]
    assert chat.messages[0]["content"] == "time?"
    assert [c["id"] for c in chat.messages[1]["tool_calls"]] == ["c1", "c2"]  # one turn
    assert chat.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items()
                                                            if k != "type"}}]


def test_tool_choice_and_text_format_become_the_chats_constraints() -> None:
    named = _parse(input="x", tools=[TOOL], tool_choice={"type": "function",
                                                         "name": "get_time"}).chat
    assert named.tool_choice is not None and named.tool_choice.named == "get_time"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formed = _parse(input="x", text={"format": {"type": "json_schema", "name": "a",
                                                "schema": schema}}).chat
    assert json.loads(formed.sampling.guided_decoding.json_schema) == schema
    assert not _parse(input="x", text={"format": {"type": "text"}}).chat.sampling.HasField(
        "guided_decoding")


@pytest.mark.parametrize(("doc", "start", "unimplemented"), [
    ({"input": []}, "input: must be a string or a non-empty list", False),
    ({"input": [{"type": "image"}]}, "input[0].type: must be message", False),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role: must be one of", False),
    ({"input": "x", "instructions": 5}, "instructions: must be a string", False),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments: must be a string", False),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens: must be in [1,", False),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type: only function", False),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]},
     "tools[0].name: must be 1 to 64", False),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "no"}},
     "tool_choice.name:", False),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort: must be one of",
     False),
    ({"input": "x", "messages": []}, "messages: unknown field", False),
    ({"input": "x", "include": ["file_search_call.results"]}, "include: may list", False),
    ({"input": "x", "stream_options": {"include_usage": True}}, "stream_options: may hold",
     False),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id:", True),
    ({"input": "x", "background": True}, "background:", True),
    ({"input": "x", "truncation": "auto"}, "truncation:", True),
])
def test_refusals_name_the_responses_fields(doc: dict[str, Any], start: str,
                                            unimplemented: bool) -> None:
    with pytest.raises(MeshError) as err:
        _parse(**doc)
    assert err.value.message.startswith(start), err.value.message
    assert (err.value.http_status == 501) is unimplemented


def test_later_errors_name_the_responses_fields_too() -> None:
    req = _parse(input="x", text={"format": {"type": "json_schema", "name": "a",
                                             "schema": {"type": "object"}}})
    assert set(req.chat.names.values()) >= {"text.format.schema", "max_output_tokens", "input"}


def _chat(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "message": message, "logprobs": None,
                                       "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                      "prompt_tokens_details": {"cached_tokens": 1}}}


def test_a_whole_answer_as_a_response_object() -> None:
    shape = ResponseShape({"instructions": None}, 1)
    out = shape.whole(_chat({"role": "assistant", "content": "Hi", "reasoning_content": "hm"}))
    assert out["id"].startswith("resp_") and out["status"] == "completed"
    assert [o["type"] for o in out["output"]] == ["reasoning", "message"]
    assert out["output"][1]["content"][0]["text"] == "Hi"
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert out["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 1},
                            "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 5}
    calls = ResponseShape({}, 1).whole(_chat({"role": "assistant", "content": None,
                                              "tool_calls": [{"id": "c1", "function": {
                                                  "name": "f", "arguments": "{}"}}]}))
    assert [(o["type"], o["call_id"], o["arguments"]) for o in calls["output"]] == [
        ("function_call", "c1", "{}")]
    cut = ResponseShape({}, 1).whole(_chat({"role": "assistant", "content": "a"}, "length"))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": finish}]}


def test_a_stream_as_the_responses_events() -> None:
    shape = ResponseShape({}, 1)
    events = shape.start()
    for chunk in (_chunk({"role": "assistant", "content": ""}),
                  _chunk({"reasoning_content": "hm"}), _chunk({"content": "Le"}),
                  _chunk({"content": "t me."}),
                  _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{"}}]}),
                  _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                         "tool_calls"),
                  {"model": "m", "choices": [], "usage": {
                      "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}):
        events += shape.chunk(chunk)
    events += shape.end()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Let me."
    assert final["output"][2]["arguments"] == "{}" and final["usage"]["output_tokens"] == 4
    assert events[0]["response"]["status"] == "in_progress" and not events[0]["response"][
        "output"]
    assert ResponseShape.sse(events[-1]).startswith(b"event: response.completed\ndata: {")


def test_a_stream_that_fails_or_says_nothing() -> None:
    shape = ResponseShape({}, 1)
    failed = shape.failed(MeshError(grpc.StatusCode.INTERNAL, "boom"))
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    assert failed[1]["response"]["error"] == {"code": "internal", "message": "boom"}
    empty = ResponseShape({}, 1)
    events = empty.chunk(_chunk({"role": "assistant", "content": ""}, "stop")) + empty.end()
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""
