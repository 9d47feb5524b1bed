"""Undecodable gRPC messages against the real mesh (issue 13, hardening): invalid UTF-8 in a
string field, and bytes cut off mid-field, sent as raw bytes on the gateway's public port (its
API, health, reflection) and on every service's mTLS port (unary RPCs, and the batched
client- and bidi-streaming RPCs after a good first message). Each ends INVALID_ARGUMENT
"could not parse <message>: ..." with no Python class name, the service logs one line for it,
and it keeps serving: health SERVING on that port, a generate request through the mesh works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import orjson
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from helpers import collect_text, mesh_credentials, text_request, wait_until

from meshlm.v1 import common_pb2, detokenizer_pb2, gateway_pb2, scheduler_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

MARKER = "MALFORMED-MARKER"
TIMEOUT = 30.0


def bad_utf8(message: Message) -> bytes:
    """`message` serialized with its MARKER string replaced by as many invalid UTF-8 bytes."""
    raw = message.SerializeToString()
    assert raw.count(MARKER.encode()) == 1
    return raw.replace(MARKER.encode(), b"\xff" * len(MARKER))


def truncated(message: Message) -> bytes:
    """`message` serialized and cut off inside its MARKER string."""
    raw = message.SerializeToString()
    return raw[: raw.index(MARKER.encode()) + 3]


MALFORMED: dict[str, Callable[[Message], bytes]] = {"bad_utf8": bad_utf8, "truncated": truncated}


@dataclass(frozen=True)
class Target:
    """One method on one port: `port` names a MeshAddresses field, `service` the log file."""

    port: str
    service: str
    method: str
    kind: str          # "unary" | "unary_stream" | "stream_unary" | "stream_stream"
    message: Message   # holds MARKER in a string field
    first: Message | None = None  # streams: a good message sent before the bad one

    def __str__(self) -> str:
        return f"{self.port}{self.method}"


TARGETS = [
    Target("gateway_grpc", "gateway", "/sglang.runtime.v1.SglangService/TextGenerate",
           "unary_stream", pb.TextGenerateRequest(text=MARKER)),
    Target("gateway_grpc", "gateway", "/sglang.runtime.v1.SglangService/Tokenize",
           "unary", pb.TokenizeRequest(text=MARKER)),
    Target("gateway_grpc", "gateway", "/grpc.health.v1.Health/Check",
           "unary", health_pb2.HealthCheckRequest(service=MARKER)),
    Target("gateway_grpc", "gateway", "/grpc.reflection.v1alpha.ServerReflection/"
           "ServerReflectionInfo", "stream_stream",
           reflection_pb2.ServerReflectionRequest(host=MARKER, list_services=""),
           first=reflection_pb2.ServerReflectionRequest(list_services="")),
    Target("tokenizer", "tokenizer", "/meshlm.v1.Tokenizer/Tokenize",
           "unary", tokenizer_pb2.TokenizeRequest(text=MARKER)),
    Target("tokenizer", "tokenizer", "/meshlm.v1.Tokenizer/Submit", "stream_stream",
           tokenizer_pb2.GenerateBatch(requests=[tokenizer_pb2.GenerateRequest(
               meta=common_pb2.RequestMeta(rid=MARKER))]),
           first=tokenizer_pb2.GenerateBatch()),
    Target("scheduler", "scheduler", "/meshlm.v1.Scheduler/Abort",
           "unary", scheduler_pb2.AbortRequest(rids=[MARKER])),
    Target("scheduler", "scheduler", "/meshlm.v1.Scheduler/Submit", "stream_unary",
           scheduler_pb2.TokenizedBatch(requests=[scheduler_pb2.TokenizedRequest(
               meta=common_pb2.RequestMeta(rid=MARKER))]),
           first=scheduler_pb2.TokenizedBatch()),
    Target("detokenizer", "detokenizer", "/meshlm.v1.Detokenizer/Push", "stream_unary",
           detokenizer_pb2.TokenBatch(outputs=[detokenizer_pb2.TokenOutput(rid=MARKER)]),
           first=detokenizer_pb2.TokenBatch()),
    Target("detokenizer", "detokenizer", "/grpc.health.v1.Health/Check",
           "unary", health_pb2.HealthCheckRequest(service=MARKER)),
    Target("gateway_inbox", "gateway", "/meshlm.v1.GatewayInbox/Deliver", "stream_unary",
           gateway_pb2.TextBatch(outputs=[gateway_pb2.TextOutput(rid=MARKER)]),
           first=gateway_pb2.TextBatch()),
]


@pytest.fixture
def connect(mesh) -> Iterator[Callable[[str], grpc.Channel]]:
    """Opens a channel to a port: plaintext to the public one, mTLS with the mesh's client
    certificate to the others. All are closed after the test."""
    opened: list[grpc.Channel] = []

    def open_channel(port: str) -> grpc.Channel:
        address = getattr(mesh.addresses, port)
        channel = (grpc.insecure_channel(address) if port == "gateway_grpc"
                   else grpc.secure_channel(address, mesh_credentials(mesh)))
        opened.append(channel)
        return channel

    yield open_channel
    for channel in opened:
        channel.close()


def call_raw(channel: grpc.Channel, target: Target, raw: bytes) -> None:
    """Sends `raw` (after the target's good first message, for streams) and reads the reply."""
    messages = [target.first.SerializeToString(), raw] if target.first is not None else [raw]
    if target.kind == "unary":
        channel.unary_unary(target.method)(raw, timeout=TIMEOUT)
    elif target.kind == "unary_stream":
        list(channel.unary_stream(target.method)(raw, timeout=TIMEOUT))
    elif target.kind == "stream_unary":
        channel.stream_unary(target.method)(iter(messages), timeout=TIMEOUT)
    else:
        list(channel.stream_stream(target.method)(iter(messages), timeout=TIMEOUT))


def assert_still_serving(channel: grpc.Channel, stub) -> None:
    """The port that refused still reports SERVING, and a request through the mesh works."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    _, msgs = collect_text(stub, text_request("Hello", stream=False, max_new_tokens=2,
                                              ignore_eos=True))
    assert msgs[-1].finished and msgs[-1].meta_info["completion_tokens"] == "2", msgs[-1]


def refusals(mesh, service: str) -> list[dict]:
    """The service's malformed_message log events so far."""
    lines = mesh.log_path(service).read_bytes().splitlines()
    events = [orjson.loads(line) for line in lines if line.startswith(b"{")]
    return [e for e in events if e.get("event") == "malformed_message"]


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_a_malformed_message_is_invalid_argument_and_the_service_keeps_serving(
        mesh, stub, connect, target: Target, kind: str):
    name = target.message.DESCRIPTOR.full_name
    raw = MALFORMED[kind](target.message)
    before = len(refusals(mesh, target.service))
    channel = connect(target.port)

    with pytest.raises(grpc.RpcError) as err:
        call_raw(channel, target, raw)

    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    details = err.value.details()
    assert details.startswith(f"could not parse {name}: "), details
    for python_word in ("Error", "Exception", "<class", "protobuf", "Traceback"):
        assert python_word not in details, details
    # The port still serves, and so does the mesh.
    assert_still_serving(channel, stub)
    # One log line, naming the method and message, and no part of the payload. (The launcher
    # copies each service's output to its log file from a thread: wait for the line.)
    wait_until(lambda: len(refusals(mesh, target.service)) > before, what="the refusal's log")
    events = refusals(mesh, target.service)[before:]
    assert [(e["method"], e["message"]) for e in events] == [(target.method, name)]
    assert MARKER[:3] not in orjson.dumps(events[0]).decode()
    assert b"DecodeError" not in mesh.log_path(target.service).read_bytes()  # no traceback


PACKED_TARGETS = [
    Target("detokenizer", "detokenizer", "/meshlm.v1.Detokenizer/Push", "stream_unary",
           detokenizer_pb2.TokenBatch(packed=common_pb2.PackedOutputs(
               rids=[MARKER], token_counts=[3], token_ids=[1], prompt_tokens=[1],
               completion_tokens=[1], cached_tokens=[0])),
           first=detokenizer_pb2.TokenBatch()),
    Target("gateway_inbox", "gateway", "/meshlm.v1.GatewayInbox/Deliver", "stream_unary",
           gateway_pb2.TextBatch(packed=common_pb2.PackedOutputs(
               rids=[MARKER, "b"], token_counts=[1], token_ids=[1], prompt_tokens=[1],
               completion_tokens=[1], cached_tokens=[0])),
           first=gateway_pb2.TextBatch()),
]


@pytest.mark.parametrize("target", PACKED_TARGETS, ids=str)
def test_packed_arrays_that_disagree_are_invalid_argument_and_the_service_keeps_serving(
        mesh, stub, connect, target: Target):
    """A well-formed batch whose packed arrays do not line up (common/packed.py) ends its
    stream INVALID_ARGUMENT, saying what is wrong; the service and the mesh go on."""
    channel = connect(target.port)
    with pytest.raises(grpc.RpcError) as err:
        call_raw(channel, target, target.message.SerializeToString())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("malformed packed outputs: "), err.value.details()
    assert_still_serving(channel, stub)
