"""Checkpoints: saving and loading a run's state on any layout, and what a checkpoint records.

* :mod:`.checkpointing` -- save / load of model, optimizer, scheduler and RNG state, published
  atomically.
* :mod:`.saved_args` -- the model arguments a checkpoint records, checked against the run.
* :mod:`.tokenizer_record` -- the tokenizer settings a checkpoint records and its copied files.
"""
