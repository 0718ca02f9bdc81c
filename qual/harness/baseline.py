"""`qual run --baseline REF`: find the baseline run and check, before any arm runs, that it can serve as one.

REF is a result directory or result.json, a history id (`12` or `history:12`), or `history:last-pass`: the run
pinned for tonight's configuration (`qual history baseline pin ID`), else its newest passing run; for a series with
neither, the last pass of the series before it (the nearest key that differs only in the checkpoints' identities or
the selection of the same corpus: a drafter swapped in place is compared with the drafter it replaces), else nothing:
the first night of a series runs the paired gate alone and becomes its baseline if it passes (`--baseline-required`
refuses that instead). What a baseline must share with tonight's run, and what may differ, is `mismatches` below
(docs/statistics.md, "Baselines").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Sequence

from qual import history as hist
from qual.baseline import ARMS, HISTORY_ID, LAST, NEAREST, PINNED, PREVIOUS_SERIES, RESULT_FILE
from qual.configuration import ConfigurationKey, describe_differences, is_successor
from qual.errors import QualError
from qual.records import ArmConfig
from qual.result import Result
from qual.sweep_result import SWEEP_SCHEMA, load_any
from qual.userfiles import check_path_name

LAST_PASS = "history:last-pass"
_HISTORY_ID = re.compile(r"(?:history:)?(\d+)")
# Compared with tonight's arms but allowed to differ: shown in the report (a baseline from another engine or build
# is the point of the comparison). Everything else of an arm's config is either a match key or shown too.
_MATCHED = ("model", "sampling", "num_speculative_tokens")


@dataclass
class ResolvedBaseline:
    """The run REF names: its result and how it was chosen."""

    ref: str
    chosen_by: str  # RESULT_FILE | HISTORY_ID | PINNED | LAST | PREVIOUS_SERIES | NEAREST
    history_id: int | None
    path: Path
    result: Result
    # the configuration-key fields in which the baseline differs from tonight's run (field, tonight, baseline); empty
    # when the keys agree
    key_differences: list[tuple[str, object, object]] = dataclass_field(default_factory=list)
    forced: bool = False  # --baseline-any was given

    def describe(self) -> str:
        which = self.path if self.history_id is None else f"run {self.history_id} ({self.chosen_by}, {self.path})"
        return f"{which}, created {self.result.created_at}"


ANY = "--baseline-any"
REQUIRED = "--baseline-required"


def resolve(ref: str, history_path: Path, configuration: ConfigurationKey, any_key: bool = False,
            required: bool = False, notes: list[str] | None = None) -> ResolvedBaseline | None:
    """The baseline run REF names (QualError, one line, if there is none or its result cannot be read), checked
    against tonight's configuration key: a baseline of another key is refused, naming the fields that differ, unless
    it is the series before tonight's (history:last-pass) or any_key (--baseline-any) takes it; the differences are
    recorded. None: history:last-pass found nothing for a series' first night (unless required); notes, if given,
    then receives what that night is told before it runs."""
    found = _find(ref, history_path, configuration, any_key, required, notes)
    if found is None:
        return None
    theirs = ConfigurationKey.of_result(found.result)
    diffs = configuration.differences(theirs, unknown_matches=True)
    follows = found.chosen_by == PREVIOUS_SERIES and is_successor(configuration, theirs)
    if diffs and not any_key and not follows:
        raise QualError(f"--baseline {ref}: {found.describe()} is another configuration: "
                        f"{describe_differences(diffs)}; pass {ANY} to compare with it anyway (recorded in the result)")
    found.key_differences, found.forced = diffs, any_key
    return found


def _find(ref: str, history_path: Path, configuration: ConfigurationKey, any_key: bool,
          required: bool, notes: list[str] | None) -> ResolvedBaseline | None:
    if ref == LAST_PASS:
        return _series_baseline(history_path, configuration, any_key, required, notes)
    m = _HISTORY_ID.fullmatch(ref)
    if m is not None:
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > len(str(hist.MAX_RUN_ID)) or not 1 <= int(digits) <= hist.MAX_RUN_ID:
            raise QualError(f"--baseline {_short(ref)}: no run can have this id "
                            f"(history ids are 1 to {hist.MAX_RUN_ID})")
        if not history_path.exists():
            raise QualError(f"--baseline {ref}: no run history at {history_path} (a history id needs one; --history)")
        run = hist.get_run(history_path, int(digits))
        if run.is_error:
            raise QualError(f"--baseline {ref}: run {run.id} ended without a verdict (exit {run.exit_code}: "
                            f"{run.error}); it measured nothing to compare with")
        return _from_history(ref, run, HISTORY_ID)
    if ref.startswith("history:"):
        raise QualError(f"--baseline {ref}: unknown history reference (use history:last-pass or history:ID)")
    check_path_name(ref, "--baseline")
    path = Path(ref)
    if path.is_dir():
        path = path / "result.json"
    if not path.is_file():
        raise QualError(f"--baseline {ref}: no result file at {path} (give a run directory, its result.json, "
                        f"a history id or {LAST_PASS})")
    return ResolvedBaseline(ref, RESULT_FILE, None, path, _load(ref, path, configuration, None, any_key))


def _series_baseline(history_path: Path, configuration: ConfigurationKey, any_key: bool,
                     required: bool, notes: list[str] | None) -> ResolvedBaseline | None:
    """history:last-pass: the series' pin, its last pass, the previous series' last pass, or (--baseline-any) the
    nearest passing run; None for a series' first night, told in notes where the model has passing nights of other
    configurations: the nearest, and each field in which it differs (an edited corpus, another --limit or max_tokens
    starts a new series, which passes on the paired gate alone)."""
    ref = LAST_PASS
    recorded = history_path.exists()
    pinned = hist.pinned_run(history_path, configuration) if recorded else None
    if pinned is not None:
        return _from_history(ref, pinned, PINNED)
    run = hist.last_pass(history_path, configuration) if recorded else None
    if run is not None:
        return _from_history(ref, run, LAST)
    passes = hist.model_passes(history_path, configuration.model) if recorded else []
    nearest = hist.nearest_pass(passes, configuration)
    if nearest is not None and not configuration.differences(nearest.key, unknown_matches=True):
        return _from_history(ref, nearest, LAST)  # tonight's key not wholly known yet (a dry run)
    previous = hist.previous_series_pass(passes, configuration)
    if previous is not None:
        return _from_history(ref, previous, PREVIOUS_SERIES)
    if nearest is not None and any_key:
        return _from_history(ref, nearest, NEAREST)
    if not required:
        if nearest is not None and notes is not None:
            notes.append(f"--baseline {ref}: the first night of this configuration, so no baseline: "
                         f"{_nearest(nearest, configuration)} ({ANY} compares with it; {REQUIRED} refuses a first night)")
        return None
    if nearest is not None:
        raise QualError(
            f"--baseline {ref}: no passing run of this configuration in {history_path}; {_nearest(nearest, configuration)}; "
            f"pass {ANY} to compare with it anyway, or drop {REQUIRED} to record this series' first night"
        )
    raise QualError(
        f"--baseline {ref}: no passing run of model {configuration.model} in {history_path}; "
        f"drop {REQUIRED} to record this series' first night, or pin one (`qual history baseline pin ID`)"
    )


def _nearest(nearest: hist.HistoryRun, configuration: ConfigurationKey) -> str:
    return (f"the nearest, run {nearest.id} of {nearest.created_at}, differs in "
            f"{describe_differences(configuration.differences(nearest.key))}")


def _from_history(ref: str, run: hist.HistoryRun, chosen_by: str) -> ResolvedBaseline:
    if not run.result_path:
        raise QualError(f"--baseline {ref}: run {run.id} has no result file recorded")
    path = Path(run.result_path)
    if not path.is_file():
        raise QualError(f"--baseline {ref}: run {run.id}'s result file {path} is missing (relative paths are read "
                        "from the working directory)")
    return ResolvedBaseline(ref, chosen_by, run.id, path, _load(ref, path, None, run.configuration, False))


def _load(ref: str, path: Path, configuration: ConfigurationKey | None, recorded: str | None, any_key: bool) -> Result:
    """The result at path; of a sweep's, the comparison that serves: the one a history row recorded (its configuration
    key), else the one of tonight's configuration (with --baseline-any, the nearest)."""
    try:
        loaded = load_any(path)
    except QualError as exc:
        raise QualError(f"--baseline {ref}: {exc}") from None
    if isinstance(loaded, Result):
        return loaded
    keys = {name: ConfigurationKey.of_result(result) for name, result in loaded.results()}
    if recorded is not None:
        serving = [name for name, key in keys.items() if key.key() == recorded]
    else:
        serving = [name for name, key in keys.items() if not configuration.differences(key, unknown_matches=True)]
        if not serving and any_key:
            serving = [min(keys, key=lambda name: len(configuration.differences(keys[name])))]
    if not serving:
        raise QualError(f"--baseline {ref}: {path} is a sweep's result ({SWEEP_SCHEMA}) and none of its candidates "
                        f"({', '.join(keys)}) is this run's configuration: give another run, or {ANY}")
    return loaded.result(serving[0])


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def mismatches(baseline: Result, arms: dict[str, ArmConfig], fingerprint: str, request_ids: Sequence[str]) -> list[str]:
    """What the baseline does not share with tonight's run; empty: it can be its baseline.

    Must match, per arm: the model (profile name), the sampling (temperature, seed, max_tokens) and K; for the
    run: the corpus fingerprint, and some request tonight replays must be in the baseline (the comparison runs on
    the requests both ran: another --limit of the same corpus).
    The engine, its build, the parallel layout, dtype, device and checkpoint paths may differ (`differences`).
    """
    found: list[str] = []

    def note(text: str) -> None:
        if text not in found:
            found.append(text)

    if baseline.corpus.fingerprint != fingerprint:
        note(f"corpus fingerprint: baseline {_short(baseline.corpus.fingerprint)} ({baseline.corpus.name}), "
             f"this run {_short(fingerprint)}")
    for arm in ARMS:
        b, t = baseline.arms[arm].config, arms[arm].to_json()
        for key in _MATCHED:
            if key == "sampling":
                bs, ts = b.get("sampling") or {}, t["sampling"]
                for field in sorted(set(bs) | set(ts)):
                    if bs.get(field) != ts.get(field):
                        note(f"sampling {field}: baseline {bs.get(field)}, this run {ts.get(field)}")
            elif b.get(key) != t[key]:
                note(f"{key}: baseline {_short(b.get(key))}, this run {_short(t[key])}")
    ran = [a for a in ARMS if baseline.arms[a].runnable and baseline.arms[a].per_request]
    if not ran:
        note("neither of the baseline's arms ran")
    for arm in ran:  # another selection of the corpus is compared on the requests both ran: there must be some
        have = {r.id for r in baseline.arms[arm].per_request}
        if request_ids and not any(i in have for i in request_ids):
            note(f"none of this run's {len(request_ids)} requests is in the baseline's {arm} arm")
    return found


def check_match(b: ResolvedBaseline, arms: dict[str, ArmConfig], fingerprint: str, request_ids: Sequence[str]) -> None:
    """Raise QualError (exit 2, one line naming each difference) if the baseline cannot serve tonight's run."""
    found = mismatches(b.result, arms, fingerprint, request_ids)
    if found:
        raise QualError(f"--baseline {b.ref}: {b.describe()} does not match this run: {'; '.join(found)}")


def _flatten(d, prefix: str = "", depth: int = 2) -> dict:
    """Keys two levels deep (extra.tokenizer, sampling.seed): an engine's profile section (extra.vllm) is one value."""
    if isinstance(d, dict) and d and depth > 0:
        out: dict = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k), depth - 1))
        return out
    return {prefix: d}


def differences(baseline: Result, tonight: dict[str, dict], engine_versions: dict[str, str]) -> list[dict]:
    """The config keys (and engine version) in which each of tonight's arms differs from the baseline's: shown."""
    rows = []
    for arm in ARMS:
        b = {**_flatten(baseline.arms[arm].config), "engine_version": baseline.arms[arm].engine_version}
        t = {**_flatten(tonight[arm]), "engine_version": engine_versions.get(arm)}
        # the engine's own profile section (extra.<engine>.*) last: it differs whenever the engine does
        for key in sorted(set(b) | set(t), key=lambda k: (k.startswith("extra."), k)):
            if b.get(key, _ABSENT) != t.get(key, _ABSENT):
                rows.append({"arm": arm, "key": key, "baseline": b.get(key, _ABSENT), "tonight": t.get(key, _ABSENT)})
    return rows


_ABSENT = "(absent)"
