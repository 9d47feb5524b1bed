"""Tool calls written in blocks between two tags (`<tool_call>` ... `</tool_call>`) among the
content: the readers' common part. Text outside the blocks is content, as it comes; text that
may begin a tag is held until it is clear. A reader of one model's format says how a block's
text becomes a call (`tool_parsers.HermesCalls`: JSON; `xml_calls`: tagged parameters)."""

from __future__ import annotations

from meshlm.gateway.protocol.text_tags import partial_tag
from meshlm.gateway.protocol.tool_call_output import CallReader, Delta


class BlockCalls(CallReader):
    """Content, and blocks read by `_begin`, `_read` and `_close`."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    _pending = ""  # not yet read as content or a block's text
    _in_block = False

    def feed(self, text: str, last: bool = False) -> tuple[str, list[Delta]]:
        self._pending += text
        content: list[str] = []
        deltas: list[Delta] = []
        while True:
            tag = self.CLOSE if self._in_block else self.OPEN
            at = self._pending.find(tag)
            if at < 0:
                break
            before, self._pending = self._pending[:at], self._pending[at + len(tag):]
            if not self._in_block:
                if before:
                    content.append(before)
                self._in_block = True
                self._begin()
            else:
                self._read(before, deltas)
                self._in_block = False
                self._close(content, deltas, closed=True)
        tag = self.CLOSE if self._in_block else self.OPEN
        keep = 0 if last else partial_tag(self._pending, tag)
        ready, self._pending = (self._pending[:len(self._pending) - keep],
                                self._pending[len(self._pending) - keep:])
        if not self._in_block:
            if ready:
                content.append(ready)  # up to what may begin a tag
        else:
            self._read(ready, deltas)
            if last:
                self._in_block = False
                self._close(content, deltas, closed=False)
        text_out = "".join(content)
        if text_out:
            self._content.append(text_out)
        return text_out, deltas

    def _begin(self) -> None:
        """A block opens."""
        raise NotImplementedError

    def _read(self, text: str, deltas: list[Delta]) -> None:
        """More of the open block's text."""
        raise NotImplementedError

    def _close(self, content: list[str], deltas: list[Delta], closed: bool) -> None:
        """The block ends (`closed`: with its tag; else the output ends in it): its call's last
        deltas, or its text back into the content when it holds no call."""
        raise NotImplementedError
