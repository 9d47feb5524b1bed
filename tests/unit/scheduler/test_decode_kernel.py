"""The native decode attention kernel (kernels/decode_attention.c) against the torch path it
replaces, and how the engine picks a backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshlm.scheduler.engine.engine import Engine, EngineConfig, decode_kernel
from meshlm.scheduler.engine.kv_cache import _cache_rows, _decode_attention, _gather, _visible
from meshlm.scheduler.kernels import native
from meshlm.scheduler.models.config import ModelConfig


def _kernel() -> native.DecodeAttention:
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    return kernel


@pytest.mark.parametrize(("heads", "kv_heads", "window", "d"), [
    (4, 4, None, 16), (8, 2, None, 64), (8, 4, 5, 128), (6, 1, 40, 16), (4, 2, 7, 64),
])
def test_kernel_matches_the_gathered_torch_attention(heads: int, kv_heads: int,
                                                     window: int | None, d: int) -> None:
    """Rows of different lengths, scattered and shared blocks, queries taken out of order
    from a packed step whose head and row strides are not contiguous ones, and a sliding
    window: the same output as the gather and two matmuls; head sizes the kernel unrolls
    (64, 128) and one it does not."""
    torch.manual_seed(0)
    bs, blocks, rows = 4, 32, 5
    k_cache = torch.randn(kv_heads, blocks, bs, d)
    v_cache = torch.randn(kv_heads, blocks, bs, d)
    positions = torch.tensor([0, 3, 17, 9, 30])
    tables = torch.stack([torch.randperm(blocks)[:8] for _ in range(rows)])
    tables[1, :2] = tables[0, :2]  # a shared prefix block
    # A packed step of 9 tokens laid out [T, heads, D] (as a projection leaves them), viewed
    # [heads, T, D]; the decode rows are some of them, out of order.
    packed = torch.randn(9, heads, d).transpose(0, 1)
    picked = torch.tensor([7, 2, 0, 5, 3])
    out = torch.zeros(9, heads, d).transpose(0, 1)

    last = positions + 1
    first = (last - window).clamp(min=0) if window is not None else torch.zeros_like(last)
    kernel = _kernel()
    scratch = torch.empty(kernel.scratch_size(heads, kv_heads, tables.shape[1] * bs))
    kernel(packed, out, picked, tables, first, last, k_cache, v_cache, scratch)

    rows_2d = _cache_rows(k_cache, tables)
    keys = _gather(k_cache, rows_2d, tuple(tables.shape))
    values = _gather(v_cache, rows_2d, tuple(tables.shape))
    visible = _visible(positions, keys.shape[2], window)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, :]
    expected = _decode_attention(packed.index_select(1, picked).contiguous(), keys, values,
                                 bias)
    torch.testing.assert_close(out.index_select(1, picked), expected, atol=1e-5, rtol=1e-5)
    untouched = [r for r in range(9) if r not in picked.tolist()]
    assert torch.count_nonzero(out[:, untouched]) == 0


def test_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "meshlm-no-such-compiler")
    with pytest.raises(native.BuildError, match="no C compiler"):
        native._build()


def test_a_build_is_kept_and_serves_without_a_compiler(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path))
    first = native._build()
    assert first == native.built_path() and first.parent == tmp_path / "kernels"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left
    monkeypatch.setenv("CC", "meshlm-no-such-compiler")  # an image without one
    assert native._build() == first


def test_the_backend_asked_for_is_the_one_served(gqa_model: Path) -> None:
    cfg = ModelConfig.from_dir(gqa_model)
    cpu = torch.device("cpu")
    assert decode_kernel("torch", cfg, torch.float32, cpu) is None
    assert isinstance(decode_kernel("native", cfg, torch.float32, cpu), native.DecodeAttention)
    assert decode_kernel("auto", cfg, torch.bfloat16, cpu) is None  # torch serves the rest
    with pytest.raises(ValueError, match="native kernel serves float32"):
        decode_kernel("native", cfg, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="expected one of auto, native, torch"):
        decode_kernel("flash", cfg, torch.float32, cpu)


@torch.inference_mode()
def test_native_and_torch_engines_draw_the_same_tokens(gqa_model: Path) -> None:
    """Greedy decoding of a batch of different lengths, step by step, the same either way."""
    from meshlm.scheduler.engine.engine import SamplingParams

    outputs = {}
    for backend in ("native", "torch"):
        engine = Engine(EngineConfig(model_path=str(gqa_model), block_size=4, max_running=4,
                                     attention_backend=backend))
        assert engine.attention_backend == backend
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for i, n in enumerate((3, 17, 40)):
            engine.add_request(f"r{i}", [(i * 31 + j * 7) % 200 + 3 for j in range(n)], params)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        outputs[backend] = tokens
    assert outputs["native"] == outputs["torch"]
    assert all(len(t) == 24 for t in outputs["native"].values())
