"""SGLang's native /generate bodies -> the public request messages: one prompt or a batch,
nulls as "not given", per-prompt fields, and what is refused."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol import native
from sglang.runtime.v1 import sglang_pb2 as pb


def test_native_text_request() -> None:
    m = native.native_generate_request(
        orjson.dumps(
            {
                "text": "hi",
                "stream": True,
                "rid": "r1",
                "return_logprob": None,
                "sampling_params": {"max_new_tokens": 8, "stop": "\n", "top_k": None, "n": 1},
            }
        )
    )
    assert isinstance(m, pb.TextGenerateRequest)
    assert m.text == "hi" and m.stream and m.rid == "r1"
    assert m.sampling_params.max_new_tokens == 8 and list(m.sampling_params.stop) == ["\n"]
    assert not m.sampling_params.HasField("top_k") and not m.HasField("return_logprob")


def test_native_ids_request() -> None:
    m = native.native_generate_request(b'{"input_ids": [1, 2], "sampling_params": {}}')
    assert isinstance(m, pb.GenerateRequest) and list(m.input_ids) == [1, 2]


@pytest.mark.parametrize(
    ("doc", "start", "code"),
    [
        (
            {"text": "a", "input_ids": [1]},
            "text: give exactly one of text and input_ids; both",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            {"stream": True},
            "text: give exactly one of text and input_ids; neither",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"text": []}, "text: the batch is empty", grpc.StatusCode.INVALID_ARGUMENT),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid: has 1 entries for 2 prompts",
         grpc.StatusCode.INVALID_ARGUMENT),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]},
         "sampling_params: has 3 entries", grpc.StatusCode.INVALID_ARGUMENT),
        (
            {"text": "a", "sampling_params": {"max_tokens": 3}},
            "sampling_params.max_tokens: unknown",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        ({"text": "a", "bogus": 1}, "bogus: unknown field", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_native_bad_requests(doc: dict[str, Any], start: str, code: grpc.StatusCode) -> None:
    with pytest.raises(MeshError) as info:
        native.native_generate_requests(orjson.dumps(doc))
    assert info.value.code == code
    assert info.value.message.startswith(start), info.value.message


def test_native_batches_split_per_prompt_fields() -> None:
    reqs, batch = native.native_generate_requests(orjson.dumps({
        "text": ["a", "b"], "rid": ["r0", "r1"], "return_logprob": True,
        "sampling_params": [{"max_new_tokens": 3, "stop": "x"}, {"temperature": 0.5}],
    }))
    assert batch and [r.text for r in reqs] == ["a", "b"]
    assert [r.rid for r in reqs] == ["r0", "r1"] and all(r.return_logprob for r in reqs)
    assert reqs[0].sampling_params.max_new_tokens == 3 and list(reqs[0].sampling_params.stop) == [
        "x"]
    assert reqs[1].sampling_params.temperature == 0.5
    reqs, batch = native.native_generate_requests(orjson.dumps({
        "input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}}))
    assert batch and [list(r.input_ids) for r in reqs] == [[1, 2], [3]]
    assert all(r.sampling_params.n == 2 for r in reqs)
    single, batch = native.native_generate_requests(b'{"input_ids": [5, 6]}')
    assert not batch and list(single[0].input_ids) == [5, 6]
