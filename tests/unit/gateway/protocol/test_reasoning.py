"""A reasoning model's thinking split from its answer, however the output is cut into pieces:
the parsers' two forms (starting in thought, or only after <think>), the answer's leading
blanks, tags held until clear, the switches (kept, dropped, held whole), a chat answer
that reads reasoning, then tool calls, streamed and whole, and a JSON constraint put after
the thinking."""

from __future__ import annotations

from typing import Any

import llguidance
import orjson
import pytest

from meshlm.common.errors import MeshError
from meshlm.gateway.mesh.inbox import Update
from meshlm.gateway.protocol.chat_output import (
    ChatOutput,
    Pieces,
    json_after_thinking,
    thinking,
)
from meshlm.gateway.protocol.constraints import json_schema_grammar, think_first
from meshlm.gateway.protocol.openai import parse_chat
from meshlm.gateway.protocol.openai_responses import ChatAnswer
from meshlm.gateway.protocol.reasoning import PARSERS, ReasoningReader, tags
from meshlm.gateway.protocol.tool_parsers import HermesCalls
from meshlm.v1 import gateway_pb2


def _split(reader: ReasoningReader, text: str, size: int) -> tuple[str, str]:
    reasoning = content = ""
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        r, c = reader.feed(piece, last=i == len(pieces) - 1)
        assert not any(tag in r + c for tag in ("<think", "</think", "[THINK", "[/THINK")), (r, c)
        reasoning += r
        content += c
    assert (reasoning, content) == ("".join(reader.reasoning), "".join(reader.content))
    return reasoning, content


@pytest.mark.parametrize("size", [1, 2, 7, 1000])
@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", "Paris, no thought.", "", "Paris, no thought."),
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("deepseek-r1", "Hmm, so.</think>\n\nAnswer: 4", "Hmm, so.", "Answer: 4"),
    ("deepseek_r1", "<think>Hmm.</think>4", "Hmm.", "4"),
    ("qwen3-thinking", "all thought, no end", "all thought, no end", ""),
    ("glm45", "<think>a</think>b", "a", "b"),
    ("mistral", "[THINK]Hmm, so.[/THINK]\n\nParis.", "Hmm, so.", "Paris."),
    ("mistral", "Paris, no thought.", "", "Paris, no thought."),
    ("deepseek-r1", "a < b and </thin ok</think>x", "a < b and </thin ok", "x"),
])
def test_the_thinking_is_split_from_the_answer(parser: str, text: str, reasoning: str,
                                               content: str, size: int) -> None:
    reader = ReasoningReader(PARSERS[parser], tags(parser))
    assert _split(reader, text, size) == (reasoning, content)


def test_a_short_output_that_may_be_a_tag_waits() -> None:
    reader = ReasoningReader(False)
    assert reader.feed("<thi") == ("", "")
    assert reader.feed("x") == ("", "<thix")  # not a tag after all
    ends = ReasoningReader(True)
    assert ends.feed("x</th") == ("x", "")
    assert ends.feed("ink> y") == ("", "y")


def _fed(output: ChatOutput, pieces: list[str]) -> list[Pieces]:
    return [output.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def test_the_switches() -> None:
    pieces = ["<think>a", "b</think>", "c"]
    dropped = ChatOutput(ReasoningReader(False), None, keep_reasoning=False)
    assert [(p.reasoning, p.content) for p in _fed(dropped, pieces)] == [
        ("", ""), ("", ""), ("", "c")]
    assert dropped.reasoning() is None and dropped.content() == "c"
    whole = ChatOutput(ReasoningReader(False), None, stream_reasoning=False)
    assert [(p.reasoning, p.content) for p in _fed(whole, pieces)] == [
        ("", ""), ("ab", ""), ("", "c")]
    assert whole.reasoning() == "ab"


def test_reasoning_then_tool_calls() -> None:
    output = ChatOutput(ReasoningReader(True), HermesCalls())
    got = sum(_fed(output, ["Need the time.</think>\n", "Sure.<tool_call>",
                            '{"name": "t", "arguments": {}}</tool_call>']), Pieces())
    assert got.reasoning == "Need the time." and got.content == "Sure."
    assert [c["function"]["name"] for c in got.calls] == ["t"]
    assert output.tool_calls()[0]["function"] == {"name": "t", "arguments": "{}"}


def _update(text: str, done: str | None = None) -> Update:
    final = gateway_pb2.TextOutput(finished=True, finish_reason=done) if done else None
    return Update(text=text, token_ids=[1], final=final, error=None, prompt_tokens=3,
                  completion_tokens=1, cached_tokens=0)


def _answer(stream: bool) -> Any:
    return ChatAnswer(model="m", created=1, n=1, prompts=1, include_usage=False,
                      top_logprobs=None, stream=stream,
                      output=lambda: ChatOutput(ReasoningReader(False), None))


def test_a_chat_answer_with_reasoning() -> None:
    whole = _answer(stream=False)
    whole.add(0, _update("<think>two and two</think>\n\nFour.", "stop"), {"id": "r"})
    [choice] = whole.response()["choices"]
    assert choice["message"]["reasoning_content"] == "two and two"
    assert choice["message"]["reasoning"] == "two and two"  # vLLM's name for it
    assert choice["message"]["content"] == "Four." and choice["finish_reason"] == "stop"
    stream = _answer(stream=True)
    chunks = []
    for piece in ("<think>two", " and two</th", "ink>\n\nFo", "ur."):
        chunks += stream.add(0, _update(piece), {"id": "r"})
    chunks += stream.add(0, _update("", "stop"), {"id": "r"})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "two and two"
    assert all(d.get("reasoning") == d["reasoning_content"] for d in deltas
               if d.get("reasoning_content"))
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    plain = _answer(stream=False)
    plain.add(0, _update("No thinking.", "stop"), {"id": "r"})
    message = plain.response()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "No thinking."
    assert "reasoning" not in message


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_earlier_answers_thinking_reaches_the_template_under_both_names(key: str) -> None:
    earlier = {"role": "assistant", "content": "Four.", key: "two and two"}
    messages = _chat(messages=[{"role": "user", "content": "2+2?"}, earlier]).messages
    assert messages[1]["reasoning"] == messages[1]["reasoning_content"] == "two and two"
    with pytest.raises(MeshError, match=rf"messages\[1\]\.{key}: must be a string"):
        _chat(messages=[{"role": "user", "content": "2+2?"}, {**earlier, key: 5}])


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def _chat(**doc: Any) -> Any:
    return parse_chat(orjson.dumps({"model": "m", "messages": [{"role": "user",
                                                                "content": "hi"}], **doc}))


def _follows(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize(("starts_in_thought", "text", "follows"), [
    (True, 'Hmm, a < b, </thin...</think>\n\n{"a":1}', True),
    (True, '</think>{"a":1}', True),
    (True, '{"a":1}', False),  # in thought until </think>
    (True, "Hmm.</think>\n\nyes", False),  # the answer is the JSON
    (True, 'Hmm.</think>{"a":1} and more', False),
    (False, '{"a":1}', True),  # no thinking
    (False, '<think>\nHmm.\n</think>\n\n{"a":1}', True),
    (False, 'Hmm.</think>{"a":1}', False),
    (False, '\n\n\n\n\n{"a":1}', False),  # a few blanks at most before the answer
])
def test_a_json_answer_comes_after_the_thinking(starts_in_thought: bool, text: str,
                                               follows: bool) -> None:
    grammar = think_first(json_schema_grammar(orjson.dumps(SCHEMA).decode(), "f"),
                          starts_in_thought)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert _follows(grammar, text) is follows


def test_a_json_answer_after_mistrals_thinking() -> None:
    grammar = think_first(json_schema_grammar(orjson.dumps(SCHEMA).decode(), "f"), False,
                          tags("mistral"))
    assert _follows(grammar, '[THINK]Hmm.[/THINK]\n\n{"a":1}') and _follows(grammar, '{"a":1}')
    assert not _follows(grammar, '<think>Hmm.</think>{"a":1}')


def test_which_constrained_chats_think_first() -> None:
    json_chat = _chat(response_format={"type": "json_schema",
                                       "json_schema": {"name": "a", "schema": SCHEMA}})
    regex_chat = _chat(structured_outputs={"regex": "(yes|no)"})
    forced = _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                   tool_choice="required")
    for req in (json_chat, forced):
        assert json_after_thinking(req) and thinking(req, "deepseek-r1") is True
        assert thinking(req, "qwen3") is False and thinking(req, "") is None
    # A regex describes the whole output: in thought only where it opens <think> itself.
    assert not json_after_thinking(regex_chat) and thinking(regex_chat, "deepseek-r1") is False
    assert thinking(_chat(separate_reasoning=False), "deepseek-r1") is None


def test_deepseek_v3_thinks_by_its_templates_switch() -> None:
    """DeepSeek-V3.1's template opens <think> when its `thinking` variable is true: then the
    output starts in thought; otherwise only an output that opens <think> thinks."""
    on = _chat(chat_template_kwargs={"thinking": True})
    for parser in ("deepseek-v3", "deepseek_v3"):
        assert thinking(on, parser) is True
        assert thinking(_chat(), parser) is False
        assert thinking(_chat(chat_template_kwargs={"thinking": False}), parser) is False
    reader = ReasoningReader(bool(thinking(on, "deepseek-v3")), tags("deepseek-v3"))
    assert _split(reader, "Hmm.</think>Paris.", 3) == ("Hmm.", "Paris.")
