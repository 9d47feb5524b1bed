"""Linear layers with weights packed once, for models served on the CPU.

`torch.nn.functional.linear` on the CPU repacks its weight for the BLAS kernel on every call;
with the few rows of a decode step that packing costs as much as the multiply. A `Packing`
lays a weight out once for its kernel and multiplies by it:

- `NativePacking`: meshlm's own kernel (`kernels/linear.c`), 16-column blocks read once per
  step while every row of the step is multiplied against them. Chosen where the kernels are
  loaded, the model is float32 and the CPU has AVX-512 or AVX2 with FMA: on this project's
  2-core AVX-512 machine it reads the bench model's weights at 1.4-1.8x oneDNN's speed up to
  8 rows, 1.2x at 16, and keeps level from 64 rows to 2048-token prompt chunks; on a 2-core
  AVX2 one (AMD EPYC) 1.5x at one row, 1.3x at 16 to 64 and 1.15x at 256, and 3.7x at one
  row of the tiny default model, where oneDNN's per-call cost dominates.
  `--packed-weight-dtype bfloat16` keeps its weights in bfloat16: half the memory, and
  1.3-1.7x faster again up to 4 rows (bound by reading them), 0.8-0.9x from 16 rows (the
  widening then costs more than the bytes saved).
- `OneDNNPacking`: oneDNN's blocked layout (the op PyTorch's own compiler, inductor, emits for
  CPU linears); measured here on one core, the decoder projections of a hidden-512 model take
  ~40% less time at 16 rows than torch's linear and ~12% less at 2048.

`pack_linears(model, packing)` swaps the decoder projections for packed ones holding only the
packed weight, so memory does not grow: q/k/v and gate/up each become one `FusedPackedLinear`
(one wider matmul per input), o and down a `PackedLinear`. So does an LM head of its own (the
plain head's matmul took 0.3 ms of a 15 ms decode step of the bench model at 11 rows against
0.14 packed, and 19 ms against 2.5 with a 32k vocabulary); one tied to the embedding stays a
plain Linear, since packing it would hold the matrix twice. oneDNN packing does nothing where
the op is missing (a torch without oneDNN) or the dtype is not one oneDNN packs on this CPU
(bfloat16 needs AVX-512).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.scheduler.kernels.native import LINEAR_COLUMNS, LINEAR_DTYPES, Kernels

# A row count oneDNN picks its packed layout for; measured the same from 16 to 2048 rows.
BATCH_HINT = 64
_DTYPES = (torch.float32, torch.bfloat16)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"
HEAD_WARM_ROWS = 64  # the head's kernels built at start-up: decode steps' rows (logits of a
                     # whole prompt, for prompt logprobs, build theirs when first asked)
# Projections of the same input, fused into one matmul: (the fused module's name, its parts).
_FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears can serve a model of `dtype` on `device`."""
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and _packs(dtype)
    )


@cache
def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


class Packing(Protocol):
    """A weight layout and the kernel that multiplies by it."""

    name: str
    # Whether the kernel is built per row count (and so worth building before serving).
    kernels_per_rows: bool

    def pack(self, weight: Tensor) -> Tensor:
        """weight [out_features, in_features], contiguous -> its packed layout."""
        ...

    def multiply(self, x: Tensor, packed: Tensor, bias: Tensor | None,
                 out_features: int) -> Tensor:
        """x [N, in_features] (N a `bucket`) -> x W^T + bias [N, out_features]."""
        ...

    def bucket(self, rows: int) -> int:
        """The row count a step of `rows` rows is padded to."""
        ...


class OneDNNPacking:
    """oneDNN's blocked layout, its kernels cached per row count (so rows go in buckets)."""

    name = "onednn"
    kernels_per_rows = True

    def __init__(self, batch_hint: int = BATCH_HINT) -> None:
        self.batch_hint = batch_hint

    def pack(self, weight: Tensor) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)

    def multiply(self, x: Tensor, packed: Tensor, bias: Tensor | None,
                 out_features: int) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def bucket(self, rows: int) -> int:
        return row_bucket(rows)


class NativePacking:
    """meshlm's 16-column blocks (`kernels/linear.c`): W's rows 16j..16j+15 transposed, block
    after block, zero rows up to a multiple of `LINEAR_COLUMNS`, in `dtype`: float32, a block
    [in, 16]; or bfloat16 (half the memory and the bytes a step reads, rounded to nearest
    even), a block [ceil(in / 2), 16, 2], each column's weights for inputs 2p and 2p + 1 side
    by side (a zero input after an odd `in`). Any row count runs as it is."""

    name = "native"
    kernels_per_rows = False

    def __init__(self, kernels: Kernels, dtype: torch.dtype = torch.float32) -> None:
        assert dtype in LINEAR_DTYPES, dtype
        self.kernels = kernels
        self.dtype = dtype

    def pack(self, weight: Tensor) -> Tensor:
        out, inputs = weight.shape
        padded = -(-out // LINEAR_COLUMNS) * LINEAR_COLUMNS
        weight = weight.to(self.dtype)
        if padded != out:
            weight = torch.cat([weight, weight.new_zeros(padded - out, inputs)])
        if self.dtype == torch.float32:
            return weight.view(padded // 16, 16, inputs).transpose(1, 2).contiguous()
        weight = F.pad(weight, (0, inputs % 2))  # [padded, 2P]
        return weight.view(padded // 16, 16, -1, 2).transpose(1, 2).contiguous()

    @property
    def activation_dtype(self) -> torch.dtype:
        """The type the activations meet the weights in: bfloat16 where the kernel rounds
        them (bfloat16 weights on a CPU with AVX512_BF16), else float32."""
        rounds = self.dtype == torch.bfloat16 and self.kernels.linear_bf16_rounds
        return torch.bfloat16 if rounds else torch.float32

    def multiply(self, x: Tensor, packed: Tensor, bias: Tensor | None,
                 out_features: int) -> Tensor:
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        self.kernels.linear(x, packed, bias, y)
        return y

    def bucket(self, rows: int) -> int:
        return rows


WEIGHT_DTYPES = ("auto", "bfloat16")  # --packed-weight-dtype


def native_packing(kernels: Kernels | None, device: torch.device, dtype: torch.dtype,
                   weight_dtype: str = "auto") -> NativePacking | None:
    """meshlm's own packing where it is the faster one here: kernels loaded, a float32 model
    on the CPU, a CPU with AVX-512 or AVX2 and FMA (oneDNN stays faster than the portable
    kernel); or where
    `weight_dtype` asks for bfloat16 weights, which only meshlm's kernel reads (a ValueError
    where it cannot serve)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"packed weight dtype {weight_dtype!r}: expected one of "
                         f"{', '.join(WEIGHT_DTYPES)}")
    usable = kernels is not None and device.type == "cpu" and dtype == torch.float32
    if weight_dtype == "bfloat16":
        if not usable:
            raise ValueError("packed weight dtype bfloat16: meshlm's matmul kernel serves it, "
                             "which needs the native attention backend and a float32 model "
                             f"on the CPU, not {dtype} on {device}")
        assert kernels is not None
        return NativePacking(kernels, torch.bfloat16)
    return NativePacking(kernels) if usable and kernels is not None and kernels.linear_vector \
        else None


_repacks = 0  # PackedLinear.repack calls in this process


def repacks() -> int:
    """How many times any `PackedLinear` was packed so far: what was read of their packed
    arrays (addresses) holds while this stays the same."""
    return _repacks


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once by `packing` (the same result as nn.Linear's)."""

    def __init__(self, linear: nn.Linear, packing: Packing) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packing = packing
        self.packed = torch.empty(0, dtype=linear.weight.dtype)
        self.repack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def repack(self, weight: Tensor) -> None:
        """Serve `weight` ([out_features, in_features], any float dtype: converted to the
        packed one) from now on: packed anew, the old packing dropped."""
        global _repacks
        _repacks += 1
        with torch.no_grad():
            self.packed = self.packing.pack(
                weight.detach().to(self.packed.dtype).contiguous())

    def forward(self, x: Tensor) -> Tensor:
        # Rows padded up to a bucket: oneDNN caches one kernel per row count, and every count
        # a busy server sees would otherwise stay cached (measured: +250 MiB in a minute).
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        n = rows.shape[0]
        padded = self.packing.bucket(n)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        return self.rows(rows)[:n].reshape(*shape[:-1], self.out_features)

    def rows(self, x: Tensor) -> Tensor:
        """x [N, in_features] with N a `packing.bucket` -> [N, out_features]: no padding, no
        reshape (the fused CPU forward keeps its rows bucketed from the start)."""
        return self.packing.multiply(x, self.packed, self.bias, self.out_features)

    def warm_up(self, max_rows: int) -> None:
        """Build the kernel of every row bucket up to `max_rows` now, not on a request's path
        (nothing to build where the packing's kernel serves every row count)."""
        if not self.packing.kernels_per_rows:
            return
        x = torch.zeros(1, self.in_features, dtype=self.packed.dtype)
        for rows in sorted({self.packing.bucket(n) for n in range(1, max_rows + 1)}):
            self(x.expand(rows, -1))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed={self.packing.name}")


class FusedPackedLinear(PackedLinear):
    """Several projections of one input (q/k/v, gate/up) as one packed matmul: the parts'
    outputs side by side, in order. Fewer, wider multiplies: measured here ~30% less time for
    q/k/v and ~10% for gate/up at 16 rows.

    A checkpoint still names the parts: `part_stores()` gives one store per part tensor for a
    reload (`models/reload.py`); the weight is repacked once every part has arrived."""

    def __init__(self, names: tuple[str, ...], parts: list[nn.Linear],
                 packing: Packing) -> None:
        with torch.no_grad():
            fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                              bias=parts[0].bias is not None, device=parts[0].weight.device,
                              dtype=parts[0].weight.dtype)
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts if p.bias is not None]))
        super().__init__(fused, packing)
        self.names = names
        self.sizes = [p.out_features for p in parts]
        self._staged: dict[int, Tensor] = {}

    def part_stores(self) -> list[tuple[str, tuple[int, ...], Callable[[Tensor], object]]]:
        """(part name, weight shape, store) per part, then (name + ".bias", ...) per bias."""
        stores: list[tuple[str, tuple[int, ...], Callable[[Tensor], object]]] = []
        offset = 0
        for i, (name, size) in enumerate(zip(self.names, self.sizes, strict=True)):
            stores.append((f"{name}.weight", (size, self.in_features), partial(self._stage, i)))
            if self.bias is not None:
                stores.append((f"{name}.bias", (size,), self.bias[offset:offset + size].copy_))
            offset += size
        return stores

    def _stage(self, index: int, weight: Tensor) -> None:
        self._staged[index] = weight.detach().to(self.packed.dtype).clone()
        if len(self._staged) == len(self.sizes):
            self.repack(torch.cat([self._staged[i] for i in range(len(self.sizes))]))
            self._staged.clear()


def _fuse(module: nn.Module, fused_name: str, names: tuple[str, ...],
          fused: FusedPackedLinear) -> None:
    """Put `fused` where the first of `names` was (keeping the children's order, which the
    reload's tensor order follows) and drop the parts."""
    children = list(module._modules.items())
    module._modules.clear()
    for name, child in children:
        if name == names[0]:
            module._modules[fused_name] = fused
        elif name not in names:
            module._modules[name] = child
    module.__dict__.pop(fused_name, None)  # the None placeholder, now a child


# Below this many rows oneDNN's packed kernels read the weights more slowly than at it: on
# this project's 2-core AVX-512 machine, a pass over the 512x8 bench model's projections took
# 7.1 ms at 1 row and 5.7 ms at 6 (one thread; 4.6 and 3.7 ms on two). A decode step of so few
# rows is bound by reading the weights, so the padding rows cost next to nothing.
MIN_ROWS = 6


def row_bucket(rows: int) -> int:
    """`rows` rounded up: to MIN_ROWS below it, exact up to 16 rows (small decode batches,
    where padding costs most), then to a multiple of 8 up to 64, of 32 up to 512 and of 64
    beyond, so the steps of a 2048-token budget use 55 kernels per weight shape."""
    if rows <= MIN_ROWS:
        return MIN_ROWS
    if rows <= 16:
        return rows
    step = 8 if rows <= 64 else 32 if rows <= 512 else 64
    return -(-rows // step) * step


def pack_linears(model: nn.Module, packing: Packing | None = None, warm_rows: int = 0) -> int:
    """Replace the decoder projections of `model` (on the CPU), and its LM head unless tied, by
    PackedLinear packed by `packing` (None: oneDNN's), and build the kernels of steps of up to
    `warm_rows` tokens; returns how many were replaced (0 where packing is unavailable)."""
    if packing is None:
        param = next(model.parameters())
        if not available(param.device, param.dtype):
            return 0
        packing = OneDNNPacking()
    replaced = 0
    for module in list(model.modules()):
        for fused_name, names in _FUSED:
            parts = [getattr(module, n, None) for n in names]
            if hasattr(module, fused_name) and all(isinstance(p, nn.Linear) for p in parts):
                _fuse(module, fused_name, names,
                      FusedPackedLinear(names, parts, packing))  # type: ignore[arg-type]
                replaced += len(names)
        for name in _PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, packing))
                replaced += 1
    head = getattr(model, HEAD, None)
    if isinstance(head, nn.Linear) and not _shares_weight(model, head):
        setattr(model, HEAD, PackedLinear(head, packing))
        replaced += 1
    if warm_rows:
        shapes: dict[tuple[int, int, bool], PackedLinear] = {}
        for name, m in model.named_modules():
            if isinstance(m, PackedLinear) and name != HEAD:
                shapes.setdefault((m.in_features, m.out_features, m.bias is None), m)
        with torch.no_grad():
            for linear in shapes.values():
                linear.warm_up(warm_rows)
            head = getattr(model, HEAD, None)
            if isinstance(head, PackedLinear):
                head.warm_up(min(warm_rows, HEAD_WARM_ROWS))
    return replaced


def _shares_weight(model: nn.Module, linear: nn.Linear) -> bool:
    """Whether `linear`'s weight is also another module's (a head tied to the embedding)."""
    return any(m is not linear and any(p is linear.weight for p in m.parameters(recurse=False))
               for m in model.modules())
