"""Slot-based contiguous KV cache and the attention backends that read and write it.

Every layer's keys and values live in one preallocated tensor each,
[num_layers, num_slots, num_kv_heads, max_model_len, head_dim]; a running sequence owns one
slot and its token at position p is stored at [layer, slot, :, p]. Only the model runner
touches these tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    """Preallocated K and V for `num_slots` sequences of up to `max_len` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.max_len = max_len
        nbytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            # Zeros, not empty: masked-out positions are still multiplied by 0 in attention,
            # and uninitialised memory may hold NaN.
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as e:
            raise MemoryError(
                f"KV cache of {nbytes / 2**30:.1f} GiB {shape} does not fit; "
                "lower max_running or max_model_len"
            ) from e
        self.nbytes = nbytes


class PrefillAttention:
    """Rows are whole sequences from position 0, right-padded to a common length T.

    Writes each row's K/V into its slot at positions [0, T) (padding lands past the row's
    length, where it is never read before being overwritten) and attends causally over the
    new tokens, so the real tokens never see the padding.
    """

    def __init__(self, cache: KVCache, slots: Tensor) -> None:
        self.cache = cache
        self.slots = slots

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t = k.shape[2]
        self.cache.k[layer, self.slots, :, :t] = k
        self.cache.v[layer, self.slots, :, :t] = v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class DecodeAttention:
    """One new token per row at `positions`; attends over the slot's positions [0, pos].

    When the batch's slots fill most of [0, max slot] (the slot table hands out the lowest
    free slot, so they usually do), attention runs on a view of those cache rows with the
    queries scattered to their slots: no copy of the cached keys and values. Otherwise the
    batch's rows are gathered. With one query per row, two batched matmuls over the grouped
    query heads beat the fused SDPA kernels on CPU and are fine elsewhere.
    """

    def __init__(
        self, cache: KVCache, slot_ids: list[int], slots: Tensor, positions: Tensor, max_len: int
    ) -> None:
        self.cache = cache
        self.slots = slots
        self.positions = positions
        self.max_len = max_len  # 1 + the largest position in the batch
        span = torch.arange(max_len, device=positions.device)
        visible = span[None, :] <= positions[:, None]  # [B, L]
        rows = max(slot_ids) + 1
        self.rows = rows if rows <= 2 * len(slot_ids) else None
        if self.rows is not None:
            # Rows of free slots see position 0 only: finite, and discarded.
            full = torch.zeros(rows, max_len, dtype=torch.bool, device=visible.device)
            full[:, 0] = True
            full[slots] = visible
            visible = full
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        self.bias = bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]  # [R, 1, 1, L]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        k_layer[self.slots, :, self.positions] = k[:, :, 0]
        v_layer[self.slots, :, self.positions] = v[:, :, 0]
        if self.rows is None:
            keys = k_layer[self.slots, :, : self.max_len]  # gathered, [B, Hkv, L, D]
            values = v_layer[self.slots, :, : self.max_len]
        else:
            keys = k_layer[: self.rows, :, : self.max_len]  # a view, [R, Hkv, L, D]
            values = v_layer[: self.rows, :, : self.max_len]
            q = q.new_zeros((self.rows, *q.shape[1:])).index_copy_(0, self.slots, q)
        out = _decode_attention(q, keys, values, self.bias)
        return out if self.rows is None else out[self.slots]


def _decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """q [R, Hq, 1, D] over keys/values [R, Hkv, L, D] with an additive bias [R, 1, 1, L].

    Query head h uses KV head h // (Hq / Hkv), as in HF's repeat_kv.
    """
    r, hq, _, d = q.shape
    hkv = keys.shape[1]
    grouped = q.reshape(r, hkv, hq // hkv, d)  # [R, Hkv, G, D]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * d**-0.5 + bias
    weights = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(weights, values).reshape(r, hq, 1, d)
