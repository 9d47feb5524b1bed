"""token_ids_logprob: the logprobs of asked token ids at each output position (what scoring
asks for with max_new_tokens=1), batched in one engine step, and at the prompt positions from
logprob_start_len, against transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import greedy, run_all

from meshlm.scheduler.engine.engine import Engine, EngineConfig, StepOutput

transformers = pytest.importorskip("transformers")

VOCAB = 256
LABELS = (5, 17, 200, 5)  # a repeat is answered twice


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _hf_next_logp(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def test_many_items_score_in_one_step(hf_llama: tuple[Any, Path]) -> None:
    hf, path = hf_llama
    engine = Engine(EngineConfig(str(path), device="cpu", dtype="float32", max_running=16,
                                 max_batched_tokens=512, block_size=4))
    rng = random.Random(0)
    query = [rng.randrange(3, VOCAB) for _ in range(9)]
    prompts = [query + [rng.randrange(3, VOCAB) for _ in range(n)] for n in range(1, 13)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, greedy(1, return_logprob=True,
                                                    token_ids_logprob=LABELS))
    outs: dict[str, StepOutput] = {o.rid: o for o in engine.step()}  # one step for all
    assert len(outs) == len(prompts) and not engine.has_work()
    for i, prompt in enumerate(prompts):
        out = outs[f"s{i}"]
        assert out.finished and len(out.new_token_ids) == 1
        [pairs] = out.output_token_ids_logprobs
        assert [t for t, _ in pairs] == list(LABELS)
        expected = _hf_next_logp(hf, prompt)[list(LABELS)]
        torch.testing.assert_close(torch.tensor([lp for _, lp in pairs]), expected,
                                   atol=1e-4, rtol=0)
        assert pairs[0][1] == pairs[3][1]


def test_every_output_position_and_only_when_asked(hf_llama: tuple[Any, Path]) -> None:
    hf, path = hf_llama
    engine = Engine(EngineConfig(str(path), device="cpu", dtype="float32", max_running=4,
                                 max_batched_tokens=8, block_size=4))
    prompt = list(range(10, 30))  # chunked: 20 tokens, 8 per step
    engine.add_request("a", prompt, greedy(3, return_logprob=True, token_ids_logprob=(7, 9)))
    engine.add_request("b", prompt, greedy(3, return_logprob=True))
    engine.add_request("c", [3, 4], greedy(2, token_ids_logprob=(7,)))  # no return_logprob
    outs = run_all(engine)
    per_token = [p for o in outs["a"] for p in o.output_token_ids_logprobs]
    assert len(per_token) == 3
    tokens = [t for o in outs["a"] for t in o.new_token_ids]
    ids = list(prompt)
    for pairs, token in zip(per_token, tokens, strict=True):
        expected = _hf_next_logp(hf, ids)[[7, 9]]
        torch.testing.assert_close(torch.tensor([lp for _, lp in pairs]), expected,
                                   atol=1e-4, rtol=0)
        ids.append(token)
    assert all(not o.output_token_ids_logprobs for o in outs["b"] + outs["c"])


def test_prompt_positions_from_logprob_start_len(hf_llama: tuple[Any, Path]) -> None:
    hf, path = hf_llama
    engine = Engine(EngineConfig(str(path), device="cpu", dtype="float32", max_running=4,
                                 max_batched_tokens=6, block_size=4))
    prompt = list(range(40, 57))  # chunked: 17 tokens, 6 per step
    engine.add_request("a", prompt, greedy(2, return_logprob=True, logprob_start_len=3,
                                           token_ids_logprob=LABELS))
    first = run_all(engine)["a"][0]
    with torch.inference_mode():
        logp = hf(input_ids=torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    got = first.input_token_ids_logprobs
    assert first.input_logprob_start == 3 and len(got) == len(prompt) - 3
    for p, pairs in zip(range(3, len(prompt)), got, strict=True):
        assert [t for t, _ in pairs] == list(LABELS)
        torch.testing.assert_close(torch.tensor([lp for _, lp in pairs]),
                                   logp[p - 1, list(LABELS)], atol=1e-4, rtol=0)


def test_out_of_vocabulary_ids_are_an_error(hf_llama: tuple[Any, Path]) -> None:
    _, path = hf_llama
    engine = Engine(EngineConfig(str(path), device="cpu", max_running=2))
    engine.add_request("x", [3, 4], greedy(1, return_logprob=True, token_ids_logprob=(VOCAB,)))
    [out] = run_all(engine)["x"]
    assert out.finish_reason == "error" and "token_ids_logprob" in (out.error or "")
