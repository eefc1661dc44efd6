"""Hugging Face interchange: import -> our logits equal transformers' (GPT-2, Megatron-BERT), the
padded vocabulary takes no probability mass, export -> from_pretrained -> equal logits, tokenizer
files, and one clear error for every broken input. The reference is transformers' own model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_chimera.checkpoint.checkpointing import (
    CheckpointContents,
    StageSlice,
    save_checkpoint,
)
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.checkpoint.saved_args import check_model_matches_checkpoint
from megatron_chimera.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
)
from megatron_chimera.data.tokenizers import build_tokenizer
from megatron_chimera.hf.common import HFError
from megatron_chimera.hf.convert import export_hf, import_hf
from megatron_chimera.hf.tensor_formats import (
    fused_qkv_from_megatron,
    fused_qkv_to_megatron,
    qkv_from_megatron,
    qkv_to_megatron,
)
from megatron_chimera.inference.loader import build_model, load_model, load_tokenizer
from megatron_chimera.model.family import BERT, GPT2
from megatron_chimera.optimizer import get_megatron_optimizer
from tests.helpers import REPO_ROOT
from tests.helpers.hf_models import reload_gpt2, save_bert, save_gpt2, transformers, write_bpe_files

FAMILY = {"gpt": GPT2, "bert": BERT}  # the variants' family prefixes

ROOT = REPO_ROOT
TOL = 1e-4
SEQ, BATCH = 16, 3


def gpt_logits(model, tokens):
    return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))


def random_tokens(vocab: int, seed: int = 1, batch: int = BATCH, seq: int = SEQ):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- layouts
def test_qkv_per_head_layout_round_trips_and_is_interleaved():
    heads, h = 3, 6  # head_dim 2
    q, k, v = (torch.randn(h, 5) for _ in range(3))
    qkv = qkv_to_megatron(q, k, v, heads)
    # head 1's rows are [q_1 | k_1 | v_1], each head_dim rows
    assert torch.equal(qkv[6:8], q[2:4]) and torch.equal(qkv[8:10], k[2:4])
    assert torch.equal(qkv[10:12], v[2:4])
    assert all(torch.equal(a, b) for a, b in zip(qkv_from_megatron(qkv, heads), (q, k, v)))
    fused = torch.cat([q, k, v])
    assert torch.equal(fused_qkv_from_megatron(fused_qkv_to_megatron(fused, heads), heads), fused)
    assert not torch.equal(fused_qkv_to_megatron(fused, heads), fused)  # a plain copy is wrong
    bias = torch.randn(3 * h)
    assert torch.equal(fused_qkv_from_megatron(fused_qkv_to_megatron(bias, heads), heads), bias)


# ----------------------------------------------------------------------------- GPT-2 import
@pytest.mark.parametrize("variant", ["tied-gelu_new", "untied-gelu"])
def test_gpt2_import_gives_hf_logits_and_loss(tmp_path, variant):
    tied, act = variant.split("-")
    hf = save_gpt2(tmp_path / "hf", vocab_size=300, tie_word_embeddings=tied == "tied",
                   activation_function=act)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), verify=True)
    assert result.agreement.max_abs_logit_diff <= TOL and result.agreement.loss_diff <= 1e-5
    assert result.model_config.padded_vocab_size == 384  # 300 padded to a multiple of 128
    assert result.model_config.gelu == ("megatron" if act == "gelu_new" else "erf")
    ours = load_model(str(tmp_path / "ckpt")).model
    tokens, labels = random_tokens(300), random_tokens(300, seed=2)
    with torch.no_grad():
        out = hf(input_ids=tokens)
        logits = gpt_logits(ours, tokens)
        loss = ours(tokens, torch.arange(SEQ).expand(BATCH, SEQ), labels=labels)
    assert (logits[..., :300] - out.logits).abs().max() <= TOL
    assert torch.isneginf(logits[..., 300:]).all()  # padding ids take no probability mass
    hf_loss = F.cross_entropy(out.logits.reshape(-1, 300), labels.reshape(-1))
    assert abs(loss.mean().item() - hf_loss.item()) <= 1e-5
    # unmasked zero-logit padding columns would move the loss well beyond the tolerance
    unmasked = torch.cat([logits[..., :300], torch.zeros(BATCH, SEQ, 84)], dim=-1)
    moved = F.cross_entropy(unmasked.reshape(-1, 384), labels.reshape(-1))
    assert abs(moved.item() - hf_loss.item()) > 1e-3


def test_gpt2_import_from_pytorch_bin_and_shards(tmp_path):
    hf = save_gpt2(tmp_path / "hf")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    # the original GPT-2 files: no "transformer." prefix, causal-mask buffers among the weights
    legacy = {k.removeprefix("transformer."): v for k, v in state.items()}
    legacy.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(4)})
    for name, prepare in (("bin", lambda d: torch.save(state, d / "pytorch_model.bin")),
                          ("legacy", lambda d: torch.save(legacy, d / "pytorch_model.bin")),
                          ("sharded", lambda d: hf.save_pretrained(d, max_shard_size="40KB"))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        prepare(folder)
        if name == "sharded":
            assert (folder / "model.safetensors.index.json").is_file()
        import_hf(str(folder), str(tmp_path / f"ckpt-{name}"))
        ours = load_model(str(tmp_path / f"ckpt-{name}")).model
        tokens = random_tokens(300)
        with torch.no_grad():
            diff = (gpt_logits(ours, tokens)[..., :300] - hf(input_ids=tokens).logits).abs().max()
        assert diff <= TOL, name


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_import_then_export_returns_the_same_tensors(tmp_path, ckpt_format):
    save_gpt2(tmp_path / "hf", tokenizer=True)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                       make_vocab_size_divisible_by=64, ckpt_format=ckpt_format)
    written = [p.name for p in Path(result.checkpoint).iterdir()]  # default: torch_dist
    assert (".metadata" in written) == (ckpt_format == "torch_dist"), written
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    from safetensors.torch import load_file
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    for name in original:
        assert torch.equal(original[name], exported[name]), name


# ----------------------------------------------------------------------------- BERT import
@pytest.mark.parametrize("variant", ["pretraining-gelu", "maskedlm-gelu_new"])
def test_megatron_bert_import_gives_hf_logits(tmp_path, variant):
    kind, act = variant.split("-")
    hf = save_bert(tmp_path / "hf", vocab_size=90, pretraining=kind == "pretraining",
                   hidden_act=act)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert result.family is BERT and result.model_config.padded_vocab_size == 128
    assert result.model_config.gelu == ("erf" if act == "gelu" else "tanh")
    ours = load_model(str(tmp_path / "ckpt")).model
    tokens = random_tokens(90)
    padding = torch.ones(BATCH, SEQ)
    padding[1, SEQ - 5:] = 0
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, SEQ // 2:] = 1
    with torch.no_grad():
        lm_logits, sop_logits = ours(tokens, padding, tokentype_ids=types)
        out = hf(input_ids=tokens, attention_mask=padding.long(), token_type_ids=types)
    theirs = out.prediction_logits if kind == "pretraining" else out.logits
    keep = padding.bool()
    assert (lm_logits[..., :90][keep] - theirs[keep]).abs().max() <= TOL
    assert torch.isneginf(lm_logits[..., 90:]).all()
    if kind == "pretraining":
        assert (sop_logits - out.seq_relationship_logits).abs().max() <= TOL
    else:
        assert sop_logits is None


# ----------------------------------------------------------------------------- export
def train_config(model: ModelConfig, data: DataConfig | None = None) -> dict:
    return dataclasses.asdict(TrainConfig(
        model=model, parallel=ParallelConfig(), optimizer=OptimizerConfig(),
        data=data or DataConfig(), training=TrainingConfig(), checkpoint=CheckpointConfig(),
        logging=LoggingConfig()))


def write_our_checkpoint(path, family: str, model_config: ModelConfig,
                         data: DataConfig | None = None, seed: int = 3):
    """A checkpoint as one-process training writes it, from a perturbed random model (the
    multi-stage case is the functional Chimera test's)."""
    from tests.helpers.hf_models import perturb_
    model = perturb_(build_model(FAMILY[family], model_config), seed, std=0.1)
    layers = (0, model_config.num_layers)
    save_checkpoint(str(path), CheckpointContents(5, [StageSlice(0, layers, model)], [layers],
                                                  args=train_config(model_config, data),
                                                  save_optim=False), rank=0, world_size=1)
    return model


@pytest.mark.parametrize("variant", ["gpt-tied", "gpt-untied", "bert-erf", "bert-tanh-nohead"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, variant):
    family = variant.split("-")[0]
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32,
                         vocab_size=200, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                         attention_dropout=0.0,
                         untie_embeddings_and_output_weights=variant == "gpt-untied",
                         gelu={"bert-erf": "erf", "bert-tanh-nohead": "tanh"}.get(variant,
                                                                                  "megatron"),
                         bert_binary_head=variant != "bert-tanh-nohead")
    model = write_our_checkpoint(tmp_path / "ckpt", family, config).eval()
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result.agreement.max_abs_logit_diff <= TOL and result.agreement.loss_diff <= 1e-5
    tokens = random_tokens(200)
    cls = {"gpt": transformers.GPT2LMHeadModel,
           "bert": (transformers.MegatronBertForMaskedLM if variant.endswith("nohead")
                    else transformers.MegatronBertForPreTraining)}[family]
    hf, info = cls.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    with torch.no_grad():
        if family == "gpt":
            ours, theirs = gpt_logits(model, tokens), hf(input_ids=tokens).logits
        else:
            types = torch.zeros_like(tokens)
            if model.num_tokentypes:
                types[:, SEQ // 2:] = 1
            ours, _ = model(tokens, torch.ones(BATCH, SEQ),
                            tokentype_ids=types if model.num_tokentypes else None)
            out = hf(input_ids=tokens, token_type_ids=types)
            theirs = out.logits if variant.endswith("nohead") else out.prediction_logits
    assert theirs.shape[-1] == 200
    assert (ours[..., :200] - theirs).abs().max() <= TOL


def test_export_of_megatron_gelu_bert_warns_and_measures(tmp_path):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                         vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)
    write_our_checkpoint(tmp_path / "ckpt", "bert", config)
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert any("GeLU" in note for note in result.notes)
    assert result.agreement.max_abs_logit_diff > TOL  # the measured, reported difference is real


def test_export_writes_tokenizer_files_transformers_reads(tmp_path):
    write_bpe_files(tmp_path / "tok")
    data = DataConfig(tokenizer_type="GPT2BPETokenizer",
                      vocab_file=str(tmp_path / "tok/vocab.json"),
                      merge_file=str(tmp_path / "tok/merges.txt"))
    ours_tok = build_tokenizer("GPT2BPETokenizer", vocab_file=data.vocab_file,
                               merge_file=data.merge_file)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                         vocab_size=ours_tok.vocab_size, hidden_dropout=0.0,
                         attention_dropout=0.0)
    write_our_checkpoint(tmp_path / "ckpt", "gpt", config, data)
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= set(result.files)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the king shall speak, and the fool laughs"
    assert hf_tok(text)["input_ids"] == ours_tok.tokenize(text)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == ours_tok.eod


def test_wordpiece_round_trip(tmp_path):
    save_bert(tmp_path / "hf", vocab_size=90, tokenizer=True)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert result.tokenizer.tokenizer_type == "BertWordPieceLowerCase"
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = load_tokenizer(load_model(str(tmp_path / "ckpt")))
    text = "The Queen shall answer"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.tokenize(text)


# ----------------------------------------------------------------------------- release / flags
def test_imported_checkpoint_loads_with_a_fresh_optimizer(tmp_path):
    save_gpt2(tmp_path / "hf")
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model = build_model(GPT2, result.model_config)
    from megatron_chimera.config import OptimizerConfig as Opt
    optimizer = get_megatron_optimizer(Opt(lr=1e-3), [model])
    target = CheckpointTarget([StageSlice(0, (0, 4), model)], 1, optimizer)
    loaded = load_checkpoint(str(tmp_path / "ckpt"), target, rank=0,
                             world_size=4)  # plain --load, no flags
    assert loaded.iteration == 0 and loaded.consumed_train_samples == 0
    assert all(not state for state in optimizer.optimizer.state.values())
    hf = reload_gpt2(tmp_path / "hf")
    torch.testing.assert_close(model.language_model.embedding.position_embeddings.weight,
                               hf.transformer.wpe.weight)


def test_training_flags_must_match_the_imported_model(tmp_path):
    save_bert(tmp_path / "hf", vocab_size=90)
    result = import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    good = result.model_config
    check_model_matches_checkpoint(str(tmp_path / "ckpt"), good)
    for change, flag in ((dict(layernorm_epsilon=1e-5), "--layernorm-epsilon"),
                         (dict(gelu="megatron"), "--gelu"),
                         (dict(num_layers=2), "--num-layers")):
        with pytest.raises(ConfigError, match=flag):
            check_model_matches_checkpoint(str(tmp_path / "ckpt"),
                                           dataclasses.replace(good, **change))


# ----------------------------------------------------------------------------- errors
def _broken_dirs(tmp_path):
    good = tmp_path / "good"
    save_gpt2(good)
    config = (good / "config.json").read_text()
    weights = (good / "model.safetensors").read_bytes()

    def make(name, files):
        folder = tmp_path / name
        folder.mkdir()
        for file, data in files.items():
            (folder / file).write_bytes(data if isinstance(data, bytes) else data.encode())
        return folder

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.bin"
    torch.save({"h.0.attn.c_attn.weight": Evil()}, evil)
    return {
        "missing-dir": (tmp_path / "nope", "not a directory"),
        "no-config": (make("no-config", {"model.safetensors": weights}), "no config.json"),
        "corrupt-config": (make("corrupt-config", {"config.json": "{oops",
                                                   "model.safetensors": weights}),
                           "not valid JSON"),
        "no-weights": (make("no-weights", {"config.json": config}), "no weights"),
        "truncated": (make("truncated", {"config.json": config,
                                         "model.safetensors": weights[:len(weights) // 2]}),
                      "corrupt or truncated safetensors"),
        "pickle": (make("pickle", {"config.json": config,
                                   "pytorch_model.bin": evil.read_bytes()}),
                   "not a weights-only state dict"),
        "model-type": (make("model-type", {"config.json": config.replace('"gpt2"', '"falcon"'),
                                           "model.safetensors": weights}),
                       "model_type 'falcon' is not supported"),
        "missing-tensor": (make("missing-tensor", {
            "config.json": config.replace('"n_layer": 4', '"n_layer": 5'),
            "model.safetensors": weights}), "missing tensor 'transformer.h.4.ln_1.weight'"),
    }


def test_broken_hf_directories_give_one_clear_error(tmp_path, capfd):
    for name, (folder, message) in _broken_dirs(tmp_path).items():
        with pytest.raises(HFError, match=message):
            import_hf(str(folder), str(tmp_path / f"ckpt-{name}"))
    assert "pwned" not in capfd.readouterr().out  # the pickle's code never ran


def test_convert_cli_reports_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/checkpoint/convert.py"), "import-hf", "--hf-dir",
         str(tmp_path / "nope"), "--save", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: --hf-dir {tmp_path / 'nope'}: not a directory"], proc.stderr


def test_import_refuses_an_existing_checkpoint(tmp_path):
    save_gpt2(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    with pytest.raises(HFError, match="already holds a checkpoint"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    with pytest.raises(HFError, match="exceeds the model's n_positions"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "c2"), max_position_embeddings=64)
