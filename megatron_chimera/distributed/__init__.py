"""Data parallelism (Megatron's ``core.distributed``): the gradient buffers and their reduction
over each stage's replicas; the optimizers that step them live in :mod:`megatron_chimera.optimizer`.

* :mod:`.grad_buffer` -- contiguous gradient (and parameter) buffers cut into buckets, and the
  distributed optimizer's shard groups.
* :mod:`.grad_sync` -- eager, globally ordered bucket reduction over the stage-replica groups.
* :mod:`.data_parallel` -- what a rank's stage modules get: buffers, synchronizer, shard groups,
  the grad-norm filter.
"""
