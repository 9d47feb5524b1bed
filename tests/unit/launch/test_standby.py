"""ServiceProcess's standby: a real detokenizer started ahead, waiting at its gate, that the
next start() uses instead of a fresh process; discarded when its command line changed."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlm.common.service import START_GATE_ENV
from meshlm.launch.certs import ensure_dev_certs
from meshlm.launch.process import ServiceProcess

IMPORT_TIMEOUT = 120.0  # a loaded 2-core CI machine imports slowly


def _events(path: Path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()
            if line.startswith("{")]


def _listening(proc: ServiceProcess, timeout: float = IMPORT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while proc.listening is None:
        assert proc.running, proc.tail()
        assert time.monotonic() < deadline, "no listening line"
        time.sleep(0.02)


@pytest.fixture
def detokenizer(tmp_path: Path) -> Iterator[ServiceProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(START_GATE_ENV, None)
    certs = ensure_dev_certs(tmp_path / "certs")
    flags = {"host": "127.0.0.1", "port": "0", "mesh-ca": str(certs.ca_cert),
             "mesh-cert": str(certs.mesh_cert), "mesh-key": str(certs.mesh_key)}
    proc = ServiceProcess("detokenizer", "detokenizer", flags, env,
                          tmp_path / "detokenizer.log")
    yield proc
    proc.discard_standby()
    proc.stop(10.0)


def test_a_start_uses_the_waiting_standby(detokenizer: ServiceProcess) -> None:
    detokenizer.prepare_standby()
    assert detokenizer.wait_standby(IMPORT_TIMEOUT)
    standby_pid = detokenizer._standby.pid if detokenizer._standby else None
    assert not detokenizer.running  # waiting is not serving: nothing started, no log yet
    assert not detokenizer.log_path.exists()

    began = time.monotonic()
    detokenizer.start()
    _listening(detokenizer)
    assert detokenizer.pid == standby_pid
    assert time.monotonic() - began < IMPORT_TIMEOUT
    events = _events(detokenizer.log_path)
    assert events[:2] == ["standby_ready", "starting"] and "listening" in events, events
    # It is the standby (started with the gate's variable), now used up.
    assert START_GATE_ENV.encode() in Path(f"/proc/{detokenizer.pid}/environ").read_bytes()
    assert detokenizer._standby is None


def test_a_standby_for_another_command_line_is_discarded(detokenizer: ServiceProcess) -> None:
    detokenizer.prepare_standby()
    standby = detokenizer._standby
    assert standby is not None
    detokenizer.flags["log-level"] = "debug"  # the service changed since
    detokenizer.start()
    _listening(detokenizer)
    assert detokenizer.pid != standby.pid
    assert standby.returncode is not None  # killed and reaped
    assert "standby_ready" not in _events(detokenizer.log_path)


def test_discarding_a_standby_ends_it(detokenizer: ServiceProcess) -> None:
    detokenizer.prepare_standby()
    standby = detokenizer._standby
    assert standby is not None
    detokenizer.discard_standby()
    assert standby.returncode is not None
    assert detokenizer._standby is None
    assert not detokenizer.wait_standby(0)


def test_a_standby_told_nothing_exits_quietly_when_its_stdin_closes(tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, START_GATE_ENV: "stdin", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "meshlm.detokenizer", "--port", "0"],
                          input=b"", capture_output=True, env=env, timeout=IMPORT_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["event"] for line in proc.stderr.splitlines()] == ["standby_ready"]
