"""A reasoning model's thinking budget (SGLang's max_thinking_tokens, vLLM's
thinking_token_budget): once the output has written that many tokens inside its thinking, the
engine writes the thinking's closing tag, token by token, and the answer follows.

It takes a sequence's matcher's place (`engine/grammar.py` uses three of its methods), around
the grammar's own matcher if the request has one: while the budget lasts it allows what that
allows (anything without one); once spent it allows only the closing tag's next id. The
thinking is open at the output's start when the prompt's last tag near its end is the opening
one (a chat template that opened it), or once the output writes the opening tag; it ends when
the output writes the closing tag, on its own or forced. Tags are matched as the tokenizer
encodes them (`TokenizedRequest.thinking_open` / `thinking_close`). No torch here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

# How far back from the prompt's end a chat template's opening tag is looked for: templates end
# the prompt with it ("<think>\n"), or with an empty block when thinking is off.
PROMPT_TAIL = 64


class ThinkingBudget:
    """The budget of one sequence; `inner`: its grammar's matcher (None: no grammar)."""

    def __init__(self, budget: int, open_ids: Sequence[int], close_ids: Sequence[int],
                 prompt_ids: Sequence[int], inner: Any = None) -> None:
        self.budget = budget
        self.open, self.close = tuple(open_ids), tuple(close_ids)
        self.inner = inner
        self.recent: list[int] = list(prompt_ids[-PROMPT_TAIL:])
        self.thinking = _open_at_end(self.recent, self.open, self.close)
        self.ended = False  # the thinking closed: the budget is done with
        self.spent = 0  # tokens written inside the thinking, before the budget ran out

    @property
    def forced(self) -> int | None:
        """The id the engine must draw next, if the budget is spent: the closing tag's next
        (after what of it the output wrote last, if it had begun writing it)."""
        if self.thinking and self.spent >= self.budget and self.close:
            return self.close[_begun(self.recent, self.close)]
        return None

    # -- the matcher's methods the model runner uses ----------------------------------------

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        """The ids allowed next, as bits in the int32 words at `ptr` (which come all set)."""
        forced = self.forced
        if forced is not None:
            ctypes.memset(ptr, 0, nbytes)
            words = (ctypes.c_uint32 * (nbytes // 4)).from_address(ptr)
            words[forced // 32] = 1 << (forced % 32)
        elif self.inner is not None:
            self.inner.unsafe_compute_mask_ptr(ptr, nbytes)

    def consume_token(self, token: int) -> bool:
        if self.thinking and self.forced is None:
            self.spent += 1
        self.recent.append(token)
        if len(self.recent) > 2 * PROMPT_TAIL:
            del self.recent[:PROMPT_TAIL]
        if self.thinking and _ends_with(self.recent, self.close):
            self.thinking, self.ended = False, True
        elif not self.thinking and not self.ended and _ends_with(self.recent, self.open):
            self.thinking, self.spent = True, 0
        return self.inner.consume_token(token) if self.inner is not None else True

    def is_error(self) -> bool:
        return self.inner is not None and bool(self.inner.is_error())

    def get_error(self) -> str:
        return str(self.inner.get_error()) if self.inner is not None else ""

    def is_stopped(self) -> bool:
        return self.inner is not None and bool(self.inner.is_stopped())


def _ends_with(ids: list[int], tag: tuple[int, ...]) -> bool:
    return bool(tag) and len(ids) >= len(tag) and tuple(ids[-len(tag):]) == tag


def _begun(ids: list[int], tag: tuple[int, ...]) -> int:
    """How many of `tag`'s first ids `ids` ends with (fewer than all of them)."""
    for n in range(len(tag) - 1, 0, -1):
        if _ends_with(ids, tag[:n]):
            return n
    return 0


def _open_at_end(ids: list[int], open_ids: tuple[int, ...], close_ids: tuple[int, ...]) -> bool:
    """Whether the last of the tags in `ids` is the opening one."""
    last_open = _last(ids, open_ids)
    return last_open >= 0 and last_open > _last(ids, close_ids)


def _last(ids: list[int], tag: tuple[int, ...]) -> int:
    """Where `tag` last starts in `ids` (-1: nowhere)."""
    if not tag:
        return -1
    for start in range(len(ids) - len(tag), -1, -1):
        if ids[start] == tag[0] and tuple(ids[start:start + len(tag)]) == tag:
            return start
    return -1
