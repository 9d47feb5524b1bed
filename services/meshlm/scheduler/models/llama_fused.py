"""The Llama family's forward on the CPU through meshlm's C kernels: the same arithmetic as
`LlamaModel.forward`, in about ten calls per layer instead of forty.

Between its matmuls a decoder layer is a few dozen small torch ops (two RMSNorms, RoPE,
slicing, the KV write, SiLU and the residual adds); at decode sizes each costs microseconds of
dispatch and together they took a fifth of the bench model's 16-row step. Here each layer is:

    add + RMSNorm -> qkv matmul -> RoPE in place -> attention (KV write, decode kernel,
    SDPA for prompt chunks) -> o matmul -> add + RMSNorm -> gate_up matmul -> SiLU * up
    -> down matmul (its residual add joins the next layer's norm)

The step's rows are padded once, up front, to the packed linears' row bucket (oneDNN's kernels
are built per row count, `cpu_linear.row_bucket`; meshlm's own take any count), so no matmul
pads or slices its input; the padding rows are never written to the KV cache nor attended
to, and are dropped at the end.

Over meshlm's own packing (the usual case on a CPU with AVX2 or AVX-512) a step does even
those calls in C: `decode_forward` hands every layer to kernels/decode_layers.c in one call,
which calls the same kernels in the same order without coming back to Python between them
(a step of decodes: the same hidden states to the bit). Python's share of a decode step was
about 1 ms of the bench model's 3.7 at one row (2 threads; 0.5 of the tiny model's 1.1), 125
us a layer; the step now takes 2.6-2.8 ms against 3.6-3.8. In the scheduler service the
engine thread also holds no GIL for the whole pass, so the event loop sends the last step's
outputs meanwhile without stalling it. Prompt chunks go the same way: through
kernels/chunk_attention.c, which attends a chunk's tokens as matrix products, where it takes
the model's heads and cache blocks, without sliding windows (`_chunk_kernel_serves`);
elsewhere a short chunk's tokens attend as decode rows over the cache (`_attention_rows`),
and a long one (CHUNK_PAIRS), like oneDNN's packing, keeps the layer-by-layer forward
(`layer_by_layer`), SDPA for the chunk.

Serves a model whose projections `pack_linears` fused (q/k/v and gate/up) and packed, in
float32 (`fuse`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.scheduler.engine.kv_cache import AttentionMeta, PagedAttention
from meshlm.scheduler.kernels.native import (
    KV_DTYPES,
    DecodeStep,
    Kernels,
    LayerWeights,
    chunk_attention_fits,
)
from meshlm.scheduler.models.cpu_linear import PackedLinear, repacks
from meshlm.scheduler.models.llama import (
    AttentionBackend,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
)

# Where the chunk kernel does not serve a step's prompt chunks (`_chunk_kernel_serves`), their
# rows attend through the decode kernel (`_attention_rows`) while a chunk's tokens times its
# end position are at most this; a longer one's step goes layer by layer, the chunk's
# attention through SDPA, which computes it as matrix products. Prefill steps of one prompt,
# the two alternated in one process (bench model, 2 threads): 8 tokens 7.6 -> 5.9 ms, 32
# 11.7 -> 10.3, 128 31.9 -> 29.0, 256 63.9 -> 61.9, 512 134.7 -> 133.0, 1,000 273 -> 312.
# The chunk kernel serves every length in one call (alternated on the AVX-512 Xeon of
# 2026-12-01: against the decode kernel row by row 128 tokens 30.3 -> 30.6 ms, 256 63.5 ->
# 59.8, 512 136.5 -> 122.4; against SDPA layer by layer 700 215.8 -> 178.0, 1,000 312.2 ->
# 265.3).
CHUNK_PAIRS = 512 * 512


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's modules, as the fused forward calls them (the modules themselves:
    a weight reload repacks them in place)."""

    index: int
    heads: int
    kv_heads: int
    head_dim: int
    input_norm: RMSNorm
    qkv: PackedLinear
    o: PackedLinear
    post_norm: RMSNorm
    gate_up: PackedLinear
    down: PackedLinear


class LayerArray:
    """The layers as decode_layers.c reads them (`native_layers`), built once and again only
    after a weight reload repacked a projection into a new array: about 60 µs of every step
    of the tiny model, 85-130 of the bench model's, when they were built for each."""

    def __init__(self) -> None:
        self.array: ctypes.Array[LayerWeights] | None = None
        self.repacks = -1  # `repacks()` when the array was built


@dataclass(frozen=True)
class FusedModel:
    embed: nn.Embedding
    rotary: RotaryEmbedding
    layers: list[FusedLayer]
    norm: RMSNorm
    # Every projection packed by meshlm's own packing, in one weight type: decode_layers.c
    # calls the matmul kernel itself (`decode_forward`).
    one_call: bool
    # The LM head where it is in meshlm's packing too: `fused_logits` multiplies by it in the
    # same call into the kernels (None: the caller's `compute_logits` does).
    head: PackedLinear | None = None
    native: LayerArray = field(default_factory=LayerArray)


def fuse(model: LlamaForCausalLM) -> FusedModel | None:
    """`model` as the fused forward runs it; None where it cannot: not float32 on the CPU, or
    a layer whose q/k/v or gate/up were not fused and packed (`pack_linears`)."""
    inner = model.model
    weight = inner.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    layers: list[FusedLayer] = []
    for i, layer in enumerate(inner.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        if not (isinstance(qkv, PackedLinear) and isinstance(o, PackedLinear)
                and isinstance(gate_up, PackedLinear) and isinstance(down, PackedLinear)):
            return None
        layers.append(FusedLayer(i, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                 layer.input_layernorm, qkv, o, layer.post_attention_layernorm,
                                 gate_up, down))
    if not layers:
        return None
    linears = [lin for f in layers for lin in (f.qkv, f.o, f.gate_up, f.down)]
    one_call = all(lin.packing.name == "native" and lin.packed.dtype == linears[0].packed.dtype
                   for lin in linears)
    head = model.lm_head
    native_head = (head if isinstance(head, PackedLinear) and head.packing.name == "native"
                   and type(model).compute_logits is LlamaForCausalLM.compute_logits else None)
    return FusedModel(inner.embed_tokens, inner.rotary_emb, layers, inner.norm, one_call,
                      native_head)


def fused_forward(model: FusedModel, kernels: Kernels, input_ids: Tensor, positions: Tensor,
                  attention: AttentionBackend, keep: Tensor | None = None) -> Tensor:
    """input_ids and positions [T] (one packed step) -> final hidden states [T, H], or of
    the packed rows `keep` only ([K, H], in its order): a step over meshlm's packing in one
    call into the kernels (`decode_forward`), any other layer by layer from here."""
    if isinstance(attention, PagedAttention) and (
            native := native_layers(model, attention)) is not None:
        return decode_forward(model, native, kernels, input_ids, positions, attention, keep)
    return layer_by_layer(model, kernels, input_ids, positions, attention, keep)


def fused_logits(model: FusedModel, kernels: Kernels, input_ids: Tensor, positions: Tensor,
                 attention: AttentionBackend, keep: Tensor | None = None) -> Tensor | None:
    """The float32 logits of `fused_forward`'s rows, the LM head multiplied in the same call
    into the kernels (`decode_forward`): where that call serves the step and the head is in
    meshlm's packing; else None, and nothing computed. One ctypes call and its tensors fewer a
    step: 170 µs of a 1-row step of the tiny model (850) went to `compute_logits`."""
    if model.head is None or not isinstance(attention, PagedAttention):
        return None
    native = native_layers(model, attention)
    if native is None:
        return None
    return decode_forward(model, native, kernels, input_ids, positions, attention, keep,
                          head=model.head)


def layer_by_layer(model: FusedModel, kernels: Kernels, input_ids: Tensor, positions: Tensor,
                   attention: AttentionBackend, keep: Tensor | None = None) -> Tensor:
    """`fused_forward`, each kernel called from here; the last layer goes past its
    attention with the rows `keep` only, padded to the packing's bucket."""
    t = input_ids.shape[0]
    n = model.layers[0].qkv.packing.bucket(t)
    if n != t:
        input_ids = F.pad(input_ids, (0, n - t))
        positions = F.pad(positions, (0, n - t))
    x = model.embed(input_ids)  # [n, H]: the residual stream, updated in place
    cos, sin = model.rotary(positions, x.dtype)  # [n, 1, D]
    cos, sin = cos.view(n, -1), sin.view(n, -1)
    normed = torch.empty_like(x)
    pending: Tensor | None = None  # the last layer's MLP output, not yet added to x
    for layer in model.layers:
        hq, hkv, d = layer.heads, layer.kv_heads, layer.head_dim
        kernels.add_rmsnorm(x, pending, layer.input_norm.weight, layer.input_norm.eps, normed)
        qkv = layer.qkv.rows(normed)
        kernels.rope(qkv, hq + hkv, d, cos, sin)
        heads = qkv.view(n, -1, d)[:t].transpose(0, 1)[None]  # [1, hq + 2 hkv, t, d]
        q, k, v = heads.split([hq, hkv, hkv], dim=1)
        out = torch.empty(n, hq, d)
        if n != t:
            out[t:].zero_()
        attention.attend(layer.index, q, k, v, out=out[:t].transpose(0, 1)[None])
        if keep is not None and layer is model.layers[-1]:
            t = keep.shape[0]
            if t == 0:
                return x.new_empty(0, x.shape[1])
            n = layer.o.packing.bucket(t)
            x, out = _gathered(x, keep, n), _gathered(out, keep, n)
            normed = torch.empty_like(x)
        o = layer.o.rows(out.view(n, -1))
        kernels.add_rmsnorm(x, o, layer.post_norm.weight, layer.post_norm.eps, normed)
        gate_up = layer.gate_up.rows(normed)
        act = torch.empty(n, gate_up.shape[1] // 2)
        kernels.silu_mul(gate_up, act)
        pending = layer.down.rows(act)
    hidden = torch.empty_like(x)
    kernels.add_rmsnorm(x, pending, model.norm.weight, model.norm.eps, hidden)
    return hidden[:t]


def _gathered(rows: Tensor, keep: Tensor, n: int) -> Tensor:
    """rows [N, ...] at `keep`, zero rows after them up to n."""
    out = rows.new_zeros(n, *rows.shape[1:])
    out[: keep.shape[0]] = rows.index_select(0, keep)
    return out


def native_layers(model: FusedModel, attention: PagedAttention
                  ) -> ctypes.Array[LayerWeights] | None:
    """The layers as `decode_forward` passes them to the C kernels, for a step that it
    serves: its decodes in one group (read in place by the decode kernel), its prompt chunks
    short enough for that kernel too (CHUNK_PAIRS), the model `one_call`; else None. Kept
    until a weight reload repacks a projection into a new array (`LayerArray`)."""
    meta = attention.meta
    if (not model.one_call or attention.kernels is None or len(meta.decodes) > 1
            or (not _chunk_kernel_serves(model, attention)
                and any((c.q_end - c.q_start) * (c.start + c.q_end - c.q_start) > CHUNK_PAIRS
                        for c in meta.chunks))):
        return None
    cache = model.native
    if cache.array is None or cache.repacks != repacks():
        cache.repacks = repacks()
        layers = []
        for layer in model.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            biases = [None if lin.bias is None else lin.bias.data_ptr() for lin in linears]
            layers.append(LayerWeights(
                *(lin.packed.data_ptr() for lin in linears), *biases,
                layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(), None,
                layer.input_norm.eps, layer.post_norm.eps))
        cache.array = (LayerWeights * len(layers))(*layers)
    return cache.array


def decode_forward(model: FusedModel, layers: ctypes.Array[LayerWeights], kernels: Kernels,
                   input_ids: Tensor, positions: Tensor, attention: PagedAttention,
                   keep: Tensor | None = None, head: PackedLinear | None = None) -> Tensor:
    """`fused_forward` for a step that `native_layers` serves, all of its layers in one call
    into the C kernels (kernels/decode_layers.c: the same kernels in the same order, without
    Python between them; a prompt chunk's attention through the chunk kernel, or the decode
    kernel row by row) -> final hidden states [T, H], or [K, H] of the K rows `keep`.

    Where `keep` leaves rows out (the tokens of prompt chunks before their last: the step
    samples none of them), the last layer computes their keys and values only, and its
    attention, o projection and MLP for the kept rows (`_kept_rows`): of the bench model's
    8 layers that is a ninth of a prompt token's work.

    With `head` (the LM head, in meshlm's packing) the same call multiplies the final hidden
    states by it and the logits [T or K, V] (float32) come back instead.

    The kernel also reads the step's rows of the embeddings and of RoPE's table itself (a
    1-row decode of the tiny model spent 60 µs in the two torch lookups)."""
    t = input_ids.shape[0]
    first = model.layers[0]
    hq, hkv, d = first.heads, first.kv_heads, first.head_dim
    hidden, inter = first.qkv.in_features, first.gate_up.out_features // 2
    k_cache, v_cache = attention.cache.k, attention.cache.v  # [L, Hkv, NB, bs, D]
    _, _, num_blocks, block_size, _ = k_cache.shape
    chunked = bool(attention.meta.chunks) and _chunk_kernel_serves(model, attention)
    rows, tables, last, chunks = _attention_rows(attention.meta, t, chunked)
    # The kernel copies the rows of the embeddings and of RoPE's table that the step reads
    # (the table's positions run past every row's: each is below the end of its block table).
    x = torch.empty(t, hidden)  # the residual stream, updated in place
    table = model.rotary.table(tables.shape[1] * block_size, x.dtype)
    if table is None:  # cos and sin computed per call (dynamic scaling), a row per token
        cos, sin = model.rotary(positions, x.dtype)
        cos, sin = cos.view(t, -1), sin.view(t, -1)
    else:
        cos, sin = table
    starts: dict[int, Tensor] = {}  # first position attended, per sliding window
    for layer, weights in zip(model.layers, layers, strict=True):
        window = attention.windows[layer.index]
        if window is None:  # from position 0
            weights.first = None
            continue
        start = starts.get(window)
        if start is None:
            start = starts[window] = (last - window).clamp_(min=0)
        weights.first = start.data_ptr()
    threads = torch.get_num_threads()
    scratch = torch.empty(kernels.scratch_size(hq, hkv, tables.shape[1] * block_size))
    qkv_width = (hq + 2 * hkv) * d
    num_kept = t if keep is None else keep.shape[0]
    kept = 0 < num_kept < t  # (none kept: every row computed, none returned)
    work = torch.empty(t * (2 + 2 * d + 2 * hidden + qkv_width + hq * d + 3 * inter)
                       + (num_kept * (hidden + 2 * hq * d) if kept else 0))
    step = DecodeStep(
        t, hidden, hq, hkv, d, inter, int(first.qkv.packed.dtype == torch.bfloat16),
        KV_DTYPES[k_cache.dtype][1], cos.data_ptr(), sin.data_ptr(),
        attention.meta.slot_mapping.data_ptr(), rows.data_ptr(), tables.data_ptr(),
        last.data_ptr(), tables.shape[1], k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), num_blocks, block_size, d**-0.5, scratch.data_ptr(),
        scratch.numel() // threads, work.data_ptr())
    step.ids, step.embed = input_ids.data_ptr(), model.embed.weight.data_ptr()
    step.vocab = model.embed.weight.shape[0]
    if table is not None:
        step.positions = positions.data_ptr()
    if chunks is not None:
        chunk_scratch = torch.empty(kernels.chunk_scratch_size(
            hkv, d, [c.start + c.q_end - c.q_start for c in attention.meta.chunks],
            k_cache.dtype))
        step.chunks, step.num_chunks = chunks.data_ptr(), chunks.shape[0]
        step.decode_rows = t - sum(c.q_end - c.q_start for c in attention.meta.chunks)
        step.chunk_scratch = chunk_scratch.data_ptr()
    if kept:
        assert keep is not None
        held = _kept_rows(attention.meta, t, keep, attention.windows[model.layers[-1].index])
        assert held[0].shape[1] == step.table_width
        step.kept, step.num_kept = keep.data_ptr(), num_kept
        step.kept_tables, step.kept_first, step.kept_last, step.kept_order = (
            a.data_ptr() for a in held)
        out = torch.empty(num_kept, hidden)
    else:
        out = torch.empty_like(x)
    result = out
    if head is not None:
        result = torch.empty(out.shape[0], head.out_features)
        step.head, step.logits, step.head_out = (head.packed.data_ptr(), result.data_ptr(),
                                                 head.out_features)
        step.head_kind = int(head.packed.dtype == torch.bfloat16)
        if head.bias is not None:
            step.head_bias = head.bias.data_ptr()
    kernels.decode_layers(step, layers, x, model.norm.weight, model.norm.eps, out)
    if keep is not None and not kept:
        return result.index_select(0, keep)
    return result


def _kept_rows(meta: AttentionMeta, t: int, keep: Tensor, window: int | None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tables [K, W], first [K], last [K], order 0 .. K - 1) for the last layer's attention
    of the packed rows `keep` through the decode kernel, each over its item's table up to
    its position (the `window` before it)."""
    _, tables, last, _ = _attention_rows(meta, t)
    tables, last = tables.index_select(0, keep), last.index_select(0, keep)
    first = (last - window).clamp_(min=0) if window is not None else torch.zeros_like(last)
    return tables, first, last, torch.arange(keep.shape[0])


def _chunk_kernel_serves(model: FusedModel, attention: PagedAttention) -> bool:
    """Whether the step's prompt chunks attend through chunk_attention.c: where it takes
    the model's heads and the cache, and no layer has a sliding window."""
    first, cache = model.layers[0], attention.cache.k
    return all(w is None for w in attention.windows) and chunk_attention_fits(
        first.heads, first.kv_heads, first.head_dim, cache.shape[3], cache.dtype)


def _attention_rows(meta: AttentionMeta, t: int, chunked: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(rows, tables, last, chunks) for the attention kernels: the decode group's as it is,
    or where the step has prompt chunks, every packed row, a chunk's token at position p
    being a row that attends up to p over its item's table (its keys are in the cache by
    then: every row's are written before any row attends). `chunked`: the decode rows first,
    and the chunks described for chunk_attention.c ([C, 4]: first packed row, rows, first
    position, the row of `tables` with its table), which attends them instead."""
    decodes = meta.decodes[0] if meta.decodes else None
    if not meta.chunks:
        assert decodes is not None
        return decodes.rows, decodes.tables, decodes.positions + 1, None
    width = max([c.table.shape[0] for c in meta.chunks]
                + ([decodes.tables.shape[1]] if decodes is not None else []))
    tables = torch.zeros(t, width, dtype=torch.long)
    last = torch.empty(t, dtype=torch.long)
    if not chunked:
        if decodes is not None:
            tables[decodes.rows, : decodes.tables.shape[1]] = decodes.tables
            last[decodes.rows] = decodes.positions + 1
        for c in meta.chunks:
            tables[c.q_start : c.q_end, : c.table.shape[0]] = c.table
            torch.arange(c.start + 1, c.start + c.q_end - c.q_start + 1,
                         out=last[c.q_start : c.q_end])
        return torch.arange(t), tables, last, None
    order = [decodes.rows] if decodes is not None else []
    r = 0
    if decodes is not None:
        r = decodes.rows.shape[0]
        tables[:r, : decodes.tables.shape[1]] = decodes.tables
        last[:r] = decodes.positions + 1
    described = []
    for c in meta.chunks:
        n = c.q_end - c.q_start
        order.append(torch.arange(c.q_start, c.q_end))
        tables[r, : c.table.shape[0]] = c.table
        described.append((c.q_start, n, c.start, r))
        r += n
    return (torch.cat(order), tables[:r], last[:r],
            torch.tensor(described, dtype=torch.long))
