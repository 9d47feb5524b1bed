"""How often a request's tokens leave the scheduler, seen from outside. A request that does not
stream reaches the detokenizer in pieces of 50 tokens (its outputs counter says so) and its
client gets the text a streaming twin gets; with --stream-interval 4 a streaming request's
tokens leave as its first token, then four at a time (the detokenizer's counter), and every
message a client gets, over gRPC and over HTTP, ends on one of those pieces (a gateway that
is behind sends what has arrived in one message: it may join pieces, never split them)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from helpers import (
    collect_text,
    generate_events,
    own_mesh,
    scrape,
    text_request,
    total,
    wait_idle,
)

from meshlm.launch.mesh import Mesh
from sglang.runtime.v1 import sglang_pb2_grpc

PROMPT = "Once upon a time"


def test_a_request_that_does_not_stream_reaches_the_detokenizer_in_pieces(mesh, stub):
    url = f"http://{mesh.service('detokenizer').metrics_address}/metrics"

    def outputs() -> float:
        return total(scrape(url), "meshlm:detokenizer_outputs_total")

    wait_idle(mesh)  # no earlier test's tokens still on their way
    before = outputs()
    whole, [last] = collect_text(stub, text_request(PROMPT, stream=False, max_new_tokens=120,
                                                    ignore_eos=True))
    between = outputs()
    streamed, msgs = collect_text(stub, text_request(PROMPT, max_new_tokens=120, ignore_eos=True))
    after = outputs()
    assert last.meta_info["completion_tokens"] == msgs[-1].meta_info["completion_tokens"] == "120"
    assert whole == streamed
    assert between - before == 4  # its first token, 50, 50, and the last 19
    assert after - between == 120


@pytest.fixture(scope="module")
def interval_mesh(tmp_path_factory) -> Iterator[Mesh]:
    with own_mesh(tmp_path_factory.mktemp("interval"), metrics_port=0,
                  env={"MESHLM_STREAM_INTERVAL": "4"}) as m:
        yield m


def test_stream_interval_streams_the_first_token_then_four_at_a_time(interval_mesh):
    url = f"http://{interval_mesh.service('detokenizer').metrics_address}/metrics"
    pieces = [1, 5, 9, 11]  # tokens out after each of the scheduler's outputs

    def outputs() -> float:
        return total(scrape(url), "meshlm:detokenizer_outputs_total")

    def on_pieces(counts: list[int]) -> bool:
        return counts[-1] == 11 and counts == sorted(set(counts)) and set(counts) <= set(pieces)

    wait_idle(interval_mesh)
    before = outputs()
    with grpc.insecure_channel(interval_mesh.addresses.gateway_grpc) as channel:
        stub = sglang_pb2_grpc.SglangServiceStub(channel)
        text, msgs = collect_text(stub, text_request(PROMPT, max_new_tokens=11, ignore_eos=True))
    assert outputs() - before == len(pieces)
    sizes = [len(m.output_ids) for m in msgs]
    assert on_pieces([sum(sizes[:i + 1]) for i in range(len(sizes))]), sizes
    before = outputs()
    events = list(generate_events(interval_mesh.addresses.gateway_http, {
        "text": PROMPT, "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 11, "ignore_eos": True}}))
    assert outputs() - before == len(pieces)
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert on_pieces(counts), counts
    assert events[-1]["text"] == text
