"""OpenAI's response shapes folded from gateway updates: whole replies, stream chunks (role
first, content deltas, the finish with the last text, usage), n > 1 and batch indices, chat
echo, logprobs (held until their text comes; the chosen token in each completion position),
embeddings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.openai_logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    dumps,
    prompt_logprobs,
)
from meshlm.gateway.protocol.openai_responses import (
    ChatAnswer,
    CompletionAnswer,
    embedding_body,
    parent_rid,
)
from meshlm.v1 import common_pb2, gateway_pb2


def _update(text: str, ids: list[int], *, done: str | None = None, completion: int = 0,
            prompt: int = 4, cached: int = 0, logprobs: common_pb2.Logprobs | None = None
            ) -> Update:
    final = gateway_pb2.TextOutput(finished=True, finish_reason=done) if done else None
    return Update(text=text, token_ids=ids, final=final, error=None, prompt_tokens=prompt,
                  completion_tokens=completion, cached_tokens=cached, logprobs=logprobs)


def _json(value: Any) -> Any:
    return orjson.loads(dumps(value))  # float32 values as the client reads them


def _answer(cls: Any = ChatAnswer, **kwargs: Any) -> Any:
    options = {"model": "m", "created": 7, "n": 1, "prompts": 1, "stream": False,
               "include_usage": False, "top_logprobs": None, **kwargs}
    return cls(**options)


def test_parent_rid() -> None:
    assert parent_rid({"id": "abc"}) == "abc"
    assert parent_rid({"id": "a-b-3", "index": "3"}) == "a-b"


def test_chat_reply() -> None:
    answer = _answer()
    assert answer.add(0, _update("Hello", [1, 2], done="stop", completion=2, cached=3),
                      {"id": "r1"}) == []
    assert answer.done
    assert answer.response() == {
        "id": "chatcmpl-r1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello",
                                             "reasoning_content": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                  "prompt_tokens_details": {"cached_tokens": 3}},
    }


def test_chat_stream_role_content_finish_usage() -> None:
    answer = _answer(stream=True, include_usage=True)
    first = answer.add(0, _update("He", [1], completion=1), {"id": "r1"})
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": "", "reasoning_content": None},
        {"content": "He", "reasoning_content": None}]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-r1"
               and c["usage"] is None for c in first)
    assert answer.add(0, _update("", [], completion=1), {"id": "r1"}) == []  # nothing new
    # The finish comes with the last text, in one chunk.
    last = answer.add(0, _update("llo", [2], done="length", completion=2), {"id": "r1"})
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in last] == [
        ({"content": "llo", "reasoning_content": None}, "length")]
    assert answer.done
    usage = answer.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2
    no_usage = _answer(stream=True)
    assert "usage" not in no_usage.add(0, _update("a", [1]), {"id": "r"})[0]


def test_n_samples_are_indexed_and_counted() -> None:
    answer = _answer(n=2, stream=True)
    chunks = answer.add(0, _update("b", [1], completion=1, cached=4),
                        {"id": "r-1", "index": "1"})
    assert [c["choices"][0]["index"] for c in chunks] == [1, 1] and chunks[0]["id"] == "chatcmpl-r"
    chunks += answer.add(0, _update("a", [2], done="stop", completion=1),
                         {"id": "r-0", "index": "0"})
    assert not answer.done
    chunks += answer.add(0, _update("", [], done="stop", completion=3, cached=4),
                         {"id": "r-1", "index": "1"})
    assert answer.done
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content"),
             c["choices"][0]["finish_reason"]) for c in chunks] == [
        (1, "", None), (1, "b", None), (0, "", None), (0, "a", "stop"), (1, "", "stop")]
    # The prompt counts once, with its first sample's cache hit; every sample's tokens count.
    assert answer.usage() == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}


def _lp(texts: list[str], values: list[float], tops: list[list[tuple[str, float]]],
        **prompt: Any) -> common_pb2.Logprobs:
    lp = common_pb2.Logprobs(output_texts=texts, output_logprobs=values, **prompt)
    for top in tops:
        lp.output_top.add(texts=[t for t, _ in top], logprobs=[v for _, v in top],
                          token_ids=list(range(len(top))))
    return lp


def test_chat_logprobs() -> None:
    lp = _lp(["Hé", "!"], [-0.5, -0.25], [[("Hé", -0.5), ("x", -2.0)], [("!", -0.25), ("?", -3)]])
    assert _json(chat_logprobs(lp, 2)) == {"refusal": None, "content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169], "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": "x", "logprob": -2.0, "bytes": [120]}]},
        {"token": "!", "logprob": -0.25, "bytes": [33], "top_logprobs": [
            {"token": "!", "logprob": -0.25, "bytes": [33]},
            {"token": "?", "logprob": -3.0, "bytes": [63]}]},
    ]}
    assert [e["top_logprobs"] for e in chat_logprobs(lp, 0)["content"]] == [[], []]
    assert _json(chat_logprobs(_lp(["a"], [-0.1], []), 0))["content"][0]["logprob"] == -0.1
    answer = _answer(top_logprobs=1)
    answer.add(0, _update("Hé!", [1, 2], done="stop", logprobs=lp), {"id": "r"})
    choice = _json(answer.response())["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hé", "!"]


def test_completion_logprobs_run_on_across_chunks_and_lead_with_the_echoed_prompt() -> None:
    builder = CompletionLogprobs(top=1)
    prompt = {"input_start": 0, "input_texts": ["<s>", "Hi"],
              "input_logprobs": [float("nan"), -4.0]}
    lp = _lp(["a", "bc"], [-1.0, -2.0], [[("a", -1.0)], [("bc", -2.0)]], **prompt)
    lp.input_top.add()  # position 0 has none
    lp.input_top.add(texts=["Hi"], logprobs=[-4.0], token_ids=[9])
    first = _json(builder.add(lp, echo=True))
    assert first == {"tokens": ["<s>", "Hi", "a", "bc"],
                     "token_logprobs": [None, -4.0, -1.0, -2.0],
                     "top_logprobs": [None, {"Hi": -4.0}, {"a": -1.0}, {"bc": -2.0}],
                     "text_offset": [0, 3, 5, 6]}
    later = _json(builder.add(_lp(["d"], [-0.5], [[("d", -0.5)]]), echo=True))
    assert later["text_offset"] == [8] and later["tokens"] == ["d"]
    # logprobs: 0 gives each position the chosen token's entry; more give the chosen token
    # beside the k most likely when it is not among them (OpenAI: up to k + 1 entries).
    zero = _json(CompletionLogprobs(top=0).add(_lp(["a", "b"], [-1.0, -0.5], []), echo=False))
    assert zero["top_logprobs"] == [{"a": -1.0}, {"b": -0.5}] and zero["tokens"] == ["a", "b"]
    sampled = _json(CompletionLogprobs(top=1).add(_lp(["b"], [-2.0], [[("a", -0.5)]]),
                                                  echo=False))
    assert sampled["top_logprobs"] == [{"a": -0.5, "b": -2.0}]
    prompt_zero = common_pb2.Logprobs(input_start=0, input_texts=["<s>", "Hi"],
                                      input_logprobs=[float("nan"), -4.0])
    echoed = _json(CompletionLogprobs(top=0).add(prompt_zero, echo=True))
    assert echoed["top_logprobs"] == [None, {"Hi": -4.0}]


def test_completion_reply_batch_echo_and_stream() -> None:
    answer = _answer(CompletionAnswer, n=2, prompts=2, echo=["P0 ", "P1 "])
    for prompt in (0, 1):
        for sample in (0, 1):
            answer.add(prompt, _update(f"t{prompt}{sample}", [1], done="length", completion=1,
                                       prompt=3 + prompt),
                       {"id": f"r{prompt}-{sample}", "index": str(sample)})
    body = answer.response()
    assert body["id"] == "cmpl-r0" and body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "P0 t00", "length"), (1, "P0 t01", "length"), (2, "P1 t10", "length"),
        (3, "P1 t11", "length")]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 4
    stream = _answer(CompletionAnswer, stream=True, echo=["Hi"])
    chunks = stream.add(0, _update(" there", [1], completion=1), {"id": "r"})
    chunks += stream.add(0, _update("!", [2], done="stop", completion=2), {"id": "r"})
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("Hi there", None), ("!", "stop")]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stream_logprobs_wait_for_their_text_and_end_with_the_finish() -> None:
    answer = _answer(CompletionAnswer, stream=True, top_logprobs=0)
    chunks = answer.add(0, _update("a", [1], logprobs=_lp(["a"], [-1.0], [])), {"id": "r"})
    # A token whose text the detokenizer holds back (half a character, the start of a stop
    # string): its logprobs wait for the chunk that brings the text.
    assert answer.add(0, _update("", [2], logprobs=_lp(["b"], [-2.0], [])), {"id": "r"}) == []
    chunks += answer.add(0, _update("bc", [3], logprobs=_lp(["c"], [-3.0], [])), {"id": "r"})
    chunks += answer.add(0, _update("", [], done="stop"), {"id": "r"})
    choices = [_json(c)["choices"][0] for c in chunks]
    assert [(c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in choices] == [
        ("a", ["a"], None), ("bc", ["b", "c"], None), ("", [], "stop")]
    assert choices[1]["logprobs"]["text_offset"] == [1, 2]
    assert choices[1]["logprobs"]["top_logprobs"] == [{"b": -2.0}, {"c": -3.0}]
    chat = _answer(stream=True, top_logprobs=0)
    chat.add(0, _update("", [1], logprobs=_lp(["x"], [-1.0], [])), {"id": "r"})
    [last] = chat.add(0, _update("", [], done="length"), {"id": "r"})
    assert last["choices"][0]["finish_reason"] == "length"
    assert [e["token"] for e in last["choices"][0]["logprobs"]["content"]] == ["x"]


def test_chat_echo_starts_the_reply() -> None:
    answer = _answer(echo="Once upon")
    answer.add(0, _update(" a time", [1], done="stop"), {"id": "r"})
    assert answer.response()["choices"][0]["message"]["content"] == "Once upon a time"
    stream = _answer(stream=True, echo="Once upon")
    chunks = stream.add(0, _update(" a time", [1], done="stop"), {"id": "r"})
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "", "reasoning_content": None},
        {"content": "Once upon", "reasoning_content": None},
        {"content": " a time", "reasoning_content": None}]


def test_embedding_body_float_and_base64() -> None:
    vectors = [[0.5, -0.25], [1.0, 0.0]]
    body = _json(embedding_body("m", vectors, 5, base64=False))
    assert body == {"object": "list", "model": "m",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                             {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}],
                    "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    encoded = embedding_body("m", vectors, 5, base64=True)["data"][1]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == [1.0, 0.0]


# ---- vLLM's return_token_ids, return_tokens_as_token_ids and prompt_logprobs ----------------


def _with_prompt(update: Update, ids: list[int]) -> Update:
    update.prompt_ids = ids
    return update


def test_token_ids_in_whole_replies() -> None:
    chat = _answer(token_ids=True)
    chat.add(0, _with_prompt(_update("Hi", [4, 5], done="stop"), [1, 2, 3]), {"id": "r"})
    body = chat.response()
    assert body["prompt_token_ids"] == [1, 2, 3] and body["choices"][0]["token_ids"] == [4, 5]
    completion = _answer(CompletionAnswer, token_ids=True, n=2)
    for sample in (0, 1):
        completion.add(0, _with_prompt(_update("x", [6 + sample], done="length"), [1, 2]),
                       {"id": f"r-{sample}", "index": str(sample)})
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in completion.response()["choices"]] == [
        ([1, 2], [6]), ([1, 2], [7])]
    plain = _answer(CompletionAnswer)
    plain.add(0, _with_prompt(_update("x", [6], done="length"), [1, 2]), {"id": "r"})
    assert "token_ids" not in plain.response()["choices"][0]
    assert "prompt_token_ids" not in plain.response()["choices"][0]


def test_streamed_token_ids_wait_with_their_held_tokens() -> None:
    """The prompt's ids come in the first chunk (chat: at its top; completions: in each
    choice's first); a token whose text is held back gives its id to the chunk with the
    text, beside its logprobs."""
    answer = _answer(CompletionAnswer, stream=True, token_ids=True, top_logprobs=0,
                     tokens_as_ids=True)
    chunks = answer.add(0, _with_prompt(_update("", [7], logprobs=_lp(["a"], [-1.0], [])),
                                        [1, 2]), {"id": "r"})
    assert chunks == []  # no text yet: held, ids and all
    chunks += answer.add(0, _update("ab", [8], logprobs=_lp(["b"], [-2.0], [])), {"id": "r"})
    chunks += answer.add(0, _update("c", [9], done="stop", logprobs=_lp(["c"], [-3.0], [])),
                         {"id": "r"})
    choices = [_json(c)["choices"][0] for c in chunks]
    assert [c.get("prompt_token_ids") for c in choices] == [[1, 2], None]
    assert [c["token_ids"] for c in choices] == [[7, 8], [9]]
    assert [c["logprobs"]["tokens"] for c in choices] == [["token_id:7", "token_id:8"],
                                                          ["token_id:9"]]
    assert choices[0]["logprobs"]["text_offset"] == [0, 1]  # still the text's offsets
    chat = _answer(stream=True, token_ids=True)
    first = chat.add(0, _with_prompt(_update("Hi", [4]), [1, 2, 3]), {"id": "r"})
    later = chat.add(0, _update("!", [5], done="stop"), {"id": "r"})
    assert first[0]["prompt_token_ids"] == [1, 2, 3] and "token_ids" not in first[0]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in first[1:] + later] == [[4], [5]]
    assert all("prompt_token_ids" not in c for c in first[1:] + later)


def test_tokens_as_ids_name_every_token_by_its_id() -> None:
    lp = _lp(["Hé"], [-0.5], [[("Hé", -0.5), ("x", -2.0)]])
    [entry] = _json(chat_logprobs(lp, 2, [42], as_ids=True))["content"]
    assert entry["token"] == "token_id:42" and entry["bytes"] == [72, 195, 169]
    assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:0", "token_id:1"]
    completion = _json(CompletionLogprobs(top=1, as_ids=True).add(lp, echo=False, ids=[42]))
    assert completion["tokens"] == ["token_id:42"]
    assert completion["top_logprobs"] == [{"token_id:0": -0.5, "token_id:42": -0.5}]


def test_tops_are_cut_to_what_each_ask_wanted() -> None:
    """prompt_logprobs may ask the engine for more top entries than logprobs did."""
    lp = _lp(["a"], [-0.5], [[("a", -0.5), ("b", -1.0), ("c", -2.0)]])
    assert len(chat_logprobs(lp, 1)["content"][0]["top_logprobs"]) == 1
    assert _json(CompletionLogprobs(top=2).add(lp, echo=False))["top_logprobs"] == [
        {"a": -0.5, "b": -1.0}]


def test_prompt_logprobs_have_the_prompt_token_its_rank_and_the_most_likely() -> None:
    lp = common_pb2.Logprobs(input_start=0, input_token_ids=[1, 5, 6],
                             input_texts=["<s>", "Hi", "!"],
                             input_logprobs=[float("nan"), -4.0, -0.5], input_ranks=[0, 9, 1])
    lp.input_top.add()  # position 0 has none
    lp.input_top.add(token_ids=[7, 8], logprobs=[-0.25, -1.0], texts=["Yo", "Hey"])
    lp.input_top.add(token_ids=[6, 8], logprobs=[-0.5, -1.5], texts=["!", "Hey"])
    assert _json(prompt_logprobs(lp, 1)) == [
        None,
        {"5": {"logprob": -4.0, "rank": 9, "decoded_token": "Hi"},
         "7": {"logprob": -0.25, "rank": 1, "decoded_token": "Yo"}},
        {"6": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}},
    ]
    assert _json(prompt_logprobs(lp, 0))[1] == {
        "5": {"logprob": -4.0, "rank": 9, "decoded_token": "Hi"}}
    answer = _answer(CompletionAnswer, prompt_logprobs=0)
    answer.add(0, _update("x", [3], done="length", logprobs=lp), {"id": "r"})
    assert len(answer.response()["choices"][0]["prompt_logprobs"]) == 3
    chat = _answer(prompt_logprobs=0)
    chat.add(0, _update("x", [3], done="length", logprobs=lp), {"id": "r"})
    body = chat.response()
    assert len(body["prompt_logprobs"]) == 3 and body["choices"][0]["logprobs"] is None


def test_logprob_token_ids_list_the_chosen_token_then_the_asked_ones() -> None:
    lp = _lp(["a"], [-0.5], [[("z", -0.1)]])  # the most likely: not listed when ids are asked
    lp.output_token_ids_logprobs.add(token_ids=[9, 42], logprobs=[-3.0, -0.5], texts=["q", "a"])
    [entry] = _json(chat_logprobs(lp, 0, [42], as_ids=True, asked=True))["content"]
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [
        ("token_id:42", -0.5), ("token_id:9", -3.0)]  # the chosen one once, first
    completion = _json(CompletionLogprobs(top=0, asked=True).add(lp, echo=False, ids=[42]))
    assert completion["top_logprobs"] == [{"a": -0.5, "q": -3.0}]


def test_continuous_usage_counts_no_token_in_the_opening_chunks() -> None:
    answer = _answer(stream=True, include_usage=True, continuous_usage=True, echo="Once")
    chunks = answer.add(0, _update("a", [1], completion=1), {"id": "r"})
    chunks += answer.add(0, _update("b", [2], completion=2, done="length"), {"id": "r"})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 0, 1, 2]
