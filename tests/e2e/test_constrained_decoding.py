"""Constrained decoding end to end: a JSON schema, a regex, a choice, an EBNF grammar or a
structural tag given by OpenAI's response_format, SGLang's fields or vLLM's structured_outputs /
guided_* holds every token the engine draws, streamed or not, greedy or sampled, n samples
each; the request stops once the grammar is complete. The default model has random weights:
left alone it writes nothing of the kind. A constraint that cannot be followed is refused by
its field's name."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

USER = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]}}}
EMAIL = r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)"


def _person(text: str) -> None:
    doc = json.loads(text)
    assert set(doc) == {"name", "age", "pet"}, doc
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 120
    assert doc["pet"] in ("cat", "dog", None)


def test_a_chat_answers_in_the_json_schema_asked(client, model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(model=model, messages=USER, max_tokens=80,
                                           temperature=0, response_format=fmt)
    _person(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model=model, messages=USER, max_tokens=20,
                                          temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    # Sampled, n samples, streamed: each sample follows it.
    stream = client.chat.completions.create(model=model, messages=USER, max_tokens=80, n=3,
                                            temperature=1.0, seed=5, response_format=fmt,
                                            stream=True)
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in stream:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    for text in texts:
        _person(text)
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}


def test_every_spelling_of_a_regex_or_choice_holds(client, model) -> None:
    for extra in ({"regex": EMAIL}, {"guided_regex": EMAIL},
                  {"structured_outputs": {"regex": EMAIL}}):
        reply = client.completions.create(model=model, prompt="Contact:", max_tokens=30,
                                          temperature=0, extra_body=extra)
        assert re.fullmatch(EMAIL, reply.choices[0].text), (extra, reply.choices[0].text)
        assert reply.choices[0].finish_reason == "stop"
    for extra in ({"guided_choice": ["red", "green", "blue"]},
                  {"structured_outputs": {"choice": ["red", "green", "blue"]}}):
        reply = client.completions.create(model=model, prompt="Colour:", max_tokens=10, n=4,
                                          temperature=1.5, extra_body=extra)
        assert {c.text for c in reply.choices} <= {"red", "green", "blue"}


def test_json_object_and_vllms_json(client, model) -> None:
    reply = client.completions.create(model=model, prompt="Data:", max_tokens=60, temperature=0,
                                      extra_body={"structured_outputs": {"json": PERSON}})
    _person(reply.choices[0].text)
    reply = client.completions.create(model=model, prompt="Data:", max_tokens=60, temperature=0,
                                      extra_body={"guided_json": json.dumps(PERSON)})
    _person(reply.choices[0].text)
    boolean = client.chat.completions.create(
        model=model, messages=USER, max_tokens=10, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "b", "schema": {"type": "boolean"}}})
    assert json.loads(boolean.choices[0].message.content) in (True, False)


def test_native_generate_with_a_schema_and_an_ebnf_grammar(mesh) -> None:
    base = mesh.addresses.gateway_http
    r = httpx.post(f"{base}/generate", timeout=60, json={
        "text": "Data:", "sampling_params": {"max_new_tokens": 60, "temperature": 0,
                                             "json_schema": json.dumps(PERSON)}})
    assert r.status_code == 200, r.text
    _person(r.json()["text"])
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    r = httpx.post(f"{base}/generate", timeout=60, json={
        "text": "SQL:", "sampling_params": {
            "max_new_tokens": 40, "ebnf": 'root ::= "SELECT " col " FROM t"\ncol ::= [a-z]{1,6}'}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"SELECT [a-z]{1,6} FROM t", r.json()["text"]), r.json()["text"]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"regex": "[a-z"}, "regex", "not a valid regex"),
    ({"guided_json": {"type": 7}}, "guided_json", "not a valid JSON schema"),
    ({"regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one constraint"),
    ({"structured_outputs": {"grammar": "root ::= "}}, None, None),  # an empty grammar is fine
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
])
def test_a_constraint_that_cannot_be_followed_is_400(client, model, extra, param, words) -> None:
    if param is None:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=extra)
        return
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 10}}}
ONE_CALL = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="], "at_least_one": True,
    "stop_after_first": True, "tags": [
        {"type": "tag", "begin": "<f=weather>", "content": {"type": "json_schema",
                                                            "json_schema": WEATHER},
         "end": "</f>"},
        {"type": "tag", "begin": "<f=time>", "content": {"type": "regex",
                                                         "pattern": "[0-9]{2}:[0-9]{2}"},
         "end": "</f>"}]}}
CALL = re.compile(r'<f=weather>(\{.*\})</f>|<f=time>[0-9]{2}:[0-9]{2}</f>')


def _one_call(text: str) -> None:
    match = CALL.fullmatch(text)
    assert match, text
    if match.group(1):
        assert set(json.loads(match.group(1))) == {"city"}


def test_a_structural_tag_forces_one_tool_call(client, model) -> None:
    """XGrammar's form as SGLang and vLLM take it in response_format: exactly one tag, its
    content held to its JSON schema or regex, then the request stops (the grammar is done)."""
    for seed in (1, 2, 3):
        reply = client.chat.completions.create(model=model, messages=USER, max_tokens=60,
                                               temperature=1.0, seed=seed,
                                               response_format=ONE_CALL)
        _one_call(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop"


def test_structural_tags_by_vllms_fields_and_the_earlier_form(client, model, mesh) -> None:
    """structured_outputs.structural_tag (its text), and the earlier form (structures and
    triggers) in the native /generate's sampling_params: free text, with every call that a
    trigger starts held to its structure; streamed too."""
    reply = client.completions.create(
        model=model, prompt="Call:", max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(ONE_CALL)}})
    _one_call(reply.choices[0].text)
    think = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "end": "</think>",
         "content": {"type": "any_text", "max_chars": 12}},
        {"type": "const_string", "value": "\nAnswer: "},
        {"type": "json_schema", "json_schema": WEATHER}]}}
    text = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt="Think:", max_tokens=60, temperature=1.0, seed=4, stream=True,
        extra_body={"structural_tag": think}))
    thought, _, answer = text.partition("</think>\nAnswer: ")
    assert thought.startswith("<think>") and len(thought) <= len("<think>") + 12, text
    assert set(json.loads(answer)) == {"city"}, text
    earlier = {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=weather>", "schema": WEATHER, "end": "</f>"}]}
    r = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=60, json={
        "text": "Free text, with calls:", "sampling_params": {
            "max_new_tokens": 30, "temperature": 0, "structural_tag": json.dumps(earlier)}})
    assert r.status_code == 200, r.text
    for call in r.json()["text"].split("<f=")[1:]:  # free text: a call only if the model wrote
        assert call.startswith("weather>{"), r.json()["text"]


def test_a_structural_tag_that_cannot_be_followed_is_400_naming_its_part(client,
                                                                         model) -> None:
    bad = json.loads(json.dumps(ONE_CALL).replace('"<f=time>"', '"<g=time>"'))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=5,
                                       response_format=bad)
    error = info.value.body
    assert error["param"] == "response_format.format.tags[1].begin", error
    assert "must start with exactly one of the triggers" in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=5,
                                       response_format={"type": "structural_tag", "format": {
                                           "type": "token", "token": "<|im_end|>"}})
    assert info.value.body["param"] == "response_format.format.type", info.value.body


def test_large_schemas_are_served_or_refused_at_once(client, model) -> None:
    """A wide schema (1,000 optional properties, ~45 KB: built off the gateway's event loop)
    is followed; a wider one (5,000), past what llguidance follows, is a 400 before any token,
    with llguidance's reason; the same wide schema again is answered too (kept, built once)."""
    def wide(n: int) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
            "type": "object", "additionalProperties": False,
            "properties": {f"p{i}": {"enum": [i]} for i in range(n)}}}}

    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=USER, max_tokens=30,
                                               temperature=0, response_format=wide(1000))
        choice = reply.choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            doc = json.loads(choice.message.content)
            assert all(key == f"p{value}" for key, value in doc.items()), doc
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=30,
                                       response_format=wide(5000))
    assert "items" in info.value.body["message"], info.value.body
