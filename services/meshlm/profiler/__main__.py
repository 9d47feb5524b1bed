"""`python -m meshlm.profiler <event_dir> [--run-id R] [--json]`."""

from __future__ import annotations

from pathlib import Path

import click
import orjson

from meshlm.profiler.report import as_json, load, report


@click.command()
@click.argument("event_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--run-id", default=None, help="only this run's events")
@click.option("--json", "as_json_", is_flag=True, help="per-request figures as JSON")
@click.option("--timelines", default=3, show_default=True, help="request timelines to print")
def main(event_dir: Path, run_id: str | None, as_json_: bool, timelines: int) -> None:
    """Per-request timelines, per-stage and per-hop times from a profiling run's event files
    (events_<stage>_<pid>.jsonl, written by every service between start_profile and
    stop_profile)."""
    traces = load(event_dir, run_id)
    if not traces:
        raise click.ClickException(f"no request events under {event_dir}"
                                   + (f" for run {run_id}" if run_id else ""))
    if as_json_:
        click.echo(orjson.dumps(as_json(traces), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(report(traces, timelines))


if __name__ == "__main__":
    main()
