"""The gateway's own CPU per streamed token, without its transports and without the rest of the
mesh: `python -m meshlm.bench.gateway_path`.

In the mesh the gateway's CPU per token moves by 10 µs between runs of the same code on this
machine (other processes on its core, how many tokens each message carries), more than most
changes to it. Here one process holds the gateway's real api and fronts, fed by a stand-in
mesh, so a run measures only the gateway's own Python and repeats to within a few per cent:

- the stand-in mesh takes the tokenizer stream's batches and, each step, hands the request
  table one packed TextBatch with a token for every stream, through the real inbox servicer
  (a request's first and last outputs whole, the rest packed, as the detokenizer sends them);
  the next step comes once every stream's message for this one was written, so each message
  carries one token, as at concurrency below saturation;
- gRPC: TextGenerate's handler as the public server runs it (the interceptors' wrapping, the
  request parsed from bytes, each response serialized), called without grpc.aio;
- HTTP: /generate with "stream": true through the HTTP app (its middleware, SSE), called as
  ASGI with a `send` that keeps the bytes' length, without uvicorn;
- OpenAI (`--transport openai`): /v1/completions with "stream": true, the same way.

It prints the process's CPU per token in the steady state (every stream started, none
finished) and per request (the rest of the run: admission, routing, the first and last
messages, ending). The registry is a stand-in (its writes are background rounds in the mesh,
measured by the registry's own tests); the transports' own cost is the mesh bench's floor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, MutableMapping
from typing import Any

import grpc
import orjson

from meshlm.common.interceptors import ErrorInterceptor, TracingInterceptor
from meshlm.common.packed import packer
from meshlm.common.parsing import ParseInterceptor
from meshlm.gateway.api.core import GatewayCore, GatewayIdentity
from meshlm.gateway.api.gateway import GatewayAPI
from meshlm.gateway.front.http_app import build_http_app
from meshlm.gateway.front.servicer import SglangServicer
from meshlm.gateway.mesh.inbox import InboxServicer, RequestTable
from meshlm.v1 import common_pb2, gateway_pb2, tokenizer_pb2
from sglang.runtime.v1 import sglang_pb2 as pb

Call = Callable[[int], Coroutine[Any, Any, None]]  # one streamed call of n tokens
ADDRESS = {"tokenizer": "tokenizer:0", "scheduler": "scheduler:0",
           "detokenizer": "detokenizer:0"}
PROMPT_TOKENS = 17
# Seconds a run may take (a second or two, normally): one that hangs (a handler that raised
# leaves its stand-in client waiting) fails the bench instead of stalling it.
RUN_TIMEOUT = 120.0
WORD = " word"


class _Deps:
    """Every role has one replica, serving."""

    ready = True
    addresses = {role: [address] for role, address in ADDRESS.items()}

    def serving(self, role: str) -> list[str]:
        return self.addresses[role]

    def pick(self, role: str, usable: Callable[[str], bool] | None = None) -> str | None:
        address = ADDRESS[role]
        return address if usable is None or usable(address) else None


class _Registry:
    """The RID registry's interface, writing nowhere."""

    degraded = False

    async def create(self, rid: str, fields: dict[str, Any]) -> bool:
        return True

    def create_later(self, rid: str, fields: dict[str, Any]) -> None:
        pass

    def update(self, rid: str, **fields: Any) -> None:
        pass

    def finish(self, rid: str, state: str, **fields: Any) -> None:
        pass


class StandInMesh:
    """The tokenizer's stream (`put`) and, behind it, one token per request per step into the
    inbox."""

    def __init__(self, table: RequestTable, tokens: int) -> None:
        self.tokens = tokens
        self.started: list[str] = []  # rids put since the last step
        self.running: dict[str, int] = {}  # rid -> tokens given
        self.batches: asyncio.Queue[gateway_pb2.TextBatch | None] = asyncio.Queue()
        self.make_batch = packer(gateway_pb2.TextBatch, texts=True)
        self.inbox = InboxServicer(table)

    async def put(self, requests: list[tokenizer_pb2.GenerateRequest]) -> None:
        self.started += [r.meta.rid for r in requests]

    def step(self) -> int:
        """Queue the next step's batch; the number of outputs in it."""
        for rid in self.started:
            self.running[rid] = 0
        self.started = []
        items: list[Any] = []
        for rid, given in list(self.running.items()):
            given += 1
            last = given == self.tokens
            if given == 1 or last:  # whole, as the detokenizer sends them
                items.append(gateway_pb2.TextOutput(
                    rid=rid, token_ids=[given], text=WORD, prompt_tokens=PROMPT_TOKENS,
                    completion_tokens=given, finished=last,
                    finish_reason="length" if last else ""))
            else:
                items.append((rid, [given], PROMPT_TOKENS, given, 0, WORD))
            if last:
                del self.running[rid]
            else:
                self.running[rid] = given
        self.batches.put_nowait(self.make_batch(items))
        return len(items)

    async def deliver(self) -> None:
        async def batches() -> AsyncIterator[gateway_pb2.TextBatch]:
            while (batch := await self.batches.get()) is not None:
                yield batch
        await self.inbox.Deliver(batches(), None)  # type: ignore[arg-type]


class _Written:
    """Counts the messages written to the clients; `wait(n)` until n more were."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self._target = 0
        self._reached = asyncio.Event()

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size
        if self.count >= self._target:
            self._reached.set()

    async def wait(self, n: int) -> None:
        self._target = self.count + n
        self._reached.clear()
        if self.count < self._target:
            await self._reached.wait()


def stand_in_api(mesh_box: list[StandInMesh]) -> tuple[GatewayAPI, RequestTable]:
    """The gateway's real api over stand-ins for the rest of the mesh: every role has one
    replica, the registry writes nowhere, and the tokenizer's stream is `mesh_box[0].put`."""
    table = RequestTable()
    core = GatewayCore(GatewayIdentity(inbox="gateway:0", served_model_name="bench"),
                       _Deps(), table, _Registry(), None)  # type: ignore[arg-type]
    core.model = common_pb2.ModelInfo(model_path="bench", max_model_len=4096,
                                      vocab_size=32000)
    core.engine_len = 4096

    class _Submit:
        lost = False

        async def put(self, requests: list[tokenizer_pb2.GenerateRequest]) -> None:
            await mesh_box[0].put(requests)

    return GatewayAPI(core, {ADDRESS["tokenizer"]: _Submit()}), table  # type: ignore[dict-item]


class _Context:
    """The little of grpc.aio's ServicerContext the gateway's handlers read, and the native
    server's `write_now` (direct writes, `api/direct.py`) unless `direct` is off."""

    def __init__(self, written: _Written, serialize: Callable[[Any], bytes],
                 direct: bool) -> None:
        self._written = written
        self._serialize = serialize
        if not direct:
            self.write_now = None  # type: ignore[assignment]

    def write_now(self, message: Any) -> bool:
        data = message if isinstance(message, bytes) else self._serialize(message)
        self._written.add(len(data))
        return True

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


def _grpc_client(api: GatewayAPI, written: _Written, direct: bool = True) -> Call:
    """One streamed TextGenerate call, through the handler as the public server wraps it;
    `direct`: running messages written directly, as on the native server."""
    servicer = SglangServicer(api)
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.TextGenerate, request_deserializer=pb.TextGenerateRequest.FromString,
        response_serializer=pb.TextGenerateResponse.SerializeToString)
    method = "/sglang.runtime.v1.SglangService/TextGenerate"
    for interceptor in reversed((TracingInterceptor(), ErrorInterceptor(), ParseInterceptor())):
        handler = interceptor.rewrap(handler, method)  # innermost first, as grpc applies them
    serialize = handler.response_serializer

    async def call(tokens: int) -> None:
        request = pb.TextGenerateRequest(text="a prompt", stream=True, sampling_params=(
            pb.SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)))
        context = _Context(written, serialize, direct)
        async for message in handler.unary_stream(request.SerializeToString(), context):
            written.add(len(serialize(message)))
    return call


def _http_client(api: GatewayAPI, written: _Written, direct: bool = True) -> Call:
    """One streamed /generate call, through the HTTP app as ASGI."""
    return _asgi_call(build_http_app(api), written, "/generate", lambda tokens: {
        "text": "a prompt", "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}, direct)


def _asgi_call(app: Any, written: _Written, path: str, body_of: Callable[[int], Any],
               direct: bool = True) -> Call:
    """A streamed POST to `path` of `app`, called as ASGI; `send` counts the body's pieces;
    `direct`: running events written directly, as on uvicorn's httptools connection."""

    async def call(tokens: int) -> None:
        body = orjson.dumps(body_of(tokens))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", b"%d" % len(body))],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 30000)}
        sent = False
        never = asyncio.Event()

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client stays connected
            return {"type": "http.disconnect"}

        await app(scope, receive, _Connection(written, direct).send)
    return call


class _Connection:
    """The server's side of one HTTP call: `send` counts the body's pieces; with `direct`, it
    is also what the gateway's direct writes take for uvicorn's connection (its transport, flow
    control and response state: `front/http_streams.DirectBody`), writing to the same count."""

    chunked_encoding = True
    disconnected = False
    response_complete = False

    def __init__(self, written: _Written, direct: bool) -> None:
        self._written = written
        self.flow = self
        self.write_paused = False
        if direct:  # without a transport, not a connection direct writes know
            self.transport = self

    def write(self, data: bytes) -> None:
        self._written.add(len(data))

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self._written.add(len(message["body"]))


def _openai_client(api: GatewayAPI, written: _Written) -> Call:
    """One streamed /v1/completions call (OpenAI's SSE), through the HTTP app as ASGI."""
    return _asgi_call(build_http_app(api), written, "/v1/completions", lambda tokens: {
        "model": "bench", "prompt": "a prompt", "stream": True, "temperature": 0,
        "max_tokens": tokens, "ignore_eos": True})


CLIENTS: dict[str, Callable[[GatewayAPI, _Written], Call]] = {
    "grpc": _grpc_client, "http": _http_client, "openai": _openai_client,
    # every message through the handler, as on grpc.aio's server (--grpc-server grpcio)
    "grpc-handler": functools.partial(_grpc_client, direct=False),
    "http-handler": functools.partial(_http_client, direct=False)}


async def measure(transport: str, streams: int, tokens: int) -> dict[str, float]:
    """One run: `streams` calls of `tokens` tokens each, started together."""
    mesh_box: list[StandInMesh] = []
    api, table = stand_in_api(mesh_box)
    mesh = StandInMesh(table, tokens)
    mesh_box.append(mesh)
    written = _Written()
    call = CLIENTS[transport](api, written)
    inbox = asyncio.create_task(mesh.deliver())
    begin = time.process_time()
    calls = [asyncio.create_task(call(tokens)) for _ in range(streams)]
    while len(mesh.started) < streams:  # every call reached the tokenizer's stream
        await asyncio.sleep(0)
    steady_cpu = steady_tokens = 0.0
    for step in range(tokens):
        start = time.process_time()
        n = mesh.step()
        await written.wait(n)
        if 0 < step < tokens - 1:  # neither a first nor a last output
            steady_cpu += time.process_time() - start
            steady_tokens += n
    await asyncio.gather(*calls)
    total = time.process_time() - begin
    mesh.batches.put_nowait(None)
    await inbox
    per_token = steady_cpu / steady_tokens
    per_request = (total - steady_cpu) / streams - 2 * per_token  # beyond its tokens' share
    return {"token_us": 1e6 * per_token, "request_us": 1e6 * per_request,
            "messages": written.count, "bytes_per_message": written.bytes / written.count}


def own_cpu_us(streams: int, tokens: int, runs: int) -> dict[str, float]:
    """The median µs per token of `runs` runs on each transport, in a fresh process (this
    one may hold torch and the bench's objects), on the CPUs this process may use."""
    out = subprocess.run([sys.executable, "-m", "meshlm.bench.gateway_path", "--json",
                          "--streams", str(streams), "--tokens", str(tokens),
                          "--runs", str(runs)], check=True, capture_output=True, text=True,
                         timeout=2 * RUN_TIMEOUT * runs + 60)
    return {t: statistics.median(r["token_us"] for r in rs)
            for t, rs in json.loads(out.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--transport", choices=(*CLIENTS, "both"),
                        default="both", help="both: gRPC and /generate (the bench's paths)")
    parser.add_argument("--json", action="store_true", help="print every run's figures as JSON")
    args = parser.parse_args()
    gc.freeze()  # as the gateway does after start-up
    transports = ("grpc", "http") if args.transport == "both" else (args.transport,)
    results: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    for _ in range(args.runs):  # the transports alternate, run by run
        for transport in transports:
            results[transport].append(asyncio.run(asyncio.wait_for(
                measure(transport, args.streams, args.tokens), RUN_TIMEOUT)))
    if args.json:
        print(json.dumps(results))
        return
    print(f"the gateway's own CPU, {args.streams} streams of {args.tokens} tokens, "
          f"{args.runs} runs (min / median / max):")
    for transport, runs in results.items():
        line = []
        for key, unit in (("token_us", "µs per token"), ("request_us", "µs per request")):
            values = sorted(r[key] for r in runs)
            line.append(f"{values[0]:.1f} / {values[len(values) // 2]:.1f} / "
                        f"{values[-1]:.1f} {unit}")
        print(f"  {transport:4}: " + ", ".join(line))


if __name__ == "__main__":
    main()
