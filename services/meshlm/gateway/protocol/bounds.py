"""The gateway's size bounds: what a public request may weigh before any work is done for it.

Each bound is a gateway flag (and MESHLM_* variable), on by default:

- HTTP body, `--http-max-body-bytes` (16 MiB): past it 413 before the body is read
  (`front/body_limit.py`).
- public gRPC message, `--grpc-max-receive-bytes` (16 MiB): past it RESOURCE_EXHAUSTED from grpc
  itself ("Received message larger than max"); the internal mesh ports keep 64 MiB.
- prompt characters, `--max-prompt-chars` (the context length x 32): past it INVALID_ARGUMENT /
  400 before tokenization (a chat: its messages' characters).
- requests of one call, `--max-batch` (`--max-inflight`): prompts x n samples past it are
  INVALID_ARGUMENT / 400 before any enters the mesh.

A prompt longer than the context length times PROMPT_CHARS_PER_TOKEN characters will not fit:
real text averages 2 to 6 characters a token, and even long runs of spaces or symbols stay far
below 32 (a prompt built to average more is refused; raise the flag to serve it). A call whose
prompts x n samples exceed what this gateway admits at once (`--max-inflight`) could never be
admitted. The 10 MB prompts the bounds were made for are refused in about 20 ms of the event
loop; the tokenizer, past a gateway with a higher bound, refuses them by a piecewise count
(`tokenizer/long_prompts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_BODY_BYTES = 16 * MIB
DEFAULT_GRPC_RECEIVE_BYTES = 16 * MIB
DEFAULT_READ_TIMEOUT = 30.0  # seconds (nginx's client_header_timeout and body timeout: 60)
PROMPT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Bounds:
    """The bounds as configured; 0 means "sized from the model" (prompt characters) or "from
    --max-inflight" (batch)."""

    max_body_bytes: int = DEFAULT_BODY_BYTES
    max_prompt_chars: int = 0
    max_batch: int = 0
    max_inflight: int = 1024
    read_timeout: float = DEFAULT_READ_TIMEOUT  # an HTTP request's head, its body's pieces

    def prompt_chars(self, max_model_len: int) -> int:
        """Characters a text prompt may have, for a model of this context length."""
        if self.max_prompt_chars > 0:
            return self.max_prompt_chars
        return max_model_len * PROMPT_CHARS_PER_TOKEN

    @property
    def batch(self) -> int:
        """Requests (prompts x samples) one call may put into the mesh: never more than the
        gateway admits at once."""
        if self.max_batch > 0:
            return min(self.max_batch, self.max_inflight)
        return self.max_inflight


def text_chars(value: object) -> int:
    """Characters of every string in a JSON-like value (a chat's messages: contents, names,
    tool calls), keys included. Iterative: a deeply nested body cannot exhaust the stack."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(str(k)) for k in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
