"""What the scheduler keeps per request beside the engine's own state, and the status codes its
error outputs carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from opentelemetry import trace

from meshlm.scheduler.engine.sequence import StepOutput
from meshlm.v1 import common_pb2


class Code(IntEnum):
    """The status code of a request's error output: google.rpc.Code numbers (those of
    grpc.StatusCode), without importing grpc."""

    INVALID_ARGUMENT = 3
    CANCELLED = 1
    DEADLINE_EXCEEDED = 4
    ALREADY_EXISTS = 6
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    UNAVAILABLE = 14


@dataclass
class Tracked:
    """A live request as the engine loop sees it: its meta as the gateway built it (where its
    outputs go, its deadline; sent on whole in its first output's header), and why it ends if
    the engine did not end it itself."""

    meta: common_pb2.RequestMeta
    prompt_tokens: int
    span: trace.Span
    header_sent: bool = False
    silent: bool = False  # finished elsewhere (stop string): its abort output is not sent
    first_token_at: float | None = None
    # Kept until sent: with the prompt logprobs, or in the header (return_prompt_ids).
    prompt_ids: list[int] = field(default_factory=list)
    # Status code of an engine refusal: a generation request to an embedding-only model is
    # FAILED_PRECONDITION (the model cannot do it), any other refusal INVALID_ARGUMENT.
    error_code: Code = Code.INVALID_ARGUMENT
    expired: bool = False  # aborted because the deadline passed: ends DEADLINE_EXCEEDED
    forfeit: str = ""  # given up by the watchdog (why): ends UNAVAILABLE
    # Aborted with every other request (abort_all): its abort output says so, CANCELLED.
    cancelled: bool = False
    # Tokens per piece of its outputs (1: each leaves at once; pacing.py), and what is held.
    hold: int = 1
    held: StepOutput | None = None
    # Read from `meta` once, for every output: where they go, and whether they carry logprobs.
    detokenizer: str = field(init=False)
    return_logprob: bool = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizer = self.meta.route.detokenizer
        self.return_logprob = self.meta.sampling.return_logprob
