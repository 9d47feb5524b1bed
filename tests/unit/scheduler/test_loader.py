"""load_format="dummy" (config.json only, seeded weights) and the engine's sliding-window cap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scheduler_helpers import (
    EngineFactory,
    greedy,
    reference_greedy,
    run_all,
    tokens_of,
    write_checkpoint,
)

from meshlm.scheduler.models.loader import load_model


def config_only(src: Path, dst: Path, **changes: object) -> Path:
    """A model dir holding src's config.json (with `changes`) and no weights."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_dummy_reads_no_safetensors_and_is_deterministic(gqa_model: Path, tmp_path: Path) -> None:
    path = config_only(gqa_model, tmp_path / "m", architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(path)
    a, cfg = load_model(path, load_format="dummy")
    b, _ = load_model(path, load_format="dummy")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    attn = a.model.layers[0].self_attn
    assert cfg.qkv_bias and torch.count_nonzero(attn.q_proj.bias) == 0
    assert torch.equal(a.model.norm.weight, torch.ones(cfg.hidden_size))
    assert 0.015 < float(attn.q_proj.weight.std()) < 0.025  # initializer_range default 0.02
    assert torch.isfinite(a.forward_full(torch.tensor([[5, 6, 7]]))).all()


def test_dummy_tied_and_bf16(mha_tied_model: Path, tmp_path: Path) -> None:
    path = config_only(mha_tied_model, tmp_path / "m")
    model, _ = load_model(path, dtype=torch.bfloat16, load_format="dummy")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_load_format(gqa_model: Path) -> None:
    with pytest.raises(ValueError, match="load_format"):
        load_model(gqa_model, load_format="pt")


def test_engine_serves_dummy_weights(
    gqa_model: Path, tmp_path: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine(config_only(gqa_model, tmp_path / "m"), load_format="dummy")
    engine.add_request("r", [5, 6, 7], greedy(4))
    assert len(tokens_of(run_all(engine)["r"])) == 4


def test_sliding_window_applies_past_the_window(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """The paged attention applies the window: the full context is served, and decoding
    past the window matches a full recompute within the window."""
    window = {"architectures": ["MistralForCausalLM"], "sliding_window": 8}
    path = write_checkpoint(tmp_path / "m", layers=2, extra_config=window)
    engine = make_engine(path, block_size=4, max_batched_tokens=16)
    assert engine.max_model_len == 256 and engine.model_config.sliding_window == 8
    prompt = list(range(5, 35))
    engine.add_request("w", prompt, greedy(6))
    assert tokens_of(run_all(engine)["w"]) == reference_greedy(engine, prompt, 6)


def test_loading_imports_neither_dynamo_nor_sympy(gqa_model: Path) -> None:
    """Building the model on the meta device and giving it memory goes around torch's
    reference ops, whose first use imports torch._dynamo and sympy: 2-3 s of every scheduler
    start (a restarted one's included) on a 2-core machine. In a fresh interpreter, since this
    one may have imported them already."""
    code = ("import sys\nfrom meshlm.scheduler.models.loader import load_model\n"
            f"model, _ = load_model({str(gqa_model)!r})\n"
            "assert next(model.parameters()).device.type == 'cpu'\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
