"""Parity with transformers: tiny random Llama, Qwen2 and Mistral checkpoints written by HF
itself; our full forward against HF's logits, our batched engine against HF greedy generate."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import DEVICES, greedy, tokens_of

from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams, StepOutput
from meshlm.scheduler.models.loader import load_model

transformers = pytest.importorskip("transformers")
# transformers 4 gives no reference past a sliding window or max_position_embeddings here: its
# eager Qwen2 attention ignores the window, and (4.45) its Mistral ignores rope_scaling.
HF5 = int(transformers.__version__.split(".")[0]) >= 5

VOCAB = 256
NEW_TOKENS = 16
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 96,
    "initializer_range": 0.2,  # peaked logits: no near-ties for greedy to split on
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@dataclass
class Case:
    config_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    lengths: tuple[int, ...] = (1, 9, 40, 80)  # forward_full parity
    hf5_lengths: tuple[int, ...] = ()  # parity checked with transformers >= 5 only


CASES = {
    "llama-untied-llama3": Case("LlamaConfig", {"rope_scaling": LLAMA3}),
    "llama-tied-biases": Case(
        "LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}
    ),
    "qwen2-untied": Case("Qwen2Config"),
    "qwen2-tied-linear-window": Case(
        "Qwen2Config",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "use_sliding_window": True,
            "sliding_window": 24,
            "max_window_layers": 1,  # layer 0 full, layer 1 windowed
        },
        lengths=(1, 9, 24),
        hf5_lengths=(40, 80),
    ),
    "mistral-window-dynamic": Case(
        "MistralConfig",
        {
            "sliding_window": 24,
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
            "head_dim": 16,  # transformers 4.57's dynamic RoPE fails on Mistral's head_dim None
        },
        lengths=(1, 9, 40, 95),
        hf5_lengths=(120,),  # > max_position_embeddings: NTK rescaled
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def hf_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path, Case]:
    """An HF model with random weights (biases and norms too) and its save_pretrained dir."""
    case = CASES[request.param]
    config = getattr(transformers, case.config_class)(
        **SHAPE, **case.kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return model, path, case


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Where our side runs: the CPU, and CUDA where a GPU is at hand (HF stays on the CPU)."""
    return str(request.param)


@torch.inference_mode()
def test_forward_full_matches_hf_logits(hf_checkpoint: tuple[Any, Path, Case],
                                        device: str) -> None:
    hf, path, case = hf_checkpoint
    ours, config = load_model(path, device)
    assert config.architecture == type(hf).__name__
    assert config.tie_word_embeddings == bool(case.kwargs.get("tie_word_embeddings", False))
    rng = random.Random(1)
    for n in case.lengths + (case.hf5_lengths if HF5 else ()):
        ids = torch.tensor([random_ids(rng, n), random_ids(rng, n)])
        expected = hf(input_ids=ids, use_cache=False).logits.float()
        got = ours.forward_full(ids.to(device)).cpu()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=str(n))


def parity_prompts(rng: random.Random, longest: int) -> list[list[int]]:
    """20+ prompts from 1 token to longer than a chunk; some share prefixes with others."""
    lengths = [1, 2, 3, 5, 8, 13, 17, 24, 31, 33, 40, 47, 55, 64, longest - 1, longest]
    prompts = [random_ids(rng, n) for n in lengths]
    prompts.append(prompts[12] + random_ids(rng, 9))  # longer than its prefix's prompt
    prompts.append(prompts[10][:37] + random_ids(rng, 11))
    prompts.append(list(prompts[13]))  # the same prompt again
    prompts.append(prompts[14][:29])
    return prompts


def test_batched_engine_greedy_matches_hf_generate(hf_checkpoint: tuple[Any, Path, Case],
                                                   device: str) -> None:
    """Greedy tokens and logprobs of a concurrently submitted set, under continuous batching
    with chunked prefill, prefix sharing and preemption (all checked to have happened), are
    those of HF generate run on each prompt alone."""
    hf, path, _ = hf_checkpoint
    engine = Engine(EngineConfig(
        str(path), device=device, dtype="float32", max_running=8, max_batched_tokens=32,
        block_size=4, num_kv_blocks=80,
    ))
    rng = random.Random(2)
    prompts = parity_prompts(rng, engine.max_model_len - NEW_TOKENS)
    assert len(prompts) >= 20 and max(map(len, prompts)) > 32

    def params(i: int) -> SamplingParams:
        # Every fourth asks for prompt logprobs (from position 0 or a little later).
        start = (-1, 0, -1, 3)[i % 4] if len(prompts[i]) > 3 else -1
        return greedy(NEW_TOKENS, return_logprob=True, top_logprobs_num=3,
                      logprob_start_len=start)

    outs: dict[str, list[StepOutput]] = {}
    decode_batches: set[int] = set()
    # Prefix owners first, their sharers a few steps later, when the prefixes are cached.
    order = [10, 12, 13, 14, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 8, 9, 11, 15]
    assert sorted(order) == list(range(len(prompts)))
    arrivals = [(i, prompts[i]) for i in order]
    while arrivals or engine.has_work():
        for _ in range(3):  # staggered arrivals: a few join before each step
            if arrivals:
                i, prompt = arrivals.pop(0)
                engine.add_request(f"r{i}", prompt, params(i))
        plan = engine.schedule()
        if plan is not None:
            decode_batches.add(sum(item.num_tokens == 1 for item in plan.items))
        result = engine.execute(plan) if plan is not None else None
        for o in engine.postprocess(plan, result):
            outs.setdefault(o.rid, []).append(o)
    stats = engine.stats()
    assert stats["preempted_total"] >= 1, stats
    assert stats["chunked_prefills_total"] >= 1, stats
    assert stats["cached_tokens_total"] > 0, stats
    assert len(decode_batches) > 3, decode_batches  # the batch grew and shrank
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0

    hf.generation_config.eos_token_id = None  # ignore_eos
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )
            prompt_logp = hf(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        expected = out.sequences[0, len(prompt):].tolist()
        assert len(expected) == NEW_TOKENS
        got = outs[f"r{i}"]
        assert tokens_of(got) == expected, (i, len(prompt))
        # Logprobs: the raw distribution's, for each chosen token and the top 3.
        step_logp = torch.stack(out.logits)[:, 0].float().log_softmax(-1)  # [new, V]
        ours = [lp for o in got for lp in o.output_logprobs]
        chosen = step_logp.gather(1, torch.tensor(expected)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(ours), chosen, atol=1e-4, rtol=0)
        tops = [t for o in got for t in o.output_top_logprobs]
        assert [[tok for tok, _ in t] for t in tops] == step_logp.topk(3).indices.tolist()
        torch.testing.assert_close(
            torch.tensor([[lp for _, lp in t] for t in tops]), step_logp.topk(3).values,
            atol=1e-4, rtol=0,
        )
        start = params(i).logprob_start_len
        first = got[0]
        if start < 0:
            assert first.input_logprobs == []
            continue
        assert first.input_logprob_start == start
        assert len(first.input_logprobs) == len(prompt) - start
        expect_prompt = [prompt_logp[p - 1, prompt[p]].item() for p in range(max(start, 1),
                                                                               len(prompt))]
        if start == 0:
            assert first.input_logprobs[0] is None
        torch.testing.assert_close(
            torch.tensor(first.input_logprobs[1 if start == 0 else 0 :]),
            torch.tensor(expect_prompt), atol=1e-4, rtol=0,
        )
