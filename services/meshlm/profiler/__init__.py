"""`python -m meshlm.profiler <event_dir>`: reports from the request-event files of a run."""
