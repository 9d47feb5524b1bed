"""meshlm's own CPU kernels, in C (`decode_attention.c`): compiled with the machine's C
compiler the first time a scheduler needs them, kept under the cache directory
(`$MESHLM_CACHE_DIR/kernels/`, one file per source and flags), loaded with ctypes. The
library carries a clone of each function per instruction set (AVX-512, AVX2, baseline), chosen
when it loads, so one built elsewhere (an image's build stage) runs on any x86-64 CPU.

The library links OpenMP by its usual name (libgomp.so.1), which resolves to the runtime
torch has already loaded: its threads are torch's own, and `threads` is torch's count. A
ctypes call releases the GIL for as long as the kernel runs.

`load()` returns None, with the reason, where no compiler is found or the build fails; the
engine then keeps its torch attention (`--attention-backend auto`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from meshlm.common.default_model import default_cache_dir

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT = 120.0
MAX_GROUP = 64  # query heads per KV head the kernel holds (decode_attention.c MAX_GROUP)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES: list[Any] = ([_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P, _P] + [_I] * 6
             + [ctypes.c_float, _P, _I, ctypes.c_int])


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here."""


@dataclass(frozen=True)
class DecodeAttention:
    """The loaded decode-attention kernel (see decode_attention.c for the layouts)."""

    fn: Callable[..., None]
    path: Path

    def __call__(self, q: Tensor, out: Tensor, rows: Tensor, tables: Tensor, first: Tensor,
                 last: Tensor, k_cache: Tensor, v_cache: Tensor, scratch: Tensor) -> None:
        """q and out [Hq, T, D] (any head and row strides; D contiguous) at packed rows
        `rows` [B]; tables [B, W], first and last [B] (int64, contiguous); caches
        [Hkv, NB, bs, D] contiguous float32; scratch float32 of `scratch_size` elements."""
        hq, _, d = q.shape
        hkv, nb, bs, _ = k_cache.shape
        threads = torch.get_num_threads()
        self.fn(q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
                out.stride(1), rows.data_ptr(), tables.data_ptr(), tables.shape[1],
                first.data_ptr(), last.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                nb, bs, rows.shape[0], hq, hkv, d, d**-0.5, scratch.data_ptr(),
                scratch.numel() // threads, threads)

    @staticmethod
    def scratch_size(num_heads: int, num_kv_heads: int, max_keys: int) -> int:
        """Scratch floats for steps whose rows attend over at most `max_keys` positions."""
        return torch.get_num_threads() * (num_heads // num_kv_heads) * max_keys


def supports(num_heads: int, num_kv_heads: int, dtype: torch.dtype,
             device: torch.device) -> bool:
    """Whether the kernel serves a model of these heads, dtype and device."""
    return (device.type == "cpu" and dtype == torch.float32
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)


@cache
def load() -> DecodeAttention | BuildError:
    """The kernel, built first if this source has not been built with this compiler; or the
    reason it cannot be had. Once per process."""
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
        fn = lib.meshlm_decode_attention_f32
    except (BuildError, OSError, AttributeError) as e:
        return e if isinstance(e, BuildError) else BuildError(str(e))
    fn.argtypes = _ARGTYPES
    fn.restype = None
    return DecodeAttention(fn, path)


def built_path() -> Path:
    """Where this source's library is (or will be) built: one file per source and flags."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"decode_attention-{key}.so"


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
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{compiler} took over {BUILD_TIMEOUT:.0f} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
