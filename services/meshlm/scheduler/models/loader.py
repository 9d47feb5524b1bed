"""Load an HF-layout model directory (config.json + *.safetensors) into `LlamaForCausalLM`.

`load_format="dummy"` reads config.json only and fills the weights from a fixed seed (for
benchmarks and tests without a checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.llama import LlamaForCausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

# Checkpoint tensors that are recomputed, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

LOAD_FORMATS = ("auto", "safetensors", "dummy")  # auto = safetensors
DUMMY_SEED = 0


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """"auto" -> config.json's torch_dtype when it names a float type, else float32."""
    if name == "auto":
        return DTYPES.get(str(config.torch_dtype), torch.float32)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` and fill it from the directory's safetensors
    ("auto", "safetensors") or with seeded random weights ("dummy": no safetensors read).

    Raises ValueError on an unknown load_format and on a missing, unexpected or misshapen
    tensor. `lm_head.weight` may be absent when `tie_word_embeddings` is set (and is ignored
    if present).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    root = Path(path)
    config = ModelConfig.from_dir(root)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    materialize(model, device)  # no random init of weights that are about to be replaced
    model.tie_weights()
    if load_format == "dummy":
        init_dummy_weights(model, DUMMY_SEED)
    else:
        load_weights(model, root)
    model.eval()
    model.requires_grad_(False)
    return model, config


def materialize(model: torch.nn.Module, device: str | torch.device) -> None:
    """Give each of `model`'s meta parameters uninitialised memory on `device`. What
    `Module.to_empty` does, without its route through torch's reference ops, which imports
    sympy (about 1 s of a scheduler's start, more on a busy machine)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            module.register_parameter(name, torch.nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=device),
                requires_grad=param.requires_grad))


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
                for key in f.keys():
                    name = key
                    if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    param = params.get(name)
                    if param is None and not name.startswith("model."):
                        name = "model." + name  # a bare *Model checkpoint
                        param = params.get(name)
                    if param is None:
                        raise ValueError(f"unexpected tensor {key!r} in {file.name}")
                    tensor = f.get_tensor(key)
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


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """HF-style random init, the same for the same seed on the same device: norm weights 1,
    biases 0, every other tensor N(0, initializer_range) (config.json's, default 0.02)."""
    std = float(model.config.raw.get("initializer_range", 0.02))
    draw = DummyDraws(seed, std)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw.into(name, param)


class DummyDraws:
    """The dummy value of each tensor in turn (`init_dummy_weights`); the draws depend on the
    order of the calls, so a reload that visits tensors in the same order gets the same
    weights."""

    def __init__(self, seed: int, std: float) -> None:
        self.seed, self.std = seed, std
        self._generators: dict[torch.device, torch.Generator] = {}

    def into(self, name: str, value: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            value.fill_(1.0)
        elif name.endswith(".bias"):
            value.zero_()
        else:
            gen = self._generators.get(value.device)
            if gen is None:
                gen = self._generators[value.device] = torch.Generator(device=value.device)
                gen.manual_seed(self.seed)
            value.normal_(0.0, self.std, generator=gen)
