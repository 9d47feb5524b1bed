"""OpenAI's Responses API (POST /v1/responses) end to end with the official `openai` package:
a response whole and streamed (the same text, the events in the API's order), a forced
function call and the next turn carrying its output, a JSON schema in text.format, and the
refusals, each naming the Responses field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

TIME = {"type": "function", "name": "get_time", "description": "The time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}


def test_a_response_whole_and_streamed_agree(client, model) -> None:
    args = {"model": model, "input": "Once upon a time", "instructions": "Tell a story.",
            "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**args)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 12
    assert whole.instructions == "Tell a story." and whole.max_output_tokens == 12
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_a_forced_call_and_the_turn_after_it(client, model) -> None:
    reply = client.responses.create(model=model, input="What time is it in Paris?",
                                    tools=[TIME], tool_choice={"type": "function",
                                                               "name": "get_time"},
                                    max_output_tokens=40, temperature=0)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET") and reply.status == "completed"
    follow = client.responses.create(model=model, max_output_tokens=4, tools=[TIME],
                                     tool_choice="none", input=[
        {"role": "user", "content": "What time is it in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert follow.output_text and follow.usage.input_tokens > reply.usage.input_tokens
    streamed = [e for e in client.responses.create(
        model=model, input="What time is it?", tools=[TIME], tool_choice="required",
        max_output_tokens=60, temperature=0, stream=True)]
    args = "".join(e.delta for e in streamed
                   if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == args and json.loads(args)["zone"] in ("UTC", "CET")


def test_text_format_constrains_the_output(client, model) -> None:
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    reply = client.responses.create(model=model, input="A number, as JSON", max_output_tokens=30,
                                    text={"format": {"type": "json_schema", "name": "number",
                                                     "schema": schema, "strict": True}})
    assert reply.status == "completed" and json.loads(reply.output_text)["n"] in (1, 2, 3)


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "bogus"}}}}, 400,
     "text.format.schema"),
    ({"input": "x", "previous_response_id": "resp_1"}, 501, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
])
def test_refusals_name_the_responses_field(mesh, model, extra, status, param) -> None:
    r = httpx.post(f"{mesh.addresses.gateway_http}/v1/responses", timeout=30,
                   json={"model": model, **extra})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


def test_input_tokens_count_the_rendered_input(mesh, client, model) -> None:
    base = mesh.addresses.gateway_http
    doc = {"model": model, "input": "What time is it?", "instructions": "Be brief."}
    r = httpx.post(f"{base}/v1/responses/input_tokens", json=doc, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "response.input_tokens"
    reply = client.responses.create(**doc, max_output_tokens=1)
    assert r.json()["input_tokens"] == reply.usage.input_tokens
    bad = httpx.post(f"{base}/v1/responses/input_tokens", json={"model": model, "input": []},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_stored_responses_are_not_found(client, model) -> None:
    reply = client.responses.create(model=model, input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError, match="not stored"):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError, match="not stored"):
        client.responses.cancel(reply.id)
