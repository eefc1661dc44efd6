"""Checkpoints: saving and loading a run's state on any layout, and what a checkpoint records.

* :mod:`.checkpointing` -- ``save_checkpoint(CheckpointContents)``: model, optimizer, scheduler
  and RNG state, published atomically; :mod:`.loading` -- its mirror
  ``load_checkpoint(CheckpointTarget)`` into any layout; :mod:`.stages` -- a rank's stages as
  checkpoints see them (global names).
* :mod:`.sharded` -- the ``torch_dist`` format: every rank writes and reads only its pieces;
  :mod:`.dcp_io` -- chunked tensor I/O through ``torch.distributed.checkpoint``;
  :mod:`.safe_reader` -- its reader: no pickle executed, every block's CRC checked;
  :mod:`.chunks` -- where a rank's piece lies in the full tensor.
* :mod:`.async_save` -- ``--async-save``: written in the background while training goes on.
* :mod:`.host_memory` -- peak host memory of a save or a load.
* :mod:`.saved_args` -- the model arguments a checkpoint records, checked against the run.
* :mod:`.tokenizer_record` -- the tokenizer settings a checkpoint records and its copied files.
"""
