"""The gateway's size bounds: how they are sized, and the checks that refuse a prompt by its
characters and a call by its number of requests, before any work is done for them."""

from __future__ import annotations

import grpc
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol import native, transcode
from meshlm.gateway.protocol.bounds import PROMPT_CHARS_PER_TOKEN, Bounds, text_chars
from meshlm.gateway.protocol.openai import MAX_PROMPT_IDS, parse_completion
from meshlm.gateway.protocol.scoring import parse_score
from meshlm.gateway.protocol.validation import (
    Limits,
    check_batch,
    check_prompt_chars,
    validate_classify,
    validate_generate,
    validate_text_embed,
    validate_text_generate,
    validate_tokenize,
)
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=64, vocab_size=100, max_prompt_chars=100, max_batch=8)


def test_prompt_chars_are_sized_from_the_context_length_unless_configured() -> None:
    assert Bounds().prompt_chars(2048) == 2048 * PROMPT_CHARS_PER_TOKEN
    assert Bounds(max_prompt_chars=500).prompt_chars(2048) == 500


def test_batch_is_the_inflight_limit_or_less() -> None:
    assert Bounds(max_inflight=1024).batch == 1024
    assert Bounds(max_batch=100, max_inflight=1024).batch == 100
    assert Bounds(max_batch=5000, max_inflight=1024).batch == 1024  # could never be admitted


def test_text_chars_counts_every_string_and_key() -> None:
    messages = [{"role": "user", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "abc"}]}]
    assert text_chars(messages) == (4 + 4 + 7 + 5) + (4 + 4 + 7 + (4 + 4 + 4 + 3))
    assert text_chars([1, 2.5, None, True]) == 0


def test_text_chars_survives_deep_nesting() -> None:
    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    assert text_chars(deep) == 1


def test_prompt_chars_over_the_limit_name_the_limit_and_the_flag() -> None:
    check_prompt_chars(100, LIMITS)
    with pytest.raises(MeshError) as err:
        check_prompt_chars(101, LIMITS, "messages")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    message = err.value.message
    assert message.startswith("messages: the prompt is 101 characters")
    assert "at most 100" in message and "--max-prompt-chars" in message
    assert "context length" in message  # OpenAI's context_length_exceeded


def test_zero_limits_check_nothing() -> None:
    unchecked = Limits(max_model_len=64, vocab_size=100)
    check_prompt_chars(10**9, unchecked)
    check_batch(10**9, 0, "text")


def test_batch_over_the_limit_names_the_limit_and_the_flags() -> None:
    check_batch(8, 8, "text")
    with pytest.raises(MeshError) as err:
        check_batch(10_000, 8, "text")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("text: the call asks for 10000 requests")
    assert "at most 8" in err.value.message and "--max-batch" in err.value.message


@pytest.mark.parametrize("check", [
    lambda text: validate_text_generate(pb.TextGenerateRequest(text=text), LIMITS),
    lambda text: validate_text_embed(pb.TextEmbedRequest(text=text), LIMITS),
    lambda text: validate_classify(pb.ClassifyRequest(text=text), LIMITS),
    lambda text: validate_tokenize(pb.TokenizeRequest(text=text), LIMITS),
])
def test_every_text_request_is_checked_before_tokenization(check) -> None:
    check("x" * 100)
    with pytest.raises(MeshError) as err:
        check("x" * 101)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("text: the prompt is 101 characters")


def test_native_batch_is_refused_before_it_is_split() -> None:
    body = b'{"text": [' + b",".join([b'"hi"'] * 10_000) + b"]}"
    with pytest.raises(MeshError) as err:
        native.native_generate_requests(body, max_batch=1024)
    assert "10000 requests" in err.value.message and "at most 1024" in err.value.message
    reqs, batch = native.native_generate_requests(body)  # no bound given: no limit
    assert batch and len(reqs) == 10_000
    with pytest.raises(MeshError):
        native.native_embed_requests(b'{"text": ["a", "b", "c"]}', max_batch=2)


def test_a_huge_prompt_is_parsed_without_json_format_scanning_it() -> None:
    big = "word " * 200_000
    body = orjson.dumps({"text": big, "sampling_params": {"max_new_tokens": 3}, "rid": "r1"})
    [req], batch = native.native_generate_requests(body)
    assert not batch and isinstance(req, pb.TextGenerateRequest)
    assert req.text == big and req.sampling_params.max_new_tokens == 3 and req.rid == "r1"
    with pytest.raises(MeshError) as err:  # orjson never yields one; a dict might
        transcode.parse_dict({"text": "\ud800" * transcode.DIRECT_CHARS}, pb.TextGenerateRequest())
    assert err.value.message.startswith("text: is not valid Unicode text")


def test_long_token_id_lists_are_bounded_before_each_id_is_looked_at() -> None:
    ids = [1] * (transcode.DIRECT_ITEMS + 10)
    [req], _ = native.native_generate_requests(orjson.dumps({"input_ids": ids}))
    assert list(req.input_ids) == ids
    with pytest.raises(MeshError) as err:
        native.native_generate_requests(orjson.dumps({"input_ids": [*ids, True]}))
    assert err.value.message.startswith("input_ids: must be a list of integers")
    # the length is checked before the ids: an id out of range is not what is reported
    long = pb.GenerateRequest(input_ids=[*ids, 10**6])
    with pytest.raises(MeshError) as err:
        validate_generate(long, LIMITS)
    assert err.value.message.startswith(f"input_ids: the prompt is {len(ids) + 1} tokens")


def test_openai_prompts_have_a_bounded_number_of_ids() -> None:
    with pytest.raises(MeshError) as err:
        parse_completion(orjson.dumps({"prompt": [1] * (MAX_PROMPT_IDS + 1)}))
    assert err.value.message == (f"prompt: has {MAX_PROMPT_IDS + 1} entries; a prompt has at "
                                 f"most {MAX_PROMPT_IDS} token ids")
    with pytest.raises(MeshError):
        parse_score(orjson.dumps({"query": [1] * (MAX_PROMPT_IDS + 1), "items": [[1]],
                                  "label_token_ids": [1]}))
