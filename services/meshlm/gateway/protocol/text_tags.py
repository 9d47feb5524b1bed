"""Tags in a streamed output (`<think>`, `<tool_call>`): what to hold back at the end of what
has come so far, because it may be the start of one."""

from __future__ import annotations


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
