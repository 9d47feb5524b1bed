"""One layer's decode attention through meshlm's native kernel: `python -m meshlm.bench.attention`.

A decode step reads every running row's keys and values where they lie in the paged KV cache.
At a few shapes (the tiny default model's heads and the bench model's, rows x keys per row) it
times one layer's call, on the threads torch uses (1 unless --threads), two ways:

- warm: the same rows' blocks every call, so they stay in the CPU's caches;
- from memory: the rows' blocks spread over a cache several times larger than the CPU's
  caches, a different set each call, as in the engine, where a step's keys and values (tens of
  MB at 64 rows of a few hundred tokens) come from memory.

Prints microseconds per call (best of a few rounds) and what that reads per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import click
import torch

from meshlm.scheduler.kernels import native

BLOCK_SIZE = 16  # the engine's default tokens per KV block
SETS = 8  # distinct sets of blocks a "from memory" round walks through


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    keys: int


SHAPES = (
    Shape("tiny", 8, 2, 32, 64, 256), Shape("tiny", 8, 2, 32, 16, 600),
    Shape("bench", 8, 4, 64, 64, 256), Shape("bench", 8, 4, 64, 16, 200),
    Shape("bench", 8, 4, 64, 16, 600),
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_call(kernels: native.Kernels, shape: Shape, dtype: torch.dtype, sets: int,
              rounds: int = 5) -> float:
    """Best microseconds per call over `rounds`, each calling once per set of blocks."""
    torch.manual_seed(0)
    per_row = -(-shape.keys // BLOCK_SIZE)
    blocks = sets * shape.rows * per_row
    k_cache = torch.randn(shape.kv_heads, blocks, BLOCK_SIZE, shape.head_dim).to(dtype)
    v_cache = torch.randn(shape.kv_heads, blocks, BLOCK_SIZE, shape.head_dim).to(dtype)
    tables = torch.randperm(blocks).view(sets, shape.rows, per_row).contiguous()
    q = torch.randn(shape.rows, shape.heads, shape.head_dim).transpose(0, 1)
    out = torch.empty(shape.rows, shape.heads, shape.head_dim).transpose(0, 1)
    rows = torch.arange(shape.rows)
    first = torch.zeros(shape.rows, dtype=torch.long)
    last = torch.full((shape.rows,), shape.keys, dtype=torch.long)
    scratch = torch.empty(kernels.scratch_size(shape.heads, shape.kv_heads, per_row * BLOCK_SIZE))
    calls = max(sets, 16)
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms the code (and, warm, the blocks)
        start = time.perf_counter()
        for i in range(calls):
            kernels.decode_attention(q, out, rows, tables[i % sets], first, last, k_cache,
                                     v_cache, scratch)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def kv_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Keys and values one call reads."""
    return 2 * shape.kv_heads * shape.rows * shape.keys * shape.head_dim * dtype.itemsize


@click.command()
@click.option("--dtype", "dtypes", multiple=True, default=("float32", "bfloat16"),
              show_default=True, type=click.Choice(list(DTYPES)), help="KV cache element type")
@click.option("--threads", default=1, show_default=True)
def main(dtypes: tuple[str, ...], threads: int) -> None:
    kernels = native.load()
    if isinstance(kernels, native.BuildError):
        raise click.ClickException(f"the native kernels are not available here: {kernels}")
    torch.set_num_threads(threads)
    print(f"one layer's decode attention, {threads} thread(s), µs per call (GB/s of keys and "
          "values read)")
    print(f"{'model':6s} {'heads':>5s} {'kv':>3s} {'dim':>4s} {'rows':>5s} {'keys':>5s} "
          f"{'kv cache':9s} {'warm':>16s} {'from memory':>16s}")
    for shape in SHAPES:
        for name in dtypes:
            dtype = DTYPES[name]
            size = kv_bytes(shape, dtype)
            warm = time_call(kernels, shape, dtype, sets=1)
            cold = time_call(kernels, shape, dtype, sets=SETS)
            print(f"{shape.name:6s} {shape.heads:5d} {shape.kv_heads:3d} {shape.head_dim:4d} "
                  f"{shape.rows:5d} {shape.keys:5d} {name:9s} "
                  f"{warm:8.0f} ({size / warm / 1e3:4.1f}) {cold:8.0f} ({size / cold / 1e3:4.1f})")


if __name__ == "__main__":
    main()
