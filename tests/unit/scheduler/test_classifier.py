"""Sequence classification: Llama, Qwen2 and Mistral *ForSequenceClassification checkpoints
written by transformers, served through the engine's embedding path (batched, chunked, prefix
cached), against transformers' own logits; last non-pad token pooling included."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import greedy, run_all

from meshlm.scheduler.engine.engine import Engine, EngineConfig
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.loader import load_model

transformers = pytest.importorskip("transformers")

PAD = 0
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
}
CASES = {
    "llama-3-labels": ("LlamaConfig", {"num_labels": 3}),
    "qwen2-1-label": ("Qwen2Config", {"num_labels": 1}),
    "mistral-2-labels": ("MistralConfig", {"id2label": {0: "no", 1: "yes"}, "head_dim": 16}),
}


@pytest.fixture(scope="module", params=list(CASES))
def classifier(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    config_class, kwargs = CASES[request.param]
    config = getattr(transformers, config_class)(**SHAPE, **kwargs, pad_token_id=PAD,
                                                 bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _hf_logits(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([prompt])).logits[0].float()


def test_config_reads_the_classifier(classifier: tuple[Any, Path]) -> None:
    hf, path = classifier
    saved = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_dir(path)
    assert config.architecture == saved["architectures"][0] == type(hf).__name__
    assert config.is_classifier and not config.has_lm_head
    assert config.num_labels == hf.config.num_labels and config.pad_token_id == PAD
    model, _ = load_model(path)
    assert model.score is not None and tuple(model.score.weight.shape) == (
        hf.config.num_labels, SHAPE["hidden_size"])


def test_class_logits_match_hf(classifier: tuple[Any, Path]) -> None:
    hf, path = classifier
    engine = Engine(EngineConfig(str(path), device="cpu", dtype="float32", max_running=4,
                                 max_batched_tokens=24, block_size=4))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 6, 30, 61, 90)]
    prompts.append(prompts[3][:45])  # a shared prefix: cached
    prompts.append(prompts[2] + [PAD, PAD, PAD])  # trailing pads: pooled before them
    prompts.append(prompts[4][:40] + [PAD] * 30)  # ... in an earlier chunk than the last
    prompts.append([PAD, PAD])  # all pad: position 0, as transformers
    for i, prompt in enumerate(prompts):
        engine.add_embed_request(f"c{i}", prompt)
    outs = run_all(engine)
    stats = engine.stats()
    assert stats["chunked_prefills_total"] > 0 and stats["cached_tokens_total"] > 0
    assert stats["kv_blocks_used"] == 0
    for i, prompt in enumerate(prompts):
        [out] = outs[f"c{i}"]
        assert out.finished and out.finish_reason == "stop" and out.embedding is not None
        got = torch.tensor(out.embedding)
        assert got.shape == (hf.config.num_labels,)
        torch.testing.assert_close(got, _hf_logits(hf, prompt), atol=1e-4, rtol=0,
                                   msg=f"prompt {i}")


def test_classifier_refuses_generation(classifier: tuple[Any, Path]) -> None:
    _, path = classifier
    engine = Engine(EngineConfig(str(path), device="cpu", max_running=2))
    engine.add_request("g", [5, 6, 7], greedy(3))
    [out] = run_all(engine)["g"]
    assert out.finish_reason == "error" and "language-model head" in (out.error or "")


def test_pool_position() -> None:
    config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=4,
                         architecture="LlamaForSequenceClassification", num_labels=2,
                         pad_token_id=0)
    assert [config.pool_position(p) for p in ([5, 6], [5, 0, 0], [0, 0], [0, 5])] == [1, 0, 0, 1]
    no_pad = ModelConfig(**{**config.__dict__, "pad_token_id": None})
    assert no_pad.pool_position([5, 0, 0]) == 2
    causal = ModelConfig(**{**config.__dict__, "architecture": "LlamaForCausalLM"})
    assert causal.pool_position([5, 0, 0]) == 2 and not causal.is_classifier
