"""The launcher's restart policy: backoff that doubles up to a cap, and a crash loop once a
service has used up its restarts within the window."""

from __future__ import annotations

from meshlm.launch.supervisor import CrashHistory, CrashLoop, RestartPolicy


def test_backoff_doubles_up_to_the_cap() -> None:
    history = CrashHistory(RestartPolicy(backoff=0.5, max_backoff=3.0, max_restarts=10,
                                         window=60.0))
    delays = [history.exited("scheduler", t) for t in range(6)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_one_exit_more_than_max_restarts_within_the_window_is_a_crash_loop() -> None:
    history = CrashHistory(RestartPolicy(backoff=0.1, max_restarts=3, window=60.0))
    assert all(history.exited("tokenizer", t) is not None for t in (0.0, 1.0, 2.0))
    assert history.exited("tokenizer", 3.0) is None
    assert history.restarts("tokenizer") == 3


def test_restarts_older_than_the_window_are_forgotten_and_the_backoff_resets() -> None:
    history = CrashHistory(RestartPolicy(backoff=0.5, max_restarts=2, window=10.0))
    assert history.exited("detokenizer", 0.0) == 0.5
    assert history.exited("detokenizer", 5.0) == 1.0
    assert history.exited("detokenizer", 12.0) == 1.0  # the first restart left the window
    assert history.exited("detokenizer", 30.0) == 0.5  # both did
    assert history.restarts("detokenizer") == 1


def test_services_are_counted_apart() -> None:
    history = CrashHistory(RestartPolicy(backoff=1.0, max_restarts=1, window=60.0))
    assert history.exited("scheduler", 0.0) == 1.0
    assert history.exited("scheduler-1", 0.0) == 1.0
    assert history.exited("scheduler", 1.0) is None
    assert history.restarts("scheduler-1") == 1


def test_the_crash_loop_message_names_the_service_and_its_last_lines() -> None:
    loop = CrashLoop("scheduler-1", -9, 5, 60.0, "/w/logs/scheduler-1.log", "line a\nline b")
    text = loop.message()
    assert text.startswith("meshlm: scheduler-1 exited with code -9 after 5 restarts within 60 s")
    assert text.endswith("Last lines of /w/logs/scheduler-1.log:\nline a\nline b")
