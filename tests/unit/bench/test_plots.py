"""plots.py: the sweep's charts are real PNG files, also with gaps in the data."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from meshlm.bench.engine import Result  # noqa: E402
from meshlm.bench.plots import THROUGHPUT_PNG, TTFT_PNG, write_plots  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake(tokens: int, ttft_s: float | None) -> Result:
    return Result("fake", tokens, 2.0, [] if ttft_s is None else [ttft_s, ttft_s * 2])


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000  # axes, lines, labels: far more than an empty image
    assert data[12:16] == b"IHDR" and int.from_bytes(data[16:20], "big") > 400  # width, px


def test_writes_both_charts_as_png(tmp_path: Path) -> None:
    series = {
        "llama.cpp": {c: fake(100 * c, 0.01 * c) for c in (1, 4, 16, 64)},
        "transformers serve": {c: fake(40 * c, 0.05 * c) for c in (1, 4, 16, 64)},
        "meshlm": {c: fake(80 * c, 0.02 * c) for c in (1, 4, 16, 64)},
    }
    out = tmp_path / "made" / "here"
    paths = write_plots(series, out, "bench model, 1 compute thread")
    assert paths == [out / THROUGHPUT_PNG, out / TTFT_PNG]
    for path in paths:
        assert_png(path)


def test_missing_points_and_a_single_concurrency_still_plot(tmp_path: Path) -> None:
    series = {"meshlm": {4: fake(10, None)}, "llama.cpp": {4: fake(20, 0.1)}}
    for path in write_plots(series, tmp_path, "one point"):
        assert_png(path)
    for path in write_plots({}, tmp_path / "empty", "nothing measured"):
        assert path.read_bytes()[:8] == PNG_SIGNATURE
