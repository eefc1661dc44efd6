"""Megatron-LM interchange: import a Megatron-core ``torch_dist`` or legacy ``mp_rank_*``
checkpoint into ours, and export ours as Megatron-core ``torch_dist`` (see
docs/MEGATRON_CHECKPOINTS.md). Works without Megatron installed."""
