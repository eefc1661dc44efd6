"""End to end with the real command lines: a legacy Megatron-LM Llama-like checkpoint (T=2 x P=2
files, 2 query groups, SwiGLU, RoPE, untied) is imported with ``convert.py import-megatron``,
trained one step by ``pretrain_gpt2.py`` (1F1B, one process) with the printed model flags, whose
first loss equals transformers' Llama built from the *Megatron* tensors (fp32, 1e-5 relative) and
the first loss of Chimera D=2 (2 gloo ranks) from the same import (1e-6 relative) and of T=2 (2
gloo ranks; the split matmuls and vocabulary-parallel cross entropy sum in another order: 1e-5
relative), then exported with ``export-megatron`` and re-imported with the trained weights
bitwise."""

from __future__ import annotations

import runpy
import shlex

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.data.gpt_dataset import MockGPTDataset
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.inference.loader import load_model
from tests.helpers import REPO_ROOT
from tests.helpers.flags import without_flags
from tests.helpers.megatron_checkpoints import write_checkpoint
from tests.unit.megatron_lm.test_import_export import llama_reference

from .launcher import launch, launch_forked, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RUN = ("--seq-length 16 --micro-batch-size 1 --global-batch-size 2 --lr 1e-2 --train-iters 1 "
       "--mock-data --vocab-size 127 --num-workers 0 --eval-iters 0 --log-interval 1").split()


def ok(result):
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


def convert(*argv: str) -> None:
    """``tools/checkpoint/convert.py argv`` in this process (its ``main``)."""
    runpy.run_path(str(REPO_ROOT / "tools/checkpoint/convert.py"))["main"](list(argv))


@pytest.mark.timeout(300)
def test_import_megatron_train_export(tmp_path, capsys):
    args, tensors = write_checkpoint(tmp_path / "megatron", "llama", "legacy", 2, 2)
    convert("import-megatron", "--load", str(tmp_path / "megatron"), "--save",
            str(tmp_path / "ckpt"))
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("train it with:"))
    flags = without_flags(shlex.split(line.split("pretrain_gpt2.py", 1)[1].rstrip(". ")),
                          {"--load", "--seq-length"})
    ok(launch("pretrain_gpt2.py", [*flags, *RUN, "--load", str(tmp_path / "ckpt"), "--save",
                                   str(tmp_path / "trained"), "--tensorboard-dir",
                                   str(tmp_path / "tb")], nproc=1, timeout=200))
    loss = scalars(tmp_path / "tb", "lm loss")[1]
    # the 2-rank worlds are forked ranks (the world, not torchrun, is what is tested here)
    ok(launch_forked("pretrain_gpt2.py",
                     [*flags, *RUN, "--load", str(tmp_path / "ckpt"),
                      "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
                      "--tensorboard-dir", str(tmp_path / "tb_chimera")], 2, timeout=200))
    assert abs(scalars(tmp_path / "tb_chimera", "lm loss")[1] - loss) <= 1e-6 * loss
    ok(launch_forked("pretrain_gpt2.py",
                     [*flags, *RUN, "--load", str(tmp_path / "ckpt"),
                      "--tensor-model-parallel-size", "2", "--tensorboard-dir",
                      str(tmp_path / "tb_tp")], 2, timeout=200))
    tp_loss = scalars(tmp_path / "tb_tp", "lm loss")[1]
    assert abs(tp_loss - loss) <= 1e-5 * loss
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=127)  # + eod: 128 ids
    data = MockGPTDataset("train", 2, 16, tokenizer.vocab_size, tokenizer.eod, 1234)
    text = torch.tensor(np.stack([data[i]["text"] for i in range(2)]))
    with torch.no_grad():
        logits = llama_reference(args, tensors)(input_ids=text[:, :-1]).logits
    reference = F.cross_entropy(logits.reshape(-1, 128), text[:, 1:].reshape(-1)).item()
    assert abs(loss - reference) <= 1e-5 * reference
    convert("export-megatron", "--load", str(tmp_path / "trained"), "--save",
            str(tmp_path / "out"))
    convert("import-megatron", "--load", str(tmp_path / "out"), "--save", str(tmp_path / "again"))
    trained = load_model(str(tmp_path / "trained")).model.state_dict()
    again = load_model(str(tmp_path / "again")).model.state_dict()
    assert all(torch.equal(trained[k], again[k]) for k in trained)
    first = load_model(str(tmp_path / "ckpt")).model.state_dict()
    assert not torch.equal(first["language_model.output_layer.weight"],
                           trained["language_model.output_layer.weight"])
