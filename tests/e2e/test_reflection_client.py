"""A client with no generated stubs, as grpcurl works: the gateway's descriptors are fetched
through its gRPC server reflection service into a fresh DescriptorPool, request messages are
built from JSON, methods are called by their reflected names and streaming kind, and replies
are read back as JSON (issue 4, point 3)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

SERVICE = "sglang.runtime.v1.SglangService"


class ReflectionClient:
    """Calls any method the server describes, with JSON in and JSON out."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.database = ProtoReflectionDescriptorDatabase(channel)
        self.pool = DescriptorPool(self.database)

    def services(self) -> list[str]:
        return list(self.database.get_services())

    def call(self, method: str, body: dict[str, Any], timeout: float = 120) -> list[dict]:
        """`method` ("package.Service/Method") with `body` as its request's JSON; the reply
        messages as JSON dicts (one for a unary method)."""
        service_name, method_name = method.split("/")
        descriptor = self.pool.FindServiceByName(service_name).FindMethodByName(method_name)
        request_cls = message_factory.GetMessageClass(descriptor.input_type)
        response_cls = message_factory.GetMessageClass(descriptor.output_type)
        request = json_format.Parse(json.dumps(body), request_cls())
        path = f"/{service_name}/{method_name}"
        kind = self.channel.unary_stream if descriptor.server_streaming else \
            self.channel.unary_unary
        call = kind(path, request_serializer=request_cls.SerializeToString,
                    response_deserializer=response_cls.FromString)
        replies = call(request, timeout=timeout)
        if not descriptor.server_streaming:
            replies = [replies]
        return [json_format.MessageToDict(r) for r in replies]


@pytest.fixture(scope="module")
def client(mesh) -> ReflectionClient:
    with grpc.insecure_channel(mesh.addresses.gateway_grpc) as channel:
        yield ReflectionClient(channel)


def test_the_gateway_describes_its_services(client):
    services = client.services()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    service = client.pool.FindServiceByName(SERVICE)
    assert service.file.name == "sglang/runtime/v1/sglang.proto"
    assert service.FindMethodByName("TextGenerate").server_streaming
    assert not service.FindMethodByName("Tokenize").server_streaming
    # The descriptors were reflected into this pool (dependencies too), not compiled in.
    assert client.pool.FindFileByName("google/api/annotations.proto")


def test_tokenize_from_json(client, mesh):
    text = "Hello, reflection! 你好"
    [reply] = client.call(f"{SERVICE}/Tokenize", {"text": text})
    assert reply["inputText"] == text
    assert reply["count"] == len(reply["tokens"]) > 1 and reply["maxModelLen"] > 0
    native = httpx.post(f"{mesh.addresses.gateway_http}/tokenize", json={"prompt": text},
                        timeout=60).json()
    assert reply["tokens"] == native["tokens"]
    [plain] = client.call(f"{SERVICE}/Tokenize", {"text": text, "add_special_tokens": False})
    assert plain["tokens"] == reply["tokens"][1:]


def test_text_generate_streams_from_json(client, mesh):
    body = {"text": "The quick brown fox", "stream": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    messages = client.call(f"{SERVICE}/TextGenerate", body)
    assert len(messages) > 1 and all(not m.get("finished") for m in messages[:-1])
    final = messages[-1]
    assert final["finished"] is True
    assert final["metaInfo"]["finish_reason"] == "length"
    assert final["metaInfo"]["completion_tokens"] == "16"
    ids = [t for m in messages for t in m.get("outputIds", [])]
    text = "".join(m.get("text", "") for m in messages)
    assert len(ids) == 16 and text
    # The same greedy request over SGLang's /generate gives the same tokens and text.
    native = httpx.post(f"{mesh.addresses.gateway_http}/generate", timeout=60, json={
        "text": body["text"], "sampling_params": body["sampling_params"]}).json()
    assert native["output_ids"] == ids and native["text"] == text


def test_errors_come_back_as_statuses(client):
    with pytest.raises(grpc.RpcError) as err:
        client.call(f"{SERVICE}/Detokenize", {"tokens": [-1]})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("tokens[0]: ")
    with pytest.raises(json_format.ParseError):  # the reflected schema refuses unknown fields
        client.call(f"{SERVICE}/Tokenize", {"txet": "hello"})
