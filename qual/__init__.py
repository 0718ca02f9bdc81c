"""qual: acceptance-rate qualification for DFlash speculative decoding under DCP."""

__version__ = "0.1.0"


def load(path):
    """A run directory or result.json (a single run's or a sweep's) with its tables as pandas DataFrames:
    run.requests, run.positions, run.categories, run.turns, run.latency, run.summary (qual/analysis.py)."""
    from qual.analysis import load as load_run  # pandas and the records load here, not with `import qual`

    return load_run(path)
