"""The embedded default model: deterministic, atomic to build, HF-shaped, with spread logits."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from meshlm.common import default_model as dm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.ensure_default_model(tmp_path_factory.mktemp("cache"))


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_two_builds_are_byte_identical(tmp_path: Path, model_dir: Path) -> None:
    other = dm.ensure_default_model(tmp_path)
    assert other == tmp_path / "models" / "meshlm-tiny-v1"
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_existing_model_is_reused(tmp_path: Path) -> None:
    path = dm.ensure_default_model(tmp_path)
    marker = path / "config.json"
    before = marker.stat().st_mtime_ns
    assert dm.ensure_default_model(tmp_path) == path
    assert marker.stat().st_mtime_ns == before


def test_incomplete_target_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "models" / "meshlm-tiny-v1"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert dm.ensure_default_model(tmp_path) == target
    assert (target / "model.safetensors").is_file()
    assert _json(target / "config.json")["model_type"] == "llama"
    assert sorted(p.name for p in target.parent.iterdir()) == ["meshlm-tiny-v1"]


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path / "env-cache"))
    assert dm.default_cache_dir() == tmp_path / "env-cache"
    assert dm.ensure_default_model() == tmp_path / "env-cache" / "models" / "meshlm-tiny-v1"


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    # spawn, not fork: a fork taken while this process runs gRPC or torch threads (the e2e
    # meshes share the pytest process in CI) can copy a held lock and hang the child.
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        paths = list(pool.map(dm.ensure_default_model, [str(tmp_path)] * 4))
    assert len(set(paths)) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["meshlm-tiny-v1"]
    assert Tokenizer.from_file(str(paths[0] / "tokenizer.json")).get_vocab_size() == 2048


def test_configs_agree_with_tokenizer(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = _json(model_dir / "config.json")
    gen = _json(model_dir / "generation_config.json")
    tok_cfg = _json(model_dir / "tokenizer_config.json")
    ids = {t: tok.token_to_id(t) for t in dm.SPECIAL_TOKENS}
    assert None not in ids.values()
    assert config["vocab_size"] == tok.get_vocab_size() == 2048
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["bos_token_id"] == gen["bos_token_id"] == ids["<|begin_of_text|>"]
    eos = [ids["<|im_end|>"], ids["<|end_of_text|>"]]
    assert config["eos_token_id"] == gen["eos_token_id"] == eos
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["bos_token"] == "<|begin_of_text|>"
    assert tok_cfg["pad_token"] == "<|pad|>"
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert _json(model_dir / "special_tokens_map.json")["eos_token"] == "<|im_end|>"
    for token_id in ids.values():
        assert tok_cfg["added_tokens_decoder"][str(token_id)]["special"] is True


def test_tokenizer_adds_bos_and_round_trips(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    text = "Hello, wörld! 你好 😀 \t tabs\n\n  and  spaces "
    with_bos = tok.encode(text).ids
    assert with_bos[0] == bos
    assert tok.encode(text, add_special_tokens=False).ids == with_bos[1:]
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert tok.encode("<|im_start|>user").tokens[1] == "<|im_start|>"


def test_weights_have_hf_llama_names_and_shapes(model_dir: Path) -> None:
    config = _json(model_dir / "config.json")
    weights = load_file(str(model_dir / "model.safetensors"))
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == torch.float32 for v in weights.values())


def llama_forward(
    config: dict[str, Any], w: dict[str, torch.Tensor], ids: list[int]
) -> torch.Tensor:
    """Reference HF Llama forward (no cache): logits [len(ids), vocab]."""
    n, heads, kv_heads = len(ids), config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    eps = config["rms_norm_eps"]

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = config["rope_theta"] ** -(torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(n).float(), inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x: torch.Tensor) -> torch.Tensor:  # HF half rotation
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.full((n, n), float("-inf")).triu(1)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, head_dim).transpose(0, 1)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        attn = torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5 + causal, -1) @ v
        h = (
            h
            + attn.transpose(0, 1).reshape(n, heads * head_dim) @ w[p + "self_attn.o_proj.weight"].T
        )
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small matmuls run faster on one thread than contending for a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_logits_are_spread(model_dir: Path) -> None:
    """Logits of a few units with clear top-2 gaps: greedy decoding has no near-ties."""
    config = _json(model_dir / "config.json")
    weights = load_file(str(model_dir / "model.safetensors"))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    logits = llama_forward(config, weights, tok.encode(dm.CORPUS[:2000]).ids)
    stds = logits.std(-1)
    top2 = logits.topk(2, -1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert 3.0 < float(stds.min()) and float(stds.max()) < 5.0
    assert float(gaps.min()) > 1e-4
    assert float((gaps < 1e-2).float().mean()) < 0.02
    assert float(gaps.median()) > 0.3


@pytest.mark.usefixtures("one_thread")
def test_greedy_decoding_does_not_collapse(model_dir: Path) -> None:
    config = _json(model_dir / "config.json")
    weights = load_file(str(model_dir / "model.safetensors"))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for prompt in ("The harbor woke slowly.", "What is the capital of France?", "Hi"):
        ids = tok.encode(prompt).ids
        start = len(ids)
        for _ in range(16):
            ids.append(int(llama_forward(config, weights, ids)[-1].argmax()))
        generated = ids[start:]
        assert len(set(generated)) >= 12, tok.decode(generated)
