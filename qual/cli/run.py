"""`qual run`: control (DCP 1) vs candidate (DCP N) on the same corpus, gated; or a sweep of candidates against one
control (`--dcp 2,4 --draft-kv replicated,sharded`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from qual.cli.crash import crash_report
from qual.cli.main import EXIT_GATE_FAILED, app
from qual.cli.outputs import check_before_work, claim_fresh_dir, leftovers_only
from qual.cli.verdict import print_speedup, print_sweep_verdict, print_verdict, print_warnings
from qual.configuration import describe_differences
from qual.engines.registry import ENGINES, get_engine
from qual.errors import EngineError, InternalError, QualError
from qual.files import DirectoryLock
from qual.options import (DEFAULT_DCP, DEFAULT_DEVICE, DEFAULT_DRAFT_KV, DEFAULT_DSA_TOPK, DEFAULT_ENGINE,
                          DEFAULT_NUMERICS, DEFAULT_TEMPERATURE, DEVICES, DRAFT_KV_MODES, DSA_TOPK_MODES, DTYPES,
                          NUMERICS, SHARDED)
from qual.paths import DEFAULT_HISTORY, origin
from qual.shown import safe
from qual.userfiles import check_path_name


# The panels of `qual run --help`, in the order a reader needs them
WHAT = "What runs"
KNOBS = "Engine knobs"
CORPUS = "The corpus"
GATE = "Gate and baseline"
OUTPUTS = "Outputs"
ATTACH = "Servers already running (--engine attach)"


def _choices(values) -> str:
    return "|".join(values)


@app.command("run")
def run_command(
    ctx: typer.Context,
    model: str = typer.Option("toy", "--model", metavar="NAME|FILE", rich_help_panel=WHAT, help="Model profile: a name "
                              "(configs/models/NAME.yaml, looked for in $QUAL_ROOT, the checkout, the package) or a "
                              "YAML file. It says which target and drafter, and how they run (engine, device, TP)."),
    target: Optional[str] = typer.Option(None, "--target", metavar="DIR", rich_help_panel=WHAT, help="Target "
                                         "checkpoint directory, in place of the profile's (and its tokenizer's, unless "
                                         "the profile names a local one)."),
    draft: Optional[str] = typer.Option(None, "--draft", metavar="DIR", rich_help_panel=WHAT,
                                        help="Drafter checkpoint directory, in place of the profile's."),
    engine: Optional[str] = typer.Option(None, "--engine", metavar=_choices(ENGINES), rich_help_panel=WHAT,
                                         help=f"What runs the arms (default: attach where --control-url/--candidate-url "
                                         f"are given, else the profile's engine, else {DEFAULT_ENGINE}: qual's "
                                         "embedded runtime)."),
    device: Optional[str] = typer.Option(None, "--device", metavar=_choices(DEVICES), rich_help_panel=WHAT,
                                         help=f"Where the arms run (default: the profile's, else {DEFAULT_DEVICE}); on "
                                         "cuda one GPU a TP rank."),
    dcp: Optional[str] = typer.Option(None, "--dcp", metavar="N[,N...]", rich_help_panel=WHAT, help="Candidate DCP "
                                      f"size (default: the profile's, else {DEFAULT_DCP}); the control is DCP 1. A list "
                                      "(2,4) sweeps: one candidate per value, the control run once."),
    tp: Optional[int] = typer.Option(None, "--tp", metavar="N", rich_help_panel=WHAT, help="TP size of both arms "
                                     "(default: the profile's, else TP follows --dcp: --dcp 3 runs TP 3; a sweep's "
                                     "control: its candidates' largest)."),
    speedup: bool = typer.Option(False, "--speedup", rich_help_panel=WHAT, help="Also run the candidate's "
                                 "configuration without the drafter (plain decoding) and report decode tokens/s with "
                                 "and without speculation, their ratio with a paired interval, and the "
                                 "acceptance-implied bound."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar=_choices(DTYPES), rich_help_panel=KNOBS,
                                        help="Floating-point type the arms compute in (default: the profile's)."),
    draft_kv: Optional[str] = typer.Option(None, "--draft-kv", metavar=f"{_choices(DRAFT_KV_MODES)}[,...]",
                                           rich_help_panel=KNOBS, help=f"The drafter's KV cache under DCP (default "
                                           f"{DEFAULT_DRAFT_KV}: the fix; {SHARDED}: the legacy bug; a list sweeps)."),
    dsa_topk: Optional[str] = typer.Option(None, "--dsa-topk", metavar=f"{_choices(DSA_TOPK_MODES)}[,...]",
                                           rich_help_panel=KNOBS, help=f"Sparse-attention targets under DCP (default "
                                           f"{DEFAULT_DSA_TOPK}: the global top-k; union: each rank's local top-k; a "
                                           "list sweeps)."),
    numerics: Optional[str] = typer.Option(None, "--numerics", metavar=_choices(NUMERICS), rich_help_panel=KNOBS,
                                           help=f"How a GLM-5 target computes (default: the profile's, else "
                                           f"{DEFAULT_NUMERICS}: as written; vllm: as vLLM's kernels compute it; "
                                           "vllm-hopper: with DeepGEMM's power-of-two scales too; docs/glm5.md)."),
    temperature: float = typer.Option(DEFAULT_TEMPERATURE, "--temperature", metavar="T", rich_help_panel=KNOBS,
                                      help="0: greedy (the drafter is always greedy); above 0 the target samples, "
                                      "seeded by --seed."),
    seed: int = typer.Option(0, "--seed", metavar="N", rich_help_panel=KNOBS, help="Seeds sampling and the paired "
                             "bootstrap's resamples."),
    corpus: Optional[str] = typer.Option(None, "--corpus", metavar="NAME|FILE", rich_help_panel=CORPUS,
                                         help="Corpus: a name (humaneval, mt-bench, gsm8k, smoke: `qual corpus list`) "
                                         "or a JSONL file (default: the profile's)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", metavar="FILE", rich_help_panel=CORPUS,
                                                help="A Jinja chat template file to render the corpus's chat rows "
                                                "with, in place of the tokenizer's own."),
    limit: Optional[int] = typer.Option(None, "--limit", metavar="N", rich_help_panel=CORPUS, help="Replay the "
                                        "corpus's first N rows: requests of a prompt corpus, conversations of a chat "
                                        "corpus (each of their turns a request; mt-bench's rows go category by "
                                        "category, so its first N are the first categories)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", metavar="N", rich_help_panel=CORPUS,
                                             help="Most new tokens a request generates (default: the row's, else the "
                                             "profile's)."),
    gate: Optional[str] = typer.Option(None, "--gate", metavar="NAME|FILE", rich_help_panel=GATE, help="Gate rules: a "
                                       "shipped gate's name (nightly, the default; nightly-baseline) or a YAML file."),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", metavar="REF", rich_help_panel=GATE, help="Also compare each arm with an earlier run: a run "
        "directory or result.json, a history id, or history:last-pass (the run pinned for this series, else its newest "
        "passing run, else the series before it's; none: a first night)."),
    baseline_any: bool = typer.Option(False, "--baseline-any", rich_help_panel=GATE, help="Let a baseline of another "
                                      "configuration key serve (another checkpoint, layout, selection...); the "
                                      "differences are recorded."),
    baseline_required: bool = typer.Option(False, "--baseline-required", rich_help_panel=GATE, help="With --baseline "
                                           "history:last-pass: a series with nothing to compare with is exit 2 (else "
                                           "its first night runs the paired gate alone and becomes its baseline if it "
                                           "passes)."),
    meta: Optional[list[str]] = typer.Option(None, "--meta", metavar="KEY=VALUE", rich_help_panel=OUTPUTS,
                                             help="A label of this night (a deployment commit, a CI run's URL, a "
                                             "cluster), repeatable: recorded in result.json, the history and the "
                                             "reports."),
    axis: str = typer.Option("date", "--axis", metavar="date|engine|qual|meta:KEY", rich_help_panel=OUTPUTS,
                             help="With --baseline: what the report's strip of this series' recorded nights runs along, "
                             "as `qual history trend --axis`: date, engine (its version), qual (version and commit) or "
                             "meta:KEY."),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", rich_help_panel=OUTPUTS, help="Output directory, "
                                      "new or empty (default ./reports/<time>-<model>-dcp<N>/)."),
    history: Optional[str] = typer.Option(None, "--history", metavar="FILE", rich_help_panel=OUTPUTS,
                                          help=f"History database (default ./{DEFAULT_HISTORY})."),
    quiet: bool = typer.Option(False, "--quiet", "-q", rich_help_panel=OUTPUTS, help="No progress on stderr (the "
                               "verdict, warnings and errors still print)."),
    dry_run: bool = typer.Option(False, "--dry-run", rich_help_panel=OUTPUTS, help="Print both arms, and what this "
                                 "machine lacks for them, and change nothing."),
    resume: Optional[Path] = typer.Option(None, "--resume", metavar="DIR", rich_help_panel=OUTPUTS,
                                          help="Finish an interrupted run in DIR."),
    control_url: Optional[str] = typer.Option(None, "--control-url", metavar="URL", rich_help_panel=ATTACH,
                                              help="The running control server (an OpenAI-compatible vLLM server qual "
                                              "did not start)."),
    candidate_url: Optional[str] = typer.Option(None, "--candidate-url", metavar="URL", rich_help_panel=ATTACH,
                                                help="The running candidate server."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", metavar="NAME[,NAME]", rich_help_panel=ATTACH,
                                              help="Environment variable holding the servers' API key (NAME, or "
                                              "CONTROL_NAME,CANDIDATE_NAME)."),
    exclusive: bool = typer.Option(False, "--exclusive", rich_help_panel=ATTACH, help="The servers serve this run "
                                   "alone, so /metrics counter diffs are one request's (needed where a server sends no "
                                   "per-request metrics)."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", metavar="N", rich_help_panel=ATTACH,
                                                  help="Requests in flight per server (default 1)."),
) -> None:
    """Replay one corpus through control and candidate, compare acceptance, apply the gate."""
    from qual.cli.progress import RunProgress
    from qual.harness.error_night import record_error_night
    from qual.harness.execute import execute, resume_command
    from qual.harness.inputs import check_unchanged
    from qual.harness.plan import load_plan, make_plan, run_options
    from qual.report.junit import gate_suite, sweep_suite

    lock = None
    if resume is not None:
        _refuse_flags_beside_resume(ctx)
        check_path_name(resume, "--resume")
        if not dry_run and resume.is_dir():
            lock = DirectoryLock(resume, "--resume")  # a second resume of this run is refused at once
        saved = load_plan(resume)  # run.json validated key by key: a bad one is exit 2 naming file and key
        plan = make_plan(saved.options, dry_run=dry_run, run_id=saved.run_id, render_time=saved.render_time)
        plan.notes = [*saved.notes, *plan.notes]
        plan.journals_sealed = saved.journals_sealed  # a run begun before journals were sealed keeps unsealed lines
        plan.out_dir = resume
        if plan.corpus_info["fingerprint"] != saved.fingerprint:
            raise QualError(f"--resume {resume}: the corpus changed since the run started (fingerprint differs)")
        if not dry_run:
            check_unchanged(saved.inputs, plan.inputs, resume)
    else:
        options = run_options(model=model, target=target, draft=draft, dcp=dcp, tp=tp, engine=engine, corpus=corpus,
                              chat_template=chat_template, limit=limit,
                              max_tokens=max_tokens, draft_kv=draft_kv, temperature=temperature, seed=seed, gate=gate,
                              out=out, history=history, device=device, dtype=dtype,
                              dsa_topk=dsa_topk, numerics=numerics, baseline=baseline, baseline_any=baseline_any,
                              baseline_required=baseline_required, meta=meta, axis=axis, control_url=control_url,
                              candidate_url=candidate_url, api_key_env=api_key_env, exclusive=exclusive,
                              max_concurrency=max_concurrency, speedup=speedup)
        plan = make_plan(options, dry_run=dry_run)
    for note in plan.notes:
        print(f"warning: {safe(note)}", file=sys.stderr)
    if dry_run:
        _print_dry_run(plan)
        return
    progress = RunProgress({arm: f"{arm} (dcp {c.dcp}, tp {c.tp})" for arm, c in plan.arms.items()}, quiet=quiet)
    if resume is None and plan.options.out is None:  # the default, named by the second: never another run's
        plan.out_dir = claim_fresh_dir(plan.out_dir, "--out")
    if resume is None and plan.out_dir.is_dir() and any(plan.out_dir.iterdir()):
        if not leftovers_only(plan.out_dir):  # a run killed while it wrote run.json left only a temporary file
            raise QualError(f"--out {plan.out_dir} is not empty (use --resume to finish a run there)")
    check_before_work(plan.out_dir, plan.history_path)
    lock = lock or DirectoryLock(plan.out_dir, "--out")
    first = plan.arms[plan.candidates[0]]
    # a sweep that ends without a verdict (exit 3 or 4) has one suite for its error: qual.gate.<model>.sweep
    suite = sweep_suite(first.model, "sweep") if plan.is_sweep else gate_suite(first.model, first.dcp)
    try:
        # From here on a bug's traceback goes to <out>/crash.txt, and exits 3 and 4 leave a junit.xml naming the cause.
        with crash_report(plan.out_dir, suite):
            with progress:
                result, _, ids = execute(plan, progress)
    except KeyboardInterrupt as exc:
        print(f"finish the run with: {resume_command(plan.out_dir)}", file=sys.stderr)
        record_error_night(plan, exc)
        raise
    except (QualError, EngineError, InternalError) as exc:
        record_error_night(plan, exc)  # a night without a verdict still leaves its row and summary.md
        raise
    finally:
        lock.release()
    with crash_report(plan.out_dir, suite):
        if plan.is_sweep:
            print_sweep_verdict(result, plan.out_dir)
        else:
            print_warnings(result)
            print_verdict(result, "control", "candidate", plan.out_dir, ids[0], plan.history_path)
            print_speedup(result)
    if not (result.passed if plan.is_sweep else result.gate.passed):  # a sweep: the worst of its candidates' verdicts
        raise typer.Exit(EXIT_GATE_FAILED)


def _refuse_flags_beside_resume(ctx: typer.Context) -> None:
    """--resume repeats the recorded run: every other flag would be ignored, so one given is refused by name."""
    given = [p for p in ctx.command.params if p.name not in ("resume", "dry_run", "quiet")
             and getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") != "DEFAULT"]
    if given:
        flag = max(given[0].opts, key=len)
        raise QualError(f"{flag} with --resume: a resumed run repeats what its run.json records; drop {flag}")


def baseline_match(b) -> str:
    """How the baseline relates to this run's configuration key (a ResolvedBaseline)."""
    from qual.baseline import PREVIOUS_SERIES

    if not b.key_differences:
        return "the same configuration"
    how = "the series before this one" if b.chosen_by == PREVIOUS_SERIES else "taken with --baseline-any"
    return f"another configuration, {how}: {describe_differences(b.key_differences)}"


def _print_dry_run(plan) -> None:
    from qual.result import FIRST_NIGHT

    print(f"# dry run: nothing is started or written (out would be {plan.out_dir})")
    count, total = plan.corpus_info["count"], len(plan.request_ids) or plan.corpus_info["count"]
    shown = f"{count} rows, {total} requests over their turns" if total != count else f"{count} requests"
    print(f"# corpus {plan.corpus_info['name']}: {shown}, {plan.corpus_info['fingerprint']}")
    for what, path in (("profile", plan.profile_path), ("gate", plan.gate_path), ("corpus", plan.corpus_info["path"])):
        print(f"# {what} file: {path} ({origin(path)})")
    print(f"# runs with {plan.how}")
    if plan.prompts is not None:
        print(f"# chat template: {plan.prompts.template.source} ({plan.prompts.template.sha256})")
    engine = get_engine(plan.engine)
    for arm, config in plan.arms.items():
        print(f"{arm}: {engine.describe(config)}")
    for problem in plan.lacking:
        print(f"# this machine lacks: {problem}")
    if plan.baseline is not None:
        print(f"# baseline: {plan.baseline.describe()}; {baseline_match(plan.baseline)}")
    elif plan.first_night:
        print(f"# baseline: none yet: {FIRST_NIGHT}")
