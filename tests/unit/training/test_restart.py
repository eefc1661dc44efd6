"""In-job restart: a restarted attempt resumes from --save and says what was lost."""

from __future__ import annotations

import pytest

from megatron_chimera.errors import UserError
from megatron_chimera.training.restart import (
    KILL_ENV,
    injected_kill,
    may_restart,
    record_progress,
    recorded_progress,
    restart_count,
    restart_load,
    restart_report,
    save_interval_advice,
)


def test_a_restarted_attempt_loads_save_and_the_first_does_not():
    first = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1"}
    again = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}
    assert restart_count(first) == 0 and restart_count(again) == 1
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2 and restart_count({}) == 0
    assert restart_load(None, "ck", first) is None
    assert restart_load(None, "ck", again) == "ck"
    assert restart_load("other", "ck", again) == "other"  # an explicit --load wins
    assert restart_load(None, None, again) is None
    assert may_restart(first) and may_restart({"SLURM_RESTART_COUNT": "0"})
    assert not may_restart({"TORCHELASTIC_MAX_RESTARTS": "0"}) and not may_restart({})


def test_the_report_names_the_lost_iterations(tmp_path):
    assert recorded_progress(str(tmp_path)) is None
    for iteration in range(1, 8):  # the first attempt died after iteration 7
        record_progress(str(tmp_path), iteration)
    assert recorded_progress(str(tmp_path)) == 7
    line = restart_report(1, str(tmp_path), 5, recorded_progress(str(tmp_path)))
    assert line == (f" restart 1 of this job: resuming from iteration 5 of {tmp_path}; the "
                    "previous attempt finished iteration 7, so 2 iterations since the "
                    "checkpoint are lost and run again")
    assert "scratch" in restart_report(1, "ck", None, 3) and "3 iterations" in \
        restart_report(1, "ck", None, 3)


def test_the_injected_kill_fires_in_the_first_attempt_only():
    assert injected_kill({}) is None
    assert injected_kill({KILL_ENV: "1:7"}) == (1, 7)
    assert injected_kill({KILL_ENV: "1:7", "TORCHELASTIC_RESTART_COUNT": "1"}) is None
    with pytest.raises(UserError, match="RANK:ITERATION"):
        injected_kill({KILL_ENV: "rank1"})


def test_save_interval_advice_from_the_measured_cost():
    # 2 s per save, 0.5 s iterations: every 5 iterations spends 2 / 2.5 = 80% saving; 1% needs
    # 2 / (0.01 x 0.5) = 400 iterations between saves
    line = save_interval_advice(2.0, 0.5, 5)
    assert line == (" save cost: 2.00 s blocking training per save, an iteration 500 ms: "
                    "--save-interval 5 spends 80.0% of the time saving, over the 1% target "
                    "(--save-interval 400 or more meets it); a failure loses up to 5 iterations")
    assert "1.0% of the time saving, within the 1% target" in save_interval_advice(2.0, 0.5, 400)
