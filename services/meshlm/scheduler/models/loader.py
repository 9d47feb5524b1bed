"""Load an HF-layout model directory (config.json + *.safetensors) into `LlamaForCausalLM`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.llama import LlamaForCausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# Checkpoint tensors that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """"auto" -> config.json's torch_dtype when it names a float type, else float32."""
    if name == "auto":
        return DTYPES.get(str(config.torch_dtype), torch.float32)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors.

    Raises ValueError on a missing, unexpected or misshapen tensor. `lm_head.weight` may be
    absent when `tie_word_embeddings` is set (and is ignored if present).
    """
    root = Path(path)
    config = ModelConfig.from_dir(root)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model.to_empty(device=device)  # no random init of weights that are about to be replaced
    model.tie_weights()
    load_weights(model, root)
    model.eval()
    model.requires_grad_(False)
    return model, config


def load_weights(model: LlamaForCausalLM, root: Path) -> None:
    """Copy every tensor of root/*.safetensors into the parameter of the same HF name."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {root}")
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    param = params.get(name)
                    if param is None:
                        raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                            f"model expects {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        more = "..." if len(missing) > 8 else ""
        raise ValueError(f"tensors missing from {root}: {missing[:8]}{more}")
