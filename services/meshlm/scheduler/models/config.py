"""ModelConfig: the fields of an HF `config.json` (+ `generation_config.json`) the engine uses.

Torch-free, so the scheduler's policy and the service can read a model's limits without
loading weights. Llama, Qwen2 and Mistral share one module layout; what differs between them
is read here, per architecture, into plain fields (biases, sliding window). Each comes as a
causal LM, a bare `*Model` (embeddings) and a `*ForSequenceClassification` (a `score` head of
num_labels rows on the last non-pad token).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# RoPE kinds the model implements (`rope_type`, or `type` in older configs).
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def _llama_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False))}


def _qwen2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """q/k/v always have biases; the window applies only with use_sliding_window, and then to
    the layers `layer_types` names (older configs: layers from max_window_layers on)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)
    ]
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return {"qkv_bias": True, **_window(window, sliding)}


def _mistral_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every layer attends within `sliding_window` when it is set."""
    return _window(cfg.get("sliding_window"), range(int(cfg["num_hidden_layers"])))


def _window(window: int | None, layers: Iterable[int]) -> dict[str, Any]:
    chosen = tuple(layers)
    if window is None or not chosen:
        return {}
    return {"sliding_window": int(window), "sliding_window_layers": chosen}


# Per architecture: config.json -> the ModelConfig fields in which it differs from the defaults.
# The bare `*Model` classes are embedding checkpoints: no LM head, weights without "model.".
# `*ForSequenceClassification`: "model.*" plus `score.weight`, no LM head.
ARCHITECTURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama_fields,
    "Qwen2ForCausalLM": _qwen2_fields,
    "MistralForCausalLM": _mistral_fields,
    "LlamaModel": _llama_fields,
    "Qwen2Model": _qwen2_fields,
    "MistralModel": _mistral_fields,
    "LlamaForSequenceClassification": _llama_fields,
    "Qwen2ForSequenceClassification": _qwen2_fields,
    "MistralForSequenceClassification": _mistral_fields,
}
CLASSIFIER_SUFFIX = "ForSequenceClassification"
POOLING_MODES = ("last", "mean")
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _num_labels(cfg: dict[str, Any]) -> int:
    """Classes of a sequence classifier: `num_labels`, else as many as id2label names, else
    transformers' default of 2."""
    if cfg.get("num_labels"):
        return int(cfg["num_labels"])
    return len(cfg.get("id2label") or {}) or 2


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling parameters or None) from either layout: transformers 5 writes one
    `rope_parameters` dict holding rope_theta, older versions `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)  # when the top-level key won
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; have {ROPE_TYPES}")
    return theta, None if kind == "default" else {"rope_type": kind, **params}


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
    rope_scaling: dict[str, Any] | None = None  # with "rope_type" in ROPE_TYPES; None = default
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Layers in sliding_window_layers attend to the last sliding_window positions (their own
    # included); the others to all. None when no layer has a window.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    # Embeddings: how hidden states pool into one vector (sentence-transformers'
    # 1_Pooling/config.json when the checkpoint has one, else the last token's).
    pooling: str = "last"
    # Sequence classifiers: the score head's rows (0 = no head), and the pad id whose
    # trailing occurrences last-token pooling skips (as transformers does).
    num_labels: int = 0
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_lm_head(self) -> bool:
        """False for embedding-only checkpoints (the bare `*Model` architectures) and sequence
        classifiers."""
        return not (self.architecture.endswith("Model") or self.is_classifier)

    @property
    def is_classifier(self) -> bool:
        """A `*ForSequenceClassification` checkpoint: its pooled output is class logits."""
        return self.architecture.endswith(CLASSIFIER_SUFFIX)

    def pool_position(self, prompt_ids: list[int]) -> int:
        """The position last-token pooling takes: the last token, or for a classifier with a
        pad id the last one that is not the pad (position 0 when all are), as transformers'
        *ForSequenceClassification does."""
        if self.is_classifier and self.pad_token_id is not None:
            for i in range(len(prompt_ids) - 1, -1, -1):
                if prompt_ids[i] != self.pad_token_id:
                    return i
            return 0
        return max(len(prompt_ids) - 1, 0)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None if it attends to every earlier position."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from config.json's dict; EOS ids are the union of both files' eos_token_id."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; have {SUPPORTED_ARCHITECTURES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = _id_set(cfg.get("eos_token_id")) | _id_set((generation or {}).get("eos_token_id"))
        rope_theta, rope_scaling = _rope(cfg)
        classifier = arch.endswith(CLASSIFIER_SUFFIX)
        pad = cfg.get("pad_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # A bare *Model or a classifier has no LM head: tie one to the embedding (never
            # used) so it loads.
            tie_word_embeddings=(
                bool(cfg.get("tie_word_embeddings", False)) or arch.endswith("Model")
                or classifier
            ),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=tuple(sorted(eos)),
            bos_token_id=cfg.get("bos_token_id"),
            architecture=arch,
            num_labels=_num_labels(cfg) if classifier else 0,
            pad_token_id=int(pad) if isinstance(pad, int) else None,
            raw=dict(cfg),
            **ARCHITECTURES[arch](cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` and, when present, `generation_config.json` from a model dir."""
        root = Path(path)
        cfg = json.loads((root / "config.json").read_text())
        gen_path = root / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        config = cls.from_dict(cfg, generation)
        pooling = _pooling_of(root)
        return dataclasses.replace(config, pooling=pooling) if pooling else config


def _pooling_of(root: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json -> the Pooling
    module's config.json), or None when it declares none."""
    modules_path = root / "modules.json"
    if not modules_path.exists():
        return None
    for module in json.loads(modules_path.read_text()):
        if str(module.get("type", "")).endswith("Pooling"):
            pooling = json.loads((root / module.get("path", "") / "config.json").read_text())
            if pooling.get("pooling_mode_mean_tokens"):
                return "mean"
            if pooling.get("pooling_mode_lasttoken"):
                return "last"
            modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"unsupported sentence-transformers pooling {modes}; "
                             f"have {POOLING_MODES}")
    return None
