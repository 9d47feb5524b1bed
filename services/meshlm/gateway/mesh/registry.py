"""The shared RID registry in Redis: who owns a request, where it runs, its state.

One hash per request, `meshlm:rid:<rid>`, with fields gateway, tokenizer, scheduler,
detokenizer, state (queued | running | finished | aborted | error), finish_reason,
created_at, updated_at (unix seconds). A live record expires after `ttl` (a gateway that died
leaves no record behind for ever); a finished one after `finished_ttl`.

The registry fails open: when Redis is unreachable, generation goes on without it (duplicate
detection across gateways is then skipped), `degraded` is set and logged once, and Redis is
probed again every `RETRY_AFTER` seconds. Nothing is lost meanwhile: the gateway keeps the
records of its live requests, and the final state of those that ended while Redis was away,
and writes them all back once Redis answers again, also after a restart that emptied it (a
new Redis `run_id`), so the registry is consistent again after reconnect. Records Redis had
already taken are its own to keep: a Redis that persists nothing loses, on restart, the final
states written before it went away (the gateway keeps no copy of what was written).

Background writes (a fresh rid's record, its state changes, its final state) leave the
request's path: they are sent at most every `FLUSH_INTERVAL`, one write per round, and the
ops of one rid within a round are merged into one write. A request shorter than the interval
then costs one write instead of three, and no Redis round trip competes with the request's
own hops while it is starting (on two cores, Redis and the gateway share a core with the
tokenizer and detokenizer: each round trip wakes Redis and costs the gateway 150-200 µs).
A round's writes go as one script (`_WRITE`, an EVAL of up to `WRITES_PER_EVAL` records):
one reply to read instead of two a record (each read by the client library cost the gateway
about as much as the rest of the round).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import typing
from itertools import chain
from typing import Any

from redis.exceptions import RedisError

from meshlm.common.logs import get_logger
from meshlm.common.redis_client import NO_AUTH, RedisAuth

log = get_logger(__name__)

KEY_PREFIX = "meshlm:rid:"
RETRY_AFTER = 2.0  # seconds without Redis after a failure
PROBE_EVERY = 1.0  # seconds between checks that Redis is there and is the same server
MAX_UNSENT = 100_000  # final states kept for Redis while it is away (oldest dropped)
FLUSH_INTERVAL = 0.05  # seconds from the first background write queued to its round
FIND_RETRIES = (0.03, 0.07, 0.15, 0.25)  # seconds between lookups of a rid not yet found
WRITES_PER_EVAL = 1000  # records one script writes (a resync's thousands go as several)

# A queued write: (rid, fields to set, the record's new TTL: None for the live TTL, a final
# state has one). A fresh rid's whole record is written so too: it cannot clash.
Op = tuple[str, dict[str, str], int | None]

# Create only if absent; set fields and TTL atomically. ARGV = ttl, field, value, ...
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


# A round's writes: for each key, HSET its fields and EXPIRE it. ARGV, key by key: the number
# of fields, the TTL, then field, value, ... Every write is tried; the first error is the
# reply (the round is then kept as unwritten, and written again: the writes are idempotent).
_WRITE = """
local at, failed = 1, nil
for _, k in ipairs(KEYS) do
  local n = tonumber(ARGV[at])
  local reply = redis.pcall('HSET', k, unpack(ARGV, at + 2, at + 1 + 2 * n))
  if type(reply) == 'table' and reply.err then failed = failed or reply.err end
  reply = redis.pcall('EXPIRE', k, ARGV[at + 1])
  if type(reply) == 'table' and reply.err then failed = failed or reply.err end
  at = at + 2 + 2 * n
end
if failed then return redis.error_reply(failed) end
return #KEYS
"""


def key(rid: str) -> str:
    return KEY_PREFIX + rid


def command(*args: str | int) -> bytes:
    """One Redis command as the server reads it (RESP: an array of bulk strings, UTF-8). A
    round's commands are packed so, not by the client library: its packing costs the gateway
    about 60 µs per request (a record's HSET has a dozen arguments), this a tenth of that."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def coalesce(ops: list[Op]) -> list[Op]:
    """One write per rid, in the order the rids first appear, with the effect of its ops in
    turn: the fields of later ops over earlier ones, and the last op's TTL."""
    merged: dict[str, Op] = {}
    for rid, data, ttl in ops:
        before = merged.get(rid)
        merged[rid] = (rid, data if before is None else {**before[1], **data}, ttl)
    return list(merged.values())


class RidRegistry:
    def __init__(self, url: str, ttl: float, finished_ttl: float,
                 auth: RedisAuth = NO_AUTH, flush_interval: float = FLUSH_INTERVAL) -> None:
        self._redis = auth.connect(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._create = self._redis.register_script(_CREATE)
        self.ttl = max(1, int(ttl))
        self.finished_ttl = max(1, int(finished_ttl))
        self.flush_interval = flush_interval
        self.degraded = False
        self._retry_at = 0.0
        self._queue: list[Op] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._busy = False
        # What Redis should hold of this gateway's requests: live records (until their final
        # state is written) and final states not written yet.
        self._live: dict[str, dict[str, str]] = {}
        self._unsent: dict[str, tuple[dict[str, str], int]] = {}
        self._run_id: str | None = None

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="registry-writer")
        self._prober = asyncio.create_task(self._probe_loop(), name="registry-prober")

    def _available(self) -> bool:
        return not self.degraded or time.monotonic() >= self._retry_at

    def _failed(self, op: str, exc: Exception) -> None:
        """Redis did not answer `op` (call it in the `except` that caught `exc`). Any other
        error is logged with its traceback, and handled the same: the registry fails open,
        and its background tasks must outlive whatever one call raised."""
        if not isinstance(exc, (RedisError, OSError)):
            log.exception("registry_unexpected_error", op=op)
        if not self.degraded:
            log.warning("registry_degraded", op=op, error=repr(exc))
        self.degraded = True
        self._retry_at = time.monotonic() + RETRY_AFTER

    def _ok(self) -> None:
        if self.degraded:
            log.info("registry_recovered", live=len(self._live), unsent=len(self._unsent))
            self._resync()
        self.degraded = False

    def _record(self, rid: str, fields: dict[str, Any]) -> dict[str, str]:
        now = time.time()
        record = {k: str(v) for k, v in {**fields, "state": "queued", "created_at": now,
                                         "updated_at": now}.items()}
        self._live[rid] = record
        return record

    def _resync(self) -> None:
        """Queue the whole of what Redis should hold of this gateway's requests."""
        for rid, record in self._live.items():
            self._queue.append((rid, record, None))
        for rid, (record, ttl) in self._unsent.items():
            self._queue.append((rid, record, ttl))
        self._wake.set()

    def _unwritten(self, ops: list[Op]) -> None:
        """Keep the final states among ops that did not reach Redis (live records are in
        `_live` anyway)."""
        for rid, data, ttl in ops:
            if ttl is not None:
                self._unsent[rid] = (data, ttl)
        while len(self._unsent) > MAX_UNSENT:
            del self._unsent[next(iter(self._unsent))]

    async def _probe_loop(self) -> None:
        """Notice Redis coming back, or coming back empty (restarted between two writes)."""
        while True:
            await asyncio.sleep(PROBE_EVERY)  # the probing period, not synchronisation
            if not self._available():
                continue
            try:
                run_id = (await self._redis.info("server")).get("run_id")
            except Exception as exc:  # noqa: BLE001 - _failed tells them apart
                self._failed("probe", exc)
                continue
            if self._run_id is not None and run_id != self._run_id and not self.degraded:
                log.warning("registry_restarted", live=len(self._live))
                self._resync()
            self._run_id = run_id
            self._ok()

    async def create(self, rid: str, fields: dict[str, Any]) -> bool:
        """Record a new request now; False when the rid is already taken (fail-open: True)."""
        record = self._record(rid, fields)
        if not self._available():
            return True
        try:
            args: list[Any] = [self.ttl, *(x for kv in record.items() for x in kv)]
            created = await self._create(keys=[key(rid)], args=args)
        except Exception as exc:  # noqa: BLE001 - _failed tells them apart
            self._failed("create", exc)
            return True
        self._ok()
        if not created:
            del self._live[rid]  # another request's rid: not ours to keep
        return bool(created)

    def create_later(self, rid: str, fields: dict[str, Any]) -> None:
        """Record a request whose rid cannot clash (a fresh random one), off the request's path."""
        self._queue.append((rid, self._record(rid, fields), None))
        self._wake.set()

    def update(self, rid: str, **fields: Any) -> None:
        """Set fields in the background (off the request's path)."""
        record = self._live.get(rid)
        if record is not None:
            record.update((k, str(v)) for k, v in fields.items())
        self._queue.append((rid, {k: str(v) for k, v in fields.items()}, None))
        self._wake.set()

    def finish(self, rid: str, state: str, **fields: Any) -> None:
        """Mark the request ended; its record then expires after finished_ttl."""
        record = {**self._live.pop(rid, {}), "state": state,
                  **{k: str(v) for k, v in fields.items()}}
        self._queue.append((rid, record, self.finished_ttl))
        self._wake.set()

    async def _write_loop(self) -> None:
        """Background writes, in order, many per round trip (one write of every command per
        round, a round at most every `flush_interval`). EVAL with the script's text, not
        EVALSHA: a script known only by its hash would first need to be known to Redis, a
        second round trip after each restart."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.flush_interval)  # gather the round's writes
            self._wake.clear()
            ops, self._queue = self._queue, []
            if not ops:
                continue
            if not self._available():
                self._unwritten(ops)
                continue
            self._busy = True
            try:
                await self._send(self._writes(coalesce(ops)))
            except Exception as exc:  # noqa: BLE001 - _failed tells them apart
                self._failed("write", exc)
                self._unwritten(ops)
                continue
            finally:
                self._busy = False
            for rid, _, ttl in ops:
                if ttl is not None:
                    self._unsent.pop(rid, None)
            self._ok()

    def _writes(self, ops: list[Op]) -> list[bytes]:
        """The EVALs of `_WRITE` that write `ops` (one per rid), `WRITES_PER_EVAL` at most
        each."""
        now = str(time.time())
        commands = []
        for start in range(0, len(ops), WRITES_PER_EVAL):
            keys: list[str] = []
            args: list[str | int] = []
            for rid, data, ttl in ops[start:start + WRITES_PER_EVAL]:
                fields = {**data, "updated_at": now}
                keys.append(key(rid))
                args += (len(fields), self.ttl if ttl is None else ttl,
                         *chain.from_iterable(fields.items()))
            commands.append(command("EVAL", _WRITE, len(keys), *keys, *args))
        return commands

    async def _send(self, commands: list[bytes]) -> None:
        """Send packed `commands` in one write and read their replies; an error reply (or
        any failure) raises, and the connection, its replies unread, is dropped."""
        pool = self._redis.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(b"".join(commands))
            for _ in commands:
                await connection.read_response()
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)

    async def get(self, rid: str) -> dict[str, str] | None:
        if not self._available():
            return None
        try:
            record = typing.cast(dict[str, str], await self._redis.hgetall(key(rid)))
        except Exception as exc:  # noqa: BLE001 - _failed tells them apart
            self._failed("get", exc)
            return None
        self._ok()
        return record or None

    async def find(self, rid: str) -> dict[str, str] | None:
        """A record another gateway may have just queued: any gateway's writer sends a fresh
        rid's record about `FLUSH_INTERVAL` after the request left, later on a busy host, so
        a rid not found is looked up again at growing intervals (`FIND_RETRIES`, about half a
        second in all) before it is taken as unknown."""
        record = await self.get(rid)
        for delay in FIND_RETRIES:
            if record is not None or self.degraded:
                break
            await asyncio.sleep(delay)  # a writer's round on a loaded host, not synchronisation
            record = await self.get(rid)
        return record

    async def flush(self) -> None:
        """Wait until the background writes queued so far have been sent (tests, shutdown)."""
        while (self._queue or self._busy) and self._writer is not None and not self._writer.done():
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.flush(), 2.0)
        for task in (self._writer, self._prober):
            if task is not None:
                task.cancel()
        await self._redis.aclose()
