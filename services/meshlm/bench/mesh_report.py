"""`make bench`'s results and report: latency, throughput, CPU per output token, and the goals.

The goals are issue 16's: with the engine's cores pinned, the mesh keeps >= 90% of the
in-process engine's throughput and adds <= 2 ms to TTFT p50 at concurrency 1; per output token
the scheduler spends <= 1.15x the bare engine's CPU, the gateway <= 15 µs over gRPC (<= 30 µs
over HTTP SSE) and the detokenizer <= 15 µs.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshlm.bench.pinning import CpuPlan, describe, format_cpus

THROUGHPUT_GOAL = 0.9        # mesh / in-process, pinned
TTFT_GOAL_MS = 2.0           # mesh - in-process TTFT p50 at concurrency 1, pinned
SCHEDULER_CPU_GOAL = 1.15    # scheduler CPU per output token / the bare engine's
GATEWAY_CPU_GOAL_US = {"gRPC": 15.0, "HTTP": 30.0}
DETOKENIZER_CPU_GOAL_US = 15.0
SPACED_GAP_S = 0.005  # the in-process engine's idle time before each request of its spaced run
SERVICES = ("scheduler", "gateway", "detokenizer", "tokenizer")  # the order they are reported
# The scheduler's engine thread (and its OpenMP workers) alone: the rest of the scheduler's CPU
# is its event loop and gRPC's threads (planning each step, encoding and sending outputs).
ENGINE_THREAD_PART = "scheduler engine thread"
# This process while it drives the mesh: on the rest CPUs with the mesh's other services when
# pinned, so its CPU is taken from theirs.
LOAD_GENERATOR_PART = "load generator"


@dataclass
class Result:
    """One path's run: TTFTs at concurrency 1, and its saturation phase's output tokens, wall
    seconds and CPU seconds per part ("engine" in-process; each service role in the mesh)."""

    name: str
    ttft: list[float]
    tokens: int
    seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    # In-process only: TTFTs with the engine idle for SPACED_GAP_S before each request, as the
    # mesh's engine is while a request crosses the other services.
    spaced_ttft: list[float] = field(default_factory=list)
    steps: int = 0  # engine steps (forward passes) in the saturation phase
    # The saturation phase's longest wait between two consecutive outputs of one request, in
    # seconds (the mesh: between two streamed messages, as its client sees them; in-process:
    # the longest engine step). A pause anywhere on the path (a collection, a stall) shows here.
    longest_gap: float = 0.0
    # The phase's (tokens, seconds) while every slot was busy (saturated.py).
    saturated: tuple[int, float] = (0, 0.0)
    messages: int = 0  # the mesh: streamed messages its clients received in the phase
    forward: float = 0.0  # CPU seconds of the engine's forward passes in the phase
    fills: tuple[float, ...] = ()  # each round's seconds to fill every slot (saturated.py)

    @classmethod
    def merged(cls, rounds: list[Result]) -> Result:
        """One path's rounds as one result: every TTFT, and the saturation phases' tokens,
        seconds, CPU and steps summed (throughput and CPU per token over all rounds)."""
        cpu: Counter[str] = Counter()
        for r in rounds:
            cpu.update(r.cpu)
        return cls(rounds[0].name, [t for r in rounds for t in r.ttft],
                   sum(r.tokens for r in rounds), sum(r.seconds for r in rounds), dict(cpu),
                   [t for r in rounds for t in r.spaced_ttft], sum(r.steps for r in rounds),
                   max(r.longest_gap for r in rounds),
                   (sum(r.saturated[0] for r in rounds), sum(r.saturated[1] for r in rounds)),
                   sum(r.messages for r in rounds), sum(r.forward for r in rounds),
                   tuple(f for r in rounds for f in r.fills))

    @property
    def messages_per_token(self) -> float:
        """Streamed messages per output token in the saturation phase (0: not counted)."""
        return self.messages / self.tokens if self.tokens else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(self.ttft) * 1000

    @property
    def spaced_p50(self) -> float | None:
        return statistics.median(self.spaced_ttft) * 1000 if self.spaced_ttft else None

    @property
    def p99(self) -> float:
        q = sorted(self.ttft)
        return q[min(len(q) - 1, int(round(0.99 * (len(q) - 1))))] * 1000

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    def cpu_us_per_token(self, part: str) -> float:
        """CPU µs `part` spent per output token in the saturation phase."""
        return self.cpu[part] / max(1, self.tokens) * 1e6


def report(results: list[Result]) -> str:
    """The table and the ratios of the mesh paths (results[1:]) to the engine (results[0])."""
    base = results[0]
    lines = [f"{'path':<12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'out tok/s':>10}"]
    for r in results:
        lines.append(f"{r.name:<12} {r.p50:>12.2f} {r.p99:>12.2f} {r.throughput:>10.1f}")
    lines.append("")
    for r in results[1:]:
        lines.append(f"{r.name} vs {base.name}: TTFT p50 {r.p50 - base.p50:+.2f} ms, "
                     f"throughput {r.throughput / base.throughput:.1%}")
    spaced = base.spaced_p50
    if spaced is not None:
        over = ", ".join(f"{r.name} {r.p50 - spaced:+.2f} ms" for r in results[1:])
        lines.append(f"{base.name} with requests {SPACED_GAP_S * 1000:.0f} ms apart (the engine "
                     f"idle before each, as the mesh's is while a request crosses the other "
                     f"services): TTFT p50 {spaced:.2f} ms; {over} over it")
    grpc_r, http_r = results[1], results[2]
    lines.append(f"gRPC vs HTTP: TTFT p50 {grpc_r.p50 / http_r.p50:.2f}x, "
                 f"throughput {grpc_r.throughput / http_r.throughput:.2f}x")
    gaps = ", ".join(f"{r.name} {r.longest_gap * 1000:.1f} ms" for r in results)
    lines.append(f"longest wait between two outputs of one request at saturation (in-process: "
                 f"its longest step): {gaps}")
    return "\n".join(lines)


def rounds_line(by_round: Mapping[str, list[Result]]) -> str:
    """Each mesh path's throughput over the in-process engine's, round by round: how much
    the machine moved the ratio during the run."""
    engine = by_round["in-process"]
    parts = []
    for name, rounds in by_round.items():
        if name != "in-process":
            ratios = " ".join(f"{r.throughput / e.throughput:.2f}"
                              for r, e in zip(rounds, engine, strict=True))
            parts.append(f"{name} {ratios}")
    return f"throughput / in-process by round: {'; '.join(parts)}"


def saturated_line(results: list[Result], concurrency: int) -> str:
    """Each path's throughput while every slot was busy (saturated.py), and the mesh's over
    the in-process engine's: the whole phase's ratio less its ramp and its drain, where steps
    of a few rows carry the mesh's per-step work over very few tokens."""
    engine = results[0]
    if not all(r.saturated[1] > 0 for r in results):
        return "throughput while every slot was busy: no request waited for a slot"
    inside = {r.name: r.saturated[0] / r.saturated[1] for r in results}
    outside = {r.name: _outside(r) for r in results}
    parts = [f"{engine.name} {inside[engine.name]:.1f} tok/s ({_share(engine):.0%} of its "
             f"tokens; {outside[engine.name]:.1f} outside it)"]
    parts += [f"{r.name} {inside[r.name]:.1f} ({inside[r.name] / inside[engine.name]:.2f}x; "
              f"{_share(r):.0%}; outside it {outside[r.name] / outside[engine.name]:.2f}x)"
              for r in results[1:]]
    return (f"throughput while every slot was busy (from the {concurrency}th request's first "
            f"token to the last request's): {', '.join(parts)}")


def fill_line(results: list[Result], concurrency: int) -> str:
    """How long each path took to fill its slots at the phase's start, mean of its rounds: the
    engine alone has every request queued before its first step; the mesh's first requests
    cross the load generator, gateway and tokenizer, which share their CPU(s) with the streams
    of those already running."""
    if not all(r.fills for r in results):
        return "time to fill every slot: not measured"
    parts = [f"{r.name} {1e3 * sum(r.fills) / len(r.fills):.1f} ms "
             f"({sum(r.fills) / r.seconds:.1%} of the phase)" for r in results]
    return (f"time to fill the {concurrency} slots (the phase's start to the {concurrency}th "
            f"request's first token), mean of the rounds: {', '.join(parts)}")


def _share(r: Result) -> float:
    return r.saturated[0] / r.tokens if r.tokens else 0.0


def _outside(r: Result) -> float:
    """Tokens per second in the ramp and the drain together."""
    seconds = r.seconds - r.saturated[1]
    return (r.tokens - r.saturated[0]) / seconds if seconds > 0 else 0.0


def batching_line(results: list[Result]) -> str:
    """Output tokens per engine step at saturation on each path: whether the mesh keeps the
    engine's batch as full as the engine alone does (fewer tokens a step: more steps, each
    with its fixed cost, for the same tokens)."""
    parts = ", ".join(f"{r.name} {r.tokens / r.steps:.1f}" for r in results if r.steps)
    return f"output tokens per engine step at saturation: {parts}"


def forward_line(results: list[Result]) -> str:
    """The engine's CPU per output token split in two on each path: its forward passes (the
    engine's own count, whichever thread ran them) and the rest of the process (in-process:
    the engine's planning and this loop; the mesh: the scheduler service's work). The forward
    is the same code on the same CPU on every path: where it costs more in the mesh, the
    services on the other CPUs slowed it through what the CPUs share (last-level cache,
    memory bandwidth), or its steps carried fewer tokens."""
    part = {r.name: "engine" if r.name == "in-process" else "scheduler" for r in results}
    counted = [r for r in results if r.forward > 0 and part[r.name] in r.cpu]
    if not counted:
        return "forward passes: not counted (the engine reported no forward_cpu_seconds_total)"
    base = counted[0]
    base_us = base.forward / max(1, base.tokens) * 1e6

    def one(r: Result) -> str:
        forward = r.forward / max(1, r.tokens) * 1e6
        rest = r.cpu_us_per_token(part[r.name]) - forward
        ratio = f" ({forward / base_us:.2f}x)" if r is not base else ""
        return f"{r.name} {forward:.0f}{ratio} + {rest:.0f}"

    return ("CPU per output token, the forward passes + the rest of the engine's process "
            f"(µs): {', '.join(one(r) for r in counted)}; the forward is the same code on the "
            "same CPU: in the mesh the services on the other CPUs share its last-level cache "
            "and memory bandwidth")


def cpu_line(engine: Result, mesh: Result, transport: str) -> str:
    """CPU µs per output token of each service on one transport, against the goals."""
    bare = engine.cpu_us_per_token("engine")
    parts = []
    for name in SERVICES:
        if name not in mesh.cpu:
            continue
        us = mesh.cpu_us_per_token(name)
        if name == "scheduler":
            split = ""
            if ENGINE_THREAD_PART in mesh.cpu:
                engine_us = mesh.cpu_us_per_token(ENGINE_THREAD_PART)
                split = (f"; engine thread {engine_us:.0f}, event loop and gRPC threads "
                         f"{us - engine_us:.0f}")
                if engine_us < us / 2:  # one CPU: the steps ran on the loop (placement.py)
                    split += ", the forward passes included (--engine-steps)"
            parts.append(f"scheduler {us:.0f} ({us / bare:.2f}x engine; "
                         f"goal <= {SCHEDULER_CPU_GOAL:.2f}x{split})")
        elif name == "gateway":
            parts.append(f"gateway {us:.0f} (goal <= {GATEWAY_CPU_GOAL_US[transport]:.0f})")
        elif name == "detokenizer":
            parts.append(f"detokenizer {us:.0f} (goal <= {DETOKENIZER_CPU_GOAL_US:.0f})")
        else:
            parts.append(f"{name} {us:.0f}")
    if LOAD_GENERATOR_PART in mesh.cpu:
        parts.append(f"load generator {mesh.cpu_us_per_token(LOAD_GENERATOR_PART):.0f}")
    return (f"CPU per output token (µs): engine in-process {bare:.0f}; "
            f"{transport}: {', '.join(parts)}")


def floor_line(floors: Mapping[str, float], gateway: Mapping[str, Result], streams: int,
               plan: CpuPlan | None, handler: Mapping[str, float], grpcio: float) -> str:
    """The transports' own CPU per streamed message (`transport_floor.py`, by transport name;
    gRPC's is the gateway's native server; both with a running request's messages written
    directly, as the gateway writes them; for comparison `handler` has every message from
    its call's handler, and `grpcio` is grpc.aio's server), the messages per token the gateway
    wrote (`gateway`: its run on that transport), and what it spends per token above the
    floor those messages cost."""
    where = f", on {describe(plan.rest)} as the gateway" if plan else ""
    per_token = _floor_per_token(floors, gateway)
    sent = ", ".join(f"{t} {gateway[t].messages_per_token:.2f}" for t in per_token)
    return (f"the transports' own cost of a streamed message (a bare server writing the "
            f"gateway's per-token message to {streams} streams at once{where}): gRPC (the "
            f"gateway's native server) {floors['gRPC']:.0f} µs, HTTP (uvicorn, SSE) "
            f"{floors['HTTP']:.0f} µs, written directly as the gateway writes them (each "
            f"through its call's handler: gRPC {handler['gRPC']:.0f}, HTTP "
            f"{handler['HTTP']:.0f}; grpc.aio's server: {grpcio:.0f}). Messages per output "
            f"token at saturation (a stream's mailbox folds what arrives while its "
            f"client is busy): {sent}; so the floor per token: "
            + ", ".join(f"{t} {us:.0f} µs" for t, us in per_token.items())
            + f". What the gateway spends above it (µs per token): "
            f"{_gateway_less(gateway, per_token)}")


def own_work_line(own: Mapping[str, float], floors: Mapping[str, float],
                  gateway: Mapping[str, Result]) -> str:
    """The gateway's own work per token without its transports (`gateway_path.py`, by
    transport name), and what is left of its figure in the mesh above that and the floor."""
    per_token = _floor_per_token(floors, gateway)
    rest = _gateway_less(gateway, {t: per_token[t] + us for t, us in own.items()})
    return (f"the gateway's own work per token, without its transports (its api, fronts and "
            f"inbox in one process, fed one token per stream per step; `python -m "
            f"meshlm.bench.gateway_path`): gRPC {own['gRPC']:.1f} µs, HTTP {own['HTTP']:.1f} "
            f"µs. Left above that and the floor (µs per token): {rest}; its per-request work "
            f"over real connections, the inbox's stream, and sharing its CPU with the other "
            f"services and the load generator")


def _floor_per_token(floors: Mapping[str, float], gateway: Mapping[str, Result]
                     ) -> dict[str, float]:
    """Each transport's floor per output token: its floor per message times the messages per
    token the gateway wrote (one, where the run did not count them)."""
    return {t: us * (gateway[t].messages_per_token or 1.0) for t, us in floors.items()}


def _gateway_less(gateway: Mapping[str, Result], parts: Mapping[str, float]) -> str:
    """"gRPC 12, HTTP 27": the gateway's µs per token on each transport less its part there."""
    return ", ".join(f"{t} {gateway[t].cpu_us_per_token('gateway') - us:.0f}"
                     for t, us in parts.items() if "gateway" in gateway[t].cpu)


def placement_lines(plan: CpuPlan, threads: Mapping[str, Counter[str]]) -> list[str]:
    """Which CPUs each part was given, and which CPUs each service's threads were seen on
    (`threads`: service -> {CPU list: how many of its threads may run there})."""
    seen = "; ".join(f"{name} " + ", ".join(f"{n} on {cpus}" for cpus, n in by_cpus.most_common())
                     for name, by_cpus in threads.items())
    return [f"CPUs: the engine on {describe(plan.engine)} (in-process: the whole bench process; "
            f"in the mesh: the scheduler, engine and event loop, MESHLM_ENGINE_CPUS="
            f"{format_cpus(plan.engine)}); the load generator and every other service and "
            f"thread on {describe(plan.rest)}",
            f"threads of each mesh service by allowed CPUs: {seen}"]


def pinned_line(engine: Result, mesh: Result, transport: str, plan: CpuPlan) -> str:
    """The mesh/in-process ratio with the engine's CPUs pinned, against the goals."""
    return (f"mesh {transport} / in-process, pinned (engine on {describe(plan.engine)}, "
            f"the rest on {describe(plan.rest)}): throughput "
            f"{mesh.throughput / engine.throughput:.2f} (goal >= {THROUGHPUT_GOAL}), "
            f"TTFT p50 at concurrency 1 {mesh.p50 - engine.p50:+.2f} ms "
            f"(goal <= +{TTFT_GOAL_MS:.0f} ms{_spaced_note(engine, mesh)})")


def _spaced_note(engine: Result, mesh: Result) -> str:
    spaced = engine.spaced_p50
    if spaced is None:
        return ""
    return (f"; {mesh.p50 - spaced:+.2f} ms over the engine with requests "
            f"{SPACED_GAP_S * 1000:.0f} ms apart")
