"""OpenAI request bodies -> the gateway's public requests: field by field, the gateway's own
validation behind them, and every refusal naming the field as the client wrote it."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.openai import (
    COMPLETION_MAX_TOKENS,
    parse_chat,
    parse_completion,
    parse_embedding,
    public_request,
)
from meshlm.gateway.protocol.openai_errors import error_body, renamed
from meshlm.gateway.protocol.validation import (
    Limits,
    normalize_sampling,
    validate_generate,
    validate_text_generate,
)
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=64, vocab_size=100)
USER = [{"role": "user", "content": "hi"}]


def _body(doc: Any) -> bytes:
    return json.dumps(doc).encode()  # orjson would refuse integers past 64 bits


def _refusal(parse: Any, doc: Any) -> MeshError:
    with pytest.raises(MeshError) as info:
        parse(_body(doc))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_chat_fields_become_sampling_params() -> None:
    req = parse_chat(_body({
        "model": "m", "messages": USER, "max_completion_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "n": 3, "stop": "\n", "seed": 11, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "stream": True, "stream_options": {"include_usage": True},
        "logprobs": True, "top_logprobs": 2, "user": "u1", "top_k": 5, "min_tokens": 1,
        "rid": "chat-1",
    }))
    p = req.sampling
    assert req.model == "m" and req.messages == USER and req.rid == "chat-1"
    assert (p.max_new_tokens, p.n, p.seed, list(p.stop), p.top_k, p.min_new_tokens) == (
        7, 3, 11, ["\n"], 5, 1)
    assert p.temperature == 0.5 and p.presence_penalty == 0.5 and p.frequency_penalty == -0.5
    assert abs(p.top_p - 0.9) < 1e-6
    assert req.stream and req.include_usage and req.top_logprobs == 2 and req.n == 3
    assert req.names["sampling_params.max_new_tokens"] == "max_completion_tokens"


def test_chat_defaults() -> None:
    req = parse_chat(_body({"messages": USER}))
    assert req.model is None and not req.stream and not req.include_usage
    assert req.top_logprobs is None and req.n == 1
    assert not req.sampling.HasField("max_new_tokens")  # the context's room, decided later
    assert parse_chat(_body({"messages": USER, "logprobs": True})).top_logprobs == 0
    assert parse_chat(_body({"messages": USER, "max_tokens": 5})).names[
        "sampling_params.max_new_tokens"] == "max_tokens"


def test_chat_content_parts_are_flattened_and_other_keys_kept() -> None:
    req = parse_chat(_body({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
        {"role": "user", "content": "c"},
    ]}))
    assert req.messages == [{"role": "system", "content": "a\nb"},
                            {"role": "assistant", "content": "", "name": "bot"},
                            {"role": "user", "content": "c"}]


@pytest.mark.parametrize(("doc", "start"), [
    ({}, "messages: must be a non-empty list"),
    ({"messages": []}, "messages: must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0]: must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: must be one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]: only text parts"),
    ({"messages": USER, "model": 3}, "model: must be a string"),
    ({"messages": USER, "temperature": 2.5}, "temperature: must be in [0, 2]"),
    ({"messages": USER, "temperature": "hot"}, "temperature: must be a number"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens: must be in [1, "),
    ({"messages": USER, "max_completion_tokens": 2.5}, "max_completion_tokens: must be an int"),
    ({"messages": USER, "n": 17}, "n: must be in [1, 16]"),
    ({"messages": USER, "n": True}, "n: must be an integer"),
    ({"messages": USER, "n": 17.0}, "n: must be in [1, 16], got 17.0"),
    ({"messages": USER, "max_tokens": 10**23}, "max_tokens: must be in [1, 2147483647], got 1e+23"),
    ({"messages": USER, "seed": -(10**23)}, "seed: must be in [0, "),
    ({"messages": USER, "seed": -1}, "seed: must be in [0, "),
    ({"messages": USER, "stop": [1]}, "stop: must be a string or a list of strings"),
    ({"messages": USER, "stream": "yes"}, "stream: must be true or false"),
    ({"messages": USER, "stream_options": {"include_usage": True}},
     "stream_options: is only allowed when stream is true"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs: must be in [0, 20]"),
    ({"messages": USER, "logprobs": 1}, "logprobs: must be true or false"),
    ({"messages": USER, "tools": [{"type": "function"}], "tool_choice": "none"},
     "tools[0].function: must be an object with a name"),
    ({"messages": USER, "logit_bias": [5]}, "logit_bias: must be an object"),
    ({"messages": USER, "logit_bias": {"a5": 1}}, 'logit_bias: "a5" is not a token id'),
    ({"messages": USER, "logit_bias": {"-5": 1}}, 'logit_bias: "-5" is not a token id'),
    ({"messages": USER, "logit_bias": {"5": "1"}}, "logit_bias: the bias of token 5 must be a n"),
    ({"messages": USER, "best_of": 2}, "best_of: unknown field"),
    ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids: must be a list of token ids"),
    ({"messages": USER, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message: cannot be combined with add_generation_prompt: true"),
    ({"messages": USER, "echo": 1}, "echo: must be true or false"),
])
def test_chat_refusals_name_the_field(doc: dict[str, Any], start: str) -> None:
    err = _refusal(parse_chat, doc)
    assert err.message.startswith(start), err.message


def test_chat_template_options_and_echo() -> None:
    """vLLM's add_generation_prompt (true unless the final message is continued),
    continue_final_message and echo (of the last message, when it is the assistant's)."""
    plain = parse_chat(_body({"messages": USER, "echo": True}))
    assert plain.add_generation_prompt and not plain.continue_final_message
    assert plain.echo and plain.echo_text is None  # the last message is the user's
    opened = [*USER, {"role": "assistant", "content": "Once upon"}]
    req = parse_chat(_body({"messages": opened, "continue_final_message": True, "echo": True}))
    assert not req.add_generation_prompt and req.continue_final_message
    assert req.echo_text == "Once upon"
    assert parse_chat(_body({"messages": opened})).echo_text is None
    assert not parse_chat(_body({"messages": USER, "add_generation_prompt": False,
                                 "continue_final_message": False})).add_generation_prompt


@pytest.mark.parametrize(("doc", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer"}}}}, "json_schema", '{"type": "integer"}'),
    ({"regex": "[ab]+"}, "regex", "[ab]+"), ({"ebnf": "root ::= \"a\""}, "ebnf", 'root ::= "a"'),
    ({"json_schema": "{}"}, "json_schema", "{}"), ({"guided_json": {}}, "json_schema", "{}"),
    ({"guided_regex": "a|b"}, "regex", "a|b"), ({"guided_choice": ["yes", "no"]}, "choice", None),
    ({"guided_grammar": "root ::= \"a\""}, "ebnf", 'root ::= "a"'),
    ({"structured_outputs": {"regex": "a"}}, "regex", "a"),
    ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}'),
    ({"structured_outputs": {"choice": ["x"], "json": None}}, "choice", None),
])
def test_every_spelling_of_a_constraint_becomes_guided_decoding(doc: dict[str, Any], kind: str,
                                                                value: str | None) -> None:
    """OpenAI's response_format and SGLang's and vLLM's own fields: one constraint each, put
    where the gateway's validation builds its grammar."""
    for parse, base, prompt in ((parse_chat, {"messages": USER}, []),
                                (parse_completion, {"prompt": "a"}, "a")):
        public = public_request(parse(_body({**base, **doc})), prompt)
        guided = public.sampling_params.guided_decoding
        assert guided.WhichOneof("constraint") == kind
        if value is not None:
            assert getattr(guided, kind) == value
        assert normalize_sampling(public.sampling_params).grammar  # built and checked
    parse_chat(_body({"messages": USER, "regex": None, "response_format": {"type": "text"}}))


@pytest.mark.parametrize(("doc", "start"), [
    ({"regex": "a", "guided_json": {}}, "guided_json: give one constraint; regex is given too"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema: must be a JSON schema object"),
    ({"response_format": {"type": "yaml"}}, "response_format.type: must be text, json_object"),
    ({"guided_choice": "yes"}, "guided_choice: must be a list of strings"),
    ({"regex": 5}, "regex: must be a string"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern: not supported"),
    ({"structured_outputs": "a"}, "structured_outputs: must be an object"),
])
def test_constraint_refusals_name_the_field(doc: dict[str, Any], start: str) -> None:
    err = _refusal(parse_chat, {"messages": USER, **doc})
    assert err.message.startswith(start), err.message


@pytest.mark.parametrize(("doc", "start"), [
    ({"regex": "[a"}, "regex: not a valid regex"),
    ({"guided_json": {"type": 12}}, "guided_json: not a valid JSON schema"),
    ({"guided_choice": []}, "guided_choice: give at least one string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "response_format.json_schema.schema: not a valid JSON schema"),
])
def test_a_constraint_that_cannot_be_followed_is_refused_by_its_name(doc: dict[str, Any],
                                                                     start: str) -> None:
    public = public_request(parse_completion(_body({"prompt": "a", **doc})), "a")
    req = parse_completion(_body({"prompt": "a", **doc}))
    with pytest.raises(MeshError) as info:
        validate_text_generate(public, LIMITS)
    err = renamed(info.value, req.names)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith(start), err


TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="],
    "tags": [{"type": "tag", "begin": "<f=a>", "content": {"type": "any_text"}, "end": "</f>"}]}}


@pytest.mark.parametrize(("doc", "client_path"), [
    ({"response_format": TAG}, "response_format"),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     "structured_outputs.structural_tag"),
    ({"structural_tag": TAG}, "structural_tag"),
])
def test_structural_tags_by_each_spelling(doc: dict[str, Any], client_path: str) -> None:
    """The structural tag reaches guided_decoding; a fault in it is named in the client's
    words, down to the part."""
    public = public_request(parse_completion(_body({"prompt": "a", **doc})), "a")
    tag = public.sampling_params.guided_decoding.structural_tag
    assert json.loads(tag) == TAG
    assert normalize_sampling(public.sampling_params).grammar
    bad = json.loads(json.dumps(doc).replace("<f=a>", "<g=a>"))
    req = parse_completion(_body({"prompt": "a", **bad}))
    with pytest.raises(MeshError) as info:
        validate_text_generate(public_request(req, "a"), LIMITS)
    err = renamed(info.value, req.names)
    assert err.message.startswith(f"{client_path}.format.tags[0].begin: must start with "), err


def test_vllms_thinking_token_budget_is_sglangs_max_thinking_tokens() -> None:
    """On both routes; it needs the gateway's reasoning parser (its tags), and says so under
    the client's name for it."""
    for parse, base in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "a"})):
        req = parse(_body({**base, "thinking_token_budget": 64}))
        public = public_request(req, "a")
        assert public.max_thinking_tokens == 64
        with pytest.raises(MeshError) as info:
            validate_text_generate(public, LIMITS)
        err = renamed(info.value, req.names)
        assert err.message.startswith("thinking_token_budget: needs a gateway started with "
                                      "--reasoning-parser"), err
    with pytest.raises(MeshError, match="thinking_token_budget: must be in"):
        parse_chat(_body({"messages": USER, "thinking_token_budget": -1}))


def test_priority_and_kept_stop_strings() -> None:
    """SGLang's priority and no_stop_trim, and vLLM's include_stop_str_in_output, reach the
    public request."""
    chat = parse_chat(_body({"messages": USER, "priority": 5, "no_stop_trim": True}))
    one = public_request(chat, "x")
    assert one.priority == 5 and one.sampling_params.no_stop_trim
    done = parse_completion(_body({"prompt": [1, 2], "priority": -3,
                                   "include_stop_str_in_output": True}))
    ids = public_request(done, [1, 2])
    assert ids.priority == -3 and ids.sampling_params.no_stop_trim
    plain = public_request(parse_completion(_body({"prompt": "a",
                                                   "include_stop_str_in_output": False})), "a")
    assert not plain.HasField("priority") and not plain.sampling_params.no_stop_trim
    _refusal(parse_chat, {"messages": USER, "priority": "high"})


def test_chat_template_kwargs() -> None:
    req = parse_chat(_body({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}))
    assert req.template_kwargs == {"enable_thinking": False}
    assert parse_chat(_body({"messages": USER, "chat_template_kwargs": None})).template_kwargs == {}
    for kwargs, start in (([1], "chat_template_kwargs: must be an object"),
                          ({"messages": []}, "chat_template_kwargs.messages: is set by the server"),
                          ({"eos_token": ""}, "chat_template_kwargs.eos_token: is set by")):
        err = _refusal(parse_chat, {"messages": USER, "chat_template_kwargs": kwargs})
        assert err.message.startswith(start), err.message


def test_logit_bias_reaches_the_public_request() -> None:
    req = parse_completion(_body({"prompt": "a", "logit_bias": {"42": -100, "7": 2.5}}))
    assert dict(public_request(req, "a").sampling_params.logit_bias) == {42: -100.0, 7: 2.5}
    # The range is the gateway's validation's, named as the client wrote it.
    chat = parse_chat(_body({"messages": USER, "logit_bias": {"5": 101}}))
    with pytest.raises(MeshError) as info:
        validate_text_generate(public_request(chat, "x"), LIMITS)
    assert renamed(info.value, chat.names).message == \
        "logit_bias: the bias of token 5 must be in [-100, 100], got 101"


def test_allowed_token_ids() -> None:
    req = parse_completion(_body({"prompt": "a", "allowed_token_ids": [9, 3, 9]}))
    assert list(public_request(req, "a").sampling_params.allowed_token_ids) == [9, 3, 9]
    v = validate_text_generate(public_request(req, "a"), LIMITS)
    assert list(v.sampling.allowed_token_ids) == [3, 9]  # a set, in order
    err = _refusal(parse_chat, {"messages": USER, "allowed_token_ids": [1, "2"]})
    assert err.message == "allowed_token_ids: must be a list of token ids"
    chat = parse_chat(_body({"messages": USER, "allowed_token_ids": [5, 100]}))
    with pytest.raises(MeshError) as info:
        validate_text_generate(public_request(chat, "x"), LIMITS)
    assert renamed(info.value, chat.names).message.startswith(
        "allowed_token_ids[1]: token id 100 is out of range [0, 100)")


def test_continuous_usage_stats_needs_include_usage() -> None:
    def continuous(options: dict[str, Any]) -> bool:
        return parse_chat(_body({"messages": USER, "stream": True,
                                 "stream_options": options})).continuous_usage
    assert continuous({"include_usage": True, "continuous_usage_stats": True})
    assert not continuous({"continuous_usage_stats": True})
    assert not continuous({"include_usage": True})
    err = _refusal(parse_chat, {"messages": USER, "stream": True,
                                "stream_options": {"continuous_usage_stats": 1}})
    assert err.message == "stream_options.continuous_usage_stats: must be true or false"


def test_sglang_reasoning_switches_are_taken() -> None:
    parse_chat(_body({"messages": USER, "separate_reasoning": True, "stream_reasoning": False}))
    err = _refusal(parse_chat, {"messages": USER, "separate_reasoning": "yes"})
    assert err.message.startswith("separate_reasoning: must be true or false")


def test_add_special_tokens_defaults_as_vllm() -> None:
    assert not parse_chat(_body({"messages": USER})).add_special_tokens
    assert parse_chat(_body({"messages": USER, "add_special_tokens": True})).add_special_tokens
    assert parse_completion(_body({"prompt": "a"})).add_special_tokens
    assert not parse_completion(_body({"prompt": "a",
                                       "add_special_tokens": False})).add_special_tokens


def test_a_null_field_is_not_given_even_when_unknown() -> None:
    parse_chat(_body({"messages": USER, "bootstrap_host": None, "lora_path": None}))
    parse_completion(_body({"prompt": "a", "kv_transfer_params": None}))
    err = _refusal(parse_completion, {"prompt": "a", "kv_transfer_params": {}})
    assert err.message == "kv_transfer_params: unknown field"
    with pytest.raises(MeshError) as info:
        parse_chat(_body({"messages": USER, "lora_path": "/adapters/a"}))
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_integral_floats_count_as_integers() -> None:
    """3.0 where an integer belongs is that integer, as in the native routes' protobuf JSON
    and in vLLM's and SGLang's pydantic models; 2.5 is refused (above)."""
    req = parse_chat(_body({"messages": USER, "max_tokens": 3.0, "n": 2.0, "seed": 7.0,
                            "logprobs": True, "top_logprobs": 1.0}))
    assert req.sampling.max_new_tokens == 3 and req.sampling.n == 2
    assert req.sampling.seed == 7 and req.top_logprobs == 1
    assert all(type(v) is int for v in (req.sampling.max_new_tokens, req.sampling.seed))


def test_accepted_and_ignored_fields() -> None:
    parse_chat(_body({"messages": USER, "user": "x", "store": False, "metadata": {},
                      "parallel_tool_calls": True, "tool_choice": "none", "logit_bias": {},
                      "response_format": {"type": "text"}, "stream": True,
                      "stream_options": {}}))


def test_completion_prompts() -> None:
    one = parse_completion(_body({"prompt": "hello"}))
    assert one.prompts == ["hello"] and not one.batch
    assert one.sampling.max_new_tokens == COMPLETION_MAX_TOKENS  # OpenAI's default
    ids = parse_completion(_body({"prompt": [1, 2, 3], "max_tokens": 4}))
    assert ids.prompts == [[1, 2, 3]] and not ids.batch and ids.sampling.max_new_tokens == 4
    batch = parse_completion(_body({"prompt": ["a", [4, 5]], "logprobs": 3, "echo": True,
                                    "best_of": 1}))
    assert batch.prompts == ["a", [4, 5]] and batch.batch
    assert batch.top_logprobs == 3 and batch.echo
    assert batch.names["top_logprobs_num"] == "logprobs"


@pytest.mark.parametrize(("doc", "start"), [
    ({}, "prompt: must be a string, a list"),
    ({"prompt": []}, "prompt: must be a string, a list"),
    ({"prompt": ["a", 3]}, "prompt[1]: must be a string or a list of token ids"),
    ({"prompt": [1, -2]}, "prompt: token ids must be in [0, 2**31)"),
    ({"prompt": ["a"] * 65}, "prompt: at most 64 prompts"),
    ({"prompt": "a", "logprobs": True}, "logprobs: must be an integer"),
    ({"prompt": "a", "logprobs": 21}, "logprobs: must be in [0, 20]"),
    ({"prompt": "a", "best_of": 3}, "best_of: only best_of == n"),
    ({"prompt": "a", "suffix": "z"}, "suffix: is not supported"),
    ({"prompt": ["a", "b"], "rid": "r"}, "rid: give it only with a single prompt"),
    ({"prompt": ["a", "b"], "request_id": "r"}, "request_id: give it only with a single prompt"),
    ({"prompt": "a", "rid": "r", "request_id": "r"}, "request_id: give rid or request_id, not"),
    ({"prompt": "a", "messages": USER}, "messages: unknown field"),
    ([1, 2], "body: must be a JSON object"),
])
def test_completion_refusals(doc: Any, start: str) -> None:
    err = _refusal(parse_completion, doc)
    assert err.message.startswith(start), err.message


def test_embedding_requests() -> None:
    req = parse_embedding(_body({"model": "m", "input": ["a", [1, 2]],
                                 "encoding_format": "base64", "user": "u"}))
    assert req.inputs == ["a", [1, 2]] and req.base64 and req.model == "m"
    assert not parse_embedding(_body({"input": "x"})).base64
    assert _refusal(parse_embedding, {"input": "x", "dimensions": 8}).message.startswith(
        "dimensions: ")
    assert _refusal(parse_embedding, {"input": "x", "encoding_format": "hex"}).message \
        .startswith("encoding_format: must be")
    assert _refusal(parse_embedding, {"input": 5}).message.startswith("input: must be")


def test_public_requests_carry_prompt_sampling_and_logprob_options() -> None:
    chat = parse_chat(_body({"messages": USER, "logprobs": True, "top_logprobs": 2,
                             "stream": True, "rid": "r1"}))
    req = public_request(chat, [5, 6, 7], max_new_tokens=9)
    assert isinstance(req, pb.GenerateRequest) and list(req.input_ids) == [5, 6, 7]
    assert req.sampling_params.max_new_tokens == 9 and req.stream and req.rid == "r1"
    assert req.return_logprob and req.top_logprobs_num == 2 and req.return_text_in_logprobs
    assert not req.HasField("logprob_start_len")
    given_max = parse_chat(_body({"messages": USER, "max_tokens": 3}))
    assert public_request(given_max, [1], max_new_tokens=9).sampling_params.max_new_tokens == 3
    echo = parse_completion(_body({"prompt": "hi", "logprobs": 0, "echo": True}))
    text = public_request(echo, "hi")
    assert isinstance(text, pb.TextGenerateRequest) and text.text == "hi"
    assert text.return_logprob and text.top_logprobs_num == 0 and text.logprob_start_len == 0
    plain = public_request(parse_completion(_body({"prompt": "hi"})), "hi")
    assert not plain.return_logprob and not plain.HasField("rid")


def _validation_error(doc: dict[str, Any], prompt: Any = "hi") -> MeshError:
    req = parse_completion(_body(doc))
    public = public_request(req, prompt)
    names = {**req.names, "text": "prompt", "input_ids": "prompt"}
    with pytest.raises(MeshError) as info:
        if isinstance(public, pb.TextGenerateRequest):
            validate_text_generate(public, LIMITS)
        else:
            validate_generate(public, LIMITS)
    return renamed(info.value, names)


@pytest.mark.parametrize(("doc", "prompt", "message"), [
    ({"prompt": "hi", "top_p": 1.5}, "hi", "top_p: must be in (0, 1], got 1.5"),
    ({"prompt": "hi", "presence_penalty": 3}, "hi", "presence_penalty: must be in [-2, 2]"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "hi",
     "min_tokens: must be in [0, max_new_tokens=5], got 20"),
    ({"prompt": "", "max_tokens": 5}, "", "prompt: must not be empty"),
    ({"prompt": [1], "max_tokens": 64}, [1],
     "max_tokens: max_tokens is too large: 64. Requested token count exceeds the model's "
     "maximum context length of 64 tokens (1 prompt + 64 completion tokens); use at most 63"),
    ({"prompt": [500]}, [500], "prompt[0]: token id 500 is out of range [0, 100)"),
    ({"prompt": "hi", "stop_token_ids": [100]}, "hi", "stop_token_ids[0]: token id 100"),
    ({"prompt": "hi", "rid": "a b"}, "hi", "rid: must be 1 to 128 characters"),
])
def test_gateway_validation_speaks_openai_names(doc: dict[str, Any], prompt: Any,
                                                 message: str) -> None:
    err = _validation_error(doc, prompt)
    assert err.message.startswith(message), err.message
    body = error_body(err)["error"]
    assert body["param"] == message.split(":")[0] and body["type"] == "invalid_request_error"


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["messages", "prompt", "input", "role", "content", "n", "max_tokens",
                         "temperature", "stop", "logprobs", "top_logprobs", "stream",
                         "stream_options", "include_usage", "seed", "type", "text", "echo"]),
        inner, max_size=5),
    max_leaves=12))
def test_any_json_parses_or_is_refused_by_name(doc: Any) -> None:
    """Random bodies: a request, or INVALID_ARGUMENT; never another exception."""
    for parse in (parse_chat, parse_completion, parse_embedding):
        try:
            req = parse(json.dumps(doc).encode())  # big ints included
        except MeshError as e:
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT
            continue
        if parse is parse_completion:
            for prompt in req.prompts:  # type: ignore[union-attr]
                public_request(req, prompt)  # type: ignore[arg-type]


def test_vllm_token_ids_and_prompt_logprobs_options() -> None:
    req = parse_completion(_body({"prompt": "a", "return_token_ids": True,
                                  "return_tokens_as_token_ids": True, "prompt_logprobs": 3,
                                  "logprobs": 1, "echo": True}))
    assert req.return_token_ids and req.tokens_as_ids and req.prompt_logprobs == 3
    public = public_request(req, "a")
    # One top count serves both asks (the larger); the answer cuts each to its own.
    assert public.return_logprob and public.top_logprobs_num == 3
    assert public.logprob_start_len == 0 and public.return_text_in_logprobs
    alone = public_request(parse_chat(_body({"messages": USER, "prompt_logprobs": 0})), [])
    assert alone.return_logprob and alone.top_logprobs_num == 0 and alone.logprob_start_len == 0
    plain = parse_chat(_body({"messages": USER}))
    assert not plain.return_token_ids and not plain.tokens_as_ids
    assert plain.prompt_logprobs is None and not public_request(plain, []).return_logprob
    # Not streamed: refused with stream, but 0 there is taken and does nothing (vLLM's).
    err = _refusal(parse_completion, {"prompt": "a", "stream": True, "prompt_logprobs": 1})
    assert err.message == "prompt_logprobs: is not available when stream is true"
    streamed = parse_chat(_body({"messages": USER, "stream": True, "prompt_logprobs": 0}))
    assert streamed.prompt_logprobs is None
    assert _refusal(parse_chat, {"messages": USER, "prompt_logprobs": -1}).message.startswith(
        "prompt_logprobs: must be in [0, ")
    assert _refusal(parse_chat, {"messages": USER, "return_token_ids": 1}).message.startswith(
        "return_token_ids: must be true or false")


def test_vllm_truncation_and_beam_search_options() -> None:
    req = parse_completion(_body({"prompt": [1, 2, 3], "truncate_prompt_tokens": 2,
                                  "truncation_side": "right"}))
    assert req.truncate == 2 and req.truncate_right
    chat = parse_chat(_body({"messages": USER, "truncate_prompt_tokens": -1}))
    assert chat.truncate == -1 and not chat.truncate_right  # the last ones kept by default
    assert parse_chat(_body({"messages": USER})).truncate is None
    assert _refusal(parse_chat, {"messages": USER, "truncate_prompt_tokens": 0}).message == (
        "truncate_prompt_tokens: must be -1 (max_model_len) or at least 1, got 0")
    assert _refusal(parse_chat, {"messages": USER, "truncation_side": "middle"}).message == (
        'truncation_side: must be "left" or "right", got "middle"')
    assert _refusal(parse_completion, {"prompt": "a", "echo": True,
                                       "truncate_prompt_tokens": 2}).message.startswith(
        "echo: cannot be combined with truncate_prompt_tokens")
    parse_chat(_body({"messages": USER, "use_beam_search": False, "length_penalty": 1.5,
                      "spaces_between_special_tokens": False}))
    with pytest.raises(MeshError) as info:
        parse_completion(_body({"prompt": "a", "use_beam_search": True}))
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.message.startswith("use_beam_search: ")


def test_logprob_token_ids_need_logprobs_and_replace_the_top_ones() -> None:
    req = parse_chat(_body({"messages": USER, "logprobs": True, "top_logprobs": 3,
                            "logprob_token_ids": [5, 7]}))
    public = public_request(req, [])
    assert list(public.token_ids_logprob) == [5, 7] and public.top_logprobs_num == 0
    assert req.names["token_ids_logprob"] == "logprob_token_ids"
    completion = parse_completion(_body({"prompt": "a", "logprobs": 0,
                                         "logprob_token_ids": [5]}))
    assert completion.logprob_ids == [5]
    for doc, words in (({"logprob_token_ids": [5]}, "needs logprobs to be set"),
                       ({"logprobs": True, "logprob_token_ids": []}, "must not be an empty list"),
                       ({"logprobs": True, "logprob_token_ids": [-1]}, "must be a list of token"),
                       ({"logprobs": True, "logprob_token_ids": list(range(21))}, "at most 20")):
        err = _refusal(parse_chat, {"messages": USER, **doc})
        assert err.message.startswith("logprob_token_ids: " + words), err.message


def test_vllm_request_id_is_the_rid() -> None:
    req = parse_chat(_body({"messages": USER, "request_id": "abc-1"}))
    assert req.rid == "abc-1" and req.names["rid"] == "request_id"
    err = renamed(MeshError(grpc.StatusCode.INVALID_ARGUMENT, "rid: must be 1 to 128"), req.names)
    assert err.message == "request_id: must be 1 to 128"


def test_vllm_structured_output_options() -> None:
    """disable_any_whitespace: false lets the JSON have whitespace (llguidance's option, in the
    schema); disable_fallback and the older guided_decoding_backend change nothing here."""
    req = parse_chat(_body({"messages": USER, "guided_decoding_backend": "xgrammar",
                            "structured_outputs": {"json": {"type": "object"},
                                                   "disable_any_whitespace": False,
                                                   "disable_fallback": True}}))
    schema = json.loads(public_request(req, []).sampling_params.guided_decoding.json_schema)
    assert schema == {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    compact = parse_chat(_body({"messages": USER, "structured_outputs": {
        "json": {"type": "object"}, "disable_any_whitespace": True}}))
    assert json.loads(public_request(compact, []).sampling_params.guided_decoding
                      .json_schema) == {"type": "object"}
    assert _refusal(parse_chat, {"messages": USER, "structured_outputs": {
        "regex": "a", "disable_any_whitespace": "yes"}}).message == (
        "structured_outputs.disable_any_whitespace: must be true or false")


def test_reasoning_effort_and_documents_are_template_variables() -> None:
    req = parse_chat(_body({"messages": USER, "reasoning_effort": "none",
                            "documents": [{"title": "a", "text": "b"}]}))
    assert req.template_kwargs == {"enable_thinking": False, "reasoning_effort": "none",
                                   "documents": [{"title": "a", "text": "b"}]}
    mine = parse_chat(_body({"messages": USER, "reasoning_effort": "high",
                             "chat_template_kwargs": {"enable_thinking": False}}))
    assert mine.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}
    for doc, start in (({"reasoning_effort": "huge"}, "reasoning_effort: must be one of"),
                       ({"documents": ["text"]}, "documents: must be a list of objects")):
        err = _refusal(parse_chat, {"messages": USER, **doc})
        assert err.message.startswith(start), err.message
