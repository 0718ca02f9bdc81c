"""The run history in SQLite: a row a night, grouped into series by configuration key.

store (the database, its schema and migrations, the write lock), runs (the rows: written, and read back typed),
series (a key's nights along an axis, what changed between them, step changes), baselines (last passes, the series
before, pins). The names below are the history's interface; its modules are its parts.
"""

from qual.history.baselines import (baseline_result_paths, configuration_of, configuration_runs, last_pass,
                                    list_pins, model_passes, nearest_pass, pin, pinned_run, previous_series_pass,
                                    unpin)
from qual.history.runs import (COLUMNS, ERROR, FAIL, FILTERS, INCONCLUSIVE, OUTCOMES, PASS, ErrorNight, HistoryRun,
                               config_key, count_runs, find_night, get_run, list_runs, record_error,
                               record_run, recorded_order)
from qual.history.series import (DEFAULT_STEP_PP, StepChange, by_configuration, changed, check_step_pp,
                                 detect_step_changes, group_series, position, trend)
from qual.history.store import (LOCK_TIMEOUT_S, MAX_RUN_ID, SCHEMA_VERSION, HistoryLocked, check_history)

__all__ = [
    "COLUMNS", "DEFAULT_STEP_PP", "ERROR", "FAIL", "FILTERS", "INCONCLUSIVE", "LOCK_TIMEOUT_S", "MAX_RUN_ID",
    "OUTCOMES", "PASS", "SCHEMA_VERSION", "ErrorNight", "HistoryLocked", "HistoryRun", "StepChange",
    "baseline_result_paths", "by_configuration", "changed", "check_history", "check_step_pp", "config_key", "configuration_of",
    "configuration_runs", "count_runs", "detect_step_changes", "find_night", "get_run", "group_series", "last_pass",
    "list_pins", "list_runs", "model_passes", "nearest_pass", "pin", "pinned_run", "position", "previous_series_pass",
    "record_error", "record_run", "recorded_order", "trend", "unpin",
]
