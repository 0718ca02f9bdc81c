"""The driver's heap kept out of the cycle collector's full walks while engines run.

Why: a full walk visits every object the process holds (the checkpoints' and the models' Python objects, compiled
code and dynamo's caches under a compiled backend) and stops the host loop for as long: on the 2-core development
CPU one walk in 30 generates of the toy pair's 64-request stream took 131 ms, against about 30 ms for a whole
generate (bench/host_loop.py's mean holds it). An engine's start freezes what is alive then (`gc.freeze`, as vLLM
does after its graph capture): the collector skips those objects from then on, and garbage made while engines run
is collected as before. The last engine to close unfreezes them, so cycles among them are collected again later.
"""

from __future__ import annotations

import gc

_engines = 0  # engines of this process started and not yet closed


def engine_started() -> None:
    """An engine is ready: collect what is garbage now, then freeze the rest."""
    global _engines
    gc.collect()
    gc.freeze()
    _engines += 1


def engine_closed() -> None:
    """An engine that engine_started() counted is gone: the last one unfreezes the heap."""
    global _engines
    _engines -= 1
    if _engines == 0:
        gc.unfreeze()
