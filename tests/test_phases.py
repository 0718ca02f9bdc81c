"""Phase times: a diagnostic that changes nothing computed and leaves no host time of generate unaccounted."""

import pytest

from qual.errors import QualError
from qual.runtime.phases import PHASES
from runtime_helpers import run


def test_phase_times_change_nothing_and_account_for_all_of_generate(tiny_pair):
    target, draft = tiny_pair
    plain, _ = run(target, draft, dcp=2, tp=2, phase_times=False)
    timed, _ = run(target, draft, dcp=2, tp=2, phase_times=True)
    assert [(r.output_token_ids, r.accepted_per_position) for r in timed] == \
        [(r.output_token_ids, r.accepted_per_position) for r in plain]


def test_phase_record_sums_to_the_generate_wall_time(tiny_pair):
    from qual.runtime.config import CacheConfig, EngineConfig, ParallelConfig, SamplingParams
    from qual.runtime.engine import LLMEngine
    from runtime_helpers import prompts

    target, draft = tiny_pair
    cfg = EngineConfig(str(target), str(draft), ParallelConfig(1, 1, 1), CacheConfig(block_size=4, memory_bytes=2**22),
                       dtype="float64", phase_times=True)
    with LLMEngine(cfg) as engine:
        out = engine.generate(prompts(), SamplingParams(max_tokens=20))
        rec = engine.phase_times()
    assert set(rec["seconds"]) == set(PHASES)
    # every decode step of every request is one engine step (the batch decodes together, rows leave as they finish)
    assert 0 < rec["decode_steps"] <= sum(r.drafts for r in out)
    assert rec["decode_steps"] >= max(r.drafts for r in out)
    assert sum(rec["seconds"].values()) == pytest.approx(rec["wall_s"], rel=1e-9, abs=1e-9)
    assert rec["seconds"]["draft"] > 0 and rec["seconds"]["verify"] > 0 and rec["seconds"]["prefill"] > 0


def test_phase_times_are_off_unless_asked_and_a_bad_value_is_refused(monkeypatch):
    from qual.engines.reference import PHASE_TIMES_ENV, phase_times_on

    monkeypatch.delenv(PHASE_TIMES_ENV, raising=False)
    assert phase_times_on() is False
    monkeypatch.setenv(PHASE_TIMES_ENV, "1")
    assert phase_times_on() is True
    monkeypatch.setenv(PHASE_TIMES_ENV, "yes")
    with pytest.raises(QualError, match="QUAL_PHASE_TIMES='yes': expected 1"):
        phase_times_on()
