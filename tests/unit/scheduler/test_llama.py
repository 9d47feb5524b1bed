"""Model and loader: HF layout, tied/untied heads, dtypes, RoPE, and the cache path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scheduler_helpers import write_checkpoint

from meshlm.scheduler.engine.kv_cache import DecodeAttention, KVCache, PrefillAttention
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.llama import LlamaForCausalLM, _inv_freq
from meshlm.scheduler.models.loader import load_model, resolve_dtype


def test_untied_loads_every_tensor(gqa_model: Path) -> None:
    model, cfg = load_model(gqa_model)
    state = load_file(str(gqa_model / "model.safetensors"))
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4 and not cfg.tie_word_embeddings
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_tied_shares_embedding(mha_tied_model: Path) -> None:
    model, cfg = load_model(mha_tied_model)
    assert cfg.tie_word_embeddings
    assert "lm_head.weight" not in load_file(str(mha_tied_model / "model.safetensors"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model.forward_full(torch.tensor([[5, 6, 7]]))
    assert logits.shape == (1, 3, cfg.vocab_size) and logits.dtype == torch.float32


def test_missing_and_unexpected_tensors_raise(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", layers=1)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old HF: ignored
    save_file(state, str(path / "model.safetensors"))
    load_model(path)
    save_file(
        {**state, "model.layers.7.mlp.up_proj.weight": torch.ones(1)},
        str(path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="unexpected"):
        load_model(path)
    del state["model.norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_model(path)


def test_dtype_selection(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "bf16", layers=1, torch_dtype="bfloat16")
    cfg = ModelConfig.from_dir(path)
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    assert resolve_dtype("float16", cfg) == torch.float16
    assert resolve_dtype("auto", ModelConfig.from_dict({**cfg.raw, "torch_dtype": None})) == (
        torch.float32
    )
    with pytest.raises(ValueError):
        resolve_dtype("int8", cfg)
    model, _ = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.forward_full(torch.tensor([[3, 4]])).dtype == torch.float32


def test_config_fields(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", layers=1, extra_config={"head_dim": 32})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    cfg = ModelConfig.from_dir(path)
    assert cfg.head_dim == 32 and cfg.eos_token_ids == (2, 9)
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig.from_dict({**raw, "architectures": ["GPT2LMHeadModel"]})


def test_llama3_rope_scaling_is_identity_at_factor_one() -> None:
    base = {
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 8,
    }
    plain = ModelConfig.from_dict(base)
    scaled = ModelConfig.from_dict(
        {
            **base,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 1.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    cpu = torch.device("cpu")
    assert torch.allclose(_inv_freq(plain, cpu), _inv_freq(scaled, cpu))
    eight = ModelConfig.from_dict({**base, "rope_scaling": {**scaled.rope_scaling, "factor": 8.0}})
    inv = _inv_freq(eight, cpu)
    assert inv[0] == _inv_freq(plain, cpu)[0]  # high frequencies untouched
    assert inv[-1] < _inv_freq(plain, cpu)[-1]  # low frequencies stretched


@pytest.mark.parametrize("slot_ids", [[6, 1], [1, 0]], ids=["gathered", "dense"])
@torch.inference_mode()
def test_cached_prefill_and_decode_match_full_forward(gqa_model: Path, slot_ids: list[int]) -> None:
    """Padded multi-row prefill + one-token decode steps against the cache == full recompute,
    for sparse slots (gathered keys) and dense slots (a view of the cache)."""
    model, cfg = load_model(gqa_model)
    cache = KVCache(cfg.num_layers, 8, cfg.num_kv_heads, 64, cfg.head_dim, torch.float32, "cpu")
    prompts = [[5, 9, 13, 200, 7], [44, 3]]
    slots = torch.tensor(slot_ids)
    ids = torch.tensor([p + [0] * (5 - len(p)) for p in prompts])
    hidden = model(ids, torch.arange(5).expand(2, 5), PrefillAttention(cache, slots))
    logits = model.compute_logits(hidden)
    for row, prompt in enumerate(prompts):
        full = model.forward_full(torch.tensor([prompt]))[0]
        assert torch.allclose(logits[row, : len(prompt)], full, atol=1e-4)
    seqs = [list(p) for p in prompts]
    for _ in range(4):
        for s in seqs:
            s.append(len(s) * 7 % 500)
        positions = torch.tensor([len(s) - 1 for s in seqs])
        attention = DecodeAttention(cache, slot_ids, slots, positions, int(positions.max()) + 1)
        assert (attention.rows is None) == (max(slot_ids) >= 2 * len(slot_ids))
        step = model.compute_logits(
            model(torch.tensor([[s[-1]] for s in seqs]), positions[:, None], attention)
        )
        for row, s in enumerate(seqs):
            full = model.forward_full(torch.tensor([s]))[0, -1]
            assert torch.allclose(step[row, 0], full, atol=1e-4)


def test_module_names_are_hf_names(gqa_model: Path) -> None:
    cfg = ModelConfig.from_dir(gqa_model)
    with torch.device("meta"):
        names = set(LlamaForCausalLM(cfg).state_dict())
    assert names == set(load_file(str(gqa_model / "model.safetensors")))
