"""Embeddings: bare *Model checkpoints written by HF, pooled as their config says, batched and
chunked, against transformers' last_hidden_state."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import greedy, run_all

from meshlm.scheduler.engine.engine import Engine, EngineConfig

transformers = pytest.importorskip("transformers")

SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def sentence_transformers_files(path: Path, mode: str) -> None:
    """modules.json + 1_Pooling/config.json as sentence-transformers writes them."""
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": SHAPE["hidden_size"],
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_lasttoken": mode == "last",
        "pooling_mode_cls_token": False,
    }))


@pytest.fixture(scope="module", params=["Qwen2Config-last", "LlamaConfig-mean"])
def embedder(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    config_class, mode = request.param.split("-")
    config = getattr(transformers, config_class)(**SHAPE)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    if mode == "mean":
        sentence_transformers_files(path, mode)
    return model, path, mode


def test_embeddings_match_hf_pooled_hidden_states(embedder: tuple[Any, Path, str]) -> None:
    hf, path, mode = embedder
    engine = Engine(EngineConfig(str(path), device="cpu", dtype="float32", max_running=4,
                                 max_batched_tokens=24, block_size=4))
    assert engine.model_config.pooling == mode
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 7, 30, 61, 100)]
    prompts.append(prompts[3][:50])  # a shared prefix: cached for last-token pooling
    for i, prompt in enumerate(prompts):
        engine.add_embed_request(f"e{i}", prompt)
    outs = run_all(engine)
    stats = engine.stats()
    assert stats["chunked_prefills_total"] > 0 and stats["kv_blocks_used"] == 0
    for i, prompt in enumerate(prompts):
        [out] = outs[f"e{i}"]
        assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []
        assert out.prompt_tokens == len(prompt) and out.embedding is not None
        with torch.inference_mode():
            hidden = hf(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
        pooled = hidden.mean(0) if mode == "mean" else hidden[-1]
        expected = torch.nn.functional.normalize(pooled, dim=-1)
        got = torch.tensor(out.embedding)
        assert got.shape == (SHAPE["hidden_size"],)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert abs(float(got.norm()) - 1.0) < 1e-5


def test_embedding_model_refuses_generation(embedder: tuple[Any, Path, str]) -> None:
    _, path, _ = embedder
    engine = Engine(EngineConfig(str(path), device="cpu", max_running=2))
    engine.add_request("g", [5, 6, 7], greedy(3))
    [out] = run_all(engine)["g"]
    assert out.finish_reason == "error" and "embeddings only" in (out.error or "")
