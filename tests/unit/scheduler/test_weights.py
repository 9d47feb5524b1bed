"""UpdateWeights: new weights without a restart. The engine on checkpoint A, updated to B in
the middle of generation: what was generated before stays, what follows is B's (equal to a
fresh engine on B given the same context), new requests equal a fresh engine on B; refused
checkpoints (each kind) leave A serving, untouched; a failed load puts A back; packed CPU
linears are repacked; the scheduler service applies updates between steps, one at a time."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file
from scheduler_helpers import (
    Outputs,
    greedy,
    make_servicer,
    run_all,
    sample_prompt,
    submit,
    tokenized,
    tokens_of,
    write_checkpoint,
)
from test_pause import expected, running_three

from meshlm.common.errors import MeshError
from meshlm.scheduler.engine import weights as engine_weights
from meshlm.scheduler.engine.engine import Engine, EngineConfig, SamplingParams, StepOutput
from meshlm.scheduler.engine.weights import WeightsLoadError
from meshlm.scheduler.models.cpu_linear import PackedLinear
from meshlm.scheduler.models.reload import CheckpointNotFound, IncompatibleCheckpoint
from meshlm.scheduler.server import SchedulerServicer
from meshlm.v1 import common_pb2, scheduler_pb2

PROMPTS = {"a": [5, 6, 7, 8, 9] * 4, "b": [40, 41, 42] * 3, "c": [(3 * i) % 500 for i in range(60)]}


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("a"), seed=0)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A's config, other random weights (stored as bfloat16: converted on load)."""
    path = write_checkpoint(tmp_path_factory.mktemp("b"), seed=7)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).float().to(torch.bfloat16) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path


def engine_on(path: Path, **kw: Any) -> Engine:
    kw = {"device": "cpu", "max_running": 4, "block_size": 4, "max_batched_tokens": 24, **kw}
    return Engine(EngineConfig(str(path), **kw))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, list[int]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return {rid: tokens_of(outs) for rid, outs in run_all(engine).items()}


def continuation(path: Path, prompt: list[int], n: int, **params: Any) -> list[int]:
    """What a fresh engine on `path` generates greedily after `prompt`."""
    return run(engine_on(path), {"x": (prompt, greedy(n, **params))})["x"]


def test_policy_drop_kv_retracts_everything_and_empties_the_prefix_cache() -> None:
    s, runner = running_three()
    s.pause("in_place")
    assert s.drop_kv() == 3 and s.paused == "in_place"  # a pause in force stays
    assert not s.running and [q.rid for q in s.waiting] == ["a", "b", "c", "d"]
    assert s.blocks.num_used == 0 and s.blocks.num_cached == 0
    assert s.stats()["retracted_total"] == 3
    s.resume()
    plan, _ = runner.step()
    assert plan is not None and all(item.start == 0 for item in plan.items)  # nothing cached
    outs = runner.drain()
    assert {rid: tokens_of(outs[rid]) for rid in "abcd"} == expected()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_update_mid_generation_goes_on_with_the_new_weights(
    ckpt_a: Path, ckpt_b: Path, packed: bool,
) -> None:
    n = 14
    requests = {  # a, b decode; c's 60-token prompt is chunked; d and e wait for a row
        "a": (PROMPTS["a"], greedy(n)),
        "b": (PROMPTS["b"], greedy(n, repetition_penalty=1.3)),
        "c": (PROMPTS["c"], greedy(n)),
        "d": ([11, 12, 13], greedy(n)),
        "e": ([70, 71] * 5, SamplingParams(temperature=0.9, top_p=0.9, seed=3,
                                           max_new_tokens=n, ignore_eos=True)),
    }
    engine = engine_on(ckpt_a, max_running=3, packed_cpu_linears=packed)
    if packed:
        if not engine.packed_linears:
            pytest.skip("no oneDNN packed linears on this machine")
        packed_before = [m.packed for m in engine.model.modules() if isinstance(m, PackedLinear)]
    plain_a = run(engine_on(ckpt_a, max_running=3), requests)
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs: dict[str, list[StepOutput]] = {}
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    before = {rid: tokens_of(outs.get(rid, [])) for rid in requests}
    assert before["a"] and before["b"] and not any(before[rid] for rid in "cde")
    assert 0 < engine.planner.running[2].num_computed_tokens < len(PROMPTS["c"])
    running = engine.stats()["running"]

    update = engine.update_weights(str(ckpt_b))
    assert update.retracted == running == 3 and update.model_path == str(ckpt_b)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] == 0
    assert engine.config.model_path == str(ckpt_b) and engine.paused is None
    if packed:  # repacked from B, not kept from A
        after = [m.packed for m in engine.model.modules() if isinstance(m, PackedLinear)]
        assert len(after) == len(packed_before) > 0
        assert all(not torch.equal(x.to_dense(), y.to_dense())
                   for x, y in zip(after, packed_before, strict=True))

    for rid, more in run_all(engine).items():
        outs.setdefault(rid, []).extend(more)
    got = {rid: tokens_of(outs[rid]) for rid in requests}
    for rid, (ids, params) in requests.items():
        k = len(before[rid])
        assert len(got[rid]) == n and outs[rid][-1].finish_reason == "length", rid
        assert [o.completion_tokens for o in outs[rid] if o.new_token_ids] == list(
            range(1, n + 1)), rid  # no token lost or repeated
        assert got[rid][:k] == plain_a[rid][:k], rid
        if params.temperature == 0.0:  # B's greedy continuation of the same context
            extra = {"repetition_penalty": params.repetition_penalty}
            assert got[rid][k:] == continuation(ckpt_b, ids + got[rid][:k], n - k, **extra), rid
    assert got["c"] != plain_a["c"]  # B's weights, not A's

    # New requests: exactly a fresh engine on B, sampled ones included.
    fresh = {f"{rid}2": req for rid, req in requests.items()}
    assert run(engine, fresh) == run(engine_on(ckpt_b, max_running=3), fresh)


def test_update_to_dummy_equals_a_fresh_dummy_engine(ckpt_a: Path) -> None:
    engine = engine_on(ckpt_a)
    engine.update_weights(str(ckpt_a), "dummy")
    assert engine.config.load_format == "dummy"
    req = {"x": (PROMPTS["a"], greedy(8))}
    assert run(engine, req) == run(engine_on(ckpt_a, load_format="dummy"), req)
    engine.update_weights(str(ckpt_a), "auto")  # and back
    assert run(engine, req) == run(engine_on(ckpt_a), req)


def test_tied_checkpoints_update_too(mha_tied_model: Path, tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "tied2", kv_heads=4, tied=True, seed=5)
    engine = Engine(EngineConfig(str(mha_tied_model), device="cpu", max_running=4))
    assert engine.update_weights(str(other)).tensors > 0
    req = {"x": (PROMPTS["b"], greedy(8))}
    assert run(engine, req) == run(Engine(EngineConfig(str(other), device="cpu",
                                                       max_running=4)), req)


def _edit(src: Path, dst: Path, config: dict[str, Any] | None = None,
          tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    """A copy of checkpoint `src` with config fields and tensors replaced (None: dropped)."""
    shutil.copytree(src, dst)
    if config:
        doc = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**doc, **config}))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        for name, value in tensors.items():
            if value is None:
                t.pop(name)
            else:
                t[name] = value
        save_file(t, str(dst / "model.safetensors"))
    return dst


def test_refused_checkpoints_name_what_differs_and_leave_a_serving(
    ckpt_a: Path, ckpt_b: Path, tmp_path: Path,
) -> None:
    up = "model.layers.0.mlp.up_proj.weight"
    cut = _edit(ckpt_b, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 100])
    tokenizer = _edit(ckpt_b, tmp_path / "tok")  # both sides have one only here
    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (ckpt_a / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 0}}}))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((ckpt_b / "config.json").read_text())
    cases: list[tuple[Path, str, type[Exception], str]] = [
        (tmp_path / "nowhere", "auto", CheckpointNotFound, "is not a directory"),
        (tmp_path, "auto", CheckpointNotFound, "has no config.json"),
        (empty, "auto", CheckpointNotFound, "has no *.safetensors"),
        (ckpt_b, "pickle", ValueError, "unknown load_format"),
        (write_checkpoint(tmp_path / "wide", hidden=128), "auto", IncompatibleCheckpoint,
         "hidden_size 64 served, 128 in the checkpoint"),
        (write_checkpoint(tmp_path / "vocab", vocab=600), "dummy", IncompatibleCheckpoint,
         "vocab_size 512 served, 600"),
        (_edit(ckpt_b, tmp_path / "arch", {"architectures": ["Qwen2ForCausalLM"]}), "auto",
         IncompatibleCheckpoint, "architecture 'LlamaForCausalLM' served, 'Qwen2ForCausalLM'"),
        (_edit(ckpt_b, tmp_path / "shape", tensors={up: torch.zeros(100, 64)}), "auto",
         IncompatibleCheckpoint, f"{up} has shape (100, 64) in the checkpoint, (128, 64)"),
        (_edit(ckpt_b, tmp_path / "missing", tensors={up: None}), "auto",
         IncompatibleCheckpoint, f"1 tensor(s) missing: {up}"),
        (_edit(ckpt_b, tmp_path / "extra", tensors={"model.extra.weight": torch.zeros(2)}),
         "auto", IncompatibleCheckpoint, "unexpected tensor 'model.extra.weight'"),
        (_edit(ckpt_b, tmp_path / "int", tensors={up: torch.zeros(128, 64, dtype=torch.int8)}),
         "auto", IncompatibleCheckpoint, f"{up} has dtype I8, not floating point"),
        (cut, "auto", IncompatibleCheckpoint, "model.safetensors is cut short"),
        (tokenizer, "auto", IncompatibleCheckpoint, "tokenizer.json has another vocabulary"),
    ]
    try:
        engine = engine_on(ckpt_a)
        engine.add_request("live", PROMPTS["a"], greedy(10))
        for _ in range(3):
            engine.step()
        for path, load_format, error, message in cases:
            with pytest.raises(error) as info:
                engine.update_weights(str(path), load_format)
            assert message in str(info.value), (path, str(info.value))
            assert engine.stats()["running"] == 1 and engine.stats()["retracted_total"] == 0
        assert engine.config.model_path == str(ckpt_a)
        rest = tokens_of(run_all(engine)["live"])
        assert rest == run(engine_on(ckpt_a), {"x": (PROMPTS["a"], greedy(10))})["x"][-len(rest):]
    finally:
        (ckpt_a / "tokenizer.json").unlink()


def test_a_load_that_fails_half_way_puts_the_old_weights_back(
    ckpt_a: Path, ckpt_b: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = engine_weights.load_checkpoint
    engine = engine_on(ckpt_a)
    want = run(engine_on(ckpt_a), {"x": (PROMPTS["c"], greedy(8))})

    def broken(model: Any, checkpoint: Any) -> int:
        if checkpoint.path == ckpt_b:
            real(model, checkpoint)  # every tensor of B copied in, then the disk goes away
            raise OSError("disk gone")
        return real(model, checkpoint)

    monkeypatch.setattr(engine_weights, "load_checkpoint", broken)
    with pytest.raises(WeightsLoadError, match=f"disk gone.*{ckpt_a} is served again"):
        engine.update_weights(str(ckpt_b))
    assert engine.config.model_path == str(ckpt_a) and engine.paused is None
    assert run(engine, {"x": (PROMPTS["c"], greedy(8))}) == want

    def hopeless(model: Any, checkpoint: Any) -> int:
        raise OSError("disk gone")

    monkeypatch.setattr(engine_weights, "load_checkpoint", hopeless)
    engine.add_request("y", PROMPTS["a"], greedy(8))
    with pytest.raises(WeightsLoadError, match="generation is paused"):
        engine.update_weights(str(ckpt_b))
    assert engine.paused == "abort"  # nothing is generated from mixed weights
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    monkeypatch.setattr(engine_weights, "load_checkpoint", real)
    engine.update_weights(str(ckpt_a))
    assert engine.resume()
    assert run(engine, {"x": (PROMPTS["c"], greedy(8))}) == want


# -- the scheduler service: UpdateWeights between engine steps ---------------------------------


@pytest.fixture
async def service(ckpt_a: Path) -> AsyncIterator[tuple[SchedulerServicer, Outputs]]:
    info = common_pb2.ModelInfo(model_path=str(ckpt_a),
                                json_info=json.dumps({"config": {}, "device": "cpu"}))
    outputs = Outputs()
    servicer = make_servicer(engine_on(ckpt_a, max_running=8, block_size=16), outputs, info)
    task = asyncio.create_task(servicer.loop.run())
    yield servicer, outputs
    task.cancel()
    servicer.loop.close()


async def _tokens_seen(outputs: Outputs, rid: str, n: int) -> None:
    while sum(len(o.token_ids) for o in outputs.items if o.rid == rid) < n:
        outputs.news.clear()
        await asyncio.wait_for(outputs.news.wait(), 30)


def _update(path: Path | str, load_format: str = "", abort_all: bool = False
            ) -> scheduler_pb2.UpdateWeightsRequest:
    return scheduler_pb2.UpdateWeightsRequest(model_path=str(path), load_format=load_format,
                                              abort_all=abort_all)


async def test_service_updates_between_steps_one_at_a_time(
    service: tuple[SchedulerServicer, Outputs], ckpt_a: Path, ckpt_b: Path,
) -> None:
    servicer, outputs = service
    long = tokenized("long", sample_prompt(30))
    long.meta.sampling.max_new_tokens = 60
    await submit(servicer, long)
    await _tokens_seen(outputs, "long", 3)
    first, second = await asyncio.gather(servicer.UpdateWeights(_update(ckpt_b), None),
                                         servicer.UpdateWeights(_update(ckpt_a), None))
    assert first.retracted == 1 and first.info.model_path == str(ckpt_b)
    assert second.info.model_path == str(ckpt_a) and 0 <= second.load_seconds <= second.seconds
    info = await servicer.GetInfo(common_pb2.GetInfoRequest(), None)
    assert info.model_path == str(ckpt_a) and json.loads(info.json_info)["device"] == "cpu"
    assert json.loads(info.json_info)["config"]["vocab_size"] == 512
    outs = await outputs.finished({"long"})
    assert len([t for o in outs["long"] for t in o.token_ids]) == 60
    assert [o.completion_tokens for o in outs["long"] if o.token_ids] == list(range(1, 61))
    assert servicer.loop.engine.stats()["retracted_total"] >= 1

    busy = tokenized("busy", sample_prompt(20))
    busy.meta.sampling.max_new_tokens = 500
    await submit(servicer, busy)
    await _tokens_seen(outputs, "busy", 1)
    reply = await servicer.UpdateWeights(_update(ckpt_b, "safetensors", abort_all=True), None)
    assert reply.aborted == 1 and reply.retracted == 0
    assert (await outputs.finished({"busy"}))["busy"][-1].finish_reason == "abort"


@pytest.mark.parametrize(("path", "load_format", "code"), [
    ("relative/dir", "", grpc.StatusCode.INVALID_ARGUMENT),
    ("", "", grpc.StatusCode.INVALID_ARGUMENT),
    ("/no/such/checkpoint", "", grpc.StatusCode.NOT_FOUND),
    ("B", "gguf", grpc.StatusCode.INVALID_ARGUMENT),
    ("WIDE", "", grpc.StatusCode.FAILED_PRECONDITION),
])
async def test_service_refusals_have_their_status_codes(
    service: tuple[SchedulerServicer, Outputs], ckpt_a: Path, ckpt_b: Path, tmp_path: Path,
    path: str, load_format: str, code: grpc.StatusCode,
) -> None:
    servicer, outputs = service
    path = {"B": str(ckpt_b), "WIDE": str(write_checkpoint(tmp_path / "w", layers=3))}.get(
        path, path)
    with pytest.raises(MeshError) as info:
        await servicer.UpdateWeights(_update(path, load_format), None)
    assert info.value.code == code, info.value.message
    assert (await servicer.GetInfo(common_pb2.GetInfoRequest(), None)).model_path == str(ckpt_a)
    await submit(servicer, tokenized("after", sample_prompt(9)))
    assert (await outputs.finished({"after"}))["after"][-1].finish_reason == "length"


def test_an_update_repacks_bfloat16_weights_as_a_fresh_engine_packs_them(
        ckpt_a: Path, ckpt_b: Path) -> None:
    engine = engine_on(ckpt_a, packed_weight_dtype="bfloat16")
    requests = {rid: (ids, greedy(10)) for rid, ids in PROMPTS.items()}
    on_a = run(engine, requests)
    engine.update_weights(str(ckpt_b))
    packed = [m.packed for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(p.dtype == torch.bfloat16 for p in packed)
    on_b = run(engine, requests)
    assert on_b == run(engine_on(ckpt_b, packed_weight_dtype="bfloat16"), requests)
    assert on_b != on_a
