"""max_new_tokens 0 and token_ids_logprob at the gateway: validation (ids in the vocabulary,
copied into the internal params only with return_logprob), SGLang's native body (a flat list;
for a batch, one for all or one per prompt), the transcoded body, and their meta_info keys."""

from __future__ import annotations

import math
from typing import Any

import grpc
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol.logprob_meta import logprob_meta
from meshlm.gateway.protocol.native import native_generate_request, native_generate_requests
from meshlm.gateway.protocol.transcode import bind_request, routes
from meshlm.gateway.protocol.validation import Limits, validate_generate, validate_text_generate
from meshlm.v1 import common_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

LIMITS = Limits(max_model_len=256, vocab_size=100)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _error(fn: Any, *args: Any) -> MeshError:
    with pytest.raises(MeshError) as info:
        fn(*args)
    assert info.value.code == INVALID
    return info.value


def test_max_new_tokens_0_is_a_prefill() -> None:
    zero = pb.SamplingParams(max_new_tokens=0)
    v = validate_text_generate(pb.TextGenerateRequest(text="a", sampling_params=zero), LIMITS)
    assert v.sampling.max_new_tokens == 0
    v = validate_generate(pb.GenerateRequest(input_ids=[1] * 255, sampling_params=zero), LIMITS)
    assert v.sampling.max_new_tokens == 0  # the prompt still has to leave a position free
    err = _error(validate_generate, pb.GenerateRequest(input_ids=[1] * 256,
                                                       sampling_params=zero), LIMITS)
    assert err.message.startswith("input_ids: ")


def test_token_ids_logprob_rides_in_the_params_with_return_logprob() -> None:
    v = validate_generate(pb.GenerateRequest(input_ids=[1, 2], return_logprob=True,
                                             token_ids_logprob=[5, 99, 5]), LIMITS)
    assert list(v.sampling.token_ids_logprob) == [5, 99, 5]
    v = validate_text_generate(pb.TextGenerateRequest(text="a", token_ids_logprob=[5]), LIMITS)
    assert not v.sampling.token_ids_logprob  # ignored without return_logprob, as SGLang does


@pytest.mark.parametrize("asked", [True, False])
def test_token_ids_logprob_outside_the_vocabulary_is_refused(asked: bool) -> None:
    err = _error(validate_text_generate, pb.TextGenerateRequest(
        text="a", return_logprob=asked, token_ids_logprob=[3, 100]), LIMITS)
    assert err.message.startswith("token_ids_logprob[1]: ")
    assert err.message.endswith("out of vocabulary")
    err = _error(validate_generate, pb.GenerateRequest(
        input_ids=[1], return_logprob=asked, token_ids_logprob=[-1]), LIMITS)
    assert err.message.startswith("token_ids_logprob[0]: ") and "non-negative" in err.message


def _asked(body: dict[str, Any]) -> list[list[int]]:
    requests, _ = native_generate_requests(orjson.dumps(body))
    return [list(r.token_ids_logprob) for r in requests]


def test_native_token_ids_logprob_one_prompt_and_a_batch() -> None:
    assert _asked({"text": "a", "token_ids_logprob": [1, 2]}) == [[1, 2]]
    assert _asked({"input_ids": [3, 4], "token_ids_logprob": []}) == [[]]
    assert _asked({"text": ["a", "b"], "token_ids_logprob": [1, 2]}) == [[1, 2], [1, 2]]
    assert _asked({"input_ids": [[3], [4]], "token_ids_logprob": [[1], [2, 3]]}) == [[1], [2, 3]]
    assert _asked({"text": ["a", "b"], "token_ids_logprob": [None, [7]]}) == [[], [7]]
    assert _asked({"text": ["a", "b"], "token_ids_logprob": None}) == [[], []]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"text": "a", "token_ids_logprob": [[1, 2]]}, "token_ids_logprob", "flat list of integers"),
    ({"input_ids": [3], "token_ids_logprob": [1, [2]]}, "token_ids_logprob",
     "flat list of integers"),
    ({"text": "a", "token_ids_logprob": 5}, "token_ids_logprob", "flat list of integers"),
    ({"text": "a", "token_ids_logprob": [1.5]}, "token_ids_logprob", "flat list of integers"),
    ({"text": "a", "token_ids_logprob": [True]}, "token_ids_logprob", "flat list of integers"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1]]}, "token_ids_logprob", "1 lists for 2"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1], [[2]]]}, "token_ids_logprob[1]",
     "flat list of integers"),
    ({"text": "a", "token_ids_logprob": [2**40]}, "token_ids_logprob[0]", "out of vocabulary"),
    ({"text": "a", "token_ids_logprob": [-(2**40)]}, "token_ids_logprob[0]", "non-negative"),
])
def test_native_token_ids_logprob_refusals(body: dict[str, Any], field: str, words: str) -> None:
    err = _error(native_generate_requests, orjson.dumps(body))
    assert err.message.startswith(f"{field}: ") and words in err.message


def test_native_one_prompt_keeps_it() -> None:
    req = native_generate_request(orjson.dumps({
        "text": "a", "return_logprob": True, "token_ids_logprob": [4, 4],
        "sampling_params": {"max_new_tokens": 0}}))
    assert list(req.token_ids_logprob) == [4, 4] and req.sampling_params.max_new_tokens == 0


def test_transcoded_body_says_flat_list_of_integers() -> None:
    [binding] = [b for b in routes() if b.rpc == "Generate"]
    body = orjson.dumps({"input_ids": [1], "token_ids_logprob": [[1, 2]]})
    err = _error(bind_request, binding, {}, [], body)
    assert err.message == "token_ids_logprob: must be a flat list of integers"
    req = bind_request(binding, {}, [], orjson.dumps({"input_ids": [1], "token_ids_logprob": [7]}))
    assert isinstance(req, pb.GenerateRequest) and list(req.token_ids_logprob) == [7]


def _top(ids: list[int], logprobs: list[float], texts: list[str] = ()) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=ids, logprobs=logprobs, texts=list(texts))


def _decoded(meta: dict[str, str]) -> dict[str, Any]:
    return {k: orjson.loads(v) for k, v in meta.items()}


def test_asked_ids_in_meta_info_only_when_given() -> None:
    lp = common_pb2.Logprobs(
        output_logprobs=[-1.0], output_token_ids_logprobs=[_top([9, 4], [-2.0, -0.5])],
        input_start=0, input_token_ids=[1, 2], input_logprobs=[math.nan, -3.0],
        input_token_ids_logprobs=[_top([], []), _top([9, 4], [-4.0, -0.25])])
    meta = _decoded(logprob_meta([8], lp, top=False, text=False, asked=True))
    assert meta["output_token_ids_logprobs"] == [[[-2.0, 9, None], [-0.5, 4, None]]]
    assert meta["input_token_ids_logprobs"] == [None, [[-4.0, 9, None], [-0.25, 4, None]]]
    assert "output_token_ids_logprobs" not in logprob_meta([8], lp, top=False, text=False)
    lp = common_pb2.Logprobs(output_logprobs=[-1.0],
                             output_token_ids_logprobs=[_top([9], [-2.0], [" x"])])
    meta = _decoded(logprob_meta([8], lp, top=False, text=True, asked=True))
    assert meta["output_token_ids_logprobs"] == [[[-2.0, 9, " x"]]]


def test_a_prefill_has_no_output_token_but_the_position_after_the_prompt() -> None:
    lp = common_pb2.Logprobs(output_top=[_top([3, 9], [-0.1, -2.0])],
                             output_token_ids_logprobs=[_top([9], [-2.0])])
    meta = _decoded(logprob_meta([], lp, top=True, text=False, asked=True))
    assert meta["output_token_logprobs"] == []
    assert meta["output_top_logprobs"] == [[[-0.1, 3, None], [-2.0, 9, None]]]
    assert meta["output_token_ids_logprobs"] == [[[-2.0, 9, None]]]
