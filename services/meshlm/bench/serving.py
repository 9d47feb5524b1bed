"""HTTP side of the engine benchmark: streamed requests to meshlm and `transformers serve`.

Both servers get the same text prompts and stream Server-Sent Events; a request's TTFT is the
time to its first event (each server sends its first event with the first generated token)
and its token count is what the server reports at the end (meshlm: meta_info
completion_tokens, transformers: usage.completion_tokens).

`TransformersServe` runs `transformers serve --continuous-batching <checkpoint>` on a loopback
port, offline (HF_HUB_OFFLINE=1: the checkpoint is a local directory), on the CPU in float32,
and waits for GET /health. It takes text only (/v1/completions has no token-id prompt) and has
no ignore_eos; its per-request `generation_config` JSON with eos_token_id -1 does the same (its
continuous-batching request ignores negative eos ids), so it streams exactly max_tokens tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx
import orjson

from meshlm.bench.raw_http import HttpError, SsePool
from meshlm.bench.workload import BenchRequest
from meshlm.launch.addresses import free_port
from meshlm.launch.spawn import exit_status, spawn, terminate

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # the CLI asks PyPI for a newer version otherwise
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


@dataclass(frozen=True)
class StreamStats:
    rid: str
    ttft: float  # seconds to the first event
    tokens: int  # completion tokens the server reported
    prompt_tokens: int
    seconds: float = 0.0  # to the end of the stream

    @property
    def itl(self) -> float | None:
        """Mean seconds between tokens after the first; None with fewer than two tokens."""
        return (self.seconds - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


StreamFn = Callable[[SsePool, BenchRequest], Awaitable[StreamStats]]


class StreamError(RuntimeError):
    """A server answered a benchmark request with an error."""


def sse_pool(base_url: str, keepalive: bool = True) -> SsePool:
    """The benchmark's client for one server: `raw_http`'s lean SSE pool (httpx spent ~260 µs
    of CPU per streamed token at 16 streams on 2 cores, taken from the server it measured);
    without `keepalive`, one connection per request."""
    url = httpx.URL(base_url)
    return SsePool(url.host, url.port or 80, keepalive)


async def drive(client: SsePool, stream: StreamFn, requests: Sequence[BenchRequest],
                concurrency: int) -> tuple[list[StreamStats], float]:
    """Run `requests` in order over `concurrency` closed-loop streams (each starts its next
    request when its last one ends); returns the per-request stats and the wall time."""
    pending = iter(requests)
    results: list[StreamStats] = []

    async def worker() -> None:
        for request in pending:  # shared iterator: each request is taken once
            results.append(await stream(client, request))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def _data(event: bytes) -> dict[str, object] | None:
    """The JSON payload of an SSE event's `data:` line; None for other events and `[DONE]`."""
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return None
        doc = orjson.loads(payload)
        if not isinstance(doc, dict):
            raise StreamError(f"unexpected event {payload[:200]!r}")
        if "error" in doc:
            raise StreamError(f"server error: {doc['error']}")
        return doc
    return None


async def meshlm_stream(client: SsePool, request: BenchRequest) -> StreamStats:
    """One request to the meshlm gateway's SGLang-native POST /generate (SSE)."""
    body = {"text": request.text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": request.max_new_tokens, "ignore_eos": True}}
    ttft, seconds, meta = await _sse(client, "/generate", body, "meta_info")
    return StreamStats(request.rid, ttft, _int(meta.get("completion_tokens")),
                       _int(meta.get("prompt_tokens")), seconds)


async def completions_stream(client: SsePool, request: BenchRequest,
                             eos_off: dict[str, object] | None = None) -> StreamStats:
    """One request to an OpenAI-style POST /v1/completions (SSE), greedy, EOS disabled by the
    `eos_off` body fields (default: transformers' per-request `generation_config`)."""
    if eos_off is None:
        gen = {"do_sample": False, "eos_token_id": -1, "max_new_tokens": request.max_new_tokens}
        eos_off = {"generation_config": json.dumps(gen)}
    body = {"prompt": request.text, "stream": True, "max_tokens": request.max_new_tokens,
            **eos_off}
    ttft, seconds, usage = await _sse(client, "/v1/completions", body, "usage")
    return StreamStats(request.rid, ttft, _int(usage.get("completion_tokens")),
                       _int(usage.get("prompt_tokens")), seconds)


async def _sse(client: SsePool, path: str, body: dict[str, object], field: str
               ) -> tuple[float, float, dict[str, object]]:
    """POST `body` to `path` and read the SSE reply: seconds to the first event and to the
    end, and the last non-empty `field` object of the events (meta_info, usage)."""
    start = time.perf_counter()
    first: list[float] = []
    last: list[dict[str, object]] = [{}]

    def on_event(event: bytes) -> None:
        doc = _data(event)
        if doc is None:
            return
        if not first:
            first.append(time.perf_counter() - start)
        value = doc.get(field)
        if isinstance(value, dict) and value:
            last[0] = value

    try:
        await client.stream(path, orjson.dumps(body), on_event)
    except HttpError as e:
        raise StreamError(f"{path}: {e}") from None
    return (first[0] if first else 0.0), time.perf_counter() - start, last[0]


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | str) and str(value).lstrip("-").isdigit() else 0


class ServerProcess:
    """A benchmark peer: one server process on 127.0.0.1, a context manager.

    start() picks a free port, spawns `args()` with `env()` and waits until GET /health
    answers 200 (retrying on another port if the one it got was taken before the server bound
    it); stop() terminates its process group. Output goes to `log_path`."""

    name = "server"

    def __init__(self, log_path: Path, startup_timeout: float = 300.0) -> None:
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> Self:
        for attempt in range(3):  # a free port can be taken before the server binds it
            self.port = free_port()
            if self._start_once():
                return self
            if "address already in use" not in self.tail().lower() or attempt == 2:
                break
        raise RuntimeError(f"{self.name} did not start; last lines of {self.log_path}:"
                           f"\n{self.tail()}")

    def _start_once(self) -> bool:
        with open(self.log_path, "ab") as log:
            self._proc = spawn(self.args(), env=self.env(), stdout=log, stderr=log)
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if exit_status(self._proc) is not None:
                    self.stop()
                    return False
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.2)  # poll interval while it loads
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {self.startup_timeout}s; "
                           f"last lines of {self.log_path}:\n{self.tail()}")

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc, timeout=10.0)
            self._proc = None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class TransformersServe(ServerProcess):
    """`transformers serve --continuous-batching` on 127.0.0.1, one checkpoint, CPU, float32
    unless `dtype` says otherwise (the model is loaded before the server listens)."""

    name = "transformers serve"

    def __init__(self, model_path: str, log_path: Path, threads: int = 0,
                 startup_timeout: float = 300.0, dtype: str = "float32") -> None:
        super().__init__(log_path, startup_timeout)
        self.model_path = model_path
        self.threads = threads
        self.dtype = dtype

    def args(self) -> list[str]:
        return [sys.executable, "-m", "transformers.cli.transformers", "serve",
                self.model_path, "--continuous-batching", "--device", "cpu",
                "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "warning"]

    def env(self) -> dict[str, str]:
        env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}
        if self.threads:  # torch takes its intra-op thread count from OpenMP's
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env
