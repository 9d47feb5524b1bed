"""The embedded default model: a tiny random-weight Llama that meshlm builds for itself.

With no model path configured, every service (tokenizer, scheduler, detokenizer) and the tests
use this checkpoint. `ensure_default_model()` creates it deterministically, in the Hugging Face
layout, under `<cache>/models/meshlm-tiny-v1` and returns that path:

- `tokenizer.json`: byte-level BPE trained with `tokenizers` on CORPUS (default_corpus.py);
  `<|begin_of_text|>` is added as BOS when `add_special_tokens=True`.
- `tokenizer_config.json`, `special_tokens_map.json`: a ChatML chat template; the eos token is
  `<|im_end|>` (the end of an assistant turn), and `generation_config.json` / `config.json`
  list both `<|im_end|>` and `<|end_of_text|>` as eos ids.
- `config.json`, `model.safetensors`: a 4-layer `LlamaForCausalLM` (GQA, 8 query heads, 2 kv
  heads) with float32 weights from a fixed numpy seed, scaled so the logits are well spread
  (greedy decoding has few near-ties and does not collapse onto one token).

The cache root is the argument, else `$MESHLM_CACHE_DIR`, else `~/.cache/meshlm`. Several
processes may call this at once: each builds into its own temporary directory beside the
target and renames it into place atomically; the losers discard their copy.

Bump `_VERSION` whenever the bytes this module produces change.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from meshlm.common.default_corpus import CORPUS

DEFAULT_MODEL_NAME = "meshlm-tiny"
_VERSION = 1
_DIR_NAME = f"{DEFAULT_MODEL_NAME}-v{_VERSION}"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
EOS_TOKEN = IM_END_TOKEN

# ChatML. The template starts with the bos token (as Llama-3's does), so a rendered chat prompt
# is encoded with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_VOCAB_SIZE = 2048
_HIDDEN = 256
_INTERMEDIATE = 512
_LAYERS = 4
_HEADS = 8
_KV_HEADS = 2
_MAX_POSITIONS = 2048
_SEED = 20240601
# Standard deviations of the random weights. The final norm makes the hidden state RMS ~1, so
# the logits have std ~ _LM_HEAD_STD * sqrt(_HIDDEN) = 4: a few units, well spread.
_EMBED_STD = 1.0
_LM_HEAD_STD = 0.25
_NORM_JITTER = 0.1

_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "model.safetensors",
)

def default_cache_dir() -> Path:
    """`$MESHLM_CACHE_DIR` if set, else `~/.cache/meshlm`."""
    env = os.environ.get("MESHLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshlm"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the default model, building it first if it is not there.

    Safe to call from several processes at once (see `build_once`).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return build_once(root / "models" / _DIR_NAME, build_default_model, _is_complete)


def build_once(target: Path, build: Callable[[Path], None],
               is_complete: Callable[[Path], bool]) -> Path:
    """`target`, built by `build(tmp_dir)` first unless `is_complete(target)`.

    The build goes into a private temporary directory renamed into place, so readers only
    ever see a complete directory and concurrent builders do not clash (the loser of the
    rename keeps the winner's). An incomplete target (damaged, or made by hand) is moved
    aside and rebuilt.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        _discard(target, target.parent / f".{target.name}.broken-{uuid.uuid4().hex}")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_default_model(out_dir: str | Path) -> None:
    """Write every file of the default model into `out_dir` (which must exist)."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: _token_id(tokenizer, tok) for tok in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_ids = [ids[IM_END_TOKEN], ids[END_OF_TEXT_TOKEN]]

    _write_json(out / "config.json", _model_config(vocab_size, ids[BOS_TOKEN], eos_ids))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": eos_ids, "pad_token_id": ids[PAD_TOKEN]},
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    save_file(_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on CORPUS (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"default model: token {token!r} missing from the vocabulary")
    return int(token_id)


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    added = {
        str(_token_id(tokenizer, tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": _MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _model_config(vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "head_dim": _HIDDEN // _HEADS,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": _INTERMEDIATE,
        "max_position_embeddings": _MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": _HEADS,
        "num_hidden_layers": _LAYERS,
        "num_key_value_heads": _KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _weights(vocab_size: int) -> dict[str, np.ndarray]:
    """HF Llama parameter names -> float32 arrays ([out, in] for linear layers)."""
    rng = np.random.default_rng(_SEED)
    head_dim = _HIDDEN // _HEADS
    kv_dim = _KV_HEADS * head_dim

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), in_features**-0.5)

    def norm() -> np.ndarray:
        return (1.0 + normal((_HIDDEN,), _NORM_JITTER)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal((vocab_size, _HIDDEN), _EMBED_STD)
    }
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = linear(_HIDDEN, _HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_dim, _HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_dim, _HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = linear(_HIDDEN, _HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "mlp.gate_proj.weight"] = linear(_INTERMEDIATE, _HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = linear(_INTERMEDIATE, _HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = linear(_HIDDEN, _INTERMEDIATE)
    tensors["model.norm.weight"] = norm()
    tensors["lm_head.weight"] = normal((vocab_size, _HIDDEN), _LM_HEAD_STD)
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _FILES)


def _discard(path: Path, aside: Path) -> None:
    try:
        os.rename(path, aside)
    except OSError:
        return  # someone else moved or replaced it first
    shutil.rmtree(aside, ignore_errors=True)
