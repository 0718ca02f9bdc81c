"""Replay a plan through its arms (resuming finished work), then compare, gate, report and record.

A single run has two arms, control and candidate; a sweep the control and each of its candidates (qual.harness.sweep),
each compared with the one control: one Result per candidate, one SweepResult holding them all."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from qual import shown
from qual.checkpoints.config import read_config, vocab_size
from qual.engines.registry import get_engine
from qual.records import ArmConfig, ArmRunInfo, EngineBuild, EngineRequest, GraphCapture, RequestResult
from qual.errors import QualError
from qual.files import WriteError, write_text
from qual.harness import sweep
from qual.harness.journal import Journal, journal_path, read_journal
from qual.harness.plan import PLAN_FILE, RunPlan
from qual.harness.turns import later_turns, wave
from qual.history import HistoryLocked, configuration_runs, record_run
from qual.report import write_reports
from qual.harness.build import build_result
from qual.harness.speedup import PLAIN_ARM
from qual.result import CorpusInfo, Result
from qual.sweep_result import SweepResult
from qual.userfiles import read_json

TREND_RUNS = 20  # earlier runs of the configuration the baseline section's trend strip shows

# What the harness can observe of a run, in order: an arm starts (its engine starts, then its first requests run: a
# prefill is not seen apart from decoding), its requests finish one by one, the arm ends; after both, the reports.
STARTING, DECODING, DONE, REPORTS = "starting", "decoding", "done", "reports"


@dataclass(frozen=True, slots=True)
class ArmProgress:
    """One arm at a phase change or a finished request; REPORTS (arm "run") is the run's last phase."""

    arm: str
    phase: str          # STARTING | DECODING | DONE | REPORTS
    done: int           # requests finished, journaled ones of an earlier piece included
    total: int
    resumed: int        # of `done`, those journaled before this process started the arm
    accepted_tokens: int
    draft_tokens: int


Progress = Callable[[ArmProgress], None]


def info_path(out_dir: Path, arm: str) -> Path:
    return out_dir / f"{arm}.arm.json"


def _save_info(out_dir: Path, arm: str, info: ArmRunInfo) -> None:
    write_text(info_path(out_dir, arm), json.dumps(asdict(info), indent=2))


def _load_info(out_dir: Path, arm: str) -> ArmRunInfo | None:
    p = info_path(out_dir, arm)
    if not p.exists():
        return None
    try:
        data = read_json(p, what="arm record")
        data["graph_capture"] = GraphCapture(**data["graph_capture"])
        if data.get("build") is not None:
            data["build"] = EngineBuild.from_json(data["build"])
        info = ArmRunInfo(**data)
    except (KeyError, TypeError, ValueError) as exc:
        raise QualError(f"{p}: unreadable arm record ({type(exc).__name__}: {exc})") from None
    if not all(isinstance(x, (int, float)) and x >= 0 for x in (info.wall_seconds, info.output_tokens)):
        raise QualError(f"{p}: wall_seconds and output_tokens must be numbers >= 0")
    return info


def check_matched(plan: RunPlan, arm: str, results: dict[str, RequestResult],
                  planned: list[EngineRequest] | None = None) -> None:
    """Matched replay is verified: every arm saw exactly the planned prompt token ids (of a later turn: the ones
    the arm's own earlier answers gave, `planned`)."""
    planned = plan.requests if planned is None else planned
    for req in planned:
        got = results.get(req.id)
        if got is None:
            raise QualError(f"arm {arm}: request {req.id} has no result")
        if tuple(got.prompt_token_ids) != tuple(req.prompt_token_ids):
            raise QualError(f"arm {arm}: request {req.id} replayed different prompt token ids than planned (corpus or tokenizer changed?)")
    missing = [rid for rid in plan.request_ids or [r.id for r in planned] if rid not in results]
    if missing:
        raise QualError(f"arm {arm}: request {missing[0]} has no result")
    extra = set(results) - {r.id for r in planned}
    if extra:
        raise QualError(f"arm {arm}: results for requests not in the plan: {', '.join(sorted(extra)[:5])}")


def read_arm_journal(plan: RunPlan, arm: str) -> dict[str, RequestResult]:
    """The arm's finished requests, each record checked against the arm (its K) and against the plan: a journal
    holds only planned requests, with their planned prompts (a later turn's: the ones the journaled answers before
    it give) and at most their planned tokens (run.json and the journals describe one run)."""
    config: ArmConfig = plan.arms[arm]
    path = journal_path(plan.out_dir, arm)
    done = read_journal(path, config.num_speculative_tokens if config.draft_path else None, _vocab(config),
                        plan.journals_sealed)
    planned = {r.id: r for r in [*plan.requests, *later_turns(plan.conversations, plan.prompts, done,
                                                               plan.corpus_info["name"])]}
    for rid, rec in done.items():
        req = planned.get(rid)
        if req is None:
            raise QualError(f"{path}: request {rid} is journaled but not in the run's plan (run.json and the journal "
                            f"describe different runs)")
        if tuple(rec.prompt_token_ids) != tuple(req.prompt_token_ids) or len(rec.output_token_ids) > req.max_tokens:
            raise QualError(f"{path}: request {rid} was journaled with another prompt or more than its "
                            f"{req.max_tokens} planned tokens (run.json and the journal describe different runs)")
        if rec.category != req.category:
            raise QualError(f"{path}: request {rid} was journaled in category {rec.category!r}, planned in "
                            f"{req.category!r} (run.json and the journal describe different runs)")
    return done


def _vocab(config: ArmConfig) -> int | None:
    """The target's vocabulary size where its checkpoint is a local directory (an attached server's is not known)."""
    if not config.target_path or not (Path(config.target_path) / "config.json").is_file():
        return None
    return vocab_size(read_config(config.target_path))


def _merged(piece: ArmRunInfo, prior: ArmRunInfo | None) -> ArmRunInfo:
    """A piece of an arm (one engine run: a wave of turns, or what a resume had left) after the earlier ones: time and
    tokens add up, and each earlier piece's facts are kept (a server restarted in between may have changed)."""
    if prior is None:
        return piece
    earlier = prior.extra.get("earlier_pieces", [])
    piece.extra["earlier_pieces"] = [*earlier, {k: v for k, v in prior.extra.items() if k != "earlier_pieces"}]
    piece.wall_seconds += prior.wall_seconds
    piece.output_tokens += prior.output_tokens
    both = piece.generate_seconds is not None and prior.generate_seconds is not None
    piece.generate_seconds = piece.generate_seconds + prior.generate_seconds if both else None
    return piece


def _check_fits(config: ArmConfig, engine, requests: list[EngineRequest]) -> None:
    """A later turn, built from the arm's answers, fits the arm's context (the plan checked a bound)."""
    for r in requests:
        needed, limit = engine.context_needed(config, len(r.prompt_token_ids), r.max_tokens), engine.max_model_len(config)
        if needed > limit:
            raise QualError(f"request {r.id}: its prompt after the arm's earlier answers is {len(r.prompt_token_ids)} "
                            f"tokens; with max_tokens {r.max_tokens} it needs {needed} positions, more than the arm's "
                            f"max_model_len {limit}")


def run_arm(plan: RunPlan, arm: str, progress: Progress | None = None, done: dict[str, RequestResult] | None = None
            ) -> tuple[ArmRunInfo, dict[str, RequestResult], list[EngineRequest]]:
    """Run one arm over the requests it has not finished yet, wave by wave of turns (a later turn's prompt holds the
    arm's own earlier answers); each result is journaled as it arrives. Returns the arm's facts, its results and
    every request it was given."""
    config: ArmConfig = plan.arms[arm]
    engine = get_engine(config.engine)
    path = journal_path(plan.out_dir, arm)
    done = read_arm_journal(plan, arm) if done is None else done
    total = len(plan.request_ids) or len(plan.requests)
    info = _load_info(plan.out_dir, arm)
    resumed = len(done)
    accepted = sum(r.accepted_tokens for r in done.values())
    drafted = sum(r.draft_tokens for r in done.values())
    planned: list[EngineRequest] = []
    journal: Journal | None = None

    def report(phase: str) -> None:
        if progress:
            progress(ArmProgress(arm, phase, len(done), total, resumed, accepted, drafted))

    def on_result(res: RequestResult) -> None:
        nonlocal accepted, drafted
        req = asked[res.id]  # the turn and conversation are the harness's: stamped whatever the engine
        res.turn, res.conversation = req.turn, req.conversation
        journal.append(res)
        done[res.id] = res
        accepted += res.accepted_tokens
        drafted += res.draft_tokens
        report(DECODING)

    def run_piece(todo: list[EngineRequest]) -> ArmRunInfo:
        nonlocal journal, info
        journal = journal or Journal(path)
        report(STARTING)
        before = len(done)
        piece = engine.run(config, todo, on_result, plan.out_dir, arm)
        piece.extra.update(requests_run=len(todo), resumed_with=before)
        info = _merged(piece, info)
        _save_info(plan.out_dir, arm, info)
        return piece

    turn, batch = 1, list(plan.requests)
    try:
        while batch:
            planned += batch
            asked = {r.id: r for r in batch}
            todo = [r for r in batch if r.id not in done]
            if todo:
                _check_fits(config, engine, todo)
                if not run_piece(todo).runnable:
                    break
            turn += 1
            batch = wave(plan.conversations, plan.prompts, turn, done, plan.corpus_info["name"])
        if info is None:  # every request journaled, the arm's record not yet written: the engine's facts still count
            asked = {}
            run_piece([])
    finally:
        if journal is not None:
            journal.close()
    report(DONE)
    return info, done, planned


def execute(plan: RunPlan, progress: Progress | None = None) -> tuple[Result | SweepResult, dict[str, Path], list[int]]:
    """Every arm, then the Result (a sweep: the SweepResult), its four reports, and a history row per comparison (a
    resumed run keeps its id, so its rows are recorded once); returns the result, the reports' paths and the rows'
    history ids.

    A file that cannot be written (disk full, read-only) is exit 2 naming it and the remedy; the journals keep
    every finished request, so `--resume` after it repeats nothing. Where run.json itself was not written, nothing
    ran and there is nothing to resume: the remedy is to run the command again."""
    try:
        return _execute(plan, progress)
    except WriteError as exc:
        if not (plan.out_dir / PLAN_FILE).is_file():
            again = f"{plan.options.command(plan.engine)} {shown.command(['--out', plan.out_dir, '--history', plan.history_path])}"
            raise QualError(f"{exc}; nothing ran (no run.json to resume from): {exc.remedy}, then run it again: "
                            f"`{again}`") from None
        raise QualError(f"{exc}; finished requests are journaled in {plan.out_dir}: {exc.remedy}, then "
                        f"`{resume_command(plan.out_dir)}`") from None


def resume_command(out_dir: Path) -> str:
    """The command that finishes the run in out_dir, shell-quoted."""
    return shown.command(["qual", "run", "--resume", out_dir])


def _execute(plan: RunPlan, progress: Progress | None) -> tuple[Result | SweepResult, dict[str, Path], list[int]]:
    # the control first (it runs once, whatever the candidates), then the candidates, then --speedup's plain arm
    order = [sweep.CONTROL, *plan.candidates, *([PLAIN_ARM] if PLAIN_ARM in plan.arms else [])]
    journals = {arm: read_arm_journal(plan, arm) for arm in order}  # a bad record: refused before any arm runs
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    plan.save()
    arms = {}
    for arm in order:
        info, results, planned = run_arm(plan, arm, progress, journals[arm])
        if info.runnable:
            check_matched(plan, arm, results, planned)
        ordered = [results[rid] for rid in plan.request_ids or [r.id for r in plan.requests] if rid in results]
        info.output_tokens = sum(len(r.output_token_ids) for r in ordered)  # all pieces of a resumed arm
        arms[arm] = (plan.arms[arm], info, ordered)
    if progress:  # the comparison (its bootstrap), the reports and the history row
        progress(ArmProgress("run", REPORTS, 0, 0, 0, 0, 0))
    trend = []
    if plan.baseline is not None and plan.history_path.exists():
        trend = configuration_runs(plan.history_path, plan.configuration, limit=TREND_RUNS)
    corpus = CorpusInfo(plan.corpus_info["name"], plan.corpus_info["path"], plan.corpus_info["fingerprint"],
                        plan.corpus_info["count"])
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")  # one time for every comparison of a sweep
    results = [(name, build_result(corpus, arms[sweep.CONTROL], arms[name], plan.gate, plan.options.seed,
                                   reproduce=plan.options.command(plan.engine), created_at=created_at,
                                   baseline=plan.baseline, trend=trend, plain=arms.get(PLAIN_ARM),
                                   meta=plan.options.meta, first_night=plan.first_night,
                                   axis=plan.options.axis))
               for name in plan.candidates]
    if plan.is_sweep:
        note = sweep.tp_note(plan.arms)
        result: Result | SweepResult = SweepResult.of(results, [note] if note else [])
        rows = [(f"{plan.run_id}/{name}", r) for name, r in results]  # one history row per comparison
    else:
        result = results[0][1]
        rows = [(plan.run_id, result)]
    paths = write_reports(result, plan.out_dir, plan.history_path)
    try:
        # one write a line: a progress heartbeat from another thread never lands inside it
        ids = [record_run(plan.history_path, row, paths["json"], run_id,
                          on_wait=lambda line: sys.stderr.write(line + "\n")) for run_id, row in rows]
    except HistoryLocked as exc:
        raise QualError(f"{exc}; the run's reports are written in {plan.out_dir}: record it in the history with "
                        f"`{resume_command(plan.out_dir)}`") from None
    return result, paths, ids
