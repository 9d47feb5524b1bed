"""DeepSeek's and Kimi K2's tool calls, read for tool_choice "auto" (the gateway's
`--tool-call-parser`; vLLM's names, and SGLang's for the same formats): after any content,
one block between
`<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>` holds the calls, each between
`<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`:

- `DeepSeekV3Calls` (`deepseek_v3`, SGLang's `deepseekv3`: DeepSeek-V3, R1):
  `function<｜tool▁sep｜>NAME` then its JSON arguments in a ```json fence;
- `DeepSeekV31Calls` (`deepseek_v31`, SGLang's `deepseekv31`: DeepSeek-V3.1 and later):
  `NAME<｜tool▁sep｜>` then its JSON arguments;
- `KimiK2Calls` (`kimi_k2`: Kimi K2): the same shape between `<|tool_calls_section_begin|>`
  and `<|tool_calls_section_end|>`, each call `<|tool_call_begin|>functions.NAME:INDEX
  <|tool_call_argument_begin|>` then its JSON, `functions.NAME:INDEX` being its id.

A call opens once its name is complete; its arguments come whole when it closes (the output
cut in one: what it had). A block that holds no call is content, as written.
"""

from __future__ import annotations

import re

from meshlm.gateway.protocol.block_calls import BlockCalls
from meshlm.gateway.protocol.tool_call_output import Delta

CALL, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeekCalls(BlockCalls):
    """The calls block: each call's name (`NAME`, from its begin tag), then its arguments
    (`ARGUMENTS`, up to its end tag)."""

    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    NAME: re.Pattern[str]
    ARGUMENTS: re.Pattern[str]

    def __init__(self) -> None:
        super().__init__()
        self._begin()

    def _begin(self) -> None:
        self._body, self._at, self._in_call, self._read_any = "", 0, False, False

    def _read(self, text: str, deltas: list[Delta]) -> None:
        self._body += text
        while True:
            if not self._in_call:
                found = self.NAME.match(self._body, self._at)
                if found is None:
                    return
                name, id_ = self.named(found.group(1).strip())
                self._open(name, deltas, id_)
                self._in_call = self._read_any = True
            else:
                found = self.ARGUMENTS.match(self._body, self._at)
                if found is None:
                    return
                self._arguments(found.group(1).strip() or "{}", deltas)
                self._in_call = False
            self._at = found.end()

    def _close(self, content: list[str], deltas: list[Delta], closed: bool) -> None:
        if self._in_call:  # cut in its arguments: what they had
            rest = self._body[self._at:].split(END)[0].strip()
            self._arguments(self.unfenced(rest) or "{}", deltas)
        elif not self._read_any:
            content.append(self.OPEN + self._body + (self.CLOSE if closed else ""))
        self._begin()

    def unfenced(self, text: str) -> str:
        return text

    def named(self, header: str) -> tuple[str, str]:
        """(name, id: "" for a new one) of a call from what precedes its arguments."""
        return header, ""


class DeepSeekV3Calls(DeepSeekCalls):
    NAME = re.compile(rf"\s*{CALL}\s*(?:function)?\s*{SEP}([^\n]+)\n")
    ARGUMENTS = re.compile(rf"\s*```(?:json)?\s*(.*?)\s*```\s*{END}", re.S)

    def unfenced(self, text: str) -> str:
        return text.removeprefix("```json").removeprefix("```").removesuffix("```").strip()


class DeepSeekV31Calls(DeepSeekCalls):
    NAME = re.compile(rf"\s*{CALL}([^<]+?){SEP}")
    ARGUMENTS = re.compile(rf"(.*?){END}", re.S)


class KimiK2Calls(DeepSeekCalls):
    """Kimi K2's: `functions.NAME:INDEX` heads each call and is its id (Kimi's chat template
    writes an earlier call's id back as its head)."""

    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    NAME = re.compile(r"\s*<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>")
    ARGUMENTS = re.compile(r"(.*?)<\|tool_call_end\|>", re.S)
    HEAD = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")

    def named(self, header: str) -> tuple[str, str]:
        found = self.HEAD.fullmatch(header)
        return (found.group(1) if found else header), header
