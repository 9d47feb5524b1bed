"""Packed batches (common/packed.py): the scheduler's and the detokenizer's batches carry a
running request's new ids, counts and text as parallel arrays, the rest whole, and the receiver
reads them back in the order they were made; a batch whose arrays disagree is refused by name.
Then the two receivers: the detokenizer decodes packed items (and turns one that matches a stop
string into a whole, finished output), and the gateway's mailbox takes them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

from meshlm.common.default_model import build_tokenizer
from meshlm.common.errors import MeshError
from meshlm.common.packed import packer, unpack
from meshlm.detokenizer.server import DetokenizerServicer
from meshlm.gateway.mesh.inbox import PendingRequest
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.v1 import common_pb2, detokenizer_pb2, gateway_pb2


def _wire(batch: Any) -> Any:
    """`batch` as its receiver gets it: serialized and parsed."""
    return type(batch).FromString(batch.SerializeToString())


def _to_gateway(items: list[Any]) -> list[Any]:
    """The detokenizer's items for one gateway as that gateway reads them: in one TextBatch,
    a run's entries as Plain tuples."""
    batch = _wire(packer(gateway_pb2.TextBatch, texts=True)(items))
    return _as_tuples(unpack(batch.outputs, batch.packed))


def _as_tuples(items: list[Any]) -> list[Any]:
    return [(i[0], list(i[1]), *i[2:]) if isinstance(i, tuple) else i for i in items]


def test_items_come_back_in_the_order_they_were_put() -> None:
    first = detokenizer_pb2.TokenOutput(rid="a", token_ids=[1], header={"prompt_tokens": 3})
    last = detokenizer_pb2.TokenOutput(rid="b", token_ids=[9], finished=True,
                                       finish_reason="length")
    items: list[Any] = [
        first,
        ("b", [4, 5], 7, 2, 1, ""),
        detokenizer_pb2.TokenOutput(rid="c", token_ids=[6]),
        detokenizer_pb2.TokenOutput(rid="d", token_ids=[]),
        ("a", [], 3, 1, 0, ""),  # a step with no new id
        ("c", [7], 5, 2, 0, ""),
        last,
    ]
    batch = _wire(packer(detokenizer_pb2.TokenBatch)(items))
    assert len(batch.outputs) == 4 and list(batch.packed.rids) == ["b", "a", "c"]
    assert list(batch.packed.outputs_at) == [0, 1, 1, 3] and not batch.packed.texts
    assert _as_tuples(list(unpack(batch.outputs, batch.packed))) == items


def test_runs_merge_with_tuples_and_whole_outputs_in_order() -> None:
    """Runs (entries already packed, as the detokenizer passes a step on) go into the batch as
    they are, between the tuples and whole outputs queued around them."""
    def run(*entries: Any) -> common_pb2.PackedOutputs:
        return _wire(packer(gateway_pb2.TextBatch, texts=True)(list(entries))).packed

    whole = gateway_pb2.TextOutput(rid="w", text="!", finished=True)
    items: list[Any] = [
        ("a", [1], 3, 1, 0, "x"),
        run(("b", [2], 4, 1, 0, "y"), ("c", [3, 4], 5, 2, 1, "zz")),
        whole,
        run(("d", [5], 6, 1, 0, "")),
        ("e", [6], 7, 1, 0, "q"),
    ]
    batch = _wire(packer(gateway_pb2.TextBatch, texts=True)(items))
    assert list(batch.packed.outputs_at) == [3]
    assert _as_tuples(unpack(batch.outputs, batch.packed)) == [
        ("a", [1], 3, 1, 0, "x"), ("b", [2], 4, 1, 0, "y"), ("c", [3, 4], 5, 2, 1, "zz"),
        whole, ("d", [5], 6, 1, 0, ""), ("e", [6], 7, 1, 0, "q")]
    alone = run(("b", [2], 4, 1, 0, "y"))
    assert packer(gateway_pb2.TextBatch, texts=True)([alone]).packed == alone


def test_texts_travel_on_the_detokenizers_hop_only() -> None:
    items = [("a", [1], 2, 1, 0, "hel"), ("b", [2, 3], 2, 2, 0, "")]
    text_batch = _wire(packer(gateway_pb2.TextBatch, texts=True)(items))
    assert _as_tuples(list(unpack(text_batch.outputs, text_batch.packed))) == items
    token_batch = _wire(packer(detokenizer_pb2.TokenBatch)(items))
    assert [i[5] for i in unpack(token_batch.outputs, token_batch.packed)] == ["", ""]


def test_a_batch_of_whole_outputs_has_no_packed_part() -> None:
    """What a sender that packs nothing (or an older one) sends reads the same."""
    outputs = [gateway_pb2.TextOutput(rid="a", text="x"), gateway_pb2.TextOutput(rid="b")]
    batch = _wire(packer(gateway_pb2.TextBatch, texts=True)(outputs))
    assert not batch.HasField("packed")
    assert list(unpack(batch.outputs, batch.packed)) == outputs


@pytest.mark.parametrize(("packed", "whole", "problem"), [
    ({"rids": ["a", "b"], "token_counts": [1], "token_ids": [1], "prompt_tokens": [1, 1],
      "completion_tokens": [1, 1], "cached_tokens": [0, 0]}, 0, "differ in length"),
    ({"rids": ["a"], "token_counts": [1], "token_ids": [1], "prompt_tokens": [1],
      "completion_tokens": [1], "cached_tokens": [0], "texts": ["x", "y"]}, 0,
     "differ in length"),
    ({"rids": ["a"], "token_counts": [2], "token_ids": [1], "prompt_tokens": [1],
      "completion_tokens": [1], "cached_tokens": [0]}, 0, "do not add up"),
    ({"rids": ["a", "b"], "token_counts": [-1, 2], "token_ids": [1], "prompt_tokens": [1, 1],
      "completion_tokens": [1, 1], "cached_tokens": [0, 0]}, 0, "do not add up"),
    ({"rids": ["a"], "token_counts": [1], "token_ids": [1], "prompt_tokens": [1],
      "completion_tokens": [1], "cached_tokens": [0], "outputs_at": [0]}, 2, "outputs_at"),
    ({"rids": ["a"], "token_counts": [1], "token_ids": [1], "prompt_tokens": [1],
      "completion_tokens": [1], "cached_tokens": [0], "outputs_at": [1, 0]}, 2, "outputs_at"),
    ({"rids": ["a"], "token_counts": [1], "token_ids": [1], "prompt_tokens": [1],
      "completion_tokens": [1], "cached_tokens": [0], "outputs_at": [2]}, 1, "outputs_at"),
])
def test_a_batch_whose_arrays_disagree_is_invalid_argument(packed: dict[str, Any], whole: int,
                                                           problem: str) -> None:
    batch = detokenizer_pb2.TokenBatch(
        outputs=[detokenizer_pb2.TokenOutput(rid=f"w{i}") for i in range(whole)],
        packed=common_pb2.PackedOutputs(**packed))
    with pytest.raises(MeshError, match=f"malformed packed outputs: .*{problem}") as caught:
        list(unpack(batch.outputs, batch.packed))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer().to_str())


def _header_output(rid: str, ids: list[int], stop: tuple[str, ...] = (),
                   return_text: bool = True) -> detokenizer_pb2.TokenOutput:
    out = detokenizer_pb2.TokenOutput(rid=rid, token_ids=ids, prompt_tokens=4,
                                      completion_tokens=len(ids))
    meta = out.header.meta
    meta.route.gateway, meta.route.scheduler = "gw", "s"
    meta.return_text = return_text
    meta.sampling.stop.extend(stop)
    return out


def test_the_detokenizer_packs_running_text_and_ends_a_stop_match_whole() -> None:
    tok = TextTokenizer(_tokenizer(), model_path=Path("."), max_model_len=2048)
    servicer = DetokenizerServicer(tok, None, None)  # type: ignore[arg-type]  # no I/O here
    ids = list(_tokenizer().encode(" the cat sat down", add_special_tokens=False).ids)
    stop_at = next(i for i in range(len(ids))  # the id that completes " sat"
                   if _tokenizer().decode(ids[:i + 1]).endswith(" sat"))
    make = packer(detokenizer_pb2.TokenBatch)
    first = make([_header_output("a", ids[:1], stop=(" sat",)),
                  _header_output("g", [5], return_text=False)])
    by_gateway, _ = servicer.decode_batch(_wire(first))
    texts = [by_gateway["gw"][0].text]
    # A running request's ids come packed; so do a token-ids-only request's.
    by_gateway, stops = servicer.decode_batch(_wire(make(
        [("a", ids[1:stop_at], 4, stop_at, 0, ""), ("g", [6], 4, 2, 0, "")])))
    (run,) = by_gateway["gw"]  # both live, for one gateway, no stop: the step's arrays
    assert isinstance(run, common_pb2.PackedOutputs)
    (a, g) = _to_gateway(by_gateway["gw"])
    assert a[:5] == ("a", ids[1:stop_at], 4, stop_at, 0) and g == ("g", [6], 4, 2, 0, "")
    texts.append(a[5])
    assert stops == {}
    # " sat" matches the stop string: that output goes whole, finished, and the scheduler is
    # told; later ids for it are dropped.
    by_gateway, stops = servicer.decode_batch(_wire(make(
        [("a", ids[stop_at:stop_at + 1], 4, stop_at + 1, 0, "")])))
    (stopped,) = by_gateway["gw"]
    assert isinstance(stopped, gateway_pb2.TextOutput) and stopped.finished
    assert (stopped.finish_reason, stopped.matched_text, stopped.completion_tokens) == (
        "stop", " sat", stop_at + 1)
    assert "".join([*texts, stopped.text]) == " the cat"  # the stop string is not output
    assert stops == {"s": ["a"]}
    by_gateway, _ = servicer.decode_batch(_wire(make([("a", ids[stop_at + 1:], 4, 9, 0, "")])))
    assert by_gateway == {}


def test_a_step_for_two_gateways_with_a_stop_and_a_stranger_goes_entry_by_entry() -> None:
    """Where a step's entries cannot pass on as one run (two gateways, a stop string matched,
    a request unknown here) each goes its own way, in order, with the text decoded once."""
    tok = TextTokenizer(_tokenizer(), model_path=Path("."), max_model_len=2048)
    servicer = DetokenizerServicer(tok, None, None)  # type: ignore[arg-type]  # no I/O here
    words = _tokenizer().encode(" red fox", add_special_tokens=False).ids
    make = packer(detokenizer_pb2.TokenBatch)
    heads = [_header_output("a", [words[0]]), _header_output("b", [words[0]]),
             _header_output("c", [words[0]], stop=(" fox",))]
    heads[1].header.meta.route.gateway = "gw2"
    servicer.decode_batch(_wire(make(heads)))
    step = make([("a", [words[1]], 4, 2, 0, ""), ("b", [words[1]], 4, 2, 0, ""),
                 ("x", [words[1]], 4, 2, 0, ""), ("c", [words[1]], 4, 2, 0, "")])
    by_gateway, stops = servicer.decode_batch(_wire(step))
    text = _tokenizer().decode(words[1:2])
    a, c = by_gateway["gw"]
    assert a == ("a", [words[1]], 4, 2, 0, text)
    assert isinstance(c, gateway_pb2.TextOutput) and c.finished and c.matched_text == " fox"
    assert by_gateway["gw2"] == [("b", [words[1]], 4, 2, 0, text)]
    assert stops == {"s": ["c"]}


def test_a_request_both_whole_and_packed_in_one_batch_keeps_its_order() -> None:
    """Steps merged into one batch can hold a request's first output (whole) and its next
    (packed): they are decoded in the order they were made."""
    tok = TextTokenizer(_tokenizer(), model_path=Path("."), max_model_len=2048)
    servicer = DetokenizerServicer(tok, None, None)  # type: ignore[arg-type]  # no I/O here
    ids = _tokenizer().encode(" one two", add_special_tokens=False).ids
    batch = packer(detokenizer_pb2.TokenBatch)(
        [_header_output("n", ids[:1]), ("n", ids[1:], 4, len(ids), 0, "")])
    by_gateway, _ = servicer.decode_batch(_wire(batch))
    first, then = _to_gateway(by_gateway["gw"])
    assert first.text + then[5] == " one two"


async def test_the_gateways_mailbox_takes_packed_and_whole_outputs_alike() -> None:
    req = PendingRequest(rid="r", tokenizer="t", scheduler="s", detokenizer="d", started_at=0.0)
    req.deliver(gateway_pb2.TextOutput(rid="r", text="a", token_ids=[1], prompt_tokens=5,
                                       completion_tokens=1, cached_tokens=2))
    req.deliver_running(("r", [2, 3], 5, 3, 2, "bc"))
    update = await req.next()
    assert (update.text, update.token_ids, update.prompt_tokens, update.completion_tokens,
            update.cached_tokens) == ("abc", [1, 2, 3], 5, 3, 2)
    req.deliver(gateway_pb2.TextOutput(rid="r", text="!", finished=True, finish_reason="length",
                                       prompt_tokens=5, completion_tokens=4, cached_tokens=2))
    req.deliver_running(("r", [9], 5, 5, 2, "late"))  # after the final: ignored
    update = await req.next()
    assert update.text == "!" and update.final is not None and req.done
