"""The driver (Megatron's ``megatron/training/``): flags -> frozen configs, initialisation, the
training loop, its monitor, health checks and per-rank error reporting.

* :mod:`.arguments` -- Megatron's flags parsed into :class:`~megatron_chimera.config.TrainConfig`.
* :mod:`.config_checks` -- cross-flag checks, run on every rank before any process group.
* :mod:`.flag_catalog` -- which Megatron-LM flags are accepted, refused, and why.
* :mod:`.initialize` -- torch.distributed, the process groups, the seeds.
* :mod:`.setup` -- the named steps that build a run: stages, optimizer, checkpoint, executors.
* :mod:`.running_schedule` -- the one owner of the running schedule: both executors, the
  micro-batches this rank reads, the ramp-up's per-N cache, the profile-guided rebuild.
* :mod:`.training` -- ``pretrain``: the loop, evaluation, checkpoint cadence.
* :mod:`.exit_conditions` -- early exits agreed by the ranks: --exit-interval,
  --exit-signal-handler (SIGTERM), --exit-duration-in-mins.
* :mod:`.monitor` -- log lines, TensorBoard, timers. :mod:`.memory_report` -- the first
  iteration's memory, measured beside the prediction. :mod:`.health` -- NaN/Inf and skipped
  iterations. :mod:`.preflight` -- outputs and splits checked before the first iteration.
* :mod:`.rank_errors` / :mod:`.process` -- one error line per failure, the others name it.
* :mod:`.argument_parser` -- the argparse parser of the flags; :mod:`.scalar_writers` --
  TensorBoard / W&B writers.

The entry scripts import :func:`pretrain`, :func:`pretrain_from_flags` and :func:`run_main` from
here.
"""

from megatron_chimera.training.rank_errors import run_main
from megatron_chimera.training.training import pretrain, pretrain_from_flags

__all__ = ["pretrain", "pretrain_from_flags", "run_main"]
