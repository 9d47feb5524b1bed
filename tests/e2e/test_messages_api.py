"""Anthropic's Messages API (POST /v1/messages) end to end with Anthropic's own `anthropic`
package: a message whole and streamed (the same text, the stream's helper folding the
events), a forced tool use and the turn carrying its result, and refusals in Anthropic's
error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest

TIME = {"name": "get_time", "description": "The time in a zone",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                         "required": ["zone"], "additionalProperties": False}}
USER = [{"role": "user", "content": "What time is it in Paris?"}]
GREEDY = {"temperature": 0}  # a field this client no longer sends itself; the server takes it


@pytest.fixture(scope="module")
def claude(mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=mesh.addresses.gateway_http, api_key="unused",
                               max_retries=0)


def test_a_message_whole_and_streamed_agree(claude, model) -> None:
    args = {"model": model, "max_tokens": 12, "extra_body": GREEDY, "system": "Tell a story.",
            "messages": [{"role": "user", "content": "Once upon a time"}]}
    whole = claude.messages.create(**args)
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == model
    [block] = whole.content
    assert block.type == "text" and block.text and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_a_forced_tool_use_and_the_turn_after_it(claude, model) -> None:
    reply = claude.messages.create(model=model, max_tokens=40, extra_body=GREEDY, tools=[TIME],
                                   tool_choice={"type": "tool", "name": "get_time"},
                                   messages=USER)
    [use] = reply.content
    assert use.type == "tool_use" and use.name == "get_time" and reply.stop_reason == "tool_use"
    assert use.input["zone"] in ("UTC", "CET")
    follow = claude.messages.create(
        model=model, max_tokens=4, tools=[TIME], tool_choice={"type": "none"},
        messages=[*USER, {"role": "assistant", "content": [use.model_dump()]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "12:00"}]}])
    assert follow.content[0].type == "text"
    assert follow.usage.input_tokens > reply.usage.input_tokens
    with claude.messages.stream(model=model, max_tokens=40, extra_body=GREEDY, tools=[TIME],
                                tool_choice={"type": "tool", "name": "get_time"},
                                messages=USER) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == use.input


def test_count_tokens_counts_the_rendered_input(claude, model) -> None:
    args = {"model": model, "system": "Be brief.", "tools": [TIME], "messages": USER}
    counted = claude.messages.count_tokens(**args)
    reply = claude.messages.create(**args, max_tokens=1, tool_choice={"type": "none"})
    assert counted.input_tokens == reply.usage.input_tokens > 0


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens: is required"),
    ({"max_tokens": 0, "messages": USER}, 400, "invalid_request_error", "max_tokens:"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages:"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305"}]}, 400,
     "invalid_request_error", "tools[0].type"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "tool", "name": "x"},
      "tools": [TIME]}, 400, "invalid_request_error", "tool_choice.name"),
    ({"max_tokens": 5, "messages": USER, "model": "claude-opus"}, 404, "not_found_error",
     "model:"),
])
def test_refusals_in_anthropics_shape(mesh, model, body, status, kind, words) -> None:
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/messages", timeout=30,
                   json={"model": model, **body})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    assert r.json()["error"]["message"].startswith(words), r.text
