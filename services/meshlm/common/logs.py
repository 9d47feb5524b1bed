"""One JSON line per event on stderr: {"ts", "level", "service", "event", ...fields}."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_service = "meshlm"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": _service,
            "event": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class EventLogger:
    """`log.info("listening", address="127.0.0.1:1234")` -> one JSON line."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, exc: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, exc_info=exc, extra={"fields": fields}, stacklevel=3)

    def debugging(self) -> bool:
        """Whether debug lines are written: test it before computing a hot path's fields."""
        return self._log.isEnabledFor(logging.DEBUG)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, False, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, False, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, True, fields)


def setup_logging(service: str, level: str = "info") -> None:
    """Route every logger (ours and libraries') through the JSON formatter."""
    global _service
    _service = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("grpc", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.Formatter.converter = time.gmtime


def get_logger(name: str) -> EventLogger:
    return EventLogger(name)
