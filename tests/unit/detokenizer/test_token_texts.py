"""Logprobs through the detokenizer: passed on with the token ids they belong to, token texts
added (batched, cached) when asked, dropped with their tokens after a stop string."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

from meshlm.common.default_model import build_tokenizer
from meshlm.detokenizer.server import DetokenizerServicer
from meshlm.detokenizer.token_texts import TokenTexts
from meshlm.tokenizer.tokenization import TextTokenizer
from meshlm.v1 import common_pb2, detokenizer_pb2, gateway_pb2


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer().to_str())


def _ids(text: str) -> list[int]:
    return list(_tokenizer().encode(text, add_special_tokens=False).ids)


def _servicer() -> DetokenizerServicer:
    tok = TextTokenizer(_tokenizer(), model_path=Path("."), max_model_len=2048)
    return DetokenizerServicer(tok, None, None)  # type: ignore[arg-type]  # no I/O here


def _lp(n: int, top: int = 0) -> common_pb2.Logprobs:
    """Logprobs for n tokens, each with `top` alternatives (ids 10, 11, ...)."""
    return common_pb2.Logprobs(
        output_logprobs=[-0.5 * (i + 1) for i in range(n)],
        output_top=[common_pb2.TopLogprobs(token_ids=list(range(10, 10 + top)),
                                           logprobs=[-1.0 - j for j in range(top)])
                    for _ in range(n)],
    )


def _output(rid: str, ids: list[int], *, header: bool = False, texts: bool = False,
            stop: tuple[str, ...] = (), logprobs: common_pb2.Logprobs | None = None,
            finished: bool = False) -> detokenizer_pb2.TokenOutput:
    out = detokenizer_pb2.TokenOutput(rid=rid, token_ids=ids, finished=finished,
                                      finish_reason="length" if finished else "")
    if header:
        meta = out.header.meta
        meta.route.gateway = "gw"
        meta.route.scheduler = "s"
        meta.return_text = True
        meta.sampling.skip_special_tokens = True
        meta.sampling.stop.extend(stop)
        meta.sampling.return_text_in_logprobs = texts
    if logprobs is not None:
        out.logprobs.CopyFrom(logprobs)
    return out


def _run(servicer: DetokenizerServicer, *outputs: detokenizer_pb2.TokenOutput
         ) -> list[gateway_pb2.TextOutput]:
    by_gateway, _ = servicer.decode_batch(detokenizer_pb2.TokenBatch(outputs=outputs))
    return by_gateway.get("gw", [])


def test_logprobs_pass_through_without_texts() -> None:
    s = _servicer()
    ids = _ids(" up on")
    (out,) = _run(s, _output("a", ids, header=True, logprobs=_lp(len(ids), top=2)))
    assert list(out.token_ids) == ids
    assert list(out.logprobs.output_logprobs) == [-0.5, -1.0]
    assert [list(t.token_ids) for t in out.logprobs.output_top] == [[10, 11], [10, 11]]
    assert not out.logprobs.output_texts and not out.logprobs.output_top[0].texts
    # An output without logprobs stays without them.
    (plain,) = _run(s, _output("b", ids, header=True))
    assert not plain.HasField("logprobs")


def test_texts_are_added_for_every_entry_when_asked() -> None:
    s = _servicer()
    tok = _tokenizer()
    ids = _ids("Once upon")
    prompt = _ids(" a time")
    lp = _lp(len(ids), top=3)
    lp.input_start = 0
    lp.input_token_ids.extend(prompt)
    lp.input_logprobs.extend([float("nan"), -2.0])
    lp.input_top.extend([common_pb2.TopLogprobs(),
                         common_pb2.TopLogprobs(token_ids=[2], logprobs=[-0.1])])
    out = _run(s, _output("a", ids, header=True, texts=True, logprobs=lp),
               _output("b", ids, header=True, logprobs=_lp(len(ids), top=1)))[0]

    def one(i: int) -> str:
        return tok.decode([i], skip_special_tokens=False)

    got = out.logprobs
    assert list(got.output_texts) == [one(i) for i in ids]
    assert list(got.input_texts) == [" a", " time"]
    assert [list(t.texts) for t in got.output_top] == [[one(10), one(11), one(12)]] * len(ids)
    assert [list(t.texts) for t in got.input_top] == [[], ["<|im_start|>"]]  # specials kept


def test_texts_of_the_asked_ids_too() -> None:
    """token_ids_logprob's entries, at output and prompt positions, get their texts."""
    lp = common_pb2.Logprobs(
        input_start=0, input_token_ids=_ids(" a time"), input_logprobs=[float("nan"), -2.0],
        input_token_ids_logprobs=[common_pb2.TopLogprobs(),
                                  common_pb2.TopLogprobs(token_ids=[10], logprobs=[-3.0])],
        output_token_ids_logprobs=[common_pb2.TopLogprobs(token_ids=[11, 10],
                                                          logprobs=[-1.0, -3.0])])
    (out,) = _run(_servicer(), _output("a", [], header=True, texts=True, logprobs=lp,
                                       finished=True))

    def one(i: int) -> str:
        return _tokenizer().decode([i], skip_special_tokens=False)

    got = out.logprobs
    assert [list(t.texts) for t in got.output_token_ids_logprobs] == [[one(11), one(10)]]
    assert [list(t.texts) for t in got.input_token_ids_logprobs] == [[], [one(10)]]
    assert not got.output_texts and list(got.input_texts) == [" a", " time"]


def test_texts_only_for_requests_that_asked() -> None:
    s = _servicer()
    ids = _ids("Once")
    outs = _run(s, _output("a", ids, header=True, texts=True, logprobs=_lp(len(ids))),
                _output("b", ids, header=True, logprobs=_lp(len(ids))))
    assert [len(o.logprobs.output_texts) for o in outs] == [len(ids), 0]


def test_logprobs_ride_with_their_tokens_while_text_is_held_back() -> None:
    s = _servicer()
    first, second = _ids(" a"), _ids(" k")
    # " k" could start the stop string " king": its text is held, its ids and logprobs are not.
    _run(s, _output("a", first, header=True, stop=(" king",), logprobs=_lp(1)))
    (b,) = _run(s, _output("a", second, logprobs=_lp(1)))
    assert b.text == "" and list(b.token_ids) == second
    assert len(b.logprobs.output_logprobs) == 1


def test_a_stop_string_drops_later_tokens_and_their_logprobs_together() -> None:
    s = _servicer()
    ids = _ids(" was a king")  # " was", " a", " k", "ing"
    _run(s, _output("a", ids[:1], header=True, texts=True, stop=(" a k",), logprobs=_lp(1)))
    (stopped,) = _run(s, _output("a", ids[1:3], logprobs=_lp(2, top=1)))
    assert stopped.finished and stopped.finish_reason == "stop"
    assert len(stopped.logprobs.output_logprobs) == len(stopped.token_ids) == 2
    assert len(stopped.logprobs.output_texts) == 2
    # The scheduler's next step for it (before the stop reached it) is dropped whole.
    assert _run(s, _output("a", ids[3:], logprobs=_lp(1), finished=True)) == []


def test_token_texts_decode_each_unseen_id_once_per_batch() -> None:
    calls: list[list[list[int]]] = []

    class Counting:
        def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
            calls.append(seqs)
            return _tokenizer().decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    texts = TokenTexts(Counting())  # type: ignore[arg-type]
    a, b = _lp(2, top=2), _lp(1, top=2)
    texts.fill([([51, 82], a), ([51], b)])
    assert len(calls) == 1 and sorted(i for (i,) in calls[0]) == [10, 11, 51, 82]
    assert list(a.output_texts) == ["O", "n"] and list(b.output_texts) == ["O"]
    texts.fill([([82], _lp(1, top=1))])
    assert len(calls) == 1  # all cached
