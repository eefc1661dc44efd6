"""Per-sample fields of a packed GPT sample, computed in the DataLoader workers.

A GPT sample is ``seq_length + 1`` tokens cut across document boundaries; the model reads
``tokens = text[:-1]`` and predicts ``labels = text[1:]``. Megatron's flags decide, from the
end-of-document (EOD) tokens among ``tokens``:

* ``--eod-mask-loss``: no loss at positions whose *input* token is EOD (Megatron masks
  ``tokens == eod``, so the prediction that crosses into the next document is not trained);
* ``--reset-position-ids``: position ids restart at 0 after every EOD;
* ``--reset-attention-mask``: a token attends only to earlier tokens of its own document; an EOD
  belongs to the document it ends. Represented by ``document_ids`` (the number of EODs before
  each position), never by an ``s x s`` mask: the model builds per-document attention from it.

:class:`GPTSampleDataset` adds the fields in ``__getitem__``, so the work runs in the workers and
the main process only stacks fixed-shape arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LtorOptions:
    """Megatron's left-to-right sample options and the tokenizer's EOD id."""

    eod_token: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False


def ltor_sample_fields(text: np.ndarray, options: LtorOptions) -> dict[str, np.ndarray]:
    """``loss_mask`` (float32), ``position_ids`` (int64) and, with ``reset_attention_mask``,
    ``document_ids`` (int32) of the ``len(text) - 1`` input tokens of one sample."""
    tokens = np.asarray(text)[:-1]
    seq = tokens.shape[0]
    is_eod = tokens == options.eod_token
    loss_mask = np.ones(seq, dtype=np.float32)
    if options.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # document of position j = number of EOD tokens strictly before j
    document_ids = np.zeros(seq, dtype=np.int32)
    np.cumsum(is_eod[:-1], out=document_ids[1:])
    positions = np.arange(seq, dtype=np.int64)
    if options.reset_position_ids:
        starts = np.concatenate(([0], np.flatnonzero(is_eod) + 1)).astype(np.int64)
        positions = positions - starts[document_ids]
    fields = {"loss_mask": loss_mask, "position_ids": positions}
    if options.reset_attention_mask:
        fields["document_ids"] = document_ids
    return fields


class GPTSampleDataset(torch.utils.data.Dataset):
    """A dataset of ``{"text"}`` GPT samples plus their :func:`ltor_sample_fields`."""

    def __init__(self, dataset: torch.utils.data.Dataset, options: LtorOptions) -> None:
        self.dataset = dataset
        self.options = options

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = dict(self.dataset[idx])
        sample.update(ltor_sample_fields(sample["text"], self.options))
        return sample
