"""The pipeline runtime: runs a rank's schedule (IR) with real stage modules over torch.distributed.

* :mod:`.executor` -- one executor for every schedule (F, B, W actions); :func:`~.executor.
  make_transport` picks the transport.
* :mod:`.program` -- a rank's lowered list compiled once into the steps the executor runs.
* :mod:`.p2p` -- the receives and sends of an iteration, pooled receive buffers.
* :mod:`.transport` -- how messages move (torch.distributed); :mod:`.nccl_semantics` -- the same
  under NCCL's rules on gloo, for the tests.
* :mod:`.topology` -- where this rank sits (pipeline rank, data-parallel rank, peers' global ranks
  and p2p groups), injected into the executor.
* :mod:`.failures` -- first-failure reporting through the c10d store.
* :mod:`.profiling` -- ``--profile-iterations``: measured F, B, W per stage, agreed on by the
  ranks, and the schedule rebuilt from them (the torch-free rebuild and the trace format are
  :mod:`megatron_chimera.schedules.measured`).
* :mod:`.trace` -- where a traced iteration's time goes between compute actions;
  :mod:`.chrome_trace` -- ``--pipeline-trace``: the measured timeline as a Chrome/Perfetto trace;
  :mod:`.hang` -- who waits for whom when an iteration stops moving (timeout, SIGUSR1).
* :mod:`.emulated` -- stages that wait instead of computing, for benchmarks;
  :mod:`.torch_pipelining` -- torch's schedules on them, for comparison.

Gradient reduction over the stage replicas lives in :mod:`megatron_chimera.distributed`.
"""
