"""meshlm's own CPU kernels, in C (`decode_attention.c`, `layer_ops.c`, `linear.c`, and
`decode_layers.c`, which runs a decode step's layers through the others):
compiled into one library with the machine's C compiler the first time a scheduler needs
them, kept under the cache directory (`$MESHLM_CACHE_DIR/kernels/`, one file per sources and
flags), loaded with ctypes. The library carries a version of each function per instruction
set (AVX-512, AVX2, baseline: clones, or an ifunc where the versions differ in more than
flags), chosen when it loads, so one built elsewhere (an image's build stage) runs on any
x86-64 CPU.

The library links OpenMP by its usual name (libgomp.so.1), which resolves to the runtime
torch has already loaded: its threads are torch's own, and `threads` is torch's count. A
ctypes call releases the GIL for as long as the kernel runs.

`load()` returns the reason (a BuildError) where no compiler is found or the build fails;
the engine then keeps its torch ops (`--attention-backend auto`).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshlm.common.default_model import default_cache_dir

SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_attention.c",
                                                             "layer_ops.c", "linear.c",
                                                             "decode_layers.c",
                                                             "chunk_attention.c"))
# The objects, each a source and its defines, compiled all at once: decode_attention.c, the
# slowest by far (a kernel per KV type, a clone of each per instruction set), in one part per
# KV type. Each part takes under half of the whole file's time: 5-8 s against 19 s on the
# 2-core development VM (gcc 12); the first scheduler start waits on the slowest.
UNITS = (*((SOURCES[0], (f"-DMESHLM_PART={part}",)) for part in (1, 2, 3)),
         *((source, ()) for source in SOURCES[1:]))
# Read by decode_attention.c (once per KV cache element type) and the 16-bit readers.
INCLUDES = tuple(Path(__file__).with_name(name) for name in ("decode_attention.inc", "simd.h"))
# KV cache element types the kernels read and write: (function suffix, store_kv's kind).
KV_DTYPES = {torch.float32: ("f32", 0), torch.bfloat16: ("bf16", 1), torch.float16: ("f16", 2)}
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# Linked apart from the compile, without -ffast-math: given it, gcc before 13 links
# crtfastmath.o into a shared library too, whose constructor turns on flush-to-zero for the
# whole process that loads it (every float op in the scheduler, torch's included, then reads
# and writes subnormals as 0).
LINK_FLAGS = ("-fopenmp", "-shared")
BUILD_TIMEOUT = 120.0
MAX_GROUP = 64  # query heads per KV head the kernel holds (decode_attention.c MAX_GROUP)
CHUNK_BLOCK = 16  # the cache block size chunk_attention.c takes (its BLOCK and TILE)
LINEAR_COLUMNS = 32  # a packed linear weight's rows run to a multiple of this (linear.c)
LINEAR_DTYPES = (torch.float32, torch.bfloat16)  # weight element types linear.c reads

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    **{f"meshlm_decode_attention_{suffix}": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P,
                                             _P] + [_I] * 6 + [_F, _P, _I, _INT]
       for suffix, _ in KV_DTYPES.values()},
    "meshlm_add_rmsnorm_f32": [_P, _P, _P, _P, _I, _I, _F, _INT],
    "meshlm_rope_f32": [_P, _I, _I, _I, _I, _P, _P, _INT],
    "meshlm_store_kv": [_P, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _INT],
    "meshlm_silu_mul_f32": [_P, _P, _I, _I, _INT],
    "meshlm_argmax_rows": [_P, _I, _I, _I, _P],
    **{f"meshlm_linear_{suffix}{path}": [_P, _I, _I, _I, _P, _P, _P, _I, _INT]
       for suffix in ("f32", "bf16") for path in ("", "_portable")},
    "meshlm_decode_layers": [_P, _P, _I, _P, _P, _F, _P, _INT],
    "meshlm_chunk_attention": [_P, _I, _I, _P, _I, _I, _P, _I, _P, _I, _P, _P, _INT]
    + [_I] * 4 + [_F, _P, _INT],
    "meshlm_linear_wide": [],
    "meshlm_linear_vector": [],
    "meshlm_linear_bf16_rounds": [],
}
# Kernels of one instruction set, called by name where the CPU has it (tests; x86-64 only).
_OPTIONAL: dict[str, list[Any]] = {
    f"meshlm_linear_{name}": _SIGNATURES["meshlm_linear_f32"]
    for name in ("f32_wide", "bf16_wide", "bf16_dot", "f32_avx2", "bf16_avx2")}
_RESULTS: dict[str, Any] = {"meshlm_linear_wide": _INT, "meshlm_linear_vector": _INT,
                            "meshlm_linear_bf16_rounds": _INT}


def chunk_attention_fits(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                         kv_dtype: torch.dtype) -> bool:
    """Whether chunk_attention.c takes a model of these shapes and its KV cache (heads of 32
    to 256 dimensions: the tiny default model's 32 included, 100 tokens 0.08 against the
    decode kernel's 0.15 ms)."""
    group = num_heads // num_kv_heads
    return (kv_dtype in KV_DTYPES and block_size == CHUNK_BLOCK and head_dim % 16 == 0
            and 32 <= head_dim <= 256 and CHUNK_BLOCK % group == 0)


class LayerWeights(ctypes.Structure):
    """decode_layers.c's `struct meshlm_layer`: one layer's packed projections, biases (None:
    none), norm weights and epsilons, and the first position each decode row attends to."""

    _fields_ = [(name, _P) for name in ("qkv", "o", "gate_up", "down", "qkv_bias", "o_bias",
                                        "gate_up_bias", "down_bias", "input_norm", "post_norm",
                                        "first")] + [("input_eps", _F), ("post_eps", _F)]


class DecodeStep(ctypes.Structure):
    """decode_layers.c's `struct meshlm_decode_step`: the model's shapes and the arrays of
    one decode step that every layer reads."""

    _fields_ = [*((name, _I) for name in ("rows", "hidden", "heads", "kv_heads", "head_dim",
                                           "inter")),
                ("weight_kind", _INT), ("kv_kind", _INT),
                *((name, _P) for name in ("cos", "signed_sin", "slots", "attention_rows",
                                          "tables", "last")),
                ("table_width", _I), ("k_cache", _P), ("v_cache", _P),
                *((name, _I) for name in ("layer_elements", "num_blocks", "block_size")),
                ("scale", _F), ("scratch", _P), ("scratch_per_thread", _I), ("work", _P),
                ("chunks", _P), ("num_chunks", _I), ("decode_rows", _I),
                ("chunk_scratch", _P),
                *((name, _P) for name in ("kept", "kept_tables", "kept_first", "kept_last",
                                          "kept_order")),
                ("num_kept", _I), ("ids", _P), ("embed", _P), ("vocab", _I),
                ("positions", _P), ("head", _P), ("head_bias", _P), ("logits", _P),
                ("head_out", _I), ("head_kind", _INT)]


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here."""


@dataclass(frozen=True)
class Kernels:
    """The loaded library: one method per kernel (the C sources give the layouts). Arrays
    are float32 on the CPU unless said otherwise; a method checks nothing, its caller
    passes what it documents."""

    fns: dict[str, Callable[..., Any]]
    path: Path

    def decode_attention(self, q: Tensor, out: Tensor, rows: Tensor, tables: Tensor,
                         first: Tensor, last: Tensor, k_cache: Tensor, v_cache: Tensor,
                         scratch: Tensor) -> None:
        """q and out [Hq, T, D] (any head and row strides; D contiguous) at packed rows
        `rows` [B]; tables [B, W], first and last [B] (int64, contiguous); caches
        [Hkv, NB, bs, D] contiguous, of a `KV_DTYPES` type; scratch of `scratch_size`
        elements."""
        hq, _, d = q.shape
        hkv, nb, bs, _ = k_cache.shape
        threads = torch.get_num_threads()
        suffix, _ = KV_DTYPES[k_cache.dtype]
        self.fns[f"meshlm_decode_attention_{suffix}"](
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
            out.stride(1), rows.data_ptr(), tables.data_ptr(), tables.shape[1],
            first.data_ptr(), last.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            nb, bs, rows.shape[0], hq, hkv, d, d**-0.5, scratch.data_ptr(),
            scratch.numel() // threads, threads)

    def chunk_attention(self, q: Tensor, out: Tensor, chunks: Tensor, tables: Tensor,
                        k_cache: Tensor, v_cache: Tensor, scratch: Tensor) -> None:
        """Prompt chunks' causal attention (chunk_attention.c): q and out [Hq, T, D] (any
        head and row strides; D contiguous); chunks [C, 4] (first packed row, rows, first
        position, row of `tables`) and tables [*, W], int64, contiguous; caches
        [Hkv, NB, 16, D] of a `KV_DTYPES` type; scratch of `chunk_scratch_size` elements.
        The shapes must pass `chunk_attention_fits`."""
        hq, _, d = q.shape
        hkv, nb, _, _ = k_cache.shape
        threads = torch.get_num_threads()
        self.fns["meshlm_chunk_attention"](
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
            out.stride(1), chunks.data_ptr(), chunks.shape[0], tables.data_ptr(),
            tables.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPES[k_cache.dtype][1],
            nb, hq, hkv, d, d**-0.5, scratch.data_ptr(), threads)

    @staticmethod
    def chunk_scratch_size(num_kv_heads: int, head_dim: int, ends: list[int],
                           kv_dtype: torch.dtype = torch.float32) -> int:
        """Scratch floats for chunks ending at positions `ends` over a cache of `kv_dtype`:
        none for float32 (read in place), a 16-bit cache's keys and values widened."""
        copies = 0 if kv_dtype == torch.float32 else 2
        return copies * num_kv_heads * head_dim * sum(-(-end // CHUNK_BLOCK) * CHUNK_BLOCK
                                                      for end in ends)

    @staticmethod
    def scratch_size(num_heads: int, num_kv_heads: int, max_keys: int) -> int:
        """Scratch floats for steps whose rows attend over at most `max_keys` positions."""
        return torch.get_num_threads() * (num_heads // num_kv_heads) * max_keys

    def decode_layers(self, step: DecodeStep, layers: ctypes.Array[LayerWeights], x: Tensor,
                      final_norm: Tensor, final_eps: float, out: Tensor) -> None:
        """Every decoder layer of a step, then the final norm: x [N, H] the residual stream
        (updated in place), out [N, H] the normed hidden states, or [K, H] those of the
        step's K kept rows (decode_layers.c gives the layouts)."""
        self.fns["meshlm_decode_layers"](
            ctypes.addressof(step), ctypes.addressof(layers), len(layers), x.data_ptr(),
            final_norm.data_ptr(), final_eps, out.data_ptr(), torch.get_num_threads())

    def add_rmsnorm(self, x: Tensor, add: Tensor | None, weight: Tensor, eps: float,
                    out: Tensor) -> None:
        """x += add (in place; none when add is None), then out = RMSNorm(x) * weight:
        x, add and out [N, H] contiguous, weight [H]."""
        rows, hidden = x.shape
        self.fns["meshlm_add_rmsnorm_f32"](
            x.data_ptr(), None if add is None else add.data_ptr(), weight.data_ptr(),
            out.data_ptr(), rows, hidden, eps, torch.get_num_threads())

    def rope(self, x: Tensor, heads: int, head_dim: int, cos: Tensor,
             signed_sin: Tensor) -> None:
        """RoPE in place on the first `heads` heads of each row of x [N, W] (rows may be
        strided, each row contiguous); cos and signed_sin [N, head_dim] contiguous
        (`RotaryEmbedding`'s)."""
        self.fns["meshlm_rope_f32"](
            x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(),
            signed_sin.data_ptr(), torch.get_num_threads())

    def store_kv(self, k: Tensor, v: Tensor, slots: Tensor, k_cache: Tensor,
                 v_cache: Tensor) -> None:
        """Keys and values [Hkv, T, D] (any head and token strides; D contiguous) into cache
        slots `slots` [T] (int64) of a layer's caches [Hkv, NB, bs, D] contiguous, of a
        `KV_DTYPES` type (rounded to nearest, ties to even)."""
        heads, tokens, d = k.shape
        _, kind = KV_DTYPES[k_cache.dtype]
        self.fns["meshlm_store_kv"](
            k.data_ptr(), k.stride(1), k.stride(0), v.data_ptr(), v.stride(1), v.stride(0),
            tokens, heads, d, slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.shape[1] * k_cache.shape[2], kind)

    @property
    def linear_wide(self) -> bool:
        """Whether `linear` runs the AVX-512 kernel here (else the AVX2 or portable one)."""
        return bool(self.fns["meshlm_linear_wide"]())

    @property
    def linear_vector(self) -> bool:
        """Whether `linear` runs a vector kernel here: AVX-512, or AVX2 with FMA (else the
        portable one, four lanes wide)."""
        return bool(self.fns["meshlm_linear_vector"]())

    @property
    def linear_bf16_rounds(self) -> bool:
        """Whether `linear` over bfloat16 weights rounds the activations to bfloat16 here (the
        AVX512_BF16 kernel: vdpbf16ps); elsewhere they stay float32."""
        return bool(self.fns["meshlm_linear_bf16_rounds"]())

    def linear(self, x: Tensor, packed: Tensor, bias: Tensor | None, out: Tensor,
               path: str = "") -> None:
        """out [N, O] (contiguous) = x W^T + bias: x [N, I] (rows may be strided, each row
        contiguous), W packed in 16-column blocks, [ceil(O / 32) * 2, I, 16] float32 or
        [ceil(O / 32) * 2, ceil(I / 2), 16, 2] bfloat16 (contiguous, `cpu_linear.NativePacking`),
        bias [O] or None. `path` runs one kernel by name, to test it where another is chosen:
        "_portable", or on x86-64 "_wide" (AVX-512), "_avx2" (AVX2 with FMA) and, bfloat16 only,
        "_dot" (AVX512_BF16; call it only where `linear_bf16_rounds`)."""
        rows, inputs = x.shape
        suffix = "bf16" if packed.dtype == torch.bfloat16 else "f32"
        self.fns[f"meshlm_linear_{suffix}{path}"](
            x.data_ptr(), x.stride(0), rows, inputs, packed.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.shape[1],
            torch.get_num_threads())

    def argmax_rows(self, x: Tensor) -> list[int]:
        """Each row's first largest element's index of x [N, V] float32 (rows may be strided,
        each row contiguous, V > 0), as numpy's argmax gives it (a NaN the largest)."""
        rows, cols = x.shape
        out = array.array("q", bytes(8 * rows))
        self.fns["meshlm_argmax_rows"](x.data_ptr(), rows, cols, x.stride(0),
                                       out.buffer_info()[0])
        return out.tolist()

    def silu_mul(self, gate_up: Tensor, out: Tensor) -> None:
        """out [N, I] = silu(gate) * up, gate_up [N, 2I] holding gate then up; contiguous."""
        rows, inter = out.shape
        self.fns["meshlm_silu_mul_f32"](gate_up.data_ptr(), out.data_ptr(), rows, inter,
                                        torch.get_num_threads())


def supports(num_heads: int, num_kv_heads: int, dtype: torch.dtype, kv_dtype: torch.dtype,
             device: torch.device) -> bool:
    """Whether the kernels serve a model of these heads, dtype, KV cache dtype and device."""
    return (device.type == "cpu" and dtype == torch.float32 and kv_dtype in KV_DTYPES
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)


@cache
def load() -> Kernels | BuildError:
    """The kernels, built first if these sources have not been built with this compiler; or
    the reason they cannot be had. Once per process."""
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
        fns = {name: getattr(lib, name) for name in _SIGNATURES}
    except (BuildError, OSError, AttributeError) as e:
        return e if isinstance(e, BuildError) else BuildError(str(e))
    fns.update({name: getattr(lib, name) for name in _OPTIONAL if hasattr(lib, name)})
    for name, argtypes in {**_SIGNATURES, **_OPTIONAL}.items():
        if name in fns:
            fns[name].argtypes = argtypes
            fns[name].restype = _RESULTS.get(name)
    return Kernels(fns, path)


def built_path() -> Path:
    """Where these sources' library is (or will be) built: one file per sources and flags."""
    digest = hashlib.sha256(" ".join(FLAGS + LINK_FLAGS).encode())
    digest.update(repr([(source.name, defines) for source, defines in UNITS]).encode())
    for source in SOURCES + INCLUDES:
        digest.update(source.read_bytes())
    return default_cache_dir() / "kernels" / f"meshlm-kernels-{digest.hexdigest()[:16]}.so"


def _build() -> Path:
    target = built_path()
    if target.is_file():  # built before: here, or into an image that has no compiler
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise BuildError(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    out_dir = target.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {out_dir}: {e.strerror}") from None
    # Built beside its final name and renamed into place: schedulers starting together each
    # build, and each finds a whole file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as objects:
            names = [str(Path(objects) / f"{i}-{source.stem}.o")
                     for i, (source, _) in enumerate(UNITS)]
            _run_all(compiler, [[*FLAGS, *defines, "-c", "-o", name, str(source)]
                                for (source, defines), name in zip(UNITS, names, strict=True)])
            _run_all(compiler, [[*LINK_FLAGS, "-o", tmp, *names, "-lm"]])
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{compiler} took over {BUILD_TIMEOUT:.0f} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _run_all(compiler: str, commands: list[list[str]]) -> None:
    """The compiler run once per argument list, all at once, within BUILD_TIMEOUT together;
    BuildError for the first that fails (the others are stopped)."""
    deadline = time.monotonic() + BUILD_TIMEOUT
    runs = [subprocess.Popen([compiler, *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for args in commands]
    try:
        for run in runs:
            _, err = run.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if run.returncode != 0:
                raise BuildError(f"{compiler} failed: {err.strip()[-500:]}")
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
