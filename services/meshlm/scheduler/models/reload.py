"""New weights for a served model, in place (UpdateWeights): check a checkpoint, then copy it in.

`check_checkpoint` reads only config.json, tokenizer.json and the safetensors headers (no torch,
so any thread may run it while the engine steps). It refuses a checkpoint that is not there
(`CheckpointNotFound`) or that the served model cannot take as it is (`IncompatibleCheckpoint`:
another architecture or config field, another vocabulary, a tensor missing, unexpected,
misshapen, not floating point, or a file cut short), naming what differs. Only then does
`load_checkpoint` (the engine thread) copy every tensor into the model's own storage and repack
the `PackedLinear` projections from the new weights: no second model is built, and a checked
checkpoint can only fail to load on an I/O error (the engine then loads the old one back).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.cpu_linear import FusedPackedLinear, PackedLinear
from meshlm.scheduler.models.loader import (
    DUMMY_SEED,
    IGNORED_SUFFIXES,
    LOAD_FORMATS,
    DummyDraws,
)

# safetensors dtypes a floating-point parameter may be loaded from (copy_ converts).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# ModelConfig fields that may differ: the checkpoint's own dtype (the served one is kept) and
# the raw dict (compared field by field instead).
_FREE_FIELDS = ("torch_dtype", "raw")
_MAX_HEADER = 100 * 2**20  # bytes; safetensors' own limit
_SHOWN = 6  # problems named in one message


class CheckpointNotFound(ValueError):
    """No checkpoint at the path: no directory, no config.json or no *.safetensors."""


class IncompatibleCheckpoint(ValueError):
    """A checkpoint the served model cannot take in place; the message says what differs."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint that passed `check_checkpoint` (or the one being served)."""

    path: Path
    load_format: str  # "safetensors" or "dummy" ("auto" resolved)
    config: ModelConfig
    files: tuple[Path, ...]  # the *.safetensors, sorted; none for "dummy"


def served_checkpoint(path: str | Path, load_format: str, config: ModelConfig) -> Checkpoint:
    """The checkpoint an engine was started from, to load back if an update fails half-way."""
    root = Path(path)
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    files = () if fmt == "dummy" else tuple(sorted(root.glob("*.safetensors")))
    return Checkpoint(root, fmt, config, files)


def check_checkpoint(path: str | Path, load_format: str, served: Checkpoint,
                     shapes: dict[str, tuple[int, ...]]) -> Checkpoint:
    """The checkpoint at `path` if the model serving `served` (its tensors' `shapes`, from
    `weight_shapes`) can take its weights in place. Raises ValueError for an unknown
    load_format, CheckpointNotFound, IncompatibleCheckpoint."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    root = Path(path)
    if not root.is_dir():
        raise CheckpointNotFound(f"{root} is not a directory")
    if not (root / "config.json").is_file():
        raise CheckpointNotFound(f"{root} has no config.json")
    try:
        config = ModelConfig.from_dir(root)
    except (ValueError, KeyError, TypeError, OSError) as exc:  # unreadable or unsupported
        raise IncompatibleCheckpoint(f"{root}/config.json: {type(exc).__name__}: {exc}") from exc
    problems = config_differences(served.config, config) + _vocab_differences(served.path, root)
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    files: tuple[Path, ...] = ()
    if fmt == "safetensors":
        files = tuple(sorted(root.glob("*.safetensors")))
        if not files:
            raise CheckpointNotFound(f"{root} has no *.safetensors")
        if not problems:  # tensor names follow from the config: check them only if it matches
            problems = _tensor_problems(files, shapes, served.config.tie_word_embeddings)
    if problems:
        shown = "; ".join(problems[:_SHOWN])
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise IncompatibleCheckpoint(
            f"{root} does not fit the served model ({served.path}): {shown}{more}")
    return Checkpoint(root, fmt, config, files)


def config_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """'field: served -> new' for each ModelConfig field that differs."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in _FREE_FIELDS:
            continue
        old, value = getattr(served, f.name), getattr(new, f.name)
        if old != value:
            out.append(f"{f.name} {old!r} served, {value!r} in the checkpoint")
    return out


def _vocab_differences(served: Path, new: Path) -> list[str]:
    """The tokenizer service keeps its tokenizer: a checkpoint must share its vocabulary
    (tokenizer.json's tokens and added tokens), when both directories have one."""
    old_file, new_file = served / "tokenizer.json", new / "tokenizer.json"
    if not (old_file.is_file() and new_file.is_file()):
        return []
    try:
        old, value = _vocabulary(old_file), _vocabulary(new_file)
    except (ValueError, OSError) as exc:
        return [f"tokenizer.json unreadable: {exc}"]
    if old == value:
        return []
    return ["tokenizer.json has another vocabulary (the tokenizer service keeps the served one)"]


def _vocabulary(file: Path) -> tuple[Any, Any]:
    doc = json.loads(file.read_text())
    added = sorted((t.get("id"), t.get("content")) for t in doc.get("added_tokens") or [])
    return (doc.get("model") or {}).get("vocab"), added


def read_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header ({name: {dtype, shape, data_offsets}}), checked against the
    file's size; IncompatibleCheckpoint when malformed or cut short."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            body = f.read(n) if 0 < n <= min(size - 8, _MAX_HEADER) else None
    except OSError as exc:
        raise IncompatibleCheckpoint(f"{file.name} is unreadable: {exc}") from exc
    if body is None:
        raise IncompatibleCheckpoint(f"{file.name} is not a safetensors file")
    try:
        header = json.loads(body)
    except ValueError as exc:
        raise IncompatibleCheckpoint(f"{file.name}: bad header ({exc})") from exc
    if not isinstance(header, dict):
        raise IncompatibleCheckpoint(f"{file.name}: bad header")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for key, meta in header.items():
        try:
            end = int(meta["data_offsets"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise IncompatibleCheckpoint(f"{file.name}: bad header entry {key!r}") from None
        if end > data:
            raise IncompatibleCheckpoint(
                f"{file.name} is cut short: {key!r} ends at byte {end} of {data}")
    return header


def _tensor_problems(files: tuple[Path, ...], shapes: dict[str, tuple[int, ...]],
                     tied: bool) -> list[str]:
    problems: list[str] = []
    found: set[str] = set()
    for file in files:
        for key, meta in read_header(file).items():
            name = target_name(key, shapes, tied)
            if name is None:
                continue
            shape = tuple(int(d) for d in meta.get("shape", ()))
            if name not in shapes:
                problems.append(f"unexpected tensor {key!r} in {file.name}")
            elif name in found:
                problems.append(f"{name} appears twice")
            elif shape != shapes[name]:
                problems.append(f"{name} has shape {shape} in the checkpoint, "
                                f"{shapes[name]} served")
            elif meta.get("dtype") not in FLOAT_DTYPES:
                problems.append(f"{name} has dtype {meta.get('dtype')}, not floating point")
            found.add(name)
    missing = [name for name in shapes if name not in found]
    if missing:
        more = ", ..." if len(missing) > 4 else ""
        problems.append(f"{len(missing)} tensor(s) missing: {', '.join(missing[:4])}{more}")
    return problems


def target_name(key: str, names: Container[str], tied: bool) -> str | None:
    """The served tensor a checkpoint key fills (load_weights' rules): None for a key that is
    never loaded, the key itself when nothing matches."""
    if key.endswith(IGNORED_SUFFIXES) or (tied and key == "lm_head.weight"):
        return None
    if key not in names and not key.startswith("model.") and "model." + key in names:
        return "model." + key  # a bare *Model checkpoint
    return key


# -- loading (engine thread) -------------------------------------------------------------------


@dataclass
class _Slot:
    """Where one checkpoint tensor goes: its shape, and how it is stored."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    store: Callable[[Tensor], object]


def _slots(model: nn.Module) -> dict[str, _Slot]:
    """Every loadable tensor by HF name, in `named_parameters()` order of the unpacked model
    (a PackedLinear stands where its Linear was), shared tensors once."""
    slots: dict[str, _Slot] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, FusedPackedLinear):  # stored under its parts' names
            parent = prefix.rpartition(".")[0]
            packed = module.packed
            for name, shape, store in module.part_stores():
                dtype = packed.dtype if name.endswith(".weight") else module.bias.dtype  # type: ignore[union-attr]
                slots[f"{parent}.{name}" if parent else name] = _Slot(shape, dtype,
                                                                       packed.device, store)
            continue
        if isinstance(module, PackedLinear):
            packed = module.packed
            slots[dot + "weight"] = _Slot((module.out_features, module.in_features),
                                          packed.dtype, packed.device, module.repack)
            if module.bias is not None:
                bias = module.bias
                slots[dot + "bias"] = _Slot(tuple(bias.shape), bias.dtype, bias.device,
                                            bias.copy_)
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            slots[dot + name] = _Slot(tuple(param.shape), param.dtype, param.device, param.copy_)
    return slots


def weight_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint must provide, by HF name."""
    return {name: slot.shape for name, slot in _slots(model).items()}


@torch.no_grad()
def load_checkpoint(model: nn.Module, checkpoint: Checkpoint) -> int:
    """Copy a checked checkpoint's tensors into `model` in place (engine thread); returns how
    many were stored. "dummy" gives the seeded random weights a fresh dummy load gives."""
    slots = _slots(model)
    if checkpoint.load_format == "dummy":
        std = float(checkpoint.config.raw.get("initializer_range", 0.02))
        _fill_dummy(slots, std)
        return len(slots)
    tied = checkpoint.config.tie_word_embeddings
    stored = 0
    for file in checkpoint.files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = target_name(key, slots, tied)
                if name is None:
                    continue
                slots[name].store(f.get_tensor(key))
                stored += 1
    return stored


def _fill_dummy(slots: dict[str, _Slot], std: float) -> None:
    """`loader.init_dummy_weights` over the slots: the same draws in the same order."""
    draw = DummyDraws(DUMMY_SEED, std)
    for name, slot in slots.items():
        value = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
        draw.into(name, value)
        slot.store(value)
