"""End to end with the real command lines: a Hugging Face Llama (4 heads, 2 KV heads, SwiGLU,
RMSNorm, RoPE base 500000 with Llama 3.1's scaling, untied; vocabulary 300 padded to 384) with
its fast tokenizer is imported, fine-tuned 20 steps with --sft (conversations packed with loss
masks) under T=2 + --sequence-parallel x Chimera D=2 (4 gloo ranks) with the printed flags and
HuggingFaceTokenizer, starting from exactly transformers' loss (each conversation alone, the mean
over the global batch's trained tokens), exported, and loaded by transformers with our trained
logits."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.data.sft_dataset import build_sft_datasets
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.inference.loader import load_model
from megatron_chimera.training.sft_reference import write_sft_dataset
from tests.helpers.flags import without_flags
from tests.helpers.hf_models import save_llama, transformers

from .launcher import launch, launch_forked, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

RUN = ("--seq-length 32 --micro-batch-size 1 --global-batch-size 8 --lr 1e-2 --train-iters 20 "
       "--sft --split 100,0,0 --num-workers 0 --eval-iters 0 --log-interval 1 "
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


def _hf_sft_loss(hf, dataset) -> float:
    """transformers' loss of the first global batch: every conversation alone, the masked
    per-token losses summed over the batch's trained tokens."""
    total, trained = 0.0, 0.0
    with torch.no_grad():
        for docs, lengths in dataset.samples[:8]:
            for doc, n in zip(docs, lengths):
                ids = torch.from_numpy(dataset.text.get(doc, 0, n).astype(np.int64))[None]
                mask = torch.from_numpy(dataset.masks.get(doc, 1, n - 1).astype(np.float64))
                logits = hf(input_ids=ids[:, :-1]).logits[0].double()
                total += float((F.cross_entropy(logits, ids[0, 1:], reduction="none")
                                * mask).sum())
                trained += float(mask.sum())
    return total / trained


@pytest.mark.timeout(400)
def test_import_train_t2_chimera_export(tmp_path):
    hf = save_llama(tmp_path / "hf", "llama", seed=5, vocab_size=300)
    data = write_sft_dataset(str(tmp_path / "chat"), 200, 300, (4, 32), seed=3)
    out = ok(launch("tools/checkpoint/convert.py",
                    ["import-hf", "--hf-dir", str(tmp_path / "hf"), "--save",
                     str(tmp_path / "ckpt")]))
    flags = _printed_flags(out.stdout)
    assert "--tokenizer-type" in flags and "HuggingFaceTokenizer" in flags
    # 4 forked ranks (the world, not torchrun, is what is tested here)
    ok(launch_forked("pretrain_gpt2.py", [*flags, *RUN, "--data-path", data, "--load",
                                          str(tmp_path / "ckpt"), "--save",
                                          str(tmp_path / "trained"), "--tensorboard-dir",
                                          str(tmp_path / "tb")], 4, timeout=300))
    losses = scalars(tmp_path / "tb", "lm loss")
    assert sorted(losses) == list(range(1, 21)) and losses[20] < losses[1]
    tokenizer = build_tokenizer("HuggingFaceTokenizer",
                                tokenizer_model=str(tmp_path / "ckpt/tokenizer/huggingface"))
    first = build_sft_datasets(data, "100,0,0", [8, 0, 0], 32, 1234, tokenizer.eod, log=False)[0]
    assert abs(losses[1] - _hf_sft_loss(hf, first)) <= 1e-5 * losses[1]
    ok(launch("tools/checkpoint/convert.py",
              ["export-hf", "--load", str(tmp_path / "trained"), "--hf-dir",
               str(tmp_path / "out")]))
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    ours = load_model(str(tmp_path / "trained")).model
    tokens = torch.from_numpy(np.stack([first[i]["text"][:16] for i in range(3)]))
    with torch.no_grad():
        theirs = exported(input_ids=tokens).logits
        mine = ours(tokens, torch.arange(16).expand(3, 16))[..., :300]
        before = hf(input_ids=tokens).logits
    assert (mine - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert (before - theirs).abs().max() > 1e-2  # training moved the weights
