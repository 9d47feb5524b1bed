"""`python -m meshlm.bench.attention`'s parts: what a call reads, and a timed call."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.bench.attention import Shape, kv_bytes, time_call
from meshlm.scheduler.kernels import native


def test_kv_bytes_counts_keys_and_values_of_every_kv_head_and_row() -> None:
    shape = Shape("t", heads=4, kv_heads=2, head_dim=16, rows=3, keys=10)
    assert kv_bytes(shape, torch.float32) == 2 * 2 * 3 * 10 * 16 * 4
    assert kv_bytes(shape, torch.bfloat16) == 2 * 2 * 3 * 10 * 16 * 2


@pytest.mark.parametrize("sets", [1, 3])
def test_a_call_is_timed_warm_and_over_several_sets_of_blocks(sets: int) -> None:
    kernels = native.load()
    assert not isinstance(kernels, native.BuildError), kernels
    us = time_call(kernels, Shape("t", 4, 2, 32, rows=2, keys=40), torch.float32, sets,
                   rounds=1)
    assert math.isfinite(us) and 0 < us < 1e6
