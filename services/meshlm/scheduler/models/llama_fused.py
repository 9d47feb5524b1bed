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

Serves a model whose projections `pack_linears` fused (q/k/v and gate/up) and packed, in
float32 (`fuse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.scheduler.kernels.native import Kernels
from meshlm.scheduler.models.cpu_linear import PackedLinear
from meshlm.scheduler.models.llama import (
    AttentionBackend,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
)


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


@dataclass(frozen=True)
class FusedModel:
    embed: nn.Embedding
    rotary: RotaryEmbedding
    layers: list[FusedLayer]
    norm: RMSNorm


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
    return FusedModel(inner.embed_tokens, inner.rotary_emb, layers, inner.norm) if layers else None


def fused_forward(model: FusedModel, kernels: Kernels, input_ids: Tensor, positions: Tensor,
                  attention: AttentionBackend) -> Tensor:
    """input_ids and positions [T] (one packed step) -> final hidden states [T, H]."""
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
        o = layer.o.rows(out.view(n, -1))
        kernels.add_rmsnorm(x, o, layer.post_norm.weight, layer.post_norm.eps, normed)
        gate_up = layer.gate_up.rows(normed)
        act = torch.empty(n, gate_up.shape[1] // 2)
        kernels.silu_mul(gate_up, act)
        pending = layer.down.rows(act)
    hidden = torch.empty_like(x)
    kernels.add_rmsnorm(x, pending, model.norm.weight, model.norm.eps, hidden)
    return hidden[:t]
