"""--event-loop: uvloop by default but for the scheduler, either loop when named, and a clear
error for anything else."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from meshlm.common.service import event_loop


def test_auto_runs_uvloop_but_for_the_scheduler():
    assert event_loop("gateway", "auto") is uvloop.run
    assert event_loop("tokenizer", "auto") is uvloop.run
    assert event_loop("detokenizer", "auto") is uvloop.run
    assert event_loop("scheduler", "auto") is asyncio.run


def test_a_named_loop_is_used_for_any_role():
    assert event_loop("scheduler", "uvloop") is uvloop.run
    assert event_loop("gateway", "asyncio") is asyncio.run


def test_the_chosen_loop_runs_the_service():
    async def loop_kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert event_loop("gateway", "auto")(loop_kind()).startswith("uvloop")
    assert event_loop("scheduler", "auto")(loop_kind()).startswith("asyncio")


def test_an_unknown_loop_is_refused_naming_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--event-loop: 'trio' is not one of auto, uvloop, "
                                         r"asyncio"):
        event_loop("gateway", "trio")
