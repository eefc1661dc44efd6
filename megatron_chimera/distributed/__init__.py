"""Data-parallel machinery of the runtime and the optimizer (Megatron's ``core.distributed``).

* :mod:`.grad_buffer` -- contiguous gradient (and parameter) buffers cut into buckets.
"""
