"""The engine benchmark's checkpoint: a random-weight Llama big enough that compute matters.

`ensure_bench_model()` builds it once under `<cache>/models/meshlm-bench-512x8-v1` and returns
that path: hidden 512, 8 layers, 8 query heads, 4 KV heads, MLP 1536, written by transformers
itself (`LlamaForCausalLM(config).save_pretrained`, safetensors, float32, weights from a fixed
torch seed). The tokenizer files are the embedded default model's (byte-level BPE, ChatML
template), so meshlm, HF `generate` and `transformers serve` all tokenize alike. Built into a
private temporary directory and renamed into place (`build_once`), like the default model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshlm.common.default_model import build_once, default_cache_dir, ensure_default_model

_VERSION = 1
NAME = f"meshlm-bench-512x8-v{_VERSION}"
SEED = 20240917
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 512, 1536, 8, 8, 4
MAX_POSITIONS = 1024  # prompts <= 256 + outputs <= 256 fit with room to spare
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
)


def ensure_bench_model(cache_dir: str | Path | None = None) -> Path:
    """The benchmark checkpoint's directory, built first if it is missing or incomplete."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / NAME,
                      lambda tmp: build_bench_model(tmp, ensure_default_model(root)),
                      _is_complete)


def build_bench_model(out_dir: Path, tokenizer_dir: Path) -> None:
    """Write the checkpoint into `out_dir` with the tokenizer files of `tokenizer_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((tokenizer_dir / "config.json").read_text())
    gen = json.loads((tokenizer_dir / "generation_config.json").read_text())
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        vocab_size=base["vocab_size"],
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=gen["pad_token_id"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:  # after save_pretrained: keep the default model's pad id
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    (out_dir / ".complete").write_text(f"{NAME}\n")


def _is_complete(path: Path) -> bool:
    return (path / ".complete").is_file()
