"""ModelConfig: per-architecture fields (biases, sliding window) and both RoPE config layouts."""

from __future__ import annotations

from typing import Any

import pytest

from meshlm.scheduler.models.config import ModelConfig

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}


def config(arch: str, **kw: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, "architectures": [arch], **kw})


def test_llama_attention_bias_covers_q_k_v_and_o() -> None:
    plain = config("LlamaForCausalLM")
    assert not (plain.qkv_bias or plain.o_proj_bias or plain.mlp_bias)
    biased = config("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    assert biased.qkv_bias and biased.o_proj_bias and biased.mlp_bias
    assert plain.sliding_window is None and plain.window_of(0) is None


def test_qwen2_has_qkv_bias_and_a_window_only_when_enabled() -> None:
    # Released Qwen2 configs carry a sliding_window with use_sliding_window false: no window.
    off = config("Qwen2ForCausalLM", sliding_window=32768, use_sliding_window=False)
    assert off.qkv_bias and not off.o_proj_bias and off.sliding_window is None
    legacy = config(
        "Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True, max_window_layers=2
    )
    assert legacy.sliding_window == 16 and legacy.sliding_window_layers == (2, 3)
    assert [legacy.window_of(i) for i in range(4)] == [None, None, 16, 16]
    types = ["sliding_attention", "full_attention"] * 2
    typed = config(
        "Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True, layer_types=types
    )
    assert typed.sliding_window_layers == (0, 2)
    all_full = config(
        "Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True, max_window_layers=4
    )
    assert all_full.sliding_window is None


def test_mistral_window_is_every_layer_or_none() -> None:
    windowed = config("MistralForCausalLM", sliding_window=4096)
    assert windowed.sliding_window == 4096 and windowed.sliding_window_layers == (0, 1, 2, 3)
    assert not windowed.qkv_bias
    assert config("MistralForCausalLM", sliding_window=None).sliding_window is None


def test_rope_from_old_and_new_layouts() -> None:
    old = config("LlamaForCausalLM", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2})
    new = config(
        "LlamaForCausalLM",
        rope_parameters={"rope_type": "linear", "factor": 2, "rope_theta": 5e5},
        dtype="bfloat16",
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2}
    assert new.torch_dtype == "bfloat16"
    plain = {"rope_type": "default", "rope_theta": 1e6}
    default = config("LlamaForCausalLM", rope_parameters=plain)
    assert default.rope_theta == 1e6 and default.rope_scaling is None


@pytest.mark.parametrize("kind", ["yarn", "longrope", "mrope"])
def test_unsupported_rope_kinds_are_named(kind: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported rope_scaling type '{kind}'"):
        config("LlamaForCausalLM", rope_scaling={"rope_type": kind, "factor": 4.0})


def test_per_layer_type_rope_parameters_rejected() -> None:
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="per-layer-type"):
        config("LlamaForCausalLM", rope_parameters=nested)
