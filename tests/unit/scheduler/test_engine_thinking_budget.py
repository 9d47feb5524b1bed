"""A thinking budget in the engine: once the output has written its budget of tokens inside the
thinking, the closing tag's ids are drawn, whatever the model would have written, and the
answer follows freely (or under the request's grammar); the thinking opens with the prompt's
last tag or the output's own opening tag. The embedded default model has random weights: left
alone it never closes a thinking."""

from __future__ import annotations

from collections.abc import Iterator

import llguidance
import pytest
from scheduler_helpers import TEST_DEVICE, run_all, tokens_of
from tokenizers import Tokenizer

from meshlm.common.default_model import ensure_default_model
from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams
from meshlm.scheduler.engine.thinking import ThinkingBudget
from meshlm.scheduler.grammar import Grammars

OPEN, CLOSE = (7, 8), (9, 10, 11)  # tags of several ids, as a tokenizer may split them


def _mask_allows(budget: ThinkingBudget, vocab: int = 64) -> set[int] | None:
    """The ids the budget allows next (None: all of them)."""
    import numpy as np

    row = np.full(vocab // 32, -1, dtype=np.int32)
    budget.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    allowed = {int(i) for i in np.flatnonzero(bits)}
    return None if len(allowed) == vocab else allowed


def test_the_budget_closes_the_thinking_the_prompt_opened() -> None:
    budget = ThinkingBudget(3, OPEN, CLOSE, [1, 2, *OPEN, 5])  # a template opened it
    for token in (20, 21, 22):
        assert _mask_allows(budget) is None
        assert budget.consume_token(token)
    for token in CLOSE:  # spent: the closing tag, id by id
        assert _mask_allows(budget) == {token}
        budget.consume_token(token)
    for token in (30, *CLOSE, 31):  # the answer: free, the budget done with
        assert _mask_allows(budget) is None
        budget.consume_token(token)


@pytest.mark.parametrize(("budget", "prompt", "output", "spent"), [
    (2, [1, *OPEN, 5, *CLOSE, 6], [20, 21, 22, 23], False),  # thinking off: an empty block
    (2, [1, 2, 3], [20, 21, 22, 23], False),  # no thinking anywhere
    (2, [1, 2, 3], [*OPEN, 20, 21], True),  # the output opens it: counted from there
    (5, [1, *OPEN], [20, *CLOSE, 21, *OPEN, *range(22, 30)], False),  # closed: done with
])
def test_when_the_thinking_is_open(budget: int, prompt: list[int], output: list[int],
                                   spent: bool) -> None:
    thinking = ThinkingBudget(budget, OPEN, CLOSE, prompt)
    for i, token in enumerate(output):
        assert _mask_allows(thinking) is None, i
        thinking.consume_token(token)
    assert _mask_allows(thinking) == ({CLOSE[0]} if spent else None)


def test_a_closing_tag_begun_as_the_budget_ends_is_finished_not_restarted() -> None:
    thinking = ThinkingBudget(2, OPEN, CLOSE, [*OPEN])
    thinking.consume_token(20)
    thinking.consume_token(CLOSE[0])  # the model began closing with its last token
    assert _mask_allows(thinking) == {CLOSE[1]}
    thinking.consume_token(CLOSE[1])
    assert _mask_allows(thinking) == {CLOSE[2]}
    thinking.consume_token(CLOSE[2])
    assert _mask_allows(thinking) is None


def test_a_zero_budget_closes_at_once_and_the_grammar_still_holds() -> None:
    inner = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), llguidance.grammar_from(
        "lark", 'start: t "ok"\nt[suffix="</t>"]: /(.|\\n)*/'))
    close = tuple(b"</t>")
    budget = ThinkingBudget(0, tuple(b"<t>"), close, list(b"q<t>"), inner)
    for token in close:
        assert _mask_allows(budget, 288) == {token}
        assert budget.consume_token(token)
    allowed = _mask_allows(budget, 288)
    assert allowed == {ord("o")}  # the grammar's own mask again
    assert budget.consume_token(ord("o")) and budget.consume_token(ord("k"))
    assert not budget.is_error() and budget.is_stopped() is inner.is_stopped()


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(ensure_default_model(None), device=TEST_DEVICE, max_running=8))


def test_the_engine_writes_the_closing_tag_once_the_budget_is_spent(engine) -> None:
    tokenizer = Tokenizer.from_file(f"{ensure_default_model(None)}/tokenizer.json")
    opening = tuple(tokenizer.encode("<think>", add_special_tokens=False).ids)
    closing = tuple(tokenizer.encode("</think>", add_special_tokens=False).ids)
    prompt = tokenizer.encode("Question: why?\n<think>\n", add_special_tokens=False).ids
    for temperature in (0.0, 1.0):
        for tokens in (0, 5):
            params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=20,
                                    ignore_eos=True, thinking=(tokens, opening, closing))
            engine.add_request("budget", prompt, params)
            out = tokens_of(run_all(engine)["budget"])
            assert tuple(out[tokens:tokens + len(closing)]) == closing, (temperature, out)
            assert closing not in {tuple(out[i:i + len(closing)]) for i in range(tokens)}
        free = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
        engine.add_request("free", prompt, free)
        text = tokenizer.decode(tokens_of(run_all(engine)["free"]))
        assert "</think>" not in text  # the random model alone never closes it
    grammars = Grammars(ensure_default_model(None), engine.vocab_size, engine.eos_token_ids)
    grammar = llguidance.grammar_from(
        "lark", 'start: t ("yes" | "no")\nt[suffix="</think>"]: /(.|\\n)*/')
    [matcher] = grammars.build([grammar])
    engine.add_request("both", prompt, SamplingParams(
        temperature=1.0, seed=5, max_new_tokens=30, thinking=(4, opening, closing)),
        matcher=matcher)
    outs = run_all(engine)["both"]
    text = tokenizer.decode(tokens_of(outs))
    assert text.endswith(("</think>yes", "</think>no")), text
    assert outs[-1].finish_reason == "stop"
