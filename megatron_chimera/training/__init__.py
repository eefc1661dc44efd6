"""The driver (Megatron's ``megatron/training/``): flags -> frozen configs, initialisation, the
training loop, its monitor, health checks and per-rank error reporting.

* :mod:`.arguments` -- Megatron's flags parsed into :class:`~megatron_chimera.config.TrainConfig`.
* :mod:`.config_checks` -- cross-flag checks, run on every rank before any process group.
* :mod:`.flag_catalog` -- which Megatron-LM flags are accepted, refused, and why.
* :mod:`.initialize` -- torch.distributed, the process groups, the seeds.
* :mod:`.setup` -- the named steps that build a run: stages, optimizer, checkpoint, executors.
* :mod:`.training` -- ``pretrain``: the loop, evaluation, checkpoint cadence.
* :mod:`.exit_conditions` -- early exits agreed by the ranks: --exit-interval,
  --exit-signal-handler (SIGTERM), --exit-duration-in-mins.
* :mod:`.measured_costs` -- profile-guided pieces: ``--partition-method time``, the measured
  stage costs kept in checkpoints, the schedule rebuilt from them.
* :mod:`.monitor` -- log lines, TensorBoard, timers. :mod:`.health` -- NaN/Inf and skipped
  iterations. :mod:`.preflight` -- outputs and splits checked before the first iteration.
* :mod:`.rank_errors` / :mod:`.process` -- one error line per failure, the others name it.

The entry scripts import :func:`pretrain`, :func:`pretrain_from_flags` and :func:`run_main` from
here.
"""

from megatron_chimera.training.rank_errors import run_main
from megatron_chimera.training.training import pretrain, pretrain_from_flags

__all__ = ["pretrain", "pretrain_from_flags", "run_main"]
