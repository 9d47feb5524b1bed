"""Llama-architecture causal LM in plain torch, with HF-compatible module and parameter names.

Also serves Qwen2 and Mistral: the differences (biases, sliding window) are ModelConfig fields.
Attention is delegated to an `AttentionBackend` passed into `forward`: the engine's backends
read and write its KV cache; `forward_full` uses plain causal attention over the given tokens
(within each layer's sliding window) and serves as the cache-free reference.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.scheduler.models.config import ModelConfig


class AttentionBackend(Protocol):
    """Where attention reads its keys and values from (a KV cache, or just the new tokens)."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
               out: Tensor | None = None) -> Tensor:
        """q [B, Hq, T, D], k and v [B, Hkv, T, D] of the new tokens, RoPE applied.

        Returns the attention output [B, Hq, T, D]: `out` where given, written in place.
        """
        ...


class CausalAttention:
    """No cache: each row attends causally over its own T tokens, within the layer's sliding
    window when `config` gives it one."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
               out: Tensor | None = None) -> Tensor:
        window = self.config.window_of(layer) if self.config is not None else None
        t = q.shape[2]
        if window is None or window >= t:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(t, device=q.device)
            behind = pos[:, None] - pos[None, :]  # query row minus key column
            mask = (behind >= 0) & (behind < window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o if out is None else out.copy_(o)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope_type(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(config: ModelConfig, device: torch.device) -> Tensor:
    """Inverse frequencies [D/2] of the config's RoPE; "dynamic" starts from the default ones
    and is rescaled per call (`_dynamic_ntk`)."""
    dim = config.head_dim
    inv = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    )
    scaling = config.rope_scaling or {}
    kind = _rope_type(config)
    if kind in ("default", "dynamic"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _dynamic_ntk(config: ModelConfig, inv: Tensor, positions: Tensor) -> Tensor:
    """HF "dynamic" NTK scaling: past max_position_embeddings, raise the RoPE base with the
    longest sequence of the call (the largest position + 1); unchanged up to it. Computed on
    the device, so no sync."""
    factor = float((config.rope_scaling or {})["factor"])
    original = config.max_position_embeddings
    seq_len = (positions.max() + 1).float().clamp(min=original)
    dim = config.head_dim
    base = config.rope_theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=inv.device) / dim
    return torch.where(seq_len > original, 1.0 / base ** exponents, inv)


class RotaryEmbedding(nn.Module):
    """cos and signed sin for given positions (HF "rotate half" layout), computed in float32:
    the sin of the first half of each head's dimensions negated, so that `apply_rotary` turns
    HF's rotate_half (negate and concatenate) into one roll.

    On the CPU both come from a table of every position below the largest seen so far (twice
    as many rows when a later position passes it), as vLLM's and SGLang's cos/sin caches: a
    step looks its rows up in two index_selects instead of computing them in eight ops (a
    1-row decode step of the tiny model spent 76 µs here). Elsewhere, and for "dynamic"
    scaling, whose frequencies depend on the call's longest position, they are computed per
    call (sizing a table from a device's positions would wait for the device)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.dynamic = _rope_type(config) == "dynamic"
        self._inv_freq: Tensor | None = None  # not a buffer: survives meta construction
        self._table: tuple[Tensor, Tensor] | None = None  # CPU: (cos, signed sin) [P, D]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos and signed sin [B, 1, T, D] of `dtype` ([T]: [T, 1, D])."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config, positions.device)
        if self.dynamic or positions.device.type != "cpu":
            inv = self._inv_freq
            if self.dynamic:
                inv = _dynamic_ntk(self.config, inv, positions)
            cos, sin = rope_cos_sin(positions.float(), inv)
            return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)
        flat = positions.reshape(-1)
        cos, sin = self._rows(int(flat.max()) + 1 if flat.numel() else 0, dtype)
        shape = (*positions.shape, cos.shape[1])
        return (cos.index_select(0, flat).view(shape).unsqueeze(1),
                sin.index_select(0, flat).view(shape).unsqueeze(1))

    def table(self, needed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """The CPU table that `forward` looks positions up in: cos and signed sin [P, D] of
        `dtype`, P >= needed; None for "dynamic" scaling, computed per call."""
        if self.dynamic:
            return None
        if self._inv_freq is None or self._inv_freq.device.type != "cpu":
            self._inv_freq = rope_inv_freq(self.config, torch.device("cpu"))
        return self._rows(needed, dtype)

    def _rows(self, needed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The CPU table, of `dtype`, with at least `needed` rows."""
        assert self._inv_freq is not None
        table = self._table
        if table is None or table[0].shape[0] < needed or table[0].dtype != dtype:
            rows = 1 << max(needed - 1, TABLE_MIN_ROWS - 1).bit_length()
            cos, sin = rope_cos_sin(torch.arange(rows).float(), self._inv_freq)
            self._table = table = cos.to(dtype), sin.to(dtype)
        return table


TABLE_MIN_ROWS = 256  # RotaryEmbedding's table starts with this many positions


def rope_cos_sin(positions: Tensor, inv: Tensor) -> tuple[Tensor, Tensor]:
    """Float positions [..., T] and inverse frequencies [D/2] -> cos and signed sin
    [..., T, D] in float32."""
    freqs = positions.unsqueeze(-1) * inv  # [..., T, D/2]
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """HF's x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1): x's halves
    swapped (a roll by half the head) times the sign that `signed_sin` carries. Three ops per
    call instead of five."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        h, qkv_bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)
        # q, k and v in one matmul where the projections were fused (`cpu_linear.pack_linears`).
        self.qkv_proj: nn.Module | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend,
                keep: Tensor | None = None) -> Tensor:
        """x [B, T, H] -> [B, T, H]; with `keep`, every token's keys and values still reach
        the cache, but only the tokens at `keep` (indices into T) come out, [B, K, H]."""
        b, t, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.view(b, t, hq, d).transpose(1, 2)
            k = k.view(b, t, hkv, d).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            # Fused: RoPE over the query and key heads side by side, one pass for both.
            qkv = self.qkv_proj(x)
            qk = qkv[..., : (hq + hkv) * d].view(b, t, hq + hkv, d).transpose(1, 2)
            q, k = apply_rotary(qk, cos, sin).split([hq, hkv], dim=1)
            v = qkv[..., (hq + hkv) * d :]
        v = v.view(b, t, hkv, d).transpose(1, 2)
        out = attention.attend(self.layer, q, k, v).transpose(1, 2)  # [B, T, Hq, D]
        if keep is not None:
            out = out.index_select(1, keep)
        return self.o_proj(out.reshape(b, out.shape[1], hq * d))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # fused gate and up (`pack_linears`)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionBackend,
                keep: Tensor | None = None) -> Tensor:
        """With `keep`, the tokens at `keep` only past the attention (`LlamaAttention`)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attention, keep)
        x = (x if keep is None else x.index_select(1, keep)) + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Its weight given, not drawn: nn.Embedding's random init on the meta device
        # (load_model) imports torch._dynamo, 2.2 s of a scheduler's start.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend,
                keep: Tensor | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention, keep if i == last else None)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """HF `LlamaForCausalLM` layout (also Qwen2's and Mistral's): `model.*` and `lm_head`
    (shared with the embedding if tied). A `*ForSequenceClassification` config adds HF's
    `score` head (num_labels rows, no bias) and ties the unused lm_head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.score = (nn.Linear(config.hidden_size, config.num_labels, bias=False)
                      if config.num_labels else None)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionBackend,
                keep: Tensor | None = None) -> Tensor:
        """input_ids and positions [B, T] -> final hidden states [B, T, H] (no lm_head), or
        of the tokens at `keep` only ([B, K, H], in its order): the last layer computes every
        token's keys and values, and its o projection and MLP for those tokens alone."""
        return self.model(input_ids, positions, attention, keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Hidden states [..., H] -> float32 logits [..., V]."""
        return self.lm_head(hidden).float()

    def classify(self, hidden: Tensor) -> Tensor:
        """Pooled hidden states [..., H] -> float32 class logits [..., num_labels]."""
        if self.score is None:
            raise RuntimeError(f"{self.config.architecture} has no classification head")
        return self.score(hidden).float()

    def forward_full(self, input_ids: Tensor) -> Tensor:
        """Cache-free reference: input_ids [B, T] -> float32 logits [B, T, V], causal attention."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        attention = CausalAttention(self.config)
        return self.compute_logits(self.forward(input_ids, positions, attention))
