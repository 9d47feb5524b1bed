"""Fixtures: tiny checkpoints and engines over them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from scheduler_helpers import (
    GPU_TEST_KV_BYTES,
    TEST_DEVICE,
    EngineFactory,
    Outputs,
    make_servicer,
    write_checkpoint,
)

from meshlm.scheduler.engine.engine import Engine, EngineConfig
from meshlm.scheduler.server import SchedulerServicer


@pytest.fixture(scope="session")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads over 2 KV heads, untied head."""
    return write_checkpoint(tmp_path_factory.mktemp("gqa"))


@pytest.fixture(scope="session")
def mha_tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Multi-head attention (kv_heads == heads), tied embeddings."""
    return write_checkpoint(tmp_path_factory.mktemp("tied"), kv_heads=4, tied=True, seed=1)


@pytest.fixture(scope="session")
def gqa_engine(gqa_model: Path) -> Engine:
    """Shared engine; tests must leave it idle (every request finished)."""
    return Engine(EngineConfig(str(gqa_model), device=TEST_DEVICE, max_running=64,
                               kv_cache_bytes=GPU_TEST_KV_BYTES))




@pytest.fixture
def make_engine(gqa_model: Path) -> EngineFactory:
    def make(path: Path | None = None, **kw: Any) -> Engine:
        kw.setdefault("device", TEST_DEVICE)
        if not {"num_kv_blocks", "kv_cache_bytes"} & kw.keys():
            kw["kv_cache_bytes"] = GPU_TEST_KV_BYTES
        return Engine(EngineConfig(str(path or gqa_model), **kw))

    return make


@pytest.fixture
async def served(make_engine: EngineFactory) -> AsyncIterator[tuple[SchedulerServicer, Outputs]]:
    """The scheduler service with its engine loop running, outputs collected (no gRPC)."""
    outputs = Outputs()
    servicer = make_servicer(make_engine(max_running=8, block_size=16), outputs)
    task = asyncio.create_task(servicer.loop.run())
    yield servicer, outputs
    task.cancel()
    servicer.loop.close()
