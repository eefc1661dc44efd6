"""End to end with the real command lines: a Hugging Face Llama (4 heads, 2 KV heads, SwiGLU,
RMSNorm, RoPE base 500000 with Llama 3.1's scaling, untied; vocabulary 300 padded to 384) with
its fast tokenizer is imported, trained 3 steps under T=2 + --sequence-parallel x Chimera D=2 (4
gloo ranks) with the printed flags and HuggingFaceTokenizer, starting from exactly transformers'
loss, exported, and loaded by transformers with our trained logits."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.data.gpt_dataset import MockGPTDataset
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.inference.loader import load_model
from tests.helpers.flags import without_flags
from tests.helpers.hf_models import save_llama, transformers

from .launcher import launch, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RUN = ("--seq-length 32 --micro-batch-size 1 --global-batch-size 8 --lr 1e-2 --train-iters 3 "
       "--mock-data --num-workers 0 --eval-iters 0 --log-interval 1 "
       "--distributed-timeout-minutes 1 --tensor-model-parallel-size 2 --sequence-parallel "
       "--pipeline-model-parallel-size 2 --pipeline-schedule chimera").split()


def ok(result):
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


def _printed_flags(stdout: str) -> list[str]:
    """The model and tokenizer flags of import-hf's "train it with:" line."""
    line = next(x for x in stdout.splitlines() if x.startswith("train it with:"))
    words = shlex.split(line.split("pretrain_gpt2.py", 1)[1].rstrip(". "))
    return without_flags(words, {"--load", "--seq-length"})  # given by the test


@pytest.mark.timeout(400)
def test_import_train_t2_chimera_export(tmp_path):
    hf = save_llama(tmp_path / "hf", "llama", seed=5, vocab_size=300)
    out = ok(launch("tools/checkpoint/convert.py",
                    ["import-hf", "--hf-dir", str(tmp_path / "hf"), "--save",
                     str(tmp_path / "ckpt")]))
    flags = _printed_flags(out.stdout)
    assert "--tokenizer-type" in flags and "HuggingFaceTokenizer" in flags
    ok(launch("pretrain_gpt2.py", [*flags, *RUN, "--load", str(tmp_path / "ckpt"), "--save",
                                   str(tmp_path / "trained"), "--tensorboard-dir",
                                   str(tmp_path / "tb")], nproc=4, timeout=300))
    losses = scalars(tmp_path / "tb", "lm loss")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    tokenizer = build_tokenizer("HuggingFaceTokenizer",
                                tokenizer_model=str(tmp_path / "ckpt/tokenizer/huggingface"))
    data = MockGPTDataset("train", 8, 32, tokenizer.vocab_size, tokenizer.eod, 1234)
    text = torch.tensor(np.stack([data[i]["text"] for i in range(8)]))
    with torch.no_grad():
        logits = hf(input_ids=text[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, 300), text[:, 1:].reshape(-1)).item()
    assert abs(losses[1] - hf_loss) <= 1e-5 * hf_loss
    ok(launch("tools/checkpoint/convert.py",
              ["export-hf", "--load", str(tmp_path / "trained"), "--hf-dir",
               str(tmp_path / "out")]))
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    ours = load_model(str(tmp_path / "trained")).model
    tokens = text[:3, :16]
    with torch.no_grad():
        theirs = exported(input_ids=tokens).logits
        mine = ours(tokens, torch.arange(16).expand(3, 16))[..., :300]
        before = hf(input_ids=tokens).logits
    assert (mine - theirs).abs().max() < 1e-4
    assert (before - theirs).abs().max() > 1e-2  # training moved the weights
