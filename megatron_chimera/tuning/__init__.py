"""Performance model and autotuner (docs/AUTOTUNER.md).

* :mod:`.hardware` -- hardware profiles (presets p100, a100, h100 or JSON) with a two-level network.
* :mod:`.analytic_costs` -- per-stage FLOPs, parameters and message sizes of GPT-2 / BERT.
* :mod:`.operators` -- a stage's compute time from its GEMM shapes and the bytes its kernels move.
* :mod:`.rank_memory` -- peak memory per pipeline rank for a schedule.
* :mod:`.perf_model` -- iteration time of a layout: the schedule simulator under a derived cost
  model (:class:`~.perf_model.PerformanceModel`).
* :mod:`.autotune` -- the search over schedules, D, W, B, N, partition and recomputation.
* :mod:`.command` -- the ``torchrun`` command of a layout.
* :mod:`.profile` -- measured stage times and ping-pong (``--profile``, ``--measure-p2p``).
* :mod:`.emulated_validation` -- predicted vs measured emulated-compute benchmark rows.
* :mod:`.published` -- throughput measured on real clusters (Narayanan et al. SC'21), as data.
* :mod:`.playground` -- the playground's reports.
"""
