"""The shipped toy pair's DCP 1 / TP 1 control arm, run as `qual run` runs an arm (qual.harness: plan, then one arm),
and request-by-request comparison of two arms' results (the vLLM fidelity tests)."""

from pathlib import Path

from qual.harness.execute import run_arm
from qual.harness.plan import RunOptions, make_plan


def toy_control_arm(out: Path, engine: str, limit: int):
    """The first `limit` HumanEval prompts, greedy, written under `out`: (run info, results in corpus order)."""
    plan = make_plan(RunOptions(model="toy", dcp=1, tp=1, engine=engine, corpus="humaneval", limit=limit,
                                temperature=0.0, out=str(out)))
    assert len(plan.requests) == limit and plan.arms["control"].dcp == 1 and plan.arms["control"].tp == 1
    plan.out_dir.mkdir(parents=True)
    info, results, _ = run_arm(plan, "control")
    return info, [results[r.id] for r in plan.requests]


def acceptance_rate(results) -> float:
    return sum(r.accepted_tokens for r in results) / sum(r.draft_tokens for r in results)


def differences(a, b, fields) -> list[str]:
    """'id: field a vs b' for every field of every request pair that differs (a and b in the same order)."""
    return [f"{x.id}: {f} {getattr(x, f)} vs {getattr(y, f)}" for x, y in zip(a, b, strict=True) for f in fields
            if getattr(x, f) != getattr(y, f)]
