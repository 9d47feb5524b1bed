"""`make bench`'s in-process path: the engine in the bench's own process, no mesh."""

from __future__ import annotations

import time

from tqdm import tqdm

from meshlm.bench.load import Saturation, prompt
from meshlm.bench.mesh_report import SPACED_GAP_S, Result
from meshlm.bench.saturated import Arrivals


class InProcess:
    """The engine in this process, warmed up once; each `round` measures TTFT (back to back
    and spaced) and the saturation phase again, with fresh rids."""

    def __init__(self, model_path: str, n_warm: int, sat: Saturation, threads: int) -> None:
        from meshlm.scheduler.engine.engine import Engine, EngineConfig
        from meshlm.tokenizer.tokenization import TextTokenizer

        self.sat = sat
        self.tok = TextTokenizer.from_pretrained(model_path)
        # On a GPU this engine shares the card with the mesh's scheduler, which takes its
        # default share (0.85) less what this one holds: 0.4 leaves it as much.
        self.engine = Engine(EngineConfig(model_path=model_path, max_running=sat.concurrency,
                                          num_threads=threads or None, mem_fraction=0.4))
        self.rounds = 0
        for i in range(n_warm):
            self._add(f"w{i}", self.tok.encode(prompt(i, 16)), 2)
            while self.engine.has_work():
                self.engine.step()

    def _add(self, rid: str, ids: list[int], new_tokens: int) -> None:
        from meshlm.scheduler.engine.engine import SamplingParams

        self.engine.add_request(rid, ids, SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))

    def _first_token(self, rid: str, i: int) -> float:
        start = time.perf_counter()
        self._add(rid, self.tok.encode(prompt(i, 16)), 1)
        seconds = 0.0
        while self.engine.has_work():
            if any(o.new_token_ids for o in self.engine.step()):
                seconds = time.perf_counter() - start
        return seconds

    def round(self, n_ttft: int) -> Result:
        r, engine = self.rounds, self.engine
        self.rounds += 1
        ttft = [self._first_token(f"t{r}-{i}", i)
                for i in tqdm(range(n_ttft), desc="engine ttft", leave=False)]
        spaced = []
        for i in range(n_ttft):
            time.sleep(SPACED_GAP_S)  # the workload: the engine idle before the request comes
            spaced.append(self._first_token(f"g{r}-{i}", i))
        ids = [self.tok.encode(text) for text, _ in self.sat.requests]
        totals = engine.stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (p, (_, new_tokens)) in enumerate(zip(ids, self.sat.requests, strict=True)):
            self._add(f"s{r}-{i}", p, new_tokens)
        tokens, longest, before = 0, 0.0, time.perf_counter()
        arrivals = Arrivals()
        while engine.has_work():
            outputs = engine.step()
            after = time.perf_counter()
            came = 0
            for o in outputs:
                n = len(o.new_token_ids)
                came += n
                if n and o.completion_tokens == n:
                    arrivals.first(after)
            tokens += came
            arrivals.add(after, came)
            longest, before = max(longest, after - before), after
        seconds, cpu, now = (time.perf_counter() - start, time.process_time() - cpu_start,
                             engine.stats())
        return Result("in-process", ttft, tokens, seconds, cpu={"engine": cpu},
                      spaced_ttft=spaced, steps=now["steps_total"] - totals["steps_total"],
                      longest_gap=longest, forward=now["forward_cpu_seconds_total"]
                      - totals["forward_cpu_seconds_total"],
                      saturated=arrivals.window(self.sat.concurrency),
                      fills=(arrivals.fill_seconds(self.sat.concurrency, start),))

