"""Prepacked oneDNN linears: every decoder projection swapped (q/k/v and gate/up fused), same
logits as nn.Linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from meshlm.scheduler.models.cpu_linear import (
    FusedPackedLinear,
    PackedLinear,
    available,
    pack_linears,
)
from meshlm.scheduler.models.loader import load_model

pytestmark = pytest.mark.skipif(not available(torch.device("cpu"), torch.float32),
                                reason="this torch has no oneDNN linear packing")


@pytest.mark.parametrize("fixture", ["gqa_model", "mha_tied_model"])
@torch.inference_mode()
def test_packed_model_matches_plain(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    plain, cfg = load_model(path)
    packed, _ = load_model(path)
    tied = cfg.tie_word_embeddings
    assert pack_linears(packed) == 7 * cfg.num_layers + (0 if tied else 1)
    # Per layer: q/k/v fused, o, gate/up fused, down; the head, unless tied to the embedding
    # (packing it would hold the matrix twice)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == (
        4 * cfg.num_layers + (0 if tied else 1))
    assert sum(isinstance(m, FusedPackedLinear) for m in packed.modules()) == 2 * cfg.num_layers
    if tied:
        assert isinstance(packed.lm_head, nn.Linear)
        assert packed.lm_head.weight is packed.model.embed_tokens.weight
    else:
        assert isinstance(packed.lm_head, PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in packed.model.layers.modules())
    ids = torch.tensor([[3, 17, 5, 99, 42, 7, 1, 250]])
    torch.testing.assert_close(packed.forward_full(ids), plain.forward_full(ids),
                               atol=1e-5, rtol=1e-5)


def test_nothing_packed_where_unavailable() -> None:
    assert not available(torch.device("cpu"), torch.float16)
    assert not available(torch.device("meta"), torch.float32)
    model = nn.Sequential(nn.Linear(4, 4)).half()
    assert pack_linears(model) == 0


def test_row_buckets_pad_small_batches_and_stay_few() -> None:
    from meshlm.scheduler.models.cpu_linear import MIN_ROWS, row_bucket

    assert [row_bucket(n) for n in range(1, MIN_ROWS + 1)] == [MIN_ROWS] * MIN_ROWS
    assert [row_bucket(n) for n in range(MIN_ROWS + 1, 17)] == list(range(MIN_ROWS + 1, 17))
    assert all(row_bucket(n) >= n for n in range(1, 4097))
    assert len({row_bucket(n) for n in range(1, 2049)}) <= 60
