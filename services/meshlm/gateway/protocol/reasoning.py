"""A reasoning model's thinking, split from its answer: `<think>...</think>` in a chat's output
becomes OpenAI-style `reasoning_content`, the rest `content`. Pure: no I/O.

The gateway's `--reasoning-parser` names the model's form (SGLang's names, and vLLM's):

- `deepseek-r1` (`deepseek_r1`), `qwen3-thinking`: the output starts in thought (their
  templates open `<think>` in the prompt): everything before `</think>` is reasoning, a
  leading `<think>` dropped; with no `</think>` at all, all of it.
- `qwen3`: reasoning only when the output starts with `<think>` (Qwen3 thinks unless its
  template's `enable_thinking` is false); `glm45` the same (GLM-4.5 and later).
- `mistral`: reasoning only in a leading `[THINK]...[/THINK]` (Magistral).
- `deepseek-v3` (`deepseek_v3`: DeepSeek-V3.1 and later): in thought from the start when the
  chat's template variable `thinking` is true (its template then opens `<think>`), else only
  when the output starts with `<think>`.

The answer after `</think>` starts at its first non-blank character. Streamed, text that may
begin or end a tag is held until it is clear.
"""

from __future__ import annotations

from meshlm.gateway.protocol.text_tags import partial_tag

OPEN, CLOSE = "<think>", "</think>"
# Whether the output starts in thought, by parser name; a name: the chat template's variable
# that says (the model's thinking switch).
PARSERS: dict[str, bool | str] = {
    "deepseek-r1": True, "deepseek_r1": True, "qwen3-thinking": True, "qwen3": False,
    "glm45": False, "mistral": False, "deepseek-v3": "thinking", "deepseek_v3": "thinking"}
# The thinking's tags, where a parser's model has its own.
_TAGS = {"mistral": ("[THINK]", "[/THINK]")}


def tags(parser: str) -> tuple[str, str]:
    """The opening and closing tags of the thinking of `parser`'s model."""
    return _TAGS.get(parser, (OPEN, CLOSE))


class ReasoningReader:
    """One choice's output, read as (reasoning, content) pieces as it comes."""

    def __init__(self, starts_in_thought: bool, tags: tuple[str, str] = (OPEN, CLOSE)) -> None:
        self._forced = starts_in_thought
        self._open, self._close = tags
        self._pending = ""
        self._state = "start"  # start -> thinking -> (after: blanks skipped) -> answer
        self.reasoning: list[str] = []
        self.content: list[str] = []

    @property
    def thinking(self) -> bool:
        """Whether the output may still be in thought."""
        return self._state in ("start", "thinking")

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """The reasoning and the content that `text` completes (`last`: the output ends)."""
        self._pending += text
        reasoning = content = ""
        if self._state == "start":
            start = self._pending.lstrip()
            if not last and self._open.startswith(start) and start != self._open:
                return "", ""  # "<thi": not yet clear
            if start.startswith(self._open):
                self._pending, self._state = start[len(self._open):], "thinking"
            else:
                self._state = "thinking" if self._forced else "answer"
        if self._state == "thinking":
            at = self._pending.find(self._close)
            if at >= 0:
                reasoning = self._pending[:at]
                self._pending = self._pending[at + len(self._close):]
                self._state = "after"
            else:
                keep = 0 if last else partial_tag(self._pending, self._close)
                cut = len(self._pending) - keep
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        if self._state == "after":
            self._pending = self._pending.lstrip()
            if self._pending:
                self._state = "answer"
        if self._state == "answer":
            content, self._pending = self._pending, ""
        if reasoning:
            self.reasoning.append(reasoning)
        if content:
            self.content.append(content)
        return reasoning, content
