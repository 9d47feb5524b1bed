"""Constrained decoding in the engine: every token drawn keeps the output inside the request's
grammar (a regex, a choice, a JSON schema), greedy or sampled, beside unconstrained requests in
the same steps; the request stops ("stop") once the grammar is complete, and a grammar that
cannot be built is reported, not raised. The embedded default model (random weights, its own
tokenizer): left alone it writes nothing of the kind."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import llguidance
import pytest
import torch
from scheduler_helpers import TEST_DEVICE, run_all, tokens_of
from tokenizers import Tokenizer

from meshlm.common.default_model import ensure_default_model
from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams
from meshlm.scheduler.engine.sampler import SamplingBatch, restrict
from meshlm.scheduler.grammar import Grammars

PROMPT = [0, 44, 385, 83, 16]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(ensure_default_model(None), device=TEST_DEVICE, max_running=16))


@pytest.fixture(scope="module")
def grammars(engine: Engine) -> Grammars:
    return Grammars(ensure_default_model(None), engine.vocab_size, engine.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(f"{ensure_default_model(None)}/tokenizer.json")


def _matcher(grammars: Grammars, grammar: str) -> object:
    [matcher] = grammars.build([grammar])
    assert not isinstance(matcher, str), matcher
    return matcher


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_outputs_follow_their_grammars_beside_free_requests(engine, grammars, tokenizer) -> None:
    regex = llguidance.grammar_from("regex", r"[ab]{3}-[0-9]{2}")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["color", "n"], "additionalProperties": False}
    as_json = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    choice = llguidance.grammar_from("choice", '["yes", "no", "maybe"]')
    asks = {
        "regex": (SamplingParams(temperature=0.0, max_new_tokens=40, grammar=regex), regex),
        "json": (SamplingParams(temperature=0.0, max_new_tokens=40, grammar=as_json), as_json),
        "choice": (SamplingParams(temperature=1.0, seed=3, max_new_tokens=40, grammar=choice),
                   choice),
    }
    for rid, (params, grammar) in asks.items():
        engine.add_request(rid, PROMPT, params, matcher=_matcher(grammars, grammar))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12))
    outs = run_all(engine)
    texts = {rid: _text(tokenizer, tokens_of(outs[rid])) for rid in outs}
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", texts["regex"]), texts["regex"]
    doc = json.loads(texts["json"])
    assert set(doc) == {"color", "n"} and doc["color"] in ("red", "green")
    assert isinstance(doc["n"], int)
    assert texts["choice"] in ("yes", "no", "maybe")
    for rid in asks:
        assert outs[rid][-1].finish_reason == "stop", (rid, outs[rid][-1])
    # The free request beside them is untouched: the same tokens as alone.
    engine.add_request("alone", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert tokens_of(run_all(engine)["alone"]) == tokens_of(outs["free"])
    assert not re.fullmatch(r"[ab]{3}-[0-9]{2}", texts["free"])


def test_a_grammar_that_cannot_be_built_says_why(grammars) -> None:
    [why] = grammars.build([llguidance.grammar_from("regex", "[a")])
    assert isinstance(why, str) and "regex" in why


def test_a_wide_object_schema_is_followed_and_a_wider_one_refused_up_front(
        engine, grammars, tokenizer) -> None:
    """An object of 1,000 optional properties (past llguidance's default row bound, within
    the scheduler's) is followed; one of 5,000 fails its first mask, which is built with the
    matcher, so it is refused before it is queued rather than after a step."""

    def wide(n: int) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object", "properties": {f"p{i}": {"enum": [i]} for i in range(n)},
             "additionalProperties": False}, defaults={"whitespace_flexible": False})

    engine.add_request("wide", PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0,
                                                      grammar=wide(1000)),
                       matcher=_matcher(grammars, wide(1000)))
    outs = run_all(engine)["wide"]
    text = _text(tokenizer, tokens_of(outs))
    if outs[-1].finish_reason == "stop":
        doc = json.loads(text)
        assert doc and all(key == f"p{value}" for key, value in doc.items()), doc
    else:  # cut short: a prefix of such an object
        assert outs[-1].finish_reason == "length", outs[-1]
        assert re.fullmatch(r'\{"p(\d+)":\1(,"p(\d+)":\3)*.*', text, re.S), text
    [why] = grammars.build([wide(5000)])
    assert isinstance(why, str) and "items" in why


def test_a_request_without_its_matcher_is_refused(engine) -> None:
    regex = llguidance.grammar_from("regex", "a+")
    engine.add_request("orphan", PROMPT, SamplingParams(max_new_tokens=4, grammar=regex))
    [out] = run_all(engine)["orphan"]
    assert out.finish_reason == "error" and "matcher" in (out.error or "")


def test_a_grammar_narrows_what_allowed_token_ids_allow() -> None:
    params = [SamplingParams(allowed_token_ids=(1, 2, 3)), SamplingParams(), SamplingParams()]
    batch = SamplingBatch.build(params, [0, 0, 0], (), [None] * 3, 6, torch.device("cpu"))
    grammar = torch.tensor([[False, False, True, True, True, False],
                            [True, False, False, False, False, False]])
    restrict(batch, [0, 2], grammar)
    assert batch.allowed is not None
    rows, masks = batch.allowed
    assert rows.tolist() == [0, 2]
    assert masks.tolist() == [[False, False, True, True, False, False],
                              [True, False, False, False, False, False]]
