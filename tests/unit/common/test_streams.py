"""BatchedStream against a fake call: coalescing, backpressure, reconnection."""

import asyncio

from meshlm.common.channels import MessageTooLarge
from meshlm.common.streams import BatchedStream


class FakeCall:
    """The write-side API of a grpc.aio client-streaming call, recording what it receives."""

    def __init__(self, peer: "FakePeer", fail: bool) -> None:
        self.peer, self.fail = peer, fail
        self.ended = asyncio.get_running_loop().create_future()

    async def write(self, batch) -> None:
        if self.ended.done():
            await self.ended
        self.peer.batches.append(batch)
        if self.fail and len(self.peer.batches) >= self.peer.fail_after:
            import grpc

            self.ended.set_exception(
                grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "boom"))

    def cancel(self) -> None:
        if not self.ended.done():
            self.ended.cancel()

    def __await__(self):
        return self.ended.__await__()


class FakePeer:
    def __init__(self, fail_after: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_after = fail_after
        self.calls = 0

    def open(self):
        self.calls += 1
        return FakeCall(self, fail=self.fail_after is not None and self.calls == 1)


async def _until(predicate, timeout=5.0):
    async def loop():
        while not predicate():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(loop(), timeout)


async def test_items_queued_together_leave_as_one_message():
    peer = FakePeer()
    stream = BatchedStream("t", "peer", peer.open, list)
    await stream.put([1, 2, 3])
    await stream.put([4])
    stream.start()
    await _until(lambda: sum(len(b) for b in peer.batches) == 4)
    assert peer.batches == [[1, 2, 3, 4]]
    await stream.close()


async def test_put_waits_when_full():
    peer = FakePeer()
    stream = BatchedStream("t", "peer", peer.open, list, capacity=2)
    await stream.put([1, 2])
    blocked = asyncio.create_task(stream.put([3]))
    for _ in range(10):
        await asyncio.sleep(0)  # let the put run as far as it can
    assert not blocked.done()
    stream.start()
    await asyncio.wait_for(blocked, 5)
    await _until(lambda: sum(len(b) for b in peer.batches) == 3)
    await stream.close()


async def test_weighed_items_count_by_weight_against_capacity_and_max_batch():
    """A weighed item (the detokenizer's run of a step's entries) counts what it carries: the
    queue fills by weight, and a batch takes items up to max_batch in weight (one at least)."""
    peer = FakePeer()
    stream = BatchedStream("t", "peer", peer.open, list, capacity=10, max_batch=6,
                           weight=len)
    await stream.put([[1] * 4, [2] * 5])
    assert stream.queued == 9
    await stream.put([[3]])  # 9 < 10: room
    blocked = asyncio.create_task(stream.put([[4] * 7]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not blocked.done() and stream.queued == 10
    stream.start()
    await asyncio.wait_for(blocked, 5)
    await _until(lambda: sum(len(b) for b in peer.batches) == 4)
    # Within 6 in weight each, in order; the 7 goes alone.
    assert [[len(i) for i in b] for b in peer.batches] == [[4], [5, 1], [7]]
    assert stream.queued == 0
    await stream.close()


class NowaitCall(FakeCall):
    """A call that can take a message at once (as the native client's), until `full`."""

    full = False

    def write_nowait(self, batch) -> bool:
        if self.full or self.ended.done():
            return False
        self.peer.batches.append(("now", batch))
        return True


class NowaitPeer(FakePeer):
    def open(self):
        self.calls += 1
        self.call = NowaitCall(self, fail=False)
        return self.call


async def test_write_through_sends_a_put_at_once_while_the_sender_is_idle():
    """With write_through, a put that finds the sender idle is its own message, written by
    the put itself; one the call cannot take at once is queued, and the sender sends it and
    what follows, in order."""
    peer = NowaitPeer()
    stream = BatchedStream("t", "peer", peer.open, list, write_through=True)
    stream.start()
    await _until(lambda: stream._idle)
    await stream.put([1, 2])
    stream.put_nowait([3])
    assert peer.batches == [("now", [1, 2]), ("now", [3])] and stream.messages_sent == 2
    peer.call.full = True
    await stream.put([4])
    stream.put_nowait([5])  # queued behind 4, not written ahead of it
    await _until(lambda: sum(len(b) for b in peer.batches if isinstance(b, list)) == 2)
    assert peer.batches[2:] in ([[4, 5]], [[4], [5]])
    peer.call.full = False
    await _until(lambda: stream._idle)
    await stream.put([6])
    assert peer.batches[-1] == ("now", [6])
    await stream.close()


async def test_quiet_write_through_sends_a_lone_put_at_once_and_gathers_a_burst():
    """With `quiet`, only a put that comes that long after the one before is written at once;
    puts close together wait for the sender, which sends them as one message."""
    peer = NowaitPeer()
    stream = BatchedStream("t", "peer", peer.open, list, write_through=True, quiet=60.0)
    stream.start()
    await _until(lambda: stream._idle)
    stream.put_nowait([1])  # the first: nothing came before it
    stream.put_nowait([2])
    stream.put_nowait([3])
    assert peer.batches == [("now", [1])]
    await _until(lambda: len(peer.batches) == 2)
    assert peer.batches[1] == [2, 3]
    await _until(lambda: stream._idle)
    stream._last_put -= 120.0  # as if two quiet minutes had passed
    stream.put_nowait([4])
    assert peer.batches[2] == ("now", [4])
    await stream.close()


async def test_without_write_through_puts_wait_for_the_sender():
    peer = NowaitPeer()
    stream = BatchedStream("t", "peer", peer.open, list)
    stream.start()
    await _until(lambda: stream._idle)
    await stream.put([1])
    assert peer.batches == []
    await _until(lambda: peer.batches == [[1]])
    await stream.close()


async def test_reconnects_and_keeps_sending_after_failure():
    peer = FakePeer(fail_after=1)
    stream = BatchedStream("t", "peer", peer.open, list)
    stream.start()
    await stream.put([1])
    await _until(lambda: peer.calls >= 2)
    await stream.put([2])
    await _until(lambda: [2] in peer.batches)
    assert peer.batches[0] == [1]
    await stream.close()


async def test_items_queued_when_the_call_fails_are_dropped_not_replayed():
    """A restarted peer must not receive work whose owners gave up when it died."""
    peer = FakePeer(fail_after=1)
    stream = BatchedStream("t", "peer", peer.open, list, max_batch=1)
    await stream.put([1, 2, 3])  # 1 is written, then the call fails with 2 and 3 queued
    stream.start()
    await _until(lambda: peer.calls >= 2)
    await stream.put([4])
    await _until(lambda: [4] in peer.batches)
    assert peer.batches == [[1], [4]]
    await stream.close()


async def test_an_unexpected_error_in_one_call_does_not_end_the_stream():
    """A bug in one batch (or in waiting for the channel) is logged; the stream reconnects and
    what is put later is sent: a stream whose task died would queue for ever."""
    peer = FakePeer()
    failures = {"batch": 1, "ready": 1}

    def make_batch(items: list[int]) -> list[int]:
        if failures["batch"]:
            failures["batch"] -= 1
            raise ValueError("cannot build this batch")
        return list(items)

    async def ready() -> None:
        if failures["ready"]:
            failures["ready"] -= 1
            raise RuntimeError("channel closed")

    stream = BatchedStream("t", "peer", peer.open, make_batch, ready=ready)
    stream.start()
    await _until(lambda: peer.calls == 1)  # the first wait for the channel failed
    await stream.put([1])  # its batch fails: dropped with its call
    await _until(lambda: peer.calls == 2)
    await stream.put([2])
    await _until(lambda: [2] in peer.batches)
    assert peer.batches == [[2]]
    await stream.close()


async def test_items_put_while_the_peer_is_down_reach_it_when_it_is_back():
    """Over real gRPC: after the peer goes away the stream opens no call until the channel is
    READY again, and what was put meanwhile is delivered to the restarted peer."""
    import grpc

    from meshlm.common.channels import CHANNEL_OPTIONS
    from meshlm.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc

    received: list[str] = []
    got = asyncio.Event()

    class Detokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
        async def Push(self, request_iterator, context):  # noqa: N802 - gRPC method name
            async for batch in request_iterator:
                received.extend(o.rid for o in batch.outputs)
                got.set()
            return common_pb2.Empty()

    async def serve(port: int) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(Detokenizer(), server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, bound

    server, port = await serve(0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    stream = BatchedStream("t", "peer", detokenizer_pb2_grpc.DetokenizerStub(channel).Push,
                           lambda items: detokenizer_pb2.TokenBatch(outputs=items),
                           ready=channel.channel_ready)
    stream.start()
    try:
        await stream.put([detokenizer_pb2.TokenOutput(rid="before")])
        await asyncio.wait_for(got.wait(), 10)
        await server.stop(None)
        await _until(lambda: not stream.connected, timeout=10)
        await stream.put([detokenizer_pb2.TokenOutput(rid="while-down")])
        # The peer stays down until the channel has tried it and failed: a call opened now
        # would fail, and what it held would be dropped.
        await _until(lambda: channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     timeout=10)
        server, _ = await serve(port)
        # Back, but the channel may wait out its reconnect backoff: a call opened now would
        # fail at once and drop this too (the requests behind it would hang).
        await stream.put([detokenizer_pb2.TokenOutput(rid="after-up")])
        await _until(lambda: "after-up" in received, timeout=10)
        assert received == ["before", "while-down", "after-up"]
    finally:
        await stream.close()
        await channel.close()
        await server.stop(None)


async def test_on_lost_hears_of_each_failed_call_and_what_it_queues_goes_on_the_next():
    """The detokenizer's stream to a gateway ends that gateway's requests when a call fails;
    what it queues then (their final errors) leaves on the next call."""
    peer = FakePeer(fail_after=1)
    lost: list[str] = []

    def on_lost(address: str) -> None:
        lost.append(address)
        stream.put_nowait([99])

    stream = BatchedStream("t", "gw:1", peer.open, list, max_batch=1, on_lost=on_lost)
    await stream.put([1, 2])
    stream.start()
    await _until(lambda: [99] in peer.batches)
    assert lost == ["gw:1"] and peer.batches == [[1], [99]]
    await stream.close()


async def test_a_failing_on_lost_does_not_stop_the_stream():
    peer = FakePeer(fail_after=1)

    def on_lost(address: str) -> None:
        raise RuntimeError("bug in a callback")

    stream = BatchedStream("t", "gw:1", peer.open, list, on_lost=on_lost)
    await stream.put([1])
    stream.start()
    await _until(lambda: peer.calls >= 2)
    await stream.put([2])
    await _until(lambda: [2] in peer.batches)
    await stream.close()


class SizedCall(FakeCall):
    """Refuses, as the native client does, a batch over `limit` items' worth of bytes."""

    limit = 3

    async def write(self, batch) -> None:
        if sum(batch) > self.limit:
            raise MessageTooLarge(sum(batch))
        await super().write(batch)


class SizedPeer(FakePeer):
    def open(self):
        self.calls += 1
        return SizedCall(self, fail=False)


async def test_a_batch_over_the_message_limit_goes_in_halves_down_to_one_item():
    """Each item weighs its value in bytes: [1, 1, 1, 1, 5, 1] is over the limit of 3, so it
    goes split in halves, down to the 5 that is over it alone and handed back; the call goes
    on and later items go out."""
    peer = SizedPeer()
    refused: list[tuple[int, int]] = []
    stream = BatchedStream("t", "peer", peer.open, list,
                           on_too_large=lambda item, error: refused.append((item, error.size)))
    await stream.put([1, 1, 1, 1, 5, 1])
    stream.start()
    await _until(lambda: refused and sum(map(sum, peer.batches)) == 5)
    assert peer.batches == [[1, 1, 1], [1], [1]]  # [1, 1, 1] | [1] [5 | 1]
    assert refused == [(5, 5)]
    await stream.put([2])
    await _until(lambda: [2] in peer.batches)
    assert peer.calls == 1 and stream.connected and not stream.lost
    await stream.close()


async def test_lost_from_a_failed_call_until_the_next_one_is_open():
    peer = FakePeer(fail_after=1)
    lost_seen: list[bool] = []
    stream = BatchedStream("t", "peer", peer.open, list,
                           on_lost=lambda address: lost_seen.append(stream.lost))
    assert not stream.lost
    stream.start()
    await stream.put([1])
    await _until(lambda: lost_seen and peer.calls >= 2 and stream.connected)
    assert lost_seen == [True] and not stream.lost
    await stream.close()
