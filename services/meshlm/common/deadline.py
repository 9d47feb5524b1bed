"""The client's deadline for the call being served, and what every hop makes of it.

A public call may carry a deadline: gRPC's own, or over HTTP the `grpc-timeout` header (the
convention of grpc-gateway, in gRPC's format: "<digits><unit>", H M S m u n). The transport
adapters set it once per call (`set_deadline`); handlers then bound their internal calls by
what is left (`timeout`), and put the absolute time on the internal requests, where the
tokenizer and the scheduler drop a request once it has passed. Deadlines are unix seconds
(`time.time()`), as they cross processes.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import grpc

from meshlm.common.errors import MeshError

_deadline: ContextVar[float | None] = ContextVar("meshlm_deadline", default=None)

_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
HEADER = "grpc-timeout"
INTERNAL_CALL_TIMEOUT = 10.0  # seconds for an internal unary call when the client sets none


def parse_timeout(value: str) -> float:
    """Seconds from a gRPC timeout ("5S", "250m", up to 8 digits and a unit);
    INVALID_ARGUMENT naming the header otherwise."""
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _UNITS:
        raise MeshError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{HEADER}: expected up to 8 digits and a unit (H, M, S, m, u or n), "
                        f"e.g. '30S' or '500m'; got {value!r}")
    return int(digits) * _UNITS[unit]


def set_deadline(deadline: float | None) -> None:
    """The current call's absolute deadline (None: none); set by the transport adapter."""
    _deadline.set(deadline)


def current() -> float | None:
    return _deadline.get()


def expired_error(what: str = "the request") -> MeshError:
    return MeshError(grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"the client's deadline passed before {what} finished")


def remaining() -> float | None:
    """Seconds left to the current call (None: no deadline); DEADLINE_EXCEEDED if none."""
    deadline = _deadline.get()
    if deadline is None:
        return None
    left = deadline - time.time()
    if left <= 0:
        raise expired_error()
    return left


def timeout(default: float = INTERNAL_CALL_TIMEOUT) -> float:
    """The timeout for an internal unary call made for the client: `default`, or less if the
    client's deadline comes sooner."""
    left = remaining()
    return default if left is None else min(default, left)


def wire(deadline: float | None) -> float:
    """An internal request's deadline field: 0 = none."""
    return deadline or 0.0


def passed(wire_deadline: float, now: float | None = None) -> bool:
    """Whether an internal request's deadline field (0 = none) has passed."""
    return wire_deadline > 0 and (now if now is not None else time.time()) >= wire_deadline
