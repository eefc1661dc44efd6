"""The pipeline runtime: runs a rank's schedule (IR) with real stage modules over torch.distributed.

* :mod:`.topology` -- where this rank sits (pipeline rank, data-parallel rank, peers' global ranks
  and p2p groups), injected into the executor.
* :mod:`.p2p` -- the messages of an iteration (derived from the schedule's dependency rule) and
  their posting.
* :mod:`.executor` -- one executor for every schedule (F, B, W actions).
* :mod:`.grad_sync` -- eager, globally ordered gradient reduction over stage replicas.
* :mod:`.failures` -- first-failure reporting through the c10d store.
* :mod:`.emulated` -- stages that sleep instead of computing, for benchmarks.
"""
