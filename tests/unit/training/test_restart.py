"""In-job restart: a restarted attempt resumes from --save and says what was lost."""

from __future__ import annotations

from megatron_chimera.training.restart import (
    may_restart,
    record_progress,
    recorded_progress,
    restart_count,
    restart_load,
    restart_report,
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
