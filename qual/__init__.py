"""qual: acceptance-rate qualification for DFlash speculative decoding under DCP."""

__version__ = "0.1.0"


def load(path):
    """A run directory or result.json (a single run's or a sweep's) with its tables as pandas DataFrames:
    run.requests, run.positions, run.categories, run.turns, run.latency, run.summary (qual/analysis.py)."""
    from qual.analysis import load as load_run  # pandas and the records load here, not with `import qual`

    return load_run(path)


def load_history(path):
    """A run history database with its nights and series as pandas DataFrames: history.runs, history.series
    (qual/history/frames.py)."""
    from qual.history.frames import load_history as load  # pandas loads with the first table, not with `import qual`

    return load(path)
