"""Paged KV cache and the attention backend that reads and writes it through block tables.

Every layer's keys and values live in one preallocated tensor each,
[num_layers, num_kv_heads, num_blocks, block_size, head_dim]: head-major, so that reading a
batch's blocks through their tables is one row gather of a 2-D view that lands in the
[heads, batch, tokens, head_dim] layout batched matmuls take without another copy. Token
position p of a sequence is stored in block `table[p // block_size]` at offset
`p % block_size` (its "slot" is `block * block_size + offset`). Only the model runner touches
these tensors.

A step's tokens are packed into one row (batch 1, T = all new tokens); `PagedAttention`
splits them back: single-token items (decodes) attend in groups of similar length over their
gathered blocks (a group pads its tables to its longest; `decode_groups` picks the split),
longer items (prompt chunks) each attend over their new tokens, plus the cached context
before them when there is one. `build_attention_meta` turns a step's items into all of this.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from meshlm.scheduler.kernels.native import Kernels


def long_tensor(values: list[int], device: torch.device | str = "cpu") -> Tensor:
    """`torch.tensor(values, dtype=torch.long, device=device)`, built through a C array: a
    quarter of the time for a step's few hundred block ids (torch reads a list item by item)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    tensor = torch.frombuffer(array.array("q", values), dtype=torch.long)
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)


class KVCache:
    """Preallocated K and V for `num_blocks` blocks of `block_size` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        nbytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            # Zeros, not empty: padded positions are multiplied by 0 in attention, and
            # uninitialised memory may hold NaN.
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as e:
            raise MemoryError(
                f"KV cache of {nbytes / 2**30:.2f} GiB {shape} does not fit; "
                "lower the KV cache budget"
            ) from e
        self.nbytes = nbytes

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element


@dataclass
class DecodeGroup:
    """Single-token items: their rows in the packed batch, block tables and positions."""

    rows: Tensor  # [B] long, indices into the packed tokens
    tables: Tensor  # [B, max_blocks] long (padded with block 0)
    positions: Tensor  # [B] long


@dataclass
class ChunkSpan:
    """A multi-token item: packed rows [q_start, q_end) at positions [start, start + n)."""

    q_start: int
    q_end: int
    start: int
    table: Tensor  # [blocks covering start + n] long


@dataclass
class AttentionMeta:
    slot_mapping: Tensor  # [T] long: cache slot of each packed token
    decodes: list[DecodeGroup]
    chunks: list[ChunkSpan]


@dataclass
class StepItem:
    """One item of a step, as attention sees it: its new tokens are positions
    [start, start + num_tokens) of a sequence whose blocks are `blocks`."""

    blocks: list[int]
    start: int
    num_tokens: int


# The fixed cost of one more decode group (a gather, two matmuls and a softmax per layer),
# in gathered blocks per row of padding it must save to pay for itself; measured on CPU.
GROUP_COST_BLOCKS = 16
MAX_DECODE_GROUPS = 4


def build_attention_meta(items: list[StepItem], block_size: int, device: torch.device | str,
                         group_cost: int = GROUP_COST_BLOCKS,
                         max_groups: int = MAX_DECODE_GROUPS) -> AttentionMeta:
    """The packed step's slots, decode groups (at most `max_groups`) and chunk spans, items in
    packing order."""
    bs = block_size
    slots: list[int] = []
    decodes: list[tuple[int, list[int], int]] = []  # (packed row, table, position)
    chunks: list[ChunkSpan] = []
    for item in items:
        a, start, end = len(slots), item.start, item.start + item.num_tokens
        blocks = item.blocks
        if item.num_tokens == 1:  # a decode: most items
            block, offset = divmod(start, bs)
            slots.append(blocks[block] * bs + offset)
            decodes.append((a, blocks[: block + 1], start))
        else:
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            table = long_tensor(blocks[: -(-end // bs)], device)
            chunks.append(ChunkSpan(a, len(slots), item.start, table))
    decodes.sort(key=lambda d: len(d[1]))
    groups = []
    for lo, hi in decode_groups([len(d[1]) for d in decodes], group_cost, max_groups):
        members = decodes[lo:hi]
        width = len(members[-1][1])
        padding = [0] * width
        flat: list[int] = []
        for _, table_ids, _ in members:  # each table padded to the group's widest with block 0
            flat += table_ids
            flat += padding[len(table_ids):]
        groups.append(DecodeGroup(
            rows=long_tensor([d[0] for d in members], device),
            tables=long_tensor(flat, device).view(len(members), width),
            positions=long_tensor([d[2] for d in members], device),
        ))
    return AttentionMeta(long_tensor(slots, device), groups, chunks)


def decode_groups(widths: list[int], group_cost: int = GROUP_COST_BLOCKS,
                  max_groups: int = MAX_DECODE_GROUPS) -> list[tuple[int, int]]:
    """Split ascending table widths into at most `max_groups` runs [lo, hi), each padded to
    its last width: greedily make the one split that saves the most gathered blocks net of
    `group_cost`, while one saves anything. O(len(widths) * max_groups)."""
    if not widths:
        return []
    runs = [(0, len(widths))]
    while len(runs) < max_groups:
        best_gain, best = 0, None
        for r, (lo, hi) in enumerate(runs):
            whole = (hi - lo) * widths[hi - 1]
            for cut in range(lo + 1, hi):
                gain = whole - (cut - lo) * widths[cut - 1] - (hi - cut) * widths[hi - 1]
                if gain - group_cost > best_gain:
                    best_gain, best = gain - group_cost, (r, cut)
        if best is None:
            break
        r, cut = best
        lo, hi = runs[r]
        runs[r : r + 1] = [(lo, cut), (cut, hi)]
    return runs


class PagedAttention:
    """The engine's attention backend for one step (see the module docstring).

    `windows[layer]` is that layer's sliding window (None = full attention): a query at
    position p sees keys at positions (p - window, p].
    """

    def __init__(self, cache: KVCache, meta: AttentionMeta, windows: list[int | None],
                 kernels: Kernels | None = None) -> None:
        self.cache = cache
        self.meta = meta
        self.windows = windows
        self._decode_bias: dict[tuple[int, int | None], Tensor] = {}
        # meshlm's C kernels write the keys and values, and the decode rows' attention reads
        # the blocks in place: no gather (the decodes come as one group,
        # `build_attention_meta(max_groups=1)`).
        self.kernels = kernels
        self._spans: dict[int | None, tuple[Tensor, Tensor]] = {}
        self._scratch: Tensor | None = None
        # Rows of the 2-D cache view each decode group / chunk reads: the same for K and V and
        # for every layer, so computed once per step.
        self._group_rows = [] if kernels else [_cache_rows(cache.k[0], g.tables)
                                               for g in meta.decodes]
        self._chunk_rows = [_cache_rows(cache.k[0], c.table[None]) for c in meta.chunks]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
               out: Tensor | None = None) -> Tensor:
        """Writes k and v into the cache, then attends. The output is `out` where given
        ([1, Hq, T, D], any strides with D contiguous), else a new one laid out token-major
        ([1, T, Hq, D] transposed), so that the o projection's reshape is a view."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [Hkv, NB, bs, D]
        hkv, _, _, d = kc.shape
        slots = self.meta.slot_mapping
        if self.kernels is not None:
            self.kernels.store_kv(k[0], v[0], slots, kc, vc)
        else:
            kc.view(hkv, -1, d).index_copy_(1, slots, k[0].to(kc.dtype))
            vc.view(hkv, -1, d).index_copy_(1, slots, v[0].to(vc.dtype))
        window = self.windows[layer]
        if out is None:
            b, hq, t, _ = q.shape
            out = q.new_empty(b, t, hq, d).transpose(1, 2)
        if self.kernels is not None and self.meta.decodes:
            self._decode_in_place(q[0], out[0], kc, vc, window)
        for i, group in enumerate(self.meta.decodes if self.kernels is None else ()):
            rows, shape = self._group_rows[i], group.tables.shape
            keys, values = _gather(kc, rows, shape, q.dtype), _gather(vc, rows, shape, q.dtype)
            qd = q[0].index_select(1, group.rows)  # [Hq, B, D]
            bias = self._bias(i, window, keys.shape[2])
            out[0].index_copy_(1, group.rows, _decode_attention(qd, keys, values, bias))
        for span, rows in zip(self.meta.chunks, self._chunk_rows, strict=True):
            a, b = span.q_start, span.q_end
            n, end = b - a, span.start + b - a
            qs = q[:, :, a:b]
            if span.start == 0 and (window is None or window >= n):
                o = F.scaled_dot_product_attention(
                    qs, k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True
                )
            else:
                span_shape = (1, span.table.shape[0])
                keys = _gather(kc, rows, span_shape, q.dtype).transpose(0, 1)[:, :, :end]
                values = _gather(vc, rows, span_shape, q.dtype).transpose(0, 1)[:, :, :end]
                pos = torch.arange(span.start, end, device=q.device)
                mask = _visible(pos, end, window)
                o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask,
                                                   enable_gqa=True)
            out[:, :, a:b] = o
        return out

    def _decode_in_place(self, q: Tensor, out: Tensor, kc: Tensor, vc: Tensor,
                         window: int | None) -> None:
        """Every decode row at once through the native kernel: q and out [Hq, T, D]."""
        assert self.kernels is not None
        group = self.meta.decodes[0]
        span = self._spans.get(window)
        if span is None:
            last = group.positions + 1
            first = (last - window).clamp_(min=0) if window is not None else torch.zeros_like(last)
            span = self._spans[window] = (first, last)
        if self._scratch is None:
            size = self.kernels.scratch_size(q.shape[0], kc.shape[0],
                                             group.tables.shape[1] * kc.shape[2])
            self._scratch = torch.empty(size, dtype=torch.float32)
        if q.stride(-1) != 1:
            q = q.contiguous()
        self.kernels.decode_attention(q, out, group.rows, group.tables, *span, kc, vc,
                                      self._scratch)

    def _bias(self, index: int, window: int | None, length: int) -> Tensor:
        """Decode group `index`'s additive mask [B, 1, L], built once per step and window."""
        bias = self._decode_bias.get((index, window))
        if bias is None:
            visible = _visible(self.meta.decodes[index].positions, length, window)  # [B, L]
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            bias = bias.masked_fill_(~visible, float("-inf"))[:, None, :]
            self._decode_bias[(index, window)] = bias
        return bias


def _cache_rows(cache: Tensor, tables: Tensor) -> Tensor:
    """The rows of a layer's blocks [Hkv, NB, bs, D], viewed as 2-D [Hkv * NB, bs * D], that
    tables [B, nb] read: head h's block j is row h * NB + j. Flat, head-major."""
    hkv, nb_total = cache.shape[:2]
    heads = torch.arange(hkv, device=tables.device)[:, None] * nb_total
    return (tables.reshape(1, -1) + heads).reshape(-1)


def _gather(cache: Tensor, rows: Tensor, table_shape: tuple[int, ...],
            dtype: torch.dtype) -> Tensor:
    """Blocks [Hkv, NB, bs, D] read through tables of `table_shape` [B, nb] (their
    `_cache_rows`) -> [Hkv, B, nb * bs, D] in `dtype` (the queries': a cache may hold a
    narrower type, `--kv-cache-dtype`).

    One row lookup in a 2-D view. `F.embedding` is the lookup: on CPU it copies whole rows
    several times faster than `index_select`.
    """
    hkv, nb_total, bs, d = cache.shape
    b, nb = table_shape
    blocks = F.embedding(rows, cache.view(hkv * nb_total, bs * d))
    return blocks.view(hkv, b, nb * bs, d).to(dtype)


def _visible(positions: Tensor, length: int, window: int | None) -> Tensor:
    """[len(positions), length] bool: key j is visible from a query at position p."""
    keys = torch.arange(length, device=positions.device)[None, :]
    p = positions[:, None]
    visible = keys <= p
    if window is not None:
        visible &= keys > p - window
    return visible


def _decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """q [Hq, B, D] over keys/values [Hkv, B, L, D] with an additive bias [B, 1, L] -> [Hq, B, D].

    Query head h uses KV head h // (Hq / Hkv), as in HF's repeat_kv. With one query per row,
    two batched matmuls over the grouped heads beat the fused SDPA kernels on CPU.
    """
    hq, r, d = q.shape
    hkv = keys.shape[0]
    g = hq // hkv
    grouped = q.view(hkv, g, r, d).transpose(1, 2)  # [Hkv, B, G, D]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * d**-0.5 + bias
    weights = scores.softmax(dim=-1).to(values.dtype)
    out = torch.matmul(weights, values)  # [Hkv, B, G, D]
    return out.transpose(1, 2).reshape(hq, r, d)
