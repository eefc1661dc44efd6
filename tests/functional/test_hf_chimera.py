"""End to end with the real command lines: a Hugging Face GPT-2 is imported (vocabulary 300
padded to 384), trained 3 steps under Chimera D=4 (4 gloo ranks) starting from exactly HF's loss,
exported, loaded by transformers with equal logits, and used by generate_text.py and evaluate.py
(checked against transformers on the exported weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.data.gpt_dataset import MockGPTDataset
from megatron_chimera.data.indexed_dataset import IndexedDatasetBuilder
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.inference.loader import load_model
from tests.helpers.hf_models import reload_gpt2, save_gpt2

from .launcher import launch, launch_forked, scalars

pytestmark = [pytest.mark.functional, pytest.mark.slow]

MODEL = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 8 --lr 1e-2 "
         "--train-iters 3 --mock-data --hidden-dropout 0 --attention-dropout 0 --num-workers 0 "
         "--eval-iters 0 --log-interval 1 --distributed-timeout-minutes 1").split()
CHIMERA = ["--pipeline-model-parallel-size", "4", "--chimera-pipes", "2"]


def ok(result):
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Import, train under Chimera D=4, export; returns the paths and the original HF model."""
    root = tmp_path_factory.mktemp("hf-chimera")
    hf = save_gpt2(root / "hf", vocab_size=300, seed=11, tokenizer=True)
    out = ok(launch("tools/checkpoint/convert.py",
                    ["import-hf", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt")]))
    assert "train it with: pretrain_gpt2.py" in out.stdout and "--gelu" not in out.stdout
    assert "verified against transformers" in out.stdout
    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer",
                       "--vocab-file", str(root / "ckpt/tokenizer/vocab.json"),
                       "--merge-file", str(root / "ckpt/tokenizer/merges.txt")]
    # 4 forked ranks (the world, not torchrun, is what is tested here)
    train = ok(launch_forked("pretrain_gpt2.py",
                             [*MODEL, *CHIMERA, *tokenizer_flags,
                              "--load", str(root / "ckpt"), "--save", str(root / "trained"),
                              "--tensorboard-dir", str(root / "tb")], 4, timeout=240))
    assert "loaded checkpoint" in train.stdout
    ok(launch("tools/checkpoint/convert.py",
              ["export-hf", "--load", str(root / "trained"), "--hf-dir", str(root / "out")]))
    return root, hf, tokenizer_flags


def test_training_starts_from_hf_loss_and_export_loads_in_transformers(trained):
    root, hf, _ = trained
    losses = scalars(root / "tb", "lm loss")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    # iteration 1's loss is the imported weights' loss on the first global batch: HF's
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(root / "hf/vocab.json"),
                                merge_file=str(root / "hf/merges.txt"))
    assert tokenizer.vocab_size == 300  # model 300 -> padded 384, tokenizer 300: masks agree
    data = MockGPTDataset("train", 8, 32, tokenizer.vocab_size, tokenizer.eod, 1234)
    text = torch.tensor(np.stack([data[i]["text"] for i in range(8)]))
    with torch.no_grad():
        logits = hf(input_ids=text[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, 300), text[:, 1:].reshape(-1)).item()
    assert abs(losses[1] - hf_loss) <= 1e-5 * hf_loss
    # the export loads in transformers and computes what our trained checkpoint computes
    exported = reload_gpt2(root / "out")
    ours = load_model(str(root / "trained")).model
    tokens = text[:3, :16]
    with torch.no_grad():
        theirs = exported(input_ids=tokens).logits
        mine = ours(tokens, torch.arange(16).expand(3, 16))[..., :300]
        before = hf(input_ids=tokens).logits
    assert (mine - theirs).abs().max() <= 1e-4
    assert (theirs - before).abs().max() > 1e-2  # training changed the weights


def test_training_with_other_model_flags_is_rejected(trained):
    root, _, tokenizer_flags = trained
    result = launch("pretrain_gpt2.py", [*MODEL, *tokenizer_flags, "--gelu", "erf",
                                         "--load", str(root / "ckpt")])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and "was saved from a different model: --gelu: megatron in the checkpoint, " \
        "erf now" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_generate_text_cli_equals_transformers_greedy(trained):
    root, _, _ = trained
    result = ok(launch("tools/generate_text.py",
                       ["--load", str(root / "trained"), "--prompt", "the king shall",
                        "--max-new-tokens", "8", "--greedy", "--ignore-eod",
                        "--output-file", str(root / "gen.jsonl")]))
    record = json.loads((root / "gen.jsonl").read_text())
    assert "the king shall" in result.stdout and record["completion"] in result.stdout
    exported = reload_gpt2(root / "out")
    prompt = record["prompt_tokens"]
    with torch.no_grad():
        ref = exported.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert record["tokens"] == ref[0, len(prompt):].tolist()
    (root / "prompts.txt").write_text("the queen\n\nthe fool\n")
    sampled = ok(launch("tools/generate_text.py",
                        ["--load", str(root / "trained"), "--prompt", "", "--prompt-file",
                         str(root / "prompts.txt"), "--max-new-tokens", "5", "--temperature",
                         "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "7"]))
    assert sampled.stdout.count("--- sample") == 3 and "seed 7" in sampled.stdout
    bad = launch("tools/generate_text.py", ["--load", str(root / "trained"), "--prompt", "x",
                                            "--max-new-tokens", "3", "--greedy", "--top-k", "3"])
    assert bad.returncode == 2 and "error: --top-k cannot be combined with --greedy" in bad.stderr


def test_evaluate_cli_perplexity_and_lambada(trained):
    root, _, _ = trained
    text = "the king shall speak and the queen shall answer while the fool laughs"
    (root / "eval.txt").write_text(text)
    ok(launch("tools/evaluate.py", ["--load", str(root / "trained"), "--text-file",
                                    str(root / "eval.txt"), "--json", str(root / "ppl.json")]))
    result = json.loads((root / "ppl.json").read_text())
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(root / "hf/vocab.json"),
                                merge_file=str(root / "hf/merges.txt"))
    ids = tokenizer.tokenize(text)
    assert len(ids) <= 32 and result["tokens_scored"] == len(ids) - 1
    exported = reload_gpt2(root / "out")
    with torch.no_grad():
        logits = exported(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = F.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert abs(result["nll_mean"] - expected) <= 1e-5
    # the same tokens as a .bin/.idx dataset give the same perplexity
    builder = IndexedDatasetBuilder(str(root / "doc.bin"), dtype=np.uint16)
    builder.add_item(ids)
    builder.end_document()
    builder.finalize(str(root / "doc.idx"))
    ok(launch("tools/evaluate.py", ["--load", str(root / "trained"), "--data-path",
                                    str(root / "doc"), "--json", str(root / "ppl2.json")]))
    assert json.loads((root / "ppl2.json").read_text())["perplexity"] == result["perplexity"]
    (root / "lambada.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in
                  ["the king shall speak", "the queen shall answer", "the fool laughs"]) + "\n")
    out = ok(launch("tools/evaluate.py", ["--load", str(root / "trained"), "--lambada",
                                          str(root / "lambada.jsonl"), "--json",
                                          str(root / "lambada.json")]))
    lambada = json.loads((root / "lambada.json").read_text())
    assert lambada["examples"] == 3 and 0.0 <= lambada["accuracy"] <= 1.0
    assert "LAMBADA" in out.stdout
