"""ModelConfig: the fields of an HF `config.json` (+ `generation_config.json`) the engine uses.

Torch-free, so the scheduler's policy and the service can read a model's limits without
loading weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures the Llama module serves. Qwen2 (q/k/v bias) and Mistral (sliding window) share
# its HF layout and are left to a later change: the bias switches below are already in place.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family model's shape and token ids."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from config.json's dict; EOS ids are the union of both files' eos_token_id."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; have {SUPPORTED_ARCHITECTURES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = _id_set(cfg.get("eos_token_id")) | _id_set((generation or {}).get("eos_token_id"))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=cfg.get("torch_dtype"),
            eos_token_ids=tuple(sorted(eos)),
            bos_token_id=cfg.get("bos_token_id"),
            architecture=arch,
            raw=dict(cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` and, when present, `generation_config.json` from a model dir."""
        root = Path(path)
        cfg = json.loads((root / "config.json").read_text())
        gen_path = root / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_dict(cfg, generation)
