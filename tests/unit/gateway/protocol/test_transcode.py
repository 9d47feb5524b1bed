"""google.api.http route table, request binding, native /generate parsing and wire encoders."""

from __future__ import annotations

import json
from typing import Any

import grpc
import orjson
import pytest
from google.api import annotations_pb2
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.descriptor import ServiceDescriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.common.errors import MeshError
from meshlm.gateway.protocol import native, transcode
from meshlm.gateway.protocol.transcode import HttpBinding, PathTemplate, bind_request
from sglang.runtime.v1 import sglang_pb2 as pb

# ---- the SglangService route table -----------------------------------------------------------


def _by_rpc() -> dict[str, HttpBinding]:
    return {b.rpc: b for b in transcode.routes()}


def test_every_rpc_has_a_route() -> None:
    service = pb.DESCRIPTOR.services_by_name["SglangService"]
    table = _by_rpc()
    assert len(service.methods) == 25
    assert set(table) == {m.name for m in service.methods}


def test_route_details() -> None:
    table = _by_rpc()
    tg = table["TextGenerate"]
    assert (tg.http_method, tg.path.template, tg.body) == ("POST", "/v1/runtime/text_generate", "*")
    assert tg.request_cls is pb.TextGenerateRequest and tg.response_cls is pb.TextGenerateResponse
    assert tg.server_streaming
    health = table["HealthCheck"]
    assert (health.http_method, health.body, health.server_streaming) == ("GET", "", False)
    streaming = {rpc for rpc, b in table.items() if b.server_streaming}
    assert streaming == {"TextGenerate", "Generate", "ChatComplete", "Complete"}


# ---- a test service with path variables, a body field and additional bindings ---------------


def _test_service() -> ServiceDescriptor:
    pool = descriptor_pool.Default()
    name = "meshlm_test/transcode_test.proto"
    try:
        return pool.FindFileByName(name).services_by_name["Things"]
    except KeyError:
        pass
    f = descriptor_pb2.FileDescriptorProto(
        name=name,
        package="meshlm.test",
        syntax="proto3",
        dependency=["google/api/annotations.proto"],
    )
    inner = f.message_type.add(name="Inner")
    inner.field.add(name="name", number=1, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    inner.field.add(name="size", number=2, type=FD.TYPE_INT32, label=FD.LABEL_OPTIONAL)
    req = f.message_type.add(name="Req")
    for number, (fname, ftype, label, tname) in enumerate(
        [
            ("id", FD.TYPE_STRING, FD.LABEL_OPTIONAL, ""),
            ("inner", FD.TYPE_MESSAGE, FD.LABEL_OPTIONAL, ".meshlm.test.Inner"),
            ("tags", FD.TYPE_STRING, FD.LABEL_REPEATED, ""),
            ("count", FD.TYPE_INT32, FD.LABEL_OPTIONAL, ""),
            ("flag", FD.TYPE_BOOL, FD.LABEL_OPTIONAL, ""),
            ("payload", FD.TYPE_MESSAGE, FD.LABEL_OPTIONAL, ".meshlm.test.Inner"),
        ],
        start=1,
    ):
        field = req.field.add(name=fname, number=number, type=ftype, label=label)
        if tname:
            field.type_name = tname
    svc = f.service.add(name="Things")
    get = svc.method.add(name="Get", input_type=".meshlm.test.Req", output_type=".meshlm.test.Req")
    get.options.Extensions[annotations_pb2.http].get = "/v1/things/{id}/{inner.name=parts/*}"
    upd = svc.method.add(
        name="Update", input_type=".meshlm.test.Req", output_type=".meshlm.test.Req"
    )
    rule = upd.options.Extensions[annotations_pb2.http]
    rule.patch, rule.body = "/v1/things/{id}", "payload"
    extra = rule.additional_bindings.add()
    extra.post, extra.body = "/v1/things/{id}:update", "*"
    pool.Add(f)
    return pool.FindFileByName(name).services_by_name["Things"]


def _test_routes() -> dict[tuple[str, str], HttpBinding]:
    return {(b.rpc, b.http_method): b for b in transcode.routes(_test_service())}


def _bind(
    b: HttpBinding, path: str, query: list[tuple[str, str]] | None = None, body: bytes = b""
) -> Any:
    params = b.path.match(path)
    assert params is not None, path
    return bind_request(b, params, query or [], body)


def test_additional_bindings_are_routes() -> None:
    assert set(_test_routes()) == {("Get", "GET"), ("Update", "PATCH"), ("Update", "POST")}


def test_path_templates() -> None:
    t = PathTemplate.parse("/v1/things/{id}/{inner.name=parts/*}")
    assert t.match("/v1/things/a1/parts/p9") == {"id": "a1", "inner.name": "parts/p9"}
    assert t.match("/v1/things/a1/other/p9") is None
    assert t.match("/v1/things/a/b/parts/p9") is None
    verb = PathTemplate.parse("/v1/things/{id}:update")
    assert verb.match("/v1/things/x:update") == {"id": "x"}
    assert verb.match("/v1/things/x") is None
    deep = PathTemplate.parse("/files/{path=**}")
    assert deep.match("/files/a/b/c.txt") == {"path": "a/b/c.txt"}
    assert PathTemplate.parse("/v1/runtime/health").match("/v1/runtime/health") == {}


def test_path_and_query_binding() -> None:
    b = _test_routes()[("Get", "GET")]
    m = _bind(
        b,
        "/v1/things/t1/parts/p2",
        [("tags", "a"), ("tags", "b"), ("count", "7"), ("flag", "true"), ("inner.size", "3")],
    )
    assert m.id == "t1" and m.inner.name == "parts/p2" and m.inner.size == 3
    assert list(m.tags) == ["a", "b"] and m.count == 7 and m.flag is True


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ([("cnt", "1")], "cnt"),
        ([("inner.nmae", "x")], "inner.nmae"),
        ([("count", "x")], "request body"),
        ([("flag", "maybe")], "flag"),
        ([("count", "1"), ("count", "2")], "count"),
        ([("payload", "x")], "payload"),
        ([("id", "again")], "id"),
    ],
)
def test_bad_query(query: list[tuple[str, str]], field: str) -> None:
    b = _test_routes()[("Get", "GET")]
    with pytest.raises(MeshError) as info:
        _bind(b, "/v1/things/t1/parts/p2", query)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(f"{field}: "), info.value.message


def test_body_field_binding() -> None:
    b = _test_routes()[("Update", "PATCH")]
    m = _bind(b, "/v1/things/t1", [("count", "2")], b'{"name": "n", "size": 4}')
    assert m.id == "t1" and m.payload.name == "n" and m.payload.size == 4 and m.count == 2
    with pytest.raises(MeshError) as info:
        _bind(b, "/v1/things/t1", [], b'{"nme": "n"}')
    assert info.value.message.startswith("payload.nme: unknown field")


def test_body_star_binding_with_path_variable() -> None:
    b = _test_routes()[("Update", "POST")]
    m = _bind(b, "/v1/things/t1:update", [], b'{"count": 3, "inner": {"name": "x"}}')
    assert m.id == "t1" and m.count == 3 and m.inner.name == "x"
    with pytest.raises(MeshError) as info:
        _bind(b, "/v1/things/t1:update", [("count", "3")], b"{}")
    assert info.value.message.startswith("count: ") and "JSON body" in info.value.message


# ---- SglangService bodies --------------------------------------------------------------------


def test_body_star_for_text_generate() -> None:
    b = _by_rpc()["TextGenerate"]
    body = b'{"text": "hi", "sampling_params": {"temperature": 0, "stop": ["x"]}, "stream": true}'
    m = bind_request(b, {}, [], body)
    assert m.text == "hi" and m.stream and m.sampling_params.HasField("temperature")
    assert list(m.sampling_params.stop) == ["x"]


@pytest.mark.parametrize(
    ("body", "start"),
    [
        (b'{"txt": "a"}', "txt: unknown field; TextGenerateRequest has: text, sampling_params"),
        (b'{"sampling_params": {"temprature": 1}}', "sampling_params.temprature: unknown field"),
        (b'{"text": 5}', "request body: "),
        (b'{"stream": "yes"}', "request body: "),
        (b"{nope", "request body is not valid JSON: "),
        (b"[1, 2]", "body: must be a JSON object"),
    ],
)
def test_bad_bodies(body: bytes, start: str) -> None:
    with pytest.raises(MeshError) as info:
        bind_request(_by_rpc()["TextGenerate"], {}, [], body)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(start), info.value.message


def test_camel_case_json_names_are_accepted() -> None:
    m = bind_request(_by_rpc()["TextGenerate"], {}, [], b'{"text": "a", "routingKey": "k"}')
    assert m.routing_key == "k"


def test_get_query_binding() -> None:
    m = bind_request(_by_rpc()["GetLoad"], {}, [("dp_rank", "2")], b"")
    assert m.HasField("dp_rank") and m.dp_rank == 2


@settings(max_examples=150, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda kids: (
            st.lists(kids, max_size=3)
            | st.dictionaries(
                st.sampled_from(["text", "sampling_params", "stop", "top_k", "stream", "x"]),
                kids,
                max_size=3,
            )
        ),
        max_leaves=8,
    )
)
def test_any_json_is_a_request_or_invalid_argument(doc: Any) -> None:
    body = json.dumps(doc).encode()  # big ints and NaN included
    for fn in (
        lambda: bind_request(_by_rpc()["TextGenerate"], {}, [], body),
        lambda: native.native_generate_requests(body),
    ):
        try:
            fn()
        except MeshError as e:
            assert e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)


# ---- encoders --------------------------------------------------------------------------------


def test_encoders() -> None:
    assert orjson.loads(transcode.message_json(pb.HealthCheckResponse())) == {"healthy": False}
    line = transcode.result_line(pb.TextGenerateResponse(text="a", finished=True))
    assert line.endswith(b"\n") and orjson.loads(line) == {
        "result": {"text": "a", "meta_info": {}, "finished": True, "output_ids": []}
    }
    err = MeshError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    assert orjson.loads(transcode.error_line(err)) == {
        "error": {"code": 8, "message": "busy", "details": []}
    }
    assert orjson.loads(transcode.status_json(err))["code"] == 8
