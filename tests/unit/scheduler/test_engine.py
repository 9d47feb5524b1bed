"""Engine end to end on tiny checkpoints: exactness against full recompute, continuous
batching, finish reasons, aborts (incl. from another thread's point of view), sampling."""

from __future__ import annotations

import json
import platform
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from scheduler_helpers import (
    TEST_DEVICE,
    EngineFactory,
    greedy,
    reference_greedy,
    run_all,
    tokens_of,
    write_checkpoint,
)

from meshlm.scheduler.engine.engine import Engine, SamplingParams, StepOutput


def prompts(n: int, seed: int, lo: int = 1, hi: int = 150, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("model", ["gqa_model", "mha_tied_model"])
def test_greedy_matches_full_recompute_under_continuous_batching(
    model: str, make_engine: EngineFactory, request: pytest.FixtureRequest
) -> None:
    engine = make_engine(request.getfixturevalue(model), max_running=6, max_batched_tokens=64)
    ps = prompts(18, seed=1)
    rng = random.Random(2)
    lengths = {f"r{i}": rng.randint(1, 14) for i in range(len(ps))}
    outs: dict[str, list[StepOutput]] = {}
    batch_sizes = []
    pending = list(enumerate(ps))
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 3)):  # staggered arrivals between steps
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, greedy(lengths[f"r{i}"]))
        plan = engine.schedule()
        if plan is not None:
            batch_sizes.append(sum(item.num_tokens == 1 for item in plan.items))
        result = engine.execute(plan) if plan else None
        for o in engine.postprocess(plan, result):
            outs.setdefault(o.rid, []).append(o)
    assert len(set(batch_sizes)) > 3  # rows joined and left the decode batch
    for i, p in enumerate(ps):
        rid = f"r{i}"
        assert tokens_of(outs[rid]) == reference_greedy(engine, p, lengths[rid]), rid
        assert outs[rid][0].new_token_ids  # the prefill step already yields a token
        assert outs[rid][-1].finish_reason == "length"
    stats = engine.stats()
    assert stats["free_slots"] == 6 and stats["finished_total"] == 18
    assert stats["generated_tokens_total"] == sum(lengths.values())


def test_alone_equals_in_a_batch_of_64(gqa_engine: Engine) -> None:
    ps = prompts(64, seed=3, hi=100)
    for i, p in enumerate(ps):
        gqa_engine.add_request(f"b{i}", p, greedy(6))
    together = run_all(gqa_engine)
    for i, p in enumerate(ps):
        gqa_engine.add_request("alone", p, greedy(6))
        assert tokens_of(run_all(gqa_engine)["alone"]) == tokens_of(together[f"b{i}"])
    assert gqa_engine.stats()["free_slots"] == 64


def test_eos_stop_ids_ignore_eos_min_new_tokens(tmp_path: Path, make_engine: EngineFactory) -> None:
    path = write_checkpoint(tmp_path / "m", seed=5)
    prompt = prompts(1, seed=4)[0]
    base = tokens_of(run_all_one(make_engine(path), prompt, greedy(12)))
    k = next(i for i in range(2, 12) if base[i] not in base[:i])  # first fresh token past 2
    eos = base[k]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    engine = make_engine(path)
    assert engine.eos_token_ids == {2, eos}

    out = run_all_one(engine, prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert tokens_of(out) == base[: k + 1]
    assert (out[-1].finish_reason, out[-1].matched_token) == ("stop", eos)
    assert out[-1].completion_tokens == k + 1

    out = run_all_one(engine, prompt, greedy(12))  # ignore_eos
    assert tokens_of(out) == base and out[-1].finish_reason == "length"

    out = run_all_one(engine, prompt, greedy(12, stop_token_ids=(eos,)))  # stop ids still apply
    assert (tokens_of(out), out[-1].finish_reason, out[-1].matched_token) == (
        base[: k + 1], "stop", eos,
    )

    out = run_all_one(engine, prompt, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                     min_new_tokens=k + 1))
    toks = tokens_of(out)
    assert eos not in toks[: k + 1] and toks[:k] == base[:k]
    assert len(toks) > k + 1 or out[-1].finish_reason == "length"


def run_all_one(engine: Engine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    engine.add_request("one", prompt, params)
    outs = run_all(engine)["one"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    return outs


def test_max_new_tokens_and_max_model_len(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=32, max_running=4)
    engine.add_request("n", [5] * 4, greedy(3))
    engine.add_request("m", [5] * 29, greedy(100))
    engine.add_request("full", [5] * 32, greedy(3))
    engine.add_request("last", [5] * 31, greedy(3))
    outs = run_all(engine)
    assert [(o.finish_reason, o.completion_tokens) for o in outs["n"]][-1] == ("length", 3)
    assert [(o.finish_reason, o.completion_tokens) for o in outs["m"]][-1] == ("length", 3)
    assert [(o.finish_reason, o.completion_tokens) for o in outs["last"]] == [("length", 1)]
    assert outs["full"][0].finish_reason == "error" and outs["full"][0].new_token_ids == []
    with pytest.raises(ValueError):
        make_engine(max_model_len=10_000)


def test_aborts_free_slots_once_and_emit_one_output(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=2)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], greedy(50))
    assert engine.abort("c") and not engine.abort("c")  # waiting: removed at once
    assert engine.stats()["waiting"] == 2
    outs: dict[str, list[StepOutput]] = {}

    def collect(new: list[StepOutput]) -> None:
        for o in new:
            outs.setdefault(o.rid, []).append(o)

    collect(engine.step())  # prefill a, b
    assert outs["c"] == [StepOutput("c", [], True, "abort", None, 3, 0, 0)]
    with ThreadPoolExecutor(1) as pool:
        plan = engine.schedule()
        assert plan is not None and len(plan.seqs) == 2
        future = pool.submit(engine.execute, plan)
        assert engine.abort("a")  # while (or after) the plan executes
        engine.add_request("d", [8, 9], greedy(2))  # arrivals are fine meanwhile too
        collect(engine.postprocess(plan, future.result()))
    assert [(o.new_token_ids, o.finish_reason) for o in outs["a"]][-1] == ([], "abort")
    assert len(outs["a"]) == 2 and outs["a"][-1].completion_tokens == 1
    stats = engine.stats()
    assert stats["free_slots"] == 1 and stats["aborted_total"] == 2 and stats["running"] == 1
    plan = engine.schedule()  # b decodes, d is admitted into a's row
    assert plan is not None and [s.rid for s in plan.seqs] == ["b", "d"]
    result = engine.execute(plan)
    assert engine.abort("b")  # after execute, before postprocess: no token for b
    collect(engine.postprocess(plan, result))
    assert outs["b"][-1].finish_reason == "abort"
    collect(run_all(engine)["d"])
    assert not engine.has_work() and engine.stats()["free_slots"] == 2
    assert all(sum(o.finished for o in v) == 1 for v in outs.values())
    assert engine.stats()["finished_total"] == 4


def test_abort_all_then_idle_postprocess(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=2)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5], greedy(50))
    engine.step()
    assert engine.abort_all() == 3
    assert engine.schedule() is None and engine.has_work()
    outs = engine.postprocess(None, None)
    assert sorted((o.rid, o.finish_reason) for o in outs) == [
        ("a", "abort"), ("b", "abort"), ("c", "abort"),
    ]
    assert not engine.has_work() and engine.stats()["free_slots"] == 2


def test_seeded_sampling_is_reproducible_and_batch_independent(gqa_engine: Engine) -> None:
    p = prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.5, max_new_tokens=12, ignore_eos=True, seed=1234)
    gqa_engine.add_request("x", p, params)
    alone = tokens_of(run_all(gqa_engine)["x"])
    others = prompts(12, seed=10)
    for i, q in enumerate(others[:6]):
        gqa_engine.add_request(f"o{i}", q, SamplingParams(temperature=1.5, max_new_tokens=3 + i,
                                                          seed=i if i % 2 else None))
    gqa_engine.step()
    gqa_engine.add_request("x", p, params)  # joins a running batch
    for i, q in enumerate(others[6:]):
        gqa_engine.add_request(f"o{i + 6}", q, SamplingParams(temperature=1.5, max_new_tokens=5))
    together = tokens_of(run_all(gqa_engine)["x"])
    assert together == alone
    gqa_engine.add_request("y", p, SamplingParams(temperature=1.5, max_new_tokens=12,
                                                  ignore_eos=True, seed=4321))
    assert tokens_of(run_all(gqa_engine)["y"]) != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(gqa_engine: Engine) -> None:
    ps = prompts(8, seed=11)
    for i, p in enumerate(ps):
        gqa_engine.add_request(f"g{i}", p, greedy(8))
        gqa_engine.add_request(f"k{i}", p, SamplingParams(temperature=1.0, top_k=1,
                                                          max_new_tokens=8, ignore_eos=True))
        gqa_engine.add_request(f"p{i}", p, SamplingParams(temperature=0.7, top_p=1e-6,
                                                          max_new_tokens=8, ignore_eos=True))
    outs = run_all(gqa_engine)
    for i in range(len(ps)):
        assert tokens_of(outs[f"k{i}"]) == tokens_of(outs[f"g{i}"])
        assert tokens_of(outs[f"p{i}"]) == tokens_of(outs[f"g{i}"])


def test_penalty_state_follows_the_slot(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=1)
    a, b = prompts(2, seed=12, lo=40, hi=60)
    no_repeat = greedy(20, frequency_penalty=1000.0)
    repetition = greedy(10, repetition_penalty=1e9)
    engine.add_request("a", a, no_repeat)
    out_a = tokens_of(run_all(engine)["a"])
    assert len(set(out_a)) == len(out_a)  # every output token penalised once generated
    engine.add_request("b", b, repetition)  # reuses slot 0: a's state must be gone
    out_b = tokens_of(run_all(engine)["b"])
    assert not set(out_b) & set(b) and len(set(out_b)) == len(out_b)
    fresh = make_engine(max_running=1)
    fresh.add_request("b", b, repetition)
    assert tokens_of(run_all(fresh)["b"]) == out_b


def test_plain_greedy_rows_beside_and_before_penalised_ones(make_engine: EngineFactory) -> None:
    """Plain greedy rows (argmax, no statistics kept) batched with penalised ones, then a
    penalised request in a slot a plain one used: each samples as it would alone."""
    engine = make_engine(max_running=2)
    x, y, z = prompts(3, seed=13, lo=40, hi=60)
    repetition = greedy(10, repetition_penalty=1e9)
    engine.add_request("x", x, greedy(12))  # slot 0
    engine.add_request("y", y, greedy(6, frequency_penalty=1000.0))  # slot 1: a mixed batch
    first = run_all(engine)
    assert tokens_of(first["x"]) == reference_greedy(engine, x, 12)
    engine.add_request("z", z, repetition)  # slot 1 is free first; slot 0 after x
    engine.add_request("x2", x, greedy(12))
    engine.add_request("z2", z, repetition)  # waits for a slot a plain request used
    second = run_all(engine)
    fresh = make_engine(max_running=1)
    fresh.add_request("z", z, repetition)
    alone = tokens_of(run_all(fresh)["z"])
    assert not set(alone) & set(z)  # the penalty bit
    assert tokens_of(second["z"]) == alone and tokens_of(second["z2"]) == alone
    assert tokens_of(second["x2"]) == tokens_of(first["x"])


def test_dtypes(tmp_path: Path, make_engine: EngineFactory) -> None:
    path = write_checkpoint(tmp_path / "bf16", torch_dtype="bfloat16", layers=1)
    auto = make_engine(path, max_running=2)
    assert auto.dtype == "bfloat16" and auto.device.split(":")[0] == TEST_DEVICE
    assert make_engine(path, dtype="float32", max_running=2).dtype == "float32"
    auto.add_request("r", [5, 6, 7], greedy(4))
    out = run_all(auto)["r"]
    assert len(tokens_of(out)) == 4 and all(0 <= t < auto.vocab_size for t in tokens_of(out))


def test_forward_cpu_is_counted_on_whichever_thread_runs_it(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=2)
    assert engine.stats()["forward_cpu_seconds_total"] == 0.0
    engine.add_request("a", [5] * 8, greedy(4))
    plan = engine.schedule()
    assert plan is not None
    start = time.thread_time()
    engine.postprocess(plan, engine.execute(plan))  # on this thread
    here = engine.stats()["forward_cpu_seconds_total"]
    assert 0 < here <= time.thread_time() - start
    with ThreadPoolExecutor(1) as pool:  # as on the engine thread
        while engine.has_work():
            plan = engine.schedule()
            engine.postprocess(plan, pool.submit(engine.execute, plan).result())
    assert engine.stats()["forward_cpu_seconds_total"] > here


def test_execute_failure_finishes_the_plan_with_error(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(max_running=2)
    engine.add_request("a", [5], greedy(5))

    def boom(plan: object) -> list[int]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "run", boom)
    outs = engine.step()
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "error")]
    assert "device lost" in (outs[0].error or "") and engine.stats()["free_slots"] == 2


def test_duplicate_rid_raises(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=2)
    engine.add_request("a", [5], greedy(2))
    with pytest.raises(ValueError):
        engine.add_request("a", [5], greedy(2))
    run_all(engine)
    engine.add_request("a", [5], greedy(2))  # finished rids may be reused
    assert run_all(engine)["a"][-1].finished


def test_n_samples_share_the_prompt_blocks(make_engine: EngineFactory) -> None:
    """n > 1: the followers wait for the leader's prompt and take its blocks from the cache."""
    engine = make_engine(max_running=8, block_size=4)
    prompt = prompts(1, seed=13, lo=37, hi=37)[0]
    engine.add_request("s0", prompt, greedy(6))
    for i in range(1, 4):
        engine.add_request(f"s{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=6,
                                                           ignore_eos=True, seed=i), after="s0")
    plan = engine.schedule()
    assert plan is not None and [s.rid for s in plan.seqs] == ["s0"]  # followers held
    first = engine.postprocess(plan, engine.execute(plan))
    assert [o.rid for o in first] == ["s0"]
    outs = run_all(engine)
    for i in range(1, 4):
        assert outs[f"s{i}"][-1].cached_tokens == 36  # every full block of the prompt
        assert len(tokens_of(outs[f"s{i}"])) == 6
    assert len({tuple(tokens_of(outs[f"s{i}"])) for i in range(1, 4)}) > 1  # own seeds
    assert engine.stats()["kv_blocks_used"] == 0


def test_aborting_a_held_follower_or_its_leader(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running=4)
    engine.add_request("lead", [5] * 20, greedy(4))
    engine.add_request("f1", [5] * 20, greedy(4), after="lead")
    engine.add_request("f2", [5] * 20, greedy(4), after="lead")
    assert engine.abort("f1")
    assert engine.abort("lead")  # still waiting: f2 is let go, and runs on its own
    outs = run_all(engine)
    assert outs["f1"][-1].finish_reason == "abort" and outs["lead"][-1].finish_reason == "abort"
    assert len(tokens_of(outs["f2"])) == 4 and outs["f2"][-1].finish_reason == "length"
    assert not engine.has_work()


def test_overload_completes_everything_within_the_cache(make_engine: EngineFactory) -> None:
    """Far more concurrent requests than KV blocks: all finish, with preemptions, and the
    cache never holds more than its blocks."""
    engine = make_engine(max_running=16, block_size=4, num_kv_blocks=64, max_model_len=200,
                         max_batched_tokens=48)
    nbytes = engine.runner.kv.nbytes
    ps = prompts(60, seed=14, lo=5, hi=60)
    rng = random.Random(15)
    lengths = [rng.randint(1, 40) for _ in ps]
    for i, p in enumerate(ps):
        engine.add_request(f"o{i}", p, greedy(lengths[i]))
    outs: dict[str, list[StepOutput]] = {}
    peak = 0
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
        peak = max(peak, engine.stats()["kv_blocks_used"])
    stats = engine.stats()
    assert peak <= 64 and engine.runner.kv.nbytes == nbytes
    assert stats["preempted_total"] > 0
    for i in range(len(ps)):
        assert len(tokens_of(outs[f"o{i}"])) == lengths[i]
        assert outs[f"o{i}"][-1].finish_reason == "length"
    # Preemption lost nothing: the same outputs as each request alone.
    for i in (0, 17, 42):
        engine.add_request("alone", ps[i], greedy(lengths[i]))
        assert tokens_of(run_all(engine)["alone"]) == tokens_of(outs[f"o{i}"])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_cpu_engine_keeps_freed_memory_mapped(make_engine: EngineFactory) -> None:
    # see tests/unit/common/test_memory_retained.py for what that saves
    engine = make_engine(device="cpu", max_running=2)
    assert engine.device == "cpu"
    assert engine.retained_memory
