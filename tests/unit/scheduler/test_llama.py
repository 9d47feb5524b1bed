"""Model and loader: HF layout, tied/untied heads, dtypes, RoPE, and the cache path."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scheduler_helpers import write_checkpoint

from meshlm.scheduler.engine.kv_cache import (
    MAX_DECODE_GROUPS,
    AttentionMeta,
    KVCache,
    PagedAttention,
    StepItem,
    build_attention_meta,
    decode_groups,
)
from meshlm.scheduler.kernels import native
from meshlm.scheduler.kernels.native import Kernels
from meshlm.scheduler.models import llama_fused
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.cpu_linear import NativePacking, pack_linears
from meshlm.scheduler.models.llama import (
    LlamaForCausalLM,
    RotaryEmbedding,
    rope_cos_sin,
    rope_inv_freq,
)
from meshlm.scheduler.models.loader import load_model, resolve_dtype


def test_untied_loads_every_tensor(gqa_model: Path) -> None:
    model, cfg = load_model(gqa_model)
    state = load_file(str(gqa_model / "model.safetensors"))
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4 and not cfg.tie_word_embeddings
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_tied_shares_embedding(mha_tied_model: Path) -> None:
    model, cfg = load_model(mha_tied_model)
    assert cfg.tie_word_embeddings
    assert "lm_head.weight" not in load_file(str(mha_tied_model / "model.safetensors"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model.forward_full(torch.tensor([[5, 6, 7]]))
    assert logits.shape == (1, 3, cfg.vocab_size) and logits.dtype == torch.float32


def test_missing_and_unexpected_tensors_raise(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", layers=1)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old HF: ignored
    save_file(state, str(path / "model.safetensors"))
    load_model(path)
    save_file(
        {**state, "model.layers.7.mlp.up_proj.weight": torch.ones(1)},
        str(path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="unexpected"):
        load_model(path)
    del state["model.norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_model(path)


def test_dtype_selection(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "bf16", layers=1, torch_dtype="bfloat16")
    cfg = ModelConfig.from_dir(path)
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    assert resolve_dtype("float16", cfg) == torch.float16
    assert resolve_dtype("auto", ModelConfig.from_dict({**cfg.raw, "torch_dtype": None})) == (
        torch.float32
    )
    with pytest.raises(ValueError):
        resolve_dtype("int8", cfg)
    model, _ = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.forward_full(torch.tensor([[3, 4]])).dtype == torch.float32


def test_config_fields(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m", layers=1, extra_config={"head_dim": 32})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    cfg = ModelConfig.from_dir(path)
    assert cfg.head_dim == 32 and cfg.eos_token_ids == (2, 9)
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig.from_dict({**raw, "architectures": ["GPT2LMHeadModel"]})


def test_llama3_rope_scaling_is_identity_at_factor_one() -> None:
    base = {
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 8,
    }
    plain = ModelConfig.from_dict(base)
    scaled = ModelConfig.from_dict(
        {
            **base,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 1.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    cpu = torch.device("cpu")
    assert torch.allclose(rope_inv_freq(plain, cpu), rope_inv_freq(scaled, cpu))
    eight = ModelConfig.from_dict({**base, "rope_scaling": {**scaled.rope_scaling, "factor": 8.0}})
    inv = rope_inv_freq(eight, cpu)
    assert inv[0] == rope_inv_freq(plain, cpu)[0]  # high frequencies untouched
    assert inv[-1] < rope_inv_freq(plain, cpu)[-1]  # low frequencies stretched



@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rope_from_its_table_equals_rope_computed_per_call(head_dim: int) -> None:
    config = ModelConfig.from_dict({"hidden_size": 4 * head_dim, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 4,
                                    "vocab_size": 8})
    rotary = RotaryEmbedding(config)
    inv = rope_inv_freq(config, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    # 1-D and 2-D positions, the later ones past the table's first rows (it grows)
    for high in (10, 200, 3000, 9000):
        for shape in ((1,), (37,), (2, 19)):
            positions = torch.randint(0, high, shape, generator=generator)
            cos, sin = rotary(positions, torch.float32)
            want_cos, want_sin = rope_cos_sin(positions.float(), inv)
            # [T] -> [T, 1, D], [B, T] -> [B, 1, T, D], as the per-call computation's
            want = (shape[0], 1, *shape[1:], head_dim)
            assert cos.shape == sin.shape == want
            assert torch.equal(cos.reshape(want_cos.shape), want_cos)
            assert torch.equal(sin.reshape(want_sin.shape), want_sin)
    assert rotary._table is not None and rotary._table[0].shape[0] == 16384
    half_cos, _ = rotary(torch.tensor([5, 7]), torch.bfloat16)  # another dtype: a new table
    assert half_cos.dtype == torch.bfloat16
    assert torch.equal(half_cos.view(2, -1), rope_cos_sin(torch.tensor([5.0, 7.0]), inv)[0]
                       .to(torch.bfloat16))

def _packed_step(model: LlamaForCausalLM, cache: KVCache, windows: list[int | None],
                 items: list[tuple[list[int], list[int], int, int]],
                 group_cost: int = 16, kernel: Kernels | None = None,
                 fused: bool = False) -> torch.Tensor:
    """One packed forward over (tokens, block table, start, n) items -> logits [T, V]; with
    `fused`, through `llama_fused.fused_forward` and `kernel`."""
    ids = [t for tokens, _, start, n in items for t in tokens[start : start + n]]
    pos = [p for _, _, start, n in items for p in range(start, start + n)]
    meta = build_attention_meta([StepItem(table, start, n) for _, table, start, n in items],
                                cache.block_size, "cpu", group_cost,
                                max_groups=1 if kernel else MAX_DECODE_GROUPS)
    attention = PagedAttention(cache, meta, windows, kernel)
    if fused:
        assert kernel is not None
        fused_model = llama_fused.fuse(model)
        assert fused_model is not None
        hidden = llama_fused.fused_forward(fused_model, kernel, torch.tensor(ids),
                                           torch.tensor(pos), attention)
        return model.compute_logits(hidden)
    hidden = model(torch.tensor([ids]), torch.tensor([pos]), attention)
    return model.compute_logits(hidden[0])


@pytest.mark.parametrize(("window", "group_cost", "backend"), [
    (None, 16, "torch"), (6, 16, "torch"), (None, 0, "torch"), (6, 0, "torch"),
    (None, 16, "native"), (6, 16, "native"), (None, 16, "fused"), (6, 16, "fused"),
])
@torch.inference_mode()
def test_paged_chunks_and_decodes_match_full_forward(gqa_model: Path, window: int | None,
                                                     group_cost: int, backend: str) -> None:
    """Prompts computed in chunks (one from position 0, one after a cached context), mixed
    with single-token decodes in one packed step, through scattered block tables ==
    full recompute; also with a sliding window shorter than the sequences, with the
    decodes in one padded group or (group cost 0) a group each, with the decodes read in
    place by the native kernel, and with the whole forward through the C kernels (its steps
    of 2 decodes padded to the packed linears' smallest row bucket, 6)."""
    kernel = native.load() if backend != "torch" else None
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(gqa_model)
    fused = backend == "fused"
    if fused:
        assert llama_fused.fuse(model) is None  # not packed yet
        pack_linears(model)
    cache = KVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    windows = [window] * cfg.num_layers
    if window is not None:  # the reference applies the same window
        model.config = dataclasses.replace(
            cfg, sliding_window=window, sliding_window_layers=tuple(range(cfg.num_layers))
        )
    a = [5, 9, 13, 200, 7, 8, 100, 31, 77, 12, 3]
    b = [44, 3, 18, 90, 91, 92, 17]
    ta, tb = [9, 2, 14, 3], [0, 11, 5, 6]  # scattered blocks
    logits = _packed_step(model, cache, windows, [(a, ta, 0, 5), (b, tb, 0, 1)],
                          group_cost, kernel, fused)
    logits = _packed_step(model, cache, windows, [(a, ta, 5, 6), (b, tb, 1, 6)],
                          group_cost, kernel, fused)
    full_a = model.forward_full(torch.tensor([a]))[0]
    full_b = model.forward_full(torch.tensor([b]))[0]
    assert torch.allclose(logits[:6], full_a[5:], atol=1e-4)
    assert torch.allclose(logits[6:], full_b[1:], atol=1e-4)
    for _ in range(3):  # decodes of both, packed together
        a.append(len(a) * 7 % 500)
        b.append(len(b) * 11 % 500)
        step = _packed_step(model, cache, windows,
                            [(a, ta, len(a) - 1, 1), (b, tb, len(b) - 1, 1)], group_cost,
                            kernel, fused)
        assert torch.allclose(step[0], model.forward_full(torch.tensor([a]))[0, -1], atol=1e-4)
        assert torch.allclose(step[1], model.forward_full(torch.tensor([b]))[0, -1], atol=1e-4)


Item = tuple[list[int], list[int], int, int]  # tokens, block table, start, n


def _paged(cache: KVCache, windows: list[int | None], kernel: Kernels, items: list[Item]
           ) -> tuple[torch.Tensor, torch.Tensor, PagedAttention]:
    """input_ids, positions and the native attention of one packed step of (tokens, block
    table, start, n) items."""
    ids = [t for tokens, _, start, n in items for t in tokens[start : start + n]]
    pos = [p for _, _, start, n in items for p in range(start, start + n)]
    meta = build_attention_meta([StepItem(table, start, n) for _, table, start, n in items],
                                cache.block_size, "cpu", max_groups=1)
    return torch.tensor(ids), torch.tensor(pos), PagedAttention(cache, meta, windows, kernel)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
@torch.inference_mode()
def test_a_step_in_one_call_equals_the_layer_by_layer_forward(
        gqa_model: Path, weights: torch.dtype, kv: torch.dtype, window: int | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over meshlm's packing runs all its layers in one call into the C kernels
    (decode_layers.c): the same kernels in the same order as the forward that calls them
    layer by layer from Python, so for a step of decodes the same hidden states to the bit,
    for float32 and bfloat16 weights, every KV cache type and a sliding window; rows of three
    lengths, so that the decode group's order (by table width) is not the packed order.
    Prompt chunks (from position 0, then after their cached context, beside a decode) attend
    through the decode kernel there, SDPA layer by layer: the same within rounding. A chunk
    too long for the kernel (CHUNK_PAIRS), or oneDNN's packing, keeps the layer-by-layer
    forward."""
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(gqa_model)
    pack_linears(model, NativePacking(kernel, weights))
    fused = llama_fused.fuse(model)
    assert fused is not None and fused.one_call
    cache = KVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, kv, "cpu")
    windows = [window] * cfg.num_layers
    seqs = [[5, 9, 13, 200, 7, 8, 100, 31, 77, 12, 3], [44, 3, 18, 90, 91],
            [18, 90, 91, 92, 17, 6]]
    tables = [[9, 2, 14, 3], [0, 11], [5, 6, 12]]
    # float32 keys: the chunk's attention sees the same keys either way; narrower ones are
    # rounded in the cache, which the decode kernel reads and SDPA (from position 0) does not
    tolerance = 1e-4 if kv == torch.float32 else 5e-2
    for chunk in ((0, 4), (4, None)):
        items = [(tokens, table, chunk[0], (chunk[1] or len(tokens)) - chunk[0])
                 for tokens, table in zip(seqs, tables, strict=True)]
        ids, pos, attention = _paged(cache, windows, kernel, items)
        assert attention.meta.chunks
        assert llama_fused.native_layers(fused, attention) is not None
        by_layer = llama_fused.layer_by_layer(fused, kernel, ids, pos, attention)
        in_one_call = llama_fused.fused_forward(fused, kernel, ids, pos, attention)
        assert torch.allclose(in_one_call, by_layer, atol=tolerance), f"chunk {chunk}"
    with monkeypatch.context() as patch:
        patch.setattr(llama_fused, "CHUNK_PAIRS", 4 * 4 - 1)
        assert llama_fused.native_layers(fused, _paged(cache, windows, kernel, [
            (seqs[0], tables[0], 0, 4)])[2]) is None
    for step in range(3):
        for i, tokens in enumerate(seqs):
            tokens.append((len(tokens) * 7 + i) % 500)
        items = [(tokens, table, len(tokens) - 1, 1) for tokens, table in zip(seqs, tables,
                                                                             strict=True)]
        ids, pos, attention = _paged(cache, windows, kernel, items)
        assert attention.meta.decodes[0].rows.tolist() != [0, 1, 2]
        assert llama_fused.native_layers(fused, attention) is not None
        by_layer = llama_fused.layer_by_layer(fused, kernel, ids, pos, attention)
        in_one_call = llama_fused.fused_forward(fused, kernel, ids, pos, attention)
        assert torch.equal(in_one_call, by_layer), f"step {step}"
    if window is not None:  # the same layers without the window attend from position 0
        ids, pos, attention = _paged(cache, [None] * cfg.num_layers, kernel, items)
        by_layer = llama_fused.layer_by_layer(fused, kernel, ids, pos, attention)
        assert torch.equal(llama_fused.fused_forward(fused, kernel, ids, pos, attention),
                           by_layer)
    if weights == torch.float32 and kv == torch.float32 and window is None:
        logits = model.compute_logits(in_one_call)
        for row, tokens in enumerate(seqs):
            full = model.forward_full(torch.tensor([tokens]))[0, -1]
            assert torch.allclose(logits[row], full, atol=1e-4)
    onednn, _ = load_model(gqa_model)
    pack_linears(onednn)
    other = llama_fused.fuse(onednn)
    assert other is not None and not other.one_call
    assert llama_fused.native_layers(other, attention) is None


@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_prompt_chunks_in_one_call_attend_through_the_chunk_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv: torch.dtype) -> None:
    """Heads of 64 over blocks of 16: a step's prompt chunks (from position 0, then after
    their cached context, beside decodes) attend through chunk_attention.c in the one-call
    forward, the decodes through the decode kernel; the same hidden states within rounding as
    the one-call forward with every row through the decode kernel, and as the layer-by-layer
    forward (SDPA; it attends a chunk from position 0 over its unrounded keys, so a 16-bit
    cache differs there by its rounding)."""
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(write_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2))
    assert cfg.head_dim == 64
    pack_linears(model, NativePacking(kernel, torch.float32))
    fused = llama_fused.fuse(model)
    assert fused is not None and fused.one_call
    cache = KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, kv, "cpu")
    windows: list[int | None] = [None] * cfg.num_layers
    torch.manual_seed(4)
    seqs = [torch.randint(3, 500, (n,)).tolist() for n in (70, 40, 23)]
    tables = [[9, 2, 14, 3, 20], [0, 11, 7], [5, 6]]
    chunked: list[bool] = []
    rows_of = llama_fused._attention_rows

    def spy(meta: AttentionMeta, t: int, chunks: bool = False) -> tuple:  # type: ignore[type-arg]
        chunked.append(chunks)
        return rows_of(meta, t, chunks)

    monkeypatch.setattr(llama_fused, "_attention_rows", spy)
    steps = [[(seqs[0], tables[0], 0, 30), (seqs[1], tables[1], 0, 40)],  # two from 0
             [(seqs[2], tables[2], 0, 23), (seqs[1], tables[1], 39, 1),  # one, a decode,
              (seqs[0], tables[0], 30, 40)]]                             # one continued
    for items in steps:
        ids, pos, attention = _paged(cache, windows, kernel, items)
        assert llama_fused.native_layers(fused, attention) is not None
        by_layer = llama_fused.layer_by_layer(fused, kernel, ids, pos, attention)
        in_one_call = llama_fused.fused_forward(fused, kernel, ids, pos, attention)
        assert chunked.pop() is True
        with monkeypatch.context() as patch:  # every row through the decode kernel
            patch.setattr(llama_fused, "chunk_attention_fits", lambda *_: False)
            row_by_row = llama_fused.fused_forward(fused, kernel, ids, pos, attention)
        assert chunked.pop() is False
        # a 16-bit cache rounds the next layer's keys and values, where the two kernels'
        # sums (in different orders) can round apart: a bfloat16 step is 2^-8 relative
        narrow = kv != torch.float32
        torch.testing.assert_close(in_one_call, by_layer, atol=5e-2 if narrow else 1e-4,
                                   rtol=5e-2 if narrow else 1e-4)
        torch.testing.assert_close(in_one_call, row_by_row, atol=5e-3 if narrow else 1e-4,
                                   rtol=1e-4)


def _kept_steps(seed: int) -> tuple[list[list[Item]], list[list[int]]]:
    """Three steps over three random sequences (two chunks from position 0; a chunk from 0,
    a decode and a continued chunk; two decodes) and the packed rows each samples: a chunk's
    last token (none where the chunk stops short of its prompt's end), each decode."""
    torch.manual_seed(seed)
    seqs = [torch.randint(3, 500, (n,)).tolist() for n in (70, 40, 23)]
    tables = [[9, 2, 14, 3, 20], [0, 11, 7], [5, 6]]
    steps = [[(seqs[0], tables[0], 0, 30), (seqs[1], tables[1], 0, 40)],
             [(seqs[2], tables[2], 0, 23), (seqs[1], tables[1], 39, 1),
              (seqs[0], tables[0], 30, 40)],
             [(seqs[2], tables[2], 22, 1), (seqs[0], tables[0], 69, 1)]]
    return steps, [[69], [22, 23, 63], [1, 0]]


@pytest.mark.parametrize(("window", "kv", "weights"), [
    (None, torch.float32, torch.float32), (20, torch.float32, torch.float32),
    (None, torch.float16, torch.float32), (20, torch.float16, torch.bfloat16)])
@torch.inference_mode()
def test_the_one_call_forward_computes_the_last_layer_for_the_kept_rows_only(
        tmp_path: Path, window: int | None, kv: torch.dtype, weights: torch.dtype) -> None:
    """`keep` (the rows a step samples: each decode and a prompt's last token) gives those
    rows' hidden states, in its order, as the whole forward gives them (the kept prompt
    token attends through the decode kernel in the last layer, not the chunk kernel: the
    same within rounding), for float32 and bfloat16 weights, float32 and float16 caches,
    with and without a sliding window; every row's keys and values still reach the cache,
    so the next step sees them. Keeping every row, or none, is the whole forward."""
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(write_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2))
    pack_linears(model, NativePacking(kernel, weights))
    fused = llama_fused.fuse(model)
    assert fused is not None and fused.one_call
    windows: list[int | None] = [window] * cfg.num_layers
    steps, keeps = _kept_steps(7)
    kept_cache = KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, kv, "cpu")
    whole_cache = KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, kv, "cpu")
    tolerance = 5e-3 if kv != torch.float32 else 1e-4
    for items, rows in zip(steps, keeps, strict=True):
        ids, pos, attention = _paged(kept_cache, windows, kernel, items)
        assert llama_fused.native_layers(fused, attention) is not None  # in one call
        keep = torch.tensor(rows)
        kept = llama_fused.fused_forward(fused, kernel, ids, pos, attention, keep)
        ids, pos, attention = _paged(whole_cache, windows, kernel, items)
        whole = llama_fused.fused_forward(fused, kernel, ids, pos, attention)
        assert kept.shape == (len(rows), cfg.hidden_size)
        torch.testing.assert_close(kept, whole.index_select(0, keep), atol=tolerance,
                                   rtol=tolerance)
        assert torch.equal(kept_cache.k, whole_cache.k) and torch.equal(kept_cache.v,
                                                                        whole_cache.v)
        for every in (torch.arange(ids.shape[0]), torch.tensor([], dtype=torch.long)):
            got = llama_fused.fused_forward(fused, kernel, ids, pos, attention, every)
            assert torch.equal(got, whole.index_select(0, every))


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_one_call_forward_multiplies_by_the_lm_head_as_compute_logits_does(
        tmp_path: Path, weights: torch.dtype) -> None:
    """`fused_logits`: the LM head in the same call into the kernels gives the logits that
    `compute_logits` gives of the forward's hidden states, to the bit (the same matmul on the
    same rows), for every row and for the kept ones, over float32 and bfloat16 weights. A
    head tied to the embeddings is not packed: then, as over oneDNN's packing or where the
    step cannot go in one call, it computes nothing and says so (None)."""
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(write_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2))
    pack_linears(model, NativePacking(kernel, weights))
    fused = llama_fused.fuse(model)
    assert fused is not None and fused.head is model.lm_head
    windows: list[int | None] = [None] * cfg.num_layers
    steps, keeps = _kept_steps(5)
    caches = [KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                      "cpu") for _ in range(2)]
    for items, rows in zip(steps, keeps, strict=True):
        for keep in (torch.tensor(rows), None):
            ids, pos, attention = _paged(caches[0], windows, kernel, items)
            logits = llama_fused.fused_logits(fused, kernel, ids, pos, attention, keep)
            ids, pos, attention = _paged(caches[1], windows, kernel, items)
            hidden = llama_fused.fused_forward(fused, kernel, ids, pos, attention, keep)
            assert logits is not None and logits.dtype == torch.float32
            assert torch.equal(logits, model.compute_logits(hidden))
    ids, pos, attention = _paged(caches[0], windows, kernel, steps[-1])
    by_layer = PagedAttention(caches[0], attention.meta, windows, None)  # not in one call
    assert llama_fused.fused_logits(fused, kernel, ids, pos, by_layer) is None
    for tied, packing in ((True, NativePacking(kernel, torch.float32)), (False, None)):
        other, _ = load_model(write_checkpoint(tmp_path / f"{tied}", hidden=256, heads=4,
                                               kv_heads=2, tied=tied))
        pack_linears(other, packing)
        fused = llama_fused.fuse(other)
        assert fused is not None and fused.head is None
        assert llama_fused.fused_logits(fused, kernel, ids, pos, attention) is None


@pytest.mark.parametrize("path", ["torch", "onednn", "native"])
@torch.inference_mode()
def test_the_other_forwards_compute_the_last_layer_for_the_kept_rows_only(
        tmp_path: Path, path: str) -> None:
    """`keep` in the forwards that do not run in one call: the torch model (the GPU's, and
    the CPU's without meshlm's packing, over torch's attention) and the fused forward layer
    by layer (over oneDNN's packing, whose rows go in buckets, and over meshlm's). The kept
    rows come out in `keep`'s order as the whole forward gives them, every row's keys and
    values still reach the cache (the same to the bit), and keeping none gives no rows."""
    kernel = native.load()
    assert not isinstance(kernel, native.BuildError), kernel
    model, cfg = load_model(write_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2))
    fused = None
    if path != "torch":
        pack_linears(model, NativePacking(kernel, torch.float32) if path == "native" else None)
        fused = llama_fused.fuse(model)
        assert fused is not None and fused.layers[0].o.packing.name == path
    windows: list[int | None] = [None] * cfg.num_layers
    steps, keeps = _kept_steps(11)
    caches = [KVCache(cfg.num_layers, 24, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                      "cpu") for _ in range(2)]

    def forward(cache: KVCache, items: list[Item], keep: torch.Tensor | None) -> torch.Tensor:
        ids, pos, attention = _paged(cache, windows, kernel, items)
        if fused is None:
            attention = PagedAttention(cache, attention.meta, windows, None)
            return model(ids[None], pos[None], attention, keep)[0]
        assert llama_fused.native_layers(fused, attention) is None or path == "native"
        return llama_fused.layer_by_layer(fused, kernel, ids, pos, attention, keep)

    for items, rows in zip(steps, keeps, strict=True):
        keep = torch.tensor(rows)
        kept = forward(caches[0], items, keep)
        whole = forward(caches[1], items, None)
        assert kept.shape == (len(rows), cfg.hidden_size)
        torch.testing.assert_close(kept, whole.index_select(0, keep), atol=1e-4, rtol=1e-4)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        none = forward(caches[1], items, torch.tensor([], dtype=torch.long))
        assert none.shape == (0, cfg.hidden_size)


def test_decode_groups_split_where_padding_costs_more_than_a_group() -> None:
    assert decode_groups([]) == []
    assert decode_groups([3, 3, 4, 4]) == [(0, 4)]  # padding 2 blocks < one group's cost
    assert decode_groups([2, 2, 2, 30, 31], group_cost=16) == [(0, 3), (3, 5)]
    assert decode_groups([1, 1, 9, 9, 20, 20], group_cost=0) == [(0, 2), (2, 4), (4, 6)]
    widths = [1, 1, 9, 9, 20, 20, 40, 40, 80]
    runs = decode_groups(widths, group_cost=1, max_groups=4)
    assert len(runs) == 4 and runs[0][0] == 0 and runs[-1][1] == len(widths)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    padded = sum((hi - lo) * widths[hi - 1] for lo, hi in runs)
    assert padded < len(widths) * widths[-1] // 2


def test_module_names_are_hf_names(gqa_model: Path) -> None:
    cfg = ModelConfig.from_dir(gqa_model)
    with torch.device("meta"):
        names = set(LlamaForCausalLM(cfg).state_dict())
    assert names == set(load_file(str(gqa_model / "model.safetensors")))
