"""meshlm's C kernels (kernels/decode_attention.c, kernels/layer_ops.c, kernels/linear.c)
against the torch ops they replace, the fused forward against the model's own, and how the
engine picks a backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.scheduler.engine.engine import Engine, EngineConfig, cpu_kernels
from meshlm.scheduler.engine.kv_cache import _cache_rows, _decode_attention, _gather, _visible
from meshlm.scheduler.kernels import native
from meshlm.scheduler.models.config import ModelConfig
from meshlm.scheduler.models.cpu_linear import NativePacking, PackedLinear, native_packing
from meshlm.scheduler.models.llama import RMSNorm, RotaryEmbedding, apply_rotary


def _cpu_has(*flags: str) -> bool:
    """Whether this CPU has all of `flags` (Linux's names in /proc/cpuinfo)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(flags) <= set(line.split(":", 1)[1].split())
    return False


def _kernels() -> native.Kernels:
    kernels = native.load()
    assert not isinstance(kernels, native.BuildError), kernels
    return kernels


@pytest.mark.parametrize(("heads", "kv_heads", "window", "d", "kv_dtype"), [
    (4, 4, None, 16, torch.float32), (8, 2, None, 64, torch.float32),
    (8, 4, 5, 128, torch.float32), (6, 1, 40, 16, torch.float32),
    (4, 2, 7, 64, torch.float32), (8, 2, None, 64, torch.bfloat16),
    (8, 4, 5, 128, torch.bfloat16), (6, 1, 40, 16, torch.bfloat16),
    (8, 2, None, 64, torch.float16), (8, 4, 5, 128, torch.float16), (6, 1, 40, 20, torch.float16),
    (8, 2, None, 32, torch.float32), (8, 2, 6, 32, torch.bfloat16),
    (8, 1, None, 64, torch.float32), (7, 1, 9, 32, torch.float16), (3, 1, None, 128, torch.float32),
])
def test_kernel_matches_the_gathered_torch_attention(heads: int, kv_heads: int,
                                                     window: int | None, d: int,
                                                     kv_dtype: torch.dtype) -> None:
    """Rows of different lengths, scattered and shared blocks, queries taken out of order
    from a packed step whose head and row strides are not contiguous ones, and a sliding
    window: the same output as the gather and two matmuls; head sizes the kernel unrolls
    (32, 64, 128) and others (20: a float16 row widened 8 at a time, then 4 more); caches of
    float32, bfloat16 and float16; groups of query heads per KV head that the kernel takes
    four, two and one at a time (8 = 4 + 4, 7 = 4 + 2 + 1, 6 = 4 + 2, 3 = 2 + 1)."""
    torch.manual_seed(0)
    bs, blocks, rows = 4, 32, 5
    k_cache = torch.randn(kv_heads, blocks, bs, d).to(kv_dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, d).to(kv_dtype)
    positions = torch.tensor([0, 3, 17, 9, 30])
    tables = torch.stack([torch.randperm(blocks)[:8] for _ in range(rows)])
    tables[1, :2] = tables[0, :2]  # a shared prefix block
    # A packed step of 9 tokens laid out [T, heads, D] (as a projection leaves them), viewed
    # [heads, T, D]; the decode rows are some of them, out of order.
    packed = torch.randn(9, heads, d).transpose(0, 1)
    picked = torch.tensor([7, 2, 0, 5, 3])
    out = torch.zeros(9, heads, d).transpose(0, 1)

    last = positions + 1
    first = (last - window).clamp(min=0) if window is not None else torch.zeros_like(last)
    kernels = _kernels()
    scratch = torch.empty(kernels.scratch_size(heads, kv_heads, tables.shape[1] * bs))
    kernels.decode_attention(packed, out, picked, tables, first, last, k_cache, v_cache,
                             scratch)

    rows_2d = _cache_rows(k_cache, tables)
    keys = _gather(k_cache, rows_2d, tuple(tables.shape), torch.float32)
    values = _gather(v_cache, rows_2d, tuple(tables.shape), torch.float32)
    visible = _visible(positions, keys.shape[2], window)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, :]
    expected = _decode_attention(packed.index_select(1, picked).contiguous(), keys, values,
                                 bias)
    torch.testing.assert_close(out.index_select(1, picked), expected, atol=1e-5, rtol=1e-5)
    untouched = [r for r in range(9) if r not in picked.tolist()]
    assert torch.count_nonzero(out[:, untouched]) == 0


@pytest.mark.parametrize(("heads", "kv_heads", "d", "kv_dtype"), [
    (8, 4, 64, torch.float32), (32, 8, 128, torch.float32), (16, 1, 64, torch.float32),
    (8, 2, 32, torch.float32),
    (8, 8, 96, torch.float32), (4, 2, 64, torch.float32), (8, 4, 64, torch.bfloat16),
    (16, 1, 128, torch.float16), (8, 8, 96, torch.float16),
])
def test_chunk_kernel_matches_the_decode_kernel_row_by_row(heads: int, kv_heads: int, d: int,
                                                           kv_dtype: torch.dtype) -> None:
    """Prompt chunks through chunk_attention.c, two in one call (one from position 0, one
    after 37 positions of cached context, its last tile part full) among other packed rows,
    blocks scattered, strides not contiguous ones, NaN in the slots past each chunk's end
    (another sequence's, or garbage, in the engine): each token the same output as the decode
    kernel's for it as a row attending up to its position; rows outside the chunks untouched.
    Groups of 2, 4, 16 and 1 query heads per KV head (tiles of 8, 4, 1 and 16 tokens); head
    sizes the kernel unrolls (32, 64, 128) and another (96); caches of float32, bfloat16 and
    float16 (widened as the keys are transposed and the values copied). What the engine sends
    it (`chunk_attention_fits`)."""
    torch.manual_seed(3)
    kernels, bs, blocks = _kernels(), native.CHUNK_BLOCK, 40
    assert native.chunk_attention_fits(heads, kv_heads, d, bs, kv_dtype)
    # not for heads below 32 dimensions, other block sizes, caches of other types, or
    # groups that do not divide a tile
    assert native.chunk_attention_fits(8, 2, 32, bs, kv_dtype)  # the tiny default model's
    assert not native.chunk_attention_fits(8, 2, 16, bs, kv_dtype)
    assert not native.chunk_attention_fits(heads, kv_heads, d, 4, kv_dtype)
    assert not native.chunk_attention_fits(heads, kv_heads, d, bs, torch.float64)
    assert not native.chunk_attention_fits(6, 2, 64, bs, kv_dtype)
    k_cache = torch.randn(kv_heads, blocks, bs, d).to(kv_dtype)
    v_cache = torch.randn(kv_heads, blocks, bs, d).to(kv_dtype)
    spans = [(2, 50, 0), (60, 29, 37)]  # (first packed row, tokens, first position)
    packed = 95
    q = torch.randn(packed, heads + 3, d).transpose(0, 1)[:heads]  # [Hq, T, D], strided
    tables = torch.randperm(blocks)[: 5 * len(spans)].view(len(spans), 5)
    for table, (_, n, start) in zip(tables, spans, strict=True):  # slots past a chunk's end
        end = start + n                                            # hold NaN: never read
        k_cache[:, table[end // bs], end % bs :] = float("nan")
        v_cache[:, table[end // bs], end % bs :] = float("nan")
    chunks = torch.tensor([[row, n, start, i] for i, (row, n, start) in enumerate(spans)])
    out = torch.full((packed, heads, d), 7.0).transpose(0, 1)
    scratch = torch.empty(kernels.chunk_scratch_size(kv_heads, d, [s + n for _, n, s in spans],
                                                     kv_dtype))
    kernels.chunk_attention(q, out, chunks, tables, k_cache, v_cache, scratch)
    rows = torch.cat([torch.arange(row, row + n) for row, n, _ in spans])
    row_tables = torch.cat([tables[i].expand(n, -1) for i, (_, n, _) in enumerate(spans)])
    last = torch.cat([torch.arange(s + 1, s + n + 1) for _, n, s in spans])
    expected = torch.full((packed, heads, d), 7.0).transpose(0, 1)
    kernels.decode_attention(q, expected, rows, row_tables.contiguous(), torch.zeros_like(last),
                             last, k_cache, v_cache,
                             torch.empty(kernels.scratch_size(heads, kv_heads, 5 * bs)))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert (out[:, 52:60] == 7.0).all() and (out[:, 89:] == 7.0).all()


def test_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "meshlm-no-such-compiler")
    with pytest.raises(native.BuildError, match="no C compiler"):
        native._build()


def test_a_build_is_kept_and_serves_without_a_compiler(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path))
    first = native._build()
    assert first == native.built_path() and first.parent == tmp_path / "kernels"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left
    monkeypatch.setenv("CC", "meshlm-no-such-compiler")  # an image without one
    assert native._build() == first


def test_loading_the_kernels_leaves_the_processes_subnormals_alone() -> None:
    """The library is built with -ffast-math but must not switch the loading process to
    flush-to-zero (gcc 12 linked crtfastmath.o into it, and after the scheduler loaded it every
    float op there read and wrote subnormals as 0). A fresh process: this one may have loaded
    another build."""
    script = ("import torch\n"
              "from meshlm.scheduler.kernels import native\n"
              "tiny = torch.tensor([1e-39], dtype=torch.float32)\n"
              "assert float(tiny * 1.0) > 0, 'subnormals flushed before loading'\n"
              "kernels = native.load()\n"
              "assert not isinstance(kernels, native.BuildError), kernels\n"
              "print(float(tiny * 1.0) > 0, float(torch.tensor([1e-39]) * 1.0) > 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.split() == ["True", "True"]


def test_the_backend_asked_for_is_the_one_served(gqa_model: Path) -> None:
    cfg = ModelConfig.from_dir(gqa_model)
    cpu = torch.device("cpu")
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert cpu_kernels("torch", cfg, f32, f32, cpu) is None
    assert isinstance(cpu_kernels("native", cfg, f32, f32, cpu), native.Kernels)
    assert isinstance(cpu_kernels("native", cfg, f32, bf16, cpu), native.Kernels)
    assert isinstance(cpu_kernels("auto", cfg, f32, f16, cpu), native.Kernels)
    assert cpu_kernels("auto", cfg, bf16, bf16, cpu) is None  # torch serves the rest
    with pytest.raises(ValueError, match="native kernels serve float32"):
        cpu_kernels("native", cfg, bf16, bf16, cpu)
    with pytest.raises(ValueError, match="not .* a torch.float64 KV cache"):
        cpu_kernels("native", cfg, f32, torch.float64, cpu)
    with pytest.raises(ValueError, match="expected one of auto, native, torch"):
        cpu_kernels("flash", cfg, f32, f32, cpu)


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "float16"])
@torch.inference_mode()
def test_native_and_torch_engines_draw_the_same_tokens(gqa_model: Path, kv_dtype: str) -> None:
    """Greedy decoding of a batch of different lengths, step by step, the same either way,
    over a float32 KV cache, a bfloat16 one and a float16 one."""
    from meshlm.scheduler.engine.engine import SamplingParams

    outputs = {}
    for backend in ("native", "torch"):
        engine = Engine(EngineConfig(model_path=str(gqa_model), block_size=4, max_running=4,
                                     attention_backend=backend, kv_cache_dtype=kv_dtype))
        assert engine.attention_backend == backend
        vector = _kernels().linear_vector  # meshlm's linears where AVX-512 or AVX2 make them
        assert engine.linear_kernel == ("native" if backend == "native" and vector  # faster
                                        else "onednn")
        assert engine.runner.kv.k.dtype == (torch.float32 if kv_dtype == "auto"
                                            else getattr(torch, kv_dtype))
        assert (engine.runner.fused is not None) == (backend == "native")  # all in C
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for i, n in enumerate((3, 17, 40)):
            engine.add_request(f"r{i}", [(i * 31 + j * 7) % 200 + 3 for j in range(n)], params)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        outputs[backend] = tokens
    assert outputs["native"] == outputs["torch"]
    assert all(len(t) == 24 for t in outputs["native"].values())


def test_add_rmsnorm_matches_the_residual_add_and_the_models_norm() -> None:
    torch.manual_seed(1)
    norm = RMSNorm(96, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x, add = torch.randn(7, 96), torch.randn(7, 96)
    expected_x = x + add
    out = torch.empty(7, 96)
    _kernels().add_rmsnorm(x, add, norm.weight.detach(), norm.eps, out)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, norm(expected_x).detach(), atol=1e-5, rtol=1e-5)
    before = x.clone()
    _kernels().add_rmsnorm(x, None, norm.weight.detach(), norm.eps, out)  # no add
    assert torch.equal(x, before)
    torch.testing.assert_close(out, norm(before).detach(), atol=1e-5, rtol=1e-5)


def test_rope_in_place_matches_apply_rotary_on_the_leading_heads_only() -> None:
    """RoPE over the query and key heads of packed q/k/v rows; the value heads after them
    are left as they were."""
    torch.manual_seed(2)
    cfg = ModelConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 8,
                                 "num_hidden_layers": 1, "vocab_size": 8})
    d = cfg.head_dim
    positions = torch.tensor([0, 5, 6, 300, 2])
    cos, sin = RotaryEmbedding(cfg)(positions, torch.float32)  # [5, 1, D]
    qkv = torch.randn(5, 8 * d)  # 4 query, 2 key, 2 value heads
    heads = qkv.view(5, 8, d).transpose(0, 1)  # [heads, T, D]
    expected = apply_rotary(heads[:6], cos.view(1, 5, d), sin.view(1, 5, d))
    values = heads[6:].clone()
    _kernels().rope(qkv, 6, d, cos.view(5, d), sin.view(5, d))
    torch.testing.assert_close(heads[:6], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(heads[6:], values)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(kv_dtype: torch.dtype) -> None:
    """Keys and values in the layouts the forwards leave them (keys contiguous after RoPE,
    values a strided view of the packed projection) into scattered slots; into a bfloat16 or
    float16 cache rounded as torch rounds (float16's overflow to infinity too)."""
    torch.manual_seed(3)
    heads, d, bs, blocks = 2, 16, 4, 6
    k_cache = torch.zeros(heads, blocks, bs, d, dtype=kv_dtype)
    v_cache = torch.zeros(heads, blocks, bs, d, dtype=kv_dtype)
    k = torch.randn(heads, 5, d) * 100
    k[0, 0, :3] = torch.tensor([70000.0, -1e-6, 65519.0])  # past float16, subnormal, rounds up
    v = torch.randn(5, 3 * heads * d)[:, heads * d : 2 * heads * d].view(5, heads, d)
    v = v.transpose(0, 1)  # [heads, T, D], rows 3 * heads * d apart
    slots = torch.tensor([13, 2, 22, 7, 0])
    _kernels().store_kv(k, v, slots, k_cache, v_cache)
    flat_k, flat_v = k_cache.view(heads, -1, d), v_cache.view(heads, -1, d)
    assert torch.equal(flat_k[:, slots], k.to(kv_dtype))
    assert torch.equal(flat_v[:, slots], v.to(kv_dtype))
    others = [s for s in range(blocks * bs) if s not in slots.tolist()]
    assert torch.count_nonzero(flat_k[:, others]) == 0 == torch.count_nonzero(flat_v[:, others])


@pytest.mark.parametrize("rows", [3, 64])  # one thread, and enough elements for all
def test_silu_mul_matches_the_mlp(rows: int) -> None:
    torch.manual_seed(4)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    out = torch.empty(rows, 1536)
    _kernels().silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_argmax_rows_gives_numpys_argmax_ties_nans_and_strided_rows_included() -> None:
    """Greedy sampling's argmax in C: each row's first largest index, as numpy's, over random
    logits, rows of equal maxima (the first wins), rows with NaNs (the first NaN, as numpy
    has it, even after a larger number) and infinities, a row of one column, and rows of a
    strided view."""
    k = _kernels()
    torch.manual_seed(0)
    x = torch.randn(70, 2053)
    x[1, 7] = x[1, 900] = x[1, 2000] = 50.0  # ties: the first
    x[2, 10], x[2, 3] = float("nan"), 60.0  # a NaN after a larger number: the NaN
    x[3, 5], x[3, 9] = float("nan"), float("nan")
    x[4, 100] = float("inf")
    x[5] = float("-inf")  # every one equal: index 0
    x[6, 2052] = 99.0  # the last column
    for view in (x, x[:, :1], x[10:20, 3:1500]):
        assert k.argmax_rows(view) == view.numpy().argmax(axis=-1).tolist()
    assert k.argmax_rows(x)[2:4] == [10, 5]


def test_an_unknown_kv_cache_dtype_is_refused(gqa_model: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        Engine(EngineConfig(model_path=str(gqa_model), kv_cache_dtype="int3"))


def test_float16_rounding_matches_torch_bit_for_bit() -> None:
    """store_kv narrows float32 to float16 in integer operations (no _Float16 needed): every
    float16 value, the ties halfway between neighbours (to even), a float32 step either side
    of them, past the largest finite value (infinity) and below the smallest subnormal (zero),
    all as torch rounds them."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = halves[torch.isfinite(halves)].float().unique()
    ties = (finite[:-1] + finite[1:]) / 2  # exact in float32
    step = torch.finfo(torch.float32).eps * ties.abs()
    extremes = torch.tensor([65504.0, 65519.99, 65520.0, 1e6, float("inf"), 2.0 ** -25,
                             2.0 ** -26, 3 * 2.0 ** -25, 1e-45, 0.0, -0.0, float("nan")])
    values = torch.cat([finite, ties, ties - step, ties + step, extremes, -extremes])
    d = 16
    values = torch.cat([values, torch.zeros(-len(values) % d)]).view(1, -1, d)
    cache = torch.zeros(1, values.shape[1], 1, d, dtype=torch.float16)
    _kernels().store_kv(values, values, torch.arange(values.shape[1]), cache, cache.clone())
    got, want = cache.view(-1), values.reshape(-1).to(torch.float16)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    same = got.view(torch.int16) == want.view(torch.int16)
    assert bool(same[~torch.isnan(want)].all()), values.reshape(-1)[~same][:8]


# The kernel chosen here, and each by name (the AVX512_BF16 one reads bfloat16 weights only).
@pytest.mark.parametrize(("path", "weight_dtype"), [
    (path, dtype) for path in ("", "_portable", "_wide", "_avx2", "_dot")
    for dtype in (torch.float32, torch.bfloat16) if path != "_dot" or dtype == torch.bfloat16])
@pytest.mark.parametrize(("inputs", "outputs"), [(512, 1024), (1100, 37), (3, 5), (64, 96),
                                                 (1025, 40)])
def test_linear_matches_torch_linear(path: str, weight_dtype: torch.dtype, inputs: int,
                                     outputs: int) -> None:
    """Every row count up to two tiles and beyond, rows over blocks of 128 (129: two blocks of
    65 and 64; 300: three, staging bfloat16 weights in each), inputs over several of the
    kernel's chunks (1100 > 2 x 512) and odd ones (a zero input pads the bfloat16 pairs),
    outputs not a whole block, with and without a bias, rows strided; bfloat16 weights against
    torch's float32 linear over the same weights rounded, and where the kernel rounds the
    activations too (AVX512_BF16), over the activations rounded."""
    kernels = _kernels()
    if path and f"meshlm_linear_{'bf16' if path == '_dot' else 'f32'}{path}" not in kernels.fns:
        pytest.skip(f"no {path} kernel on this architecture")
    if path == "_dot" and not kernels.linear_bf16_rounds:
        pytest.skip("no AVX512_BF16 on this CPU")
    if path == "_wide" and not kernels.linear_wide:
        pytest.skip("no AVX-512 on this CPU")
    if path == "_avx2" and not _cpu_has("avx2", "fma"):
        pytest.skip("no AVX2 with FMA on this CPU")
    rounds = weight_dtype == torch.bfloat16 and (
        path == "_dot" or (path == "" and kernels.linear_bf16_rounds))
    torch.manual_seed(5)
    weight, bias = torch.randn(outputs, inputs), torch.randn(outputs)
    packed = NativePacking(kernels, weight_dtype).pack(weight)
    blocks = -(-outputs // 32) * 2
    assert packed.shape == ((blocks, inputs, 16) if weight_dtype == torch.float32
                            else (blocks, -(-inputs // 2), 16, 2))
    assert packed.dtype == weight_dtype
    served = weight.to(weight_dtype).float()
    for rows in (1, 2, 3, 5, 8, 9, 13, 16, 17, 64, 129, 300):
        x = torch.randn(rows, inputs + 7)[:, 3:3 + inputs]  # rows inputs + 7 floats apart
        seen = x.bfloat16().float() if rounds else x
        for b in (None, bias):
            out = torch.full((rows, outputs), float("nan"))
            kernels.linear(x, packed, b, out, path)
            torch.testing.assert_close(out, torch.nn.functional.linear(seen, served, b),
                                       atol=1e-4 * inputs**0.5, rtol=1e-4)


@torch.inference_mode()
def test_bfloat16_packed_weights_halve_the_memory_and_serve(gqa_model: Path) -> None:
    from meshlm.scheduler.engine.engine import SamplingParams

    def engine(**kw: str) -> Engine:
        return Engine(EngineConfig(model_path=str(gqa_model), block_size=4, max_running=4,
                                   **kw))  # type: ignore[arg-type]

    full, half = engine(), engine(packed_weight_dtype="bfloat16")
    assert half.linear_kernel == "native"
    sizes = {}
    for name, e in (("full", full), ("half", half)):
        packed = [m.packed for m in e.model.modules() if isinstance(m, PackedLinear)]
        assert packed and all(p.dtype == (torch.bfloat16 if name == "half" else torch.float32)
                              for p in packed)
        sizes[name] = sum(p.numel() * p.element_size() for p in packed)
    assert sizes["half"] * 2 == sizes["full"]
    packing = next(m.packing for m in half.model.modules() if isinstance(m, PackedLinear))
    assert packing.activation_dtype == (  # type: ignore[attr-defined]
        torch.bfloat16 if _kernels().linear_bf16_rounds else torch.float32)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    half.add_request("r", [(j * 7) % 200 + 3 for j in range(20)], params)
    tokens = []
    while half.has_work():
        tokens += [t for out in half.step() for t in out.new_token_ids]
    assert len(tokens) == 16
    with pytest.raises(ValueError, match="bfloat16: meshlm's matmul kernel serves it"):
        engine(packed_weight_dtype="bfloat16", attention_backend="torch")
    with pytest.raises(ValueError, match="expected one of auto, bfloat16"):
        engine(packed_weight_dtype="float16")
    with pytest.raises(ValueError, match="not packed"):
        engine(packed_weight_dtype="bfloat16", packed_cpu_linears=False)  # type: ignore[arg-type]


def test_a_natively_packed_linear_serves_and_repacks_like_nn_linear() -> None:
    torch.manual_seed(6)
    plain = torch.nn.Linear(96, 50)
    packing = NativePacking(_kernels())
    packed = PackedLinear(plain, packing)
    x = torch.randn(2, 3, 96)  # any leading shape, as nn.Linear takes
    with torch.no_grad():
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        plain.weight.mul_(-2)
        packed.repack(plain.weight)  # a weight reload
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
    cpu = torch.device("cpu")
    assert native_packing(None, cpu, torch.float32) is None
    assert native_packing(_kernels(), cpu, torch.bfloat16) is None
    assert native_packing(_kernels(), cpu, torch.float32, "bfloat16").dtype == torch.bfloat16  # type: ignore[union-attr]
    assert (native_packing(_kernels(), cpu, torch.float32) is None) != _kernels().linear_vector
