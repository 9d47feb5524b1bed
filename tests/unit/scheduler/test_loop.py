"""The engine loop over a real tiny engine, without gRPC: what the wire fields embed and after
do, deadlines enforced (also while paused), bounded admission, aborts before arrival, and the
outputs of a request that does not stream sent in pieces."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scheduler_helpers import Outputs, sample_prompt, tokenized, write_checkpoint

from meshlm.scheduler.engine.sequence import SamplingParams, StepOutput
from meshlm.scheduler.loop import EngineLoop
from meshlm.scheduler.pacing import HOLD_TOKENS, hold_tokens, merge
from meshlm.scheduler.placement import StepPlacement
from meshlm.scheduler.tracked import Code
from meshlm.v1 import common_pb2, scheduler_pb2


@pytest.fixture(params=["thread", "loop"])
def placement(request: pytest.FixtureRequest) -> StepPlacement:
    """Every loop test runs with the steps on the engine thread, and again with the short
    ones on the event loop (placement.py)."""
    return StepPlacement(allowed=request.param == "loop")


@pytest.fixture
async def running(make_engine: Any, request: pytest.FixtureRequest, tmp_path: Path,
                  placement: StepPlacement) -> AsyncIterator[tuple[EngineLoop, Outputs]]:
    """An engine loop over the tiny engine, running; `@pytest.mark.parametrize("running", [N],
    indirect=True)` gives it a model of N positions instead of 256."""
    positions = getattr(request, "param", None)
    path = write_checkpoint(tmp_path / "long", max_positions=positions) if positions else None
    outputs = Outputs()
    loop = EngineLoop(make_engine(path, max_running=8, block_size=16), ThreadPoolExecutor(1),
                      outputs, address="s", placement=placement)
    task = asyncio.create_task(loop.run())
    yield loop, outputs
    task.cancel()
    loop.close()


def _submit(loop: EngineLoop, *reqs: scheduler_pb2.TokenizedRequest) -> None:
    loop.submit(scheduler_pb2.TokenizedBatch(requests=reqs))


async def test_followers_share_the_leaders_prompt(running: tuple[EngineLoop, Outputs]):
    loop, outputs = running
    prompt = sample_prompt(40)
    _submit(loop, tokenized("p-0", prompt),
            *(tokenized(f"p-{i}", prompt, after="p-0") for i in (1, 2)))
    outs = await outputs.finished({"p-0", "p-1", "p-2"})
    cached = [outs[f"p-{i}"][-1].cached_tokens for i in range(3)]
    assert cached[0] == 0 and min(cached[1:]) >= 32, cached
    tokens = {tuple(t for o in outs[f"p-{i}"] for t in o.token_ids) for i in range(3)}
    assert len(tokens) == 1  # greedy: the same sample three times


async def test_embed_requests_answer_with_their_vector(running: tuple[EngineLoop, Outputs]):
    loop, outputs = running
    _submit(loop, tokenized("e", sample_prompt(10), embed=True))
    [out] = (await outputs.finished({"e"}))["e"]
    assert out.finish_reason == "stop" and not out.token_ids and out.prompt_tokens == 10
    assert len(out.embedding) == loop.engine.model_config.hidden_size
    assert abs(sum(x * x for x in out.embedding) - 1.0) < 1e-4
    assert out.HasField("header") and not out.header.meta.return_text


# 16k positions: "free" must not reach its length limit before "running" passes its deadline,
# however fast the machine steps.
@pytest.mark.parametrize("running", [16384], indirect=True)
async def test_a_request_past_its_deadline_ends_deadline_exceeded(
        running: tuple[EngineLoop, Outputs]):
    """The scheduler enforces the client's deadline itself: a request already past it is never
    queued, and a running one is ended (its KV freed) once it passes, while a request without
    a deadline runs on."""
    loop, outputs = running
    long = {"deadline": time.time() + 0.5}
    late = tokenized("late", sample_prompt(8), deadline=time.time() - 1)
    ongoing = tokenized("running", sample_prompt(8), **long)
    ongoing.meta.sampling.max_new_tokens = 100_000  # far more than 0.5 s of steps
    free = tokenized("free", sample_prompt(8))
    free.meta.sampling.max_new_tokens = 100_000
    _submit(loop, late, ongoing, free)
    outs = await outputs.finished({"late", "running"})
    for rid, what in (("late", "before the request reached the scheduler"),
                      ("running", "deadline passed after")):
        final = outs[rid][-1]
        assert final.finish_reason == "error", final
        assert final.error.code == Code.DEADLINE_EXCEEDED
        assert what in final.error.message
    assert not any(o.token_ids for o in outs["late"])
    assert sum(len(o.token_ids) for o in outs["running"]) > 0
    stats = loop.engine.stats()
    assert stats["running"] == 1 and "free" in loop.tracked  # only "free" is left
    loop.abort(["free"], reason="abort")
    assert (await outputs.finished({"free"}))["free"][-1].finish_reason == "abort"


async def test_a_paused_scheduler_still_ends_requests_past_their_deadline(
        running: tuple[EngineLoop, Outputs]):
    loop, outputs = running
    await loop.between_steps(lambda: loop.engine.pause("in_place"), 30)
    _submit(loop, tokenized("held", sample_prompt(8), deadline=time.time() + 0.2))
    final = (await outputs.finished({"held"}))["held"][-1]
    assert final.error.code == Code.DEADLINE_EXCEEDED
    await loop.between_steps(loop.engine.resume, 30)


async def test_an_abort_before_its_request_ends_it_on_arrival(
        running: tuple[EngineLoop, Outputs]):
    loop, outputs = running
    assert loop.abort(["early"]) == 0 and "early" in loop.pre_aborted
    _submit(loop, tokenized("early", sample_prompt(8)))
    [final] = (await outputs.finished({"early"}))["early"]
    assert final.finish_reason == "abort" and not final.token_ids
    assert "early" not in loop.pre_aborted and loop.engine.stats()["running"] == 0


async def test_abort_all_ends_each_request_with_abort_saying_cancelled(
        running: tuple[EngineLoop, Outputs]):
    """An abort of every request still finishes each with "abort"; its status says CANCELLED
    (the gateway ends gRPC streams with it). An abort of one rid carries no status."""
    loop, outputs = running
    for rid in ("a", "b", "one"):
        req = tokenized(rid, sample_prompt(8))
        req.meta.sampling.max_new_tokens = 200
        _submit(loop, req)
    await outputs.until(lambda: all(outputs.of(r) for r in ("a", "b", "one")))
    assert loop.abort(["one"]) == 1
    assert loop.abort([], every=True) == 2
    outs = await outputs.finished({"a", "b", "one"})
    for rid in ("a", "b"):
        final = outs[rid][-1]
        assert final.finish_reason == "abort" and final.error.code == Code.CANCELLED
        assert "abort_all" in final.error.message
    assert outs["one"][-1].finish_reason == "abort" and not outs["one"][-1].HasField("error")


async def test_the_waiting_queue_is_bounded(make_engine: Any):
    """Past max_queued waiting requests a new one ends at once with RESOURCE_EXHAUSTED; once
    the queue drains, requests are taken again."""
    engine = make_engine(max_running=1, block_size=16)
    outputs = Outputs()
    loop = EngineLoop(engine, ThreadPoolExecutor(1), outputs, address="s", max_queued=2)
    reqs = [tokenized(f"q-{i}", sample_prompt(8)) for i in range(4)]
    _submit(loop, *reqs)  # one batch: nothing has run yet, so all wait
    assert engine.num_waiting == 2
    task = asyncio.create_task(loop.run())
    try:
        refused = (await outputs.finished({"q-2", "q-3"}))
        for rid in ("q-2", "q-3"):
            final = refused[rid][-1]
            assert final.error.code == Code.RESOURCE_EXHAUSTED
            assert "2 requests waiting (limit 2)" in final.error.message
        outs = await outputs.finished({"q-0", "q-1"})
        assert all(outs[r][-1].finish_reason == "length" for r in ("q-0", "q-1"))
        _submit(loop, tokenized("q-4", sample_prompt(8)))
        assert (await outputs.finished({"q-4"}))["q-4"][-1].finish_reason == "length"
    finally:
        task.cancel()
        loop.close()


class _FakeEngine:
    def __init__(self) -> None:
        self.added: list[tuple[str, list[int], SamplingParams, int]] = []
        self.salts: dict[str, str] = {}
        self.matchers: dict[str, Any] = {}
        self.model_config = SimpleNamespace(has_lm_head=True)
        self.num_waiting = 0

    def add_request(self, rid: str, ids: list[int], params: SamplingParams,
                    after: str | None = None, priority: int = 0, matcher: Any = None,
                    cache_salt: str = "") -> None:
        self.added.append((rid, ids, params, priority))
        self.salts[rid] = cache_salt
        self.matchers[rid] = matcher


@pytest.mark.parametrize("start", [-1, 0])
def test_admission_keeps_the_prompt_only_for_prompt_logprobs(start: int) -> None:
    engine = _FakeEngine()
    loop = EngineLoop(engine, None, None)  # type: ignore[arg-type]
    loop.admit(scheduler_pb2.TokenizedRequest(input_ids=[1, 2, 3], meta=common_pb2.RequestMeta(
        rid="r", route=common_pb2.Route(detokenizer="d"),
        sampling=common_pb2.SamplingParams(top_p=1.0, max_new_tokens=2, return_logprob=True,
                                           logprob_start_len=start,
                                           return_text_in_logprobs=True))))
    tracked = loop.tracked["r"]
    assert tracked.meta.sampling.return_text_in_logprobs
    assert tracked.prompt_ids == ([1, 2, 3] if start >= 0 else [])
    assert engine.added[0][2].logprob_start_len == start


class _FakeGrammars:
    """Builds "matcher of <grammar>"; a grammar "bad" cannot be built."""

    def __init__(self) -> None:
        self.built: list[list[str]] = []

    def build(self, grammars: list[str]) -> list[Any]:
        self.built.append(grammars)
        return ["bad grammar" if g == "bad" else ("matcher", g) for g in grammars]


async def test_a_batch_with_constraints_waits_for_its_matchers_then_keeps_its_order() -> None:
    engine = _FakeEngine()
    grammars = _FakeGrammars()
    loop = EngineLoop(engine, None, None, grammars=grammars)  # type: ignore[arg-type]

    def request(rid: str, grammar: str = "") -> scheduler_pb2.TokenizedRequest:
        return scheduler_pb2.TokenizedRequest(input_ids=[1], meta=common_pb2.RequestMeta(
            rid=rid, route=common_pb2.Route(detokenizer="d"),
            sampling=common_pb2.SamplingParams(top_p=1.0, max_new_tokens=1, grammar=grammar)))

    loop.submit(scheduler_pb2.TokenizedBatch(requests=[
        request("free"), request("held", "g1"), request("broken", "bad")]))
    assert engine.added == []  # the whole batch waits for the matchers, built off the loop
    await asyncio.gather(*loop._building)
    assert grammars.built == [["g1", "bad"]]
    assert [rid for rid, *_ in engine.added] == ["free", "held"]
    assert engine.matchers == {"free": None, "held": ("matcher", "g1")}
    [refused] = [o for o in loop._pending if o.rid == "broken"]
    assert refused.finish_reason == "error" and "bad grammar" in (refused.error or "")
    assert loop.tracked["broken"].error_code == Code.INVALID_ARGUMENT


def test_admission_passes_the_gateways_priority_and_salt_to_the_engine() -> None:
    engine = _FakeEngine()
    loop = EngineLoop(engine, None, None)  # type: ignore[arg-type]
    for rid, priority in (("low", -3), ("none", 0), ("high", 7)):
        loop.admit(scheduler_pb2.TokenizedRequest(input_ids=[1], meta=common_pb2.RequestMeta(
            rid=rid, route=common_pb2.Route(detokenizer="d"), priority=priority,
            cache_salt=f"salt-{rid}" if priority else "",
            sampling=common_pb2.SamplingParams(top_p=1.0, max_new_tokens=1))))
    assert [(rid, priority) for rid, _, _, priority in engine.added] == [
        ("low", -3), ("none", 0), ("high", 7)]
    assert engine.salts == {"low": "salt-low", "none": "", "high": "salt-high"}


def _long(rid: str, n: int, **kw: Any) -> scheduler_pb2.TokenizedRequest:
    req = tokenized(rid, sample_prompt(12), **kw)
    req.meta.sampling.max_new_tokens = n
    return req


async def test_a_request_that_does_not_stream_gets_its_tokens_in_pieces(
        running: tuple[EngineLoop, Outputs]):
    """Its first output at once (with the header), then pieces of at least HOLD_TOKENS tokens,
    then its end: the same tokens and logprobs as a streaming twin's one output per token."""
    loop, outputs = running
    whole, streamed = _long("whole", 120, stream=False), _long("streamed", 120)
    for req in (whole, streamed):
        req.meta.sampling.return_logprob = True
    _submit(loop, whole, streamed)
    outs = await outputs.finished({"whole", "streamed"})
    pieces = [len(o.token_ids) for o in outs["whole"]]
    assert pieces[0] == 1 and outs["whole"][0].HasField("header"), pieces
    assert all(n >= HOLD_TOKENS for n in pieces[1:-1]) and len(pieces) <= 4, pieces
    assert [len(o.token_ids) for o in outs["streamed"]] == [1] * 120
    tokens = {k: [t for o in v for t in o.token_ids] for k, v in outs.items()}
    assert len(tokens["whole"]) == 120 and tokens["whole"] == tokens["streamed"]
    logprobs = {k: [x for o in v for x in o.logprobs.output_logprobs] for k, v in outs.items()}
    assert logprobs["whole"] == pytest.approx(logprobs["streamed"], abs=1e-5)
    assert [o.completion_tokens for o in outs["whole"]][-1] == 120


async def test_stop_strings_keep_a_request_that_does_not_stream_token_by_token(
        running: tuple[EngineLoop, Outputs]):
    """The detokenizer matches stop strings: it sees each token as soon as it is made."""
    loop, outputs = running
    req = _long("stops", 60, stream=False)
    req.meta.sampling.stop.append("never appears")
    _submit(loop, req)
    outs = (await outputs.finished({"stops"}))["stops"]
    assert [len(o.token_ids) for o in outs] == [1] * 60


async def test_an_abort_sends_what_was_held(running: tuple[EngineLoop, Outputs]):
    """Aborted mid-piece, a request that does not stream still gets every token it made; its
    streaming twin, stepped in the same batches, says when some are held."""
    loop, outputs = running
    _submit(loop, _long("held", 200, stream=False), _long("twin", 200))
    await outputs.until(lambda: len(outputs.of("twin")) >= 8)
    assert len(outputs.of("held")) == 1  # the first token; the next ones are held
    loop.abort(["held"])
    outs = (await outputs.finished({"held"}))["held"]
    assert outs[-1].finish_reason == "abort" and len(outs) == 2
    assert sum(len(o.token_ids) for o in outs) == outs[-1].completion_tokens >= 8


def test_merged_outputs_keep_the_prompts_logprobs_and_the_later_counts() -> None:
    def output(ids: list[int], done: bool, prompt: list[float | None]) -> StepOutput:
        return StepOutput(rid="r", new_token_ids=ids, finished=done,
                          finish_reason="length" if done else None, matched_token=None,
                          prompt_tokens=3, completion_tokens=len(ids), cached_tokens=0,
                          output_logprobs=[-0.5] * len(ids), input_logprob_start=1,
                          input_logprobs=prompt)
    merged = merge(output([1, 2], False, [None, -1.0]), output([3], True, []))
    assert merged.new_token_ids == [1, 2, 3] and merged.output_logprobs == [-0.5] * 3
    assert merged.input_logprobs == [None, -1.0] and merged.input_logprob_start == 1
    assert merged.finished and merged.finish_reason == "length"
    assert merged.completion_tokens == 1  # the later output's count


async def test_stream_interval_sends_the_first_token_then_every_nth(make_engine: Any):
    """--stream-interval 4: a streaming request's first token at once, then pieces of 4; its
    last piece whatever is left."""
    outputs = Outputs()
    loop = EngineLoop(make_engine(None, max_running=8, block_size=16), ThreadPoolExecutor(1),
                      outputs, address="s", stream_interval=4)
    task = asyncio.create_task(loop.run())
    try:
        _submit(loop, _long("paced", 11))
        outs = (await outputs.finished({"paced"}))["paced"]
        assert [len(o.token_ids) for o in outs] == [1, 4, 4, 2]
    finally:
        task.cancel()
        loop.close()


def test_what_is_held_back_and_what_is_not() -> None:
    def meta(**kw: Any) -> common_pb2.RequestMeta:
        return tokenized("r", [1], **kw).meta
    with_stop = meta(stream=False)
    with_stop.sampling.stop.append("\n")
    assert hold_tokens(meta(), 1) == 1 and hold_tokens(meta(), 8) == 8
    assert hold_tokens(meta(stream=False), 1) == HOLD_TOKENS
    assert hold_tokens(with_stop, 8) == 1 and hold_tokens(meta(embed=True, stream=False), 8) == 1
    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        EngineLoop(SimpleNamespace(), ThreadPoolExecutor(1), Outputs(),  # type: ignore[arg-type]
                   stream_interval=0)


async def test_on_one_cpu_short_steps_run_on_the_event_loop_and_long_ones_on_the_engine_thread(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch):
    """Placement "loop": once a step has been timed, the steps within the budget run on the
    event loop's own thread; a prompt whose step would pass it, and every step while a torch
    trace records, go to the engine thread. The tokens are the same either way."""
    engine = make_engine(None, max_running=8, block_size=16)
    tracing = False
    placement = StepPlacement(allowed=True, held=lambda: tracing)
    outputs = Outputs()
    loop = EngineLoop(engine, ThreadPoolExecutor(1), outputs, address="s", placement=placement)
    where: list[tuple[int, bool]] = []  # (tokens, ran on the event loop's thread)
    execute, loop_thread = engine.execute, threading.get_ident()

    def watched(plan: Any) -> Any:
        where.append((plan.num_tokens, threading.get_ident() == loop_thread))
        return execute(plan)

    monkeypatch.setattr(engine, "execute", watched)
    task = asyncio.create_task(loop.run())
    try:
        _submit(loop, tokenized("a", sample_prompt(12)))  # 4 tokens: a prompt step, 3 decodes
        first = (await outputs.finished({"a"}))["a"]
        assert where == [(12, False), (1, True), (1, True), (1, True)]  # timed, then here
        assert placement.seconds_per_token is not None
        # Cost and budget fixed: a 12-token step passes a budget of 6 tokens, a decode fits.
        monkeypatch.setattr(placement, "observe", lambda seconds, tokens: None)
        placement.seconds_per_token, placement.max_seconds = 1.0, 6.0
        where.clear()
        _submit(loop, tokenized("b", sample_prompt(12)))
        second = (await outputs.finished({"b"}))["b"]
        assert where == [(12, False), (1, True), (1, True), (1, True)]
        assert [t for o in second for t in o.token_ids] == [t for o in first for t in o.token_ids]
        tracing = True  # a torch trace records only the engine thread
        where.clear()
        _submit(loop, tokenized("c", sample_prompt(5)))
        await outputs.finished({"c"})
        assert where == [(5, False), (1, False), (1, False), (1, False)]
    finally:
        task.cancel()
        loop.close()
