"""Random and malformed requests against the real mesh, over gRPC and HTTP (issue 4, point 4).

Every answer must be a valid result or a client-error status: never INTERNAL/UNKNOWN (gRPC)
or a 5xx other than 503 (HTTP), never a hang (each call has a deadline), and no service may
die. Values are drawn to straddle the validation limits (negative, zero, huge, NaN, wrong
types), generation lengths are kept small where valid so the run stays short.
"""

from __future__ import annotations

import math

import grpc
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.runtime.v1 import sglang_pb2 as pb

CALL_TIMEOUT = 30.0  # seconds: a call that takes longer counts as a hang
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS}

# Generation lengths: short when valid, and values validation must refuse.
max_tokens = st.sampled_from([-1, 0, 1, 3, 2**31 - 1, 10**6])
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, 1e30]))
ints = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([-1, 0, 1, 5]))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "hello", "\x00", "🙂" * 5]))
token_ids = st.lists(st.one_of(st.integers(-5, 3000), st.sampled_from([-2**31, 2**31 - 1])),
                     max_size=12)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    p = pb.SamplingParams(max_new_tokens=draw(max_tokens))
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        if draw(st.booleans()):
            setattr(p, name, draw(floats))
    for name in ("top_k", "min_new_tokens", "n"):
        if draw(st.booleans()):
            setattr(p, name, draw(st.sampled_from([-1, 0, 1, 2, 4, 10**6])))
    if draw(st.booleans()):
        p.stop.extend(draw(st.lists(texts, max_size=3)))
    if draw(st.booleans()):
        p.stop_token_ids.extend(draw(token_ids))
    if draw(st.booleans()):
        p.seed = draw(st.integers(-2**63, 2**63 - 1))
    if draw(st.booleans()):
        p.regex = draw(texts)
    return p


def _logprob_fields(draw: st.DrawFn, req: pb.TextGenerateRequest | pb.GenerateRequest) -> None:
    if draw(st.booleans()):
        req.return_logprob = draw(st.booleans())
        req.top_logprobs_num = draw(st.sampled_from([-1, 0, 2, 10**6]))
        req.logprob_start_len = draw(st.sampled_from([-2, -1, 0, 3, 10**6]))
    if draw(st.booleans()):
        req.routed_dp_rank = draw(ints)


@st.composite
def text_generate(draw: st.DrawFn) -> pb.TextGenerateRequest:
    req = pb.TextGenerateRequest(text=draw(texts), sampling_params=draw(sampling_params()),
                                 stream=draw(st.booleans()))
    _logprob_fields(draw, req)
    if draw(st.booleans()):
        req.rid = draw(texts)
    return req


@st.composite
def generate(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest(input_ids=draw(token_ids), sampling_params=draw(sampling_params()),
                             stream=draw(st.booleans()))
    _logprob_fields(draw, req)
    return req


def _grpc_outcome(call) -> None:  # noqa: ANN001 - a stub call
    """Run a call to its end; fail on a server fault or a hang, accept any client error."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            for _ in result:
                pass
    except grpc.RpcError as e:
        assert e.code() not in BAD_GRPC, f"{e.code()}: {e.details()}"


@pytest.fixture(autouse=True)
def _services_survive(mesh):
    yield
    assert mesh.exited() == {}, f"services died: {mesh.exited()}"


@SETTINGS
@given(req=text_generate())
def test_grpc_text_generate_fuzz(stub, req: pb.TextGenerateRequest) -> None:
    _grpc_outcome(lambda: stub.TextGenerate(req, timeout=CALL_TIMEOUT))


@SETTINGS
@given(req=generate())
def test_grpc_generate_fuzz(stub, req: pb.GenerateRequest) -> None:
    _grpc_outcome(lambda: stub.Generate(req, timeout=CALL_TIMEOUT))


@SETTINGS
@given(text=texts, ids=token_ids, special=st.booleans())
def test_grpc_tokenize_detokenize_fuzz(stub, text: str, ids: list[int], special: bool) -> None:
    _grpc_outcome(lambda: stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=special),
                                        timeout=CALL_TIMEOUT))
    _grpc_outcome(lambda: stub.Detokenize(pb.DetokenizeRequest(tokens=ids), timeout=CALL_TIMEOUT))


def _json_value(depth: int = 2) -> st.SearchStrategy[object]:
    leaves = st.one_of(st.none(), st.booleans(), ints, floats.filter(math.isfinite), texts)
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
        max_leaves=8)


@st.composite
def generate_body(draw: st.DrawFn) -> object:
    """/generate bodies: mostly well-shaped with bad values, sometimes any JSON at all."""
    if draw(st.integers(0, 4)) == 0:
        return draw(_json_value())
    body: dict[str, object] = {}
    if draw(st.booleans()):
        body["text"] = draw(st.one_of(texts, st.lists(texts, max_size=3), ints))
    else:
        body["input_ids"] = draw(st.one_of(token_ids, st.lists(token_ids, max_size=2), texts))
    params: dict[str, object] = {"max_new_tokens": draw(max_tokens)}
    for name in ("temperature", "top_p", "top_k", "min_p", "n", "repetition_penalty",
                 "stop", "seed", "ignore_eos"):
        if draw(st.booleans()):
            params[name] = draw(_json_value())
    body["sampling_params"] = params
    for name in ("stream", "return_logprob", "top_logprobs_num", "logprob_start_len", "rid"):
        if draw(st.booleans()):
            body[name] = draw(_json_value())
    return body


# (path, whether the body is JSON made by a strategy or raw bytes)
HTTP_PATHS = ["/generate", "/encode", "/v1/runtime/text_generate", "/v1/runtime/generate",
              "/v1/runtime/tokenize", "/v1/runtime/detokenize", "/v1/chat/completions",
              "/v1/completions", "/v1/embeddings", "/abort_request", "/tokenize"]


def _http_outcome(client: httpx.Client, path: str, content: bytes) -> None:
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json"}) as resp:
        body = b"".join(resp.iter_bytes())
    assert resp.status_code < 500 or resp.status_code == 503, (
        f"{path} -> {resp.status_code}: {body[:300]!r}")
    if resp.status_code == 200:  # a stream's error event must not be an internal fault
        assert b'"code":13' not in body.replace(b" ", b""), body[:300]
        assert b"internal error" not in body.lower(), body[:300]


@pytest.fixture(scope="module")
def http(mesh):
    with httpx.Client(base_url=mesh.addresses.gateway_http, timeout=CALL_TIMEOUT) as client:
        yield client


@SETTINGS
@given(body=generate_body())
def test_http_generate_fuzz(http, body: object) -> None:
    _http_outcome(http, "/generate", orjson.dumps(body))


@SETTINGS
@given(path=st.sampled_from(HTTP_PATHS), body=st.one_of(
    _json_value().map(orjson.dumps),
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"[]", b"null", b'{"text": "\\ud800"}', b"\xff\xfe"]),
))
def test_http_any_route_fuzz(http, path: str, body: bytes) -> None:
    _http_outcome(http, path, body)
