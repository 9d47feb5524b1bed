"""ParseInterceptor: a request that does not parse (bad UTF-8 in a string field, truncated
bytes) ends its call INVALID_ARGUMENT naming the message type, in unary calls and in the middle
of a request stream, with one log line and no Python class name; good requests are untouched.
A real grpc.aio server on a loopback port, with the interceptors GrpcServer installs."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshlm.common.interceptors import ErrorInterceptor, TracingInterceptor
from meshlm.common.parsing import ParseInterceptor, message_name, reason_of
from meshlm.common.server import Binding, GrpcServer, Sink
from meshlm.v1 import common_pb2, tokenizer_pb2

MARKER = "MALFORMED-MARKER"


def bad_utf8(message: object) -> bytes:
    """`message` serialized with its MARKER string replaced by as many invalid UTF-8 bytes."""
    raw = message.SerializeToString()  # type: ignore[attr-defined]
    assert raw.count(MARKER.encode()) == 1
    return raw.replace(MARKER.encode(), b"\xff" * len(MARKER))


def truncated(message: object) -> bytes:
    """`message` serialized and cut off inside its MARKER string."""
    raw = message.SerializeToString()  # type: ignore[attr-defined]
    return raw[: raw.index(MARKER.encode()) + 3]


REQUEST = tokenizer_pb2.TokenizeRequest(text=MARKER)
BATCH = tokenizer_pb2.GenerateBatch(requests=[tokenizer_pb2.GenerateRequest(
    meta=common_pb2.RequestMeta(rid=MARKER))])
MALFORMED = {"bad_utf8": bad_utf8, "truncated": truncated}


class Recorder:
    """Handlers of the four kinds (and a context.write stream) that record what they got."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    async def unary(self, request: tokenizer_pb2.TokenizeRequest,
                    context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        self.seen.append(request)
        return tokenizer_pb2.TokenizeResponse(tokens=[len(request.text)])

    async def unary_stream(self, request: tokenizer_pb2.TokenizeRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[tokenizer_pb2.TokenizeResponse]:
        self.seen.append(request)
        yield tokenizer_pb2.TokenizeResponse(tokens=[len(request.text)])

    async def written(self, request: tokenizer_pb2.TokenizeRequest,
                      context: grpc.aio.ServicerContext) -> None:
        self.seen.append(request)
        await context.write(tokenizer_pb2.TokenizeResponse(tokens=[len(request.text)]))

    async def stream_unary(self, requests: AsyncIterator[tokenizer_pb2.GenerateBatch],
                           context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        async for batch in requests:
            self.seen.append(batch)
        return common_pb2.Empty()

    async def stream_stream(self, requests: AsyncIterator[tokenizer_pb2.GenerateBatch],
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[tokenizer_pb2.RejectionBatch]:
        async for batch in requests:
            self.seen.append(batch)
            yield tokenizer_pb2.RejectionBatch()


def handlers(r: Recorder) -> grpc.GenericRpcHandler:
    req = tokenizer_pb2.TokenizeRequest.FromString
    resp = tokenizer_pb2.TokenizeResponse.SerializeToString
    batch = tokenizer_pb2.GenerateBatch.FromString
    return grpc.method_handlers_generic_handler("test.Parse", {
        "Unary": grpc.unary_unary_rpc_method_handler(r.unary, req, resp),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(r.unary_stream, req, resp),
        "Written": grpc.unary_stream_rpc_method_handler(r.written, req, resp),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(
            r.stream_unary, batch, common_pb2.Empty.SerializeToString),
        "StreamStream": grpc.stream_stream_rpc_method_handler(
            r.stream_stream, batch, tokenizer_pb2.RejectionBatch.SerializeToString),
    })


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Channel, Recorder]]:
    recorder = Recorder()
    server = grpc.aio.server(
        interceptors=[TracingInterceptor(), ErrorInterceptor(), ParseInterceptor()])
    server.add_generic_rpc_handlers([handlers(recorder)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel, recorder
    await channel.close()
    await server.stop(None)


def refusals(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.fields for r in caplog.records  # type: ignore[attr-defined]
            if r.getMessage() == "malformed_message"]


def assert_refused(err: grpc.aio.AioRpcError, name: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert details.startswith(f"could not parse {name}: "), details
    assert "Error" not in details and "<class" not in details and "protobuf" not in details


# ---- the pure helpers -------------------------------------------------------------------------


def test_the_message_name_comes_from_the_generated_deserializer():
    assert message_name(tokenizer_pb2.GenerateBatch.FromString, "/m.S/X") == \
        "meshlm.v1.GenerateBatch"
    assert message_name(lambda raw: raw, "/m.S/X") == "the request of /m.S/X"


def test_the_reason_is_protobufs_words_without_the_exception_class():
    assert reason_of(DecodeError("Error parsing message with type 'a.B': Wire format was "
                                 "corrupt")) == "wire format was corrupt"
    assert reason_of(ValueError("boom")) == "malformed message"


# ---- through a server -------------------------------------------------------------------------


async def test_good_requests_of_every_kind_are_parsed_as_before(served):
    channel, recorder = served
    raw = tokenizer_pb2.TokenizeRequest(text="hello").SerializeToString()
    reply = await channel.unary_unary("/test.Parse/Unary")(raw, timeout=5)
    assert tokenizer_pb2.TokenizeResponse.FromString(reply).tokens == [5]
    assert [r async for r in channel.unary_stream("/test.Parse/UnaryStream")(raw, timeout=5)]
    assert [r async for r in channel.unary_stream("/test.Parse/Written")(raw, timeout=5)]
    batch = tokenizer_pb2.GenerateBatch(requests=[tokenizer_pb2.GenerateRequest(
        meta=common_pb2.RequestMeta(rid="r"))])
    raws = [batch.SerializeToString()] * 2
    await channel.stream_unary("/test.Parse/StreamUnary")(iter(raws), timeout=5)
    assert len([r async for r in channel.stream_stream("/test.Parse/StreamStream")(
        iter(raws), timeout=5)]) == 2
    assert recorder.seen[:3] == [tokenizer_pb2.TokenizeRequest(text="hello")] * 3
    assert recorder.seen[3:] == [batch] * 4


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("method", ["Unary", "UnaryStream", "Written"])
async def test_a_malformed_unary_request_is_invalid_argument(served, caplog, kind, method):
    channel, recorder = served
    raw = MALFORMED[kind](REQUEST)
    with caplog.at_level(logging.WARNING, logger="meshlm.common.parsing"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method == "Unary":
                await channel.unary_unary(f"/test.Parse/{method}")(raw, timeout=5)
            else:
                [r async for r in channel.unary_stream(f"/test.Parse/{method}")(raw, timeout=5)]
    assert_refused(err.value, "meshlm.v1.TokenizeRequest")
    assert recorder.seen == []  # the handler never ran
    [line] = refusals(caplog)
    assert line["method"] == f"/test.Parse/{method}"
    assert line["message"] == "meshlm.v1.TokenizeRequest"
    assert line["size"] == len(raw) and MARKER[:3] not in str(line)  # no payload


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("method", ["StreamUnary", "StreamStream"])
async def test_a_malformed_message_mid_stream_ends_the_stream_invalid_argument(
        served, caplog, kind, method):
    channel, recorder = served
    good = tokenizer_pb2.GenerateBatch(requests=[tokenizer_pb2.GenerateRequest(
        meta=common_pb2.RequestMeta(rid="ok"))])
    raws = [good.SerializeToString(), MALFORMED[kind](BATCH), good.SerializeToString()]
    with caplog.at_level(logging.WARNING, logger="meshlm.common.parsing"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method == "StreamUnary":
                await channel.stream_unary(f"/test.Parse/{method}")(iter(raws), timeout=5)
            else:
                [r async for r in channel.stream_stream(f"/test.Parse/{method}")(
                    iter(raws), timeout=5)]
    assert_refused(err.value, "meshlm.v1.GenerateBatch")
    assert recorder.seen == [good]  # the message before the bad one was handled, none after
    assert len(refusals(caplog)) == 1


async def test_grpc_server_refuses_malformed_health_checks_on_both_ports():
    server = GrpcServer([])
    main = await server.start("127.0.0.1", 0, None)
    health_only = await server.serve_health("127.0.0.1", 0)
    raw = bad_utf8(health_pb2.HealthCheckRequest(service=MARKER))
    try:
        for address in (main, health_only):
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary("/grpc.health.v1.Health/Check")(raw, timeout=5)
                assert_refused(err.value, "grpc.health.v1.HealthCheckRequest")
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


@pytest.mark.parametrize("kind", sorted(MALFORMED))
async def test_a_native_servers_sink_takes_parsed_messages_and_refuses_malformed_ones(
        caplog, kind):
    recorder, taken = Recorder(), []
    server = GrpcServer([Binding(
        lambda r, s: s.add_generic_rpc_handlers([handlers(r)]), recorder, "test.Parse",
        {"StreamUnary": Sink(tokenizer_pb2.GenerateBatch, taken.append)})], native=True)
    address = await server.start("127.0.0.1", 0, None)
    good = tokenizer_pb2.GenerateBatch(requests=[tokenizer_pb2.GenerateRequest(
        meta=common_pb2.RequestMeta(rid="ok"))])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            method = channel.stream_unary("/test.Parse/StreamUnary")
            await method(iter([good.SerializeToString()] * 2), timeout=5)
            assert taken == [good, good] and recorder.seen == []  # the sink took them
            raws = [good.SerializeToString(), MALFORMED[kind](BATCH), good.SerializeToString()]
            with caplog.at_level(logging.WARNING, logger="meshlm.common.parsing"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await method(iter(raws), timeout=5)
    finally:
        await server.stop(None)
    assert_refused(err.value, "meshlm.v1.GenerateBatch")
    assert taken == [good] * 3  # the one before the bad message, none after
    assert len(refusals(caplog)) == 1
