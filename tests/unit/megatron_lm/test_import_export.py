"""``import-megatron`` / ``export-megatron`` on Megatron-LM checkpoints written from known facts
(tests/helpers/megatron_checkpoints.py, checked against real megatron-core 0.16.1 output):

* every imported weight equals the source tensor bitwise, for ``torch_dist`` and legacy files at
  T=1 x P=1 and T=2 x P=2, GPT-2-like and Llama-like (grouped QKV, SwiGLU, RoPE, untied), local
  and Transformer-Engine legacy names;
* the imported model's logits equal transformers' GPT2 / Llama built from the *Megatron* tensors
  by an independent mapping written here (fp32, 1e-5: summation order only, 1e-7 observed);
* export -> import is bitwise, and the export has exactly the keys and shapes Megatron writes;
* a truncated or corrupt file, an unsupported feature and an unknown tensor are one line each;
* ``--load`` of a Megatron directory in training names the converting command.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_chimera.checkpoint.megatron_format import (
    MegatronCheckpointError,
    find_megatron_checkpoint,
    load_megatron_file,
    refuse_megatron_checkpoint,
)
from megatron_chimera.config import CheckpointConfig, ConfigError
from megatron_chimera.inference.loader import load_model
from megatron_chimera.megatron_lm.exporter import export_megatron
from megatron_chimera.megatron_lm.importer import import_megatron
from megatron_chimera.megatron_lm.torch_dist_reader import TorchDistReader
from megatron_chimera.training.config_checks import _validate_checkpoint
from tests.helpers.megatron_checkpoints import write_checkpoint

LOGIT_ATOL = 1e-5
SEQ = 12
# Megatron global name -> ours, written out for the test (not taken from the converter)
_OURS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
         "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
         "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
         "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
         "self_attention.linear_proj.weight": "self_attention.dense.weight",
         "self_attention.linear_proj.bias": "self_attention.dense.bias",
         "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
         "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
         "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
         "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
         "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
         "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias"}


def our_name(name: str) -> str:
    if name.startswith("decoder.layers."):
        index, suffix = name[len("decoder.layers."):].split(".", 1)
        return f"language_model.encoder.layers.{index}.{_OURS[suffix]}"
    return {"embedding.word_embeddings.weight": "language_model.embedding.word_embeddings.weight",
            "embedding.position_embeddings.weight":
                "language_model.embedding.position_embeddings.weight",
            "decoder.final_layernorm.weight": "language_model.encoder.final_layernorm.weight",
            "decoder.final_layernorm.bias": "language_model.encoder.final_layernorm.bias",
            "output_layer.weight": "language_model.output_layer.weight"}[name]


def _layer(tensors, i, suffix):
    return tensors[f"decoder.layers.{i}.{suffix}"]


def gpt2_reference(args: argparse.Namespace, tensors: dict[str, torch.Tensor]):
    """transformers' GPT2LMHeadModel from Megatron's tensors: per-head [q_h; k_h; v_h] rows ->
    HF's [q | k | v] columns (Conv1D stores [in, out])."""
    transformers = pytest.importorskip("transformers")
    h, heads = args.hidden_size, args.num_attention_heads
    config = transformers.GPT2Config(
        vocab_size=args.padded_vocab_size, n_positions=args.max_position_embeddings, n_embd=h,
        n_layer=args.num_layers, n_head=heads, n_inner=args.ffn_hidden_size,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=args.norm_epsilon)
    state = {"transformer.wte.weight": tensors["embedding.word_embeddings.weight"],
             "transformer.wpe.weight": tensors["embedding.position_embeddings.weight"],
             "transformer.ln_f.weight": tensors["decoder.final_layernorm.weight"],
             "transformer.ln_f.bias": tensors["decoder.final_layernorm.bias"]}
    for i in range(args.num_layers):
        p = f"transformer.h.{i}."
        qkv_w = _layer(tensors, i, "self_attention.linear_qkv.weight").view(heads, 3, -1, h)
        qkv_b = _layer(tensors, i, "self_attention.linear_qkv.bias").view(heads, 3, -1)
        state[p + "attn.c_attn.weight"] = torch.cat(
            [qkv_w[:, j].reshape(-1, h) for j in range(3)]).t()
        state[p + "attn.c_attn.bias"] = torch.cat([qkv_b[:, j].reshape(-1) for j in range(3)])
        for hf, meg in (("attn.c_proj", "self_attention.linear_proj"),
                        ("mlp.c_fc", "mlp.linear_fc1"), ("mlp.c_proj", "mlp.linear_fc2")):
            state[f"{p}{hf}.weight"] = _layer(tensors, i, meg + ".weight").t()
            state[f"{p}{hf}.bias"] = _layer(tensors, i, meg + ".bias")
        for hf, meg in (("ln_1", "self_attention.linear_qkv"), ("ln_2", "mlp.linear_fc1")):
            state[f"{p}{hf}.weight"] = _layer(tensors, i, meg + ".layer_norm_weight")
            state[f"{p}{hf}.bias"] = _layer(tensors, i, meg + ".layer_norm_bias")
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.eval()


def llama_reference(args: argparse.Namespace, tensors: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM from Megatron's tensors: rows per query group
    [q of the group; k; v] -> q/k/v_proj; linear_fc1 [gate; up] -> gate/up_proj."""
    transformers = pytest.importorskip("transformers")
    h, heads, d = args.hidden_size, args.num_attention_heads, args.kv_channels
    groups = args.num_query_groups
    config = transformers.LlamaConfig(
        vocab_size=args.padded_vocab_size, hidden_size=h, intermediate_size=args.ffn_hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=heads,
        num_key_value_heads=groups, head_dim=d, max_position_embeddings=args.seq_length,
        rms_norm_eps=args.norm_epsilon, rope_theta=float(args.rotary_base),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    state = {"model.embed_tokens.weight": tensors["embedding.word_embeddings.weight"],
             "model.norm.weight": tensors["decoder.final_layernorm.weight"],
             "lm_head.weight": tensors["output_layer.weight"]}
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        qkv = _layer(tensors, i, "self_attention.linear_qkv.weight").view(groups, -1, d, h)
        per = heads // groups
        state[p + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(-1, h)
        state[p + "self_attn.k_proj.weight"] = qkv[:, per].reshape(-1, h)
        state[p + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(-1, h)
        state[p + "self_attn.o_proj.weight"] = _layer(tensors, i,
                                                      "self_attention.linear_proj.weight")
        gate, up = _layer(tensors, i, "mlp.linear_fc1.weight").chunk(2)
        state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"] = gate, up
        state[p + "mlp.down_proj.weight"] = _layer(tensors, i, "mlp.linear_fc2.weight")
        state[p + "input_layernorm.weight"] = _layer(
            tensors, i, "self_attention.linear_qkv.layer_norm_weight")
        state[p + "post_attention_layernorm.weight"] = _layer(
            tensors, i, "mlp.linear_fc1.layer_norm_weight")
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(state, strict=False)
    return model.eval()


CASES = [("gpt", "torch_dist", 1, 1, "local"), ("gpt", "legacy", 2, 2, "local"),
         ("llama", "torch_dist", 1, 1, "local"),
         ("llama", "legacy", 2, 2, "local"), ("llama", "legacy", 2, 1, "te"),
         ("gpt", "legacy", 1, 2, "te")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def imported(request, tmp_path_factory):
    kind, fmt, tensor, pipeline, spec = request.param
    root = tmp_path_factory.mktemp(f"{kind}_{fmt}")
    args, tensors = write_checkpoint(root / "megatron", kind, fmt, tensor, pipeline, spec=spec)
    result = import_megatron(str(root / "megatron"), str(root / "ours"))
    return kind, args, tensors, result, root


def test_every_imported_weight_equals_the_source_bitwise(imported):
    _, _, tensors, result, root = imported
    ours = load_model(str(root / "ours")).model.state_dict()
    assert result.tensors == len(tensors) == len(ours)
    for name, value in tensors.items():
        assert torch.equal(ours[our_name(name)], value), name


def test_logits_equal_transformers_built_from_the_megatron_tensors(imported):
    kind, args, tensors, _, root = imported
    reference = (llama_reference if kind == "llama" else gpt2_reference)(args, tensors)
    model = load_model(str(root / "ours")).model
    tokens = torch.randint(0, args.padded_vocab_size, (2, SEQ),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens, torch.arange(SEQ).expand(2, SEQ))
        theirs = reference(input_ids=tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < LOGIT_ATOL


def test_export_has_megatrons_keys_and_round_trips_bitwise(imported, tmp_path):
    kind, args, tensors, result, root = imported
    exported = export_megatron(str(root / "ours"), str(tmp_path / "megatron"))
    reference = TorchDistReader(exported.path)
    fixture = tmp_path / "fixture"
    write_checkpoint(fixture, kind, "torch_dist")  # the same model as Megatron writes it
    expected = TorchDistReader(str(fixture / "iter_0000007")).metadata.state_dict_metadata
    got = reference.metadata.state_dict_metadata
    assert sorted(got) == sorted(expected)
    for key, meta in expected.items():
        assert getattr(got[key], "size", None) == getattr(meta, "size", None), key
    again = import_megatron(str(tmp_path / "megatron"), str(tmp_path / "again"))
    assert again.model_config == result.model_config
    first = load_model(str(root / "ours")).model.state_dict()
    second = load_model(str(tmp_path / "again")).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_truncated_or_corrupt_file_is_one_line_naming_it(tmp_path):
    write_checkpoint(tmp_path / "legacy", "gpt", "legacy", 2, 1)
    victim = tmp_path / "legacy/iter_0000007/mp_rank_01/model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:3000])
    with pytest.raises(MegatronCheckpointError, match="mp_rank_01/model_optim_rng.pt is corrupt"):
        import_megatron(str(tmp_path / "legacy"), str(tmp_path / "a"))
    write_checkpoint(tmp_path / "dist", "llama", "torch_dist")
    chunk = next((tmp_path / "dist/iter_0000007").glob("*.distcp"))
    chunk.write_bytes(chunk.read_bytes()[:-500])
    with pytest.raises(MegatronCheckpointError) as info:
        import_megatron(str(tmp_path / "dist"), str(tmp_path / "b"))
    assert chunk.name in str(info.value) and "\n" not in str(info.value)
    write_checkpoint(tmp_path / "zeroed", "llama", "torch_dist")  # same size, 4 KiB zeroed
    reader = TorchDistReader(str(tmp_path / "zeroed/iter_0000007"))  # inside the embedding
    info = next(v for k, v in reader.metadata.storage_data.items()
                if k.fqn == "embedding.word_embeddings.weight")
    chunk = tmp_path / "zeroed/iter_0000007" / info.relative_path
    data = bytearray(chunk.read_bytes())
    middle = info.offset + info.length // 2
    data[middle - 2048:middle + 2048] = bytes(4096)
    chunk.write_bytes(bytes(data))
    with pytest.raises(MegatronCheckpointError, match=f"{chunk.name} is corrupt: tensor .* CRC"):
        import_megatron(str(tmp_path / "zeroed"), str(tmp_path / "z"))
    write_checkpoint(tmp_path / "flipped", "gpt", "legacy")
    victim = tmp_path / "flipped/iter_0000007/mp_rank_00/model_optim_rng.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(MegatronCheckpointError, match="model_optim_rng.pt is corrupt"):
        import_megatron(str(tmp_path / "flipped"), str(tmp_path / "f"))
    (tmp_path / "dist/iter_0000007/.metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(MegatronCheckpointError, match=r"\.metadata is corrupt"):
        import_megatron(str(tmp_path / "dist"), str(tmp_path / "c"))


def test_a_missing_rank_file_is_named(tmp_path):
    write_checkpoint(tmp_path / "m", "gpt", "legacy", 2, 2)
    import shutil

    shutil.rmtree(tmp_path / "m/iter_0000007/mp_rank_01_000")
    with pytest.raises(MegatronCheckpointError, match="missing mp_rank_01_000/model_optim_rng.pt"):
        import_megatron(str(tmp_path / "m"), str(tmp_path / "out"))
    for name in ("mp_rank_00_001", "mp_rank_01_001"):
        shutil.rmtree(tmp_path / "m/iter_0000007" / name)
    with pytest.raises(MegatronCheckpointError, match="T=2 x P=2"):
        import_megatron(str(tmp_path / "m"), str(tmp_path / "out"))
    # T=2 x P=1 missing its last tensor rank: the grid comes from the saved args, not the files
    write_checkpoint(tmp_path / "t2", "gpt", "legacy", 2, 1)
    shutil.rmtree(tmp_path / "t2/iter_0000007/mp_rank_01")
    with pytest.raises(MegatronCheckpointError) as info:
        import_megatron(str(tmp_path / "t2"), str(tmp_path / "out2"))
    assert "missing mp_rank_01/model_optim_rng.pt of its T=2 x P=1" in str(info.value)
    assert not (tmp_path / "out2").exists()


class NotAllowed:  # a pickled object outside the allow-list
    pass


def test_loading_runs_no_pickle_outside_the_allow_list(tmp_path):
    torch.save({"args": argparse.Namespace(a=NotAllowed())}, tmp_path / "x.pt")
    with pytest.raises(MegatronCheckpointError, match="NotAllowed.*allow-list"):
        load_megatron_file(str(tmp_path / "x.pt"))


@pytest.mark.parametrize("override, message", [
    ({"num_experts": 8}, "mixture of experts"),
    ({"qk_layernorm": True}, "QK layer norm"),
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual-pipeline"),
])
def test_an_unsupported_feature_is_refused_by_name(tmp_path, override, message):
    write_checkpoint(tmp_path / "m", "llama", "torch_dist", **override)
    with pytest.raises(MegatronCheckpointError, match=message):
        import_megatron(str(tmp_path / "m"), str(tmp_path / "out"))


def test_an_expert_parallel_legacy_checkpoint_is_refused_by_name(tmp_path):
    write_checkpoint(tmp_path / "m", "gpt", "legacy")
    (tmp_path / "m/iter_0000007/mp_rank_00").rename(tmp_path / "m/iter_0000007/mp_rank_00_000_001")
    with pytest.raises(MegatronCheckpointError, match="expert-parallel"):
        import_megatron(str(tmp_path / "m"), str(tmp_path / "out"))


def test_an_unknown_tensor_is_refused_by_name(tmp_path):
    write_checkpoint(tmp_path / "m", "gpt", "legacy")
    path = tmp_path / "m/iter_0000007/mp_rank_00/model_optim_rng.pt"
    state = load_megatron_file(str(path))
    state["model"]["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    torch.save(state, path)
    with pytest.raises(MegatronCheckpointError, match="q_layernorm.weight.*not support"):
        import_megatron(str(tmp_path / "m"), str(tmp_path / "out"))
    assert not list((tmp_path / "out").glob("iter_*"))  # the streamed save left nothing behind


def test_the_whole_model_paths_equal_the_streamed_ones(tmp_path):
    """``--ckpt-format torch`` imports through a whole model and its export loads it whole; the
    default ``torch_dist`` streams both ways: the same tensors and Megatron files."""
    write_checkpoint(tmp_path / "m", "llama", "legacy", 2, 2)
    import_megatron(str(tmp_path / "m"), str(tmp_path / "whole"), ckpt_format="torch")
    import_megatron(str(tmp_path / "m"), str(tmp_path / "streamed"))
    whole = load_model(str(tmp_path / "whole")).model.state_dict()
    streamed = load_model(str(tmp_path / "streamed")).model.state_dict()
    assert sorted(whole) == sorted(streamed)
    assert all(torch.equal(whole[k], streamed[k]) for k in whole)
    readers = [TorchDistReader(export_megatron(str(tmp_path / name),
                                               str(tmp_path / f"{name}_out")).path)
               for name in ("whole", "streamed")]
    keys = readers[0].model_keys()
    assert keys and sorted(keys) == sorted(readers[1].model_keys())
    assert all(torch.equal(readers[0].read(k), readers[1].read(k)) for k in keys)


def test_training_load_of_a_megatron_checkpoint_names_the_command(tmp_path):
    write_checkpoint(tmp_path / "m", "gpt", "legacy")
    with pytest.raises(ConfigError, match="convert.py import-megatron --load .*/m --save"):
        _validate_checkpoint(CheckpointConfig(load=str(tmp_path / "m")))
    with pytest.raises(ConfigError, match="Megatron-LM torch checkpoint"):
        refuse_megatron_checkpoint(str(tmp_path / "m/iter_0000007"))
    refuse_megatron_checkpoint(str(tmp_path))  # not a Megatron checkpoint: no complaint


def test_a_release_checkpoint_is_found_and_ours_is_not_taken_for_megatrons(tmp_path):
    args, tensors = write_checkpoint(tmp_path / "m", "gpt", "torch_dist")
    (tmp_path / "m/iter_0000007").rename(tmp_path / "m/release")
    (tmp_path / "m/latest_checkpointed_iteration.txt").write_text("release")
    found = find_megatron_checkpoint(str(tmp_path / "m"))
    assert (found.format, found.iteration) == ("torch_dist", None)
    import_megatron(str(tmp_path / "m"), str(tmp_path / "ours"), ckpt_format="torch")
    import_megatron(str(tmp_path / "m"), str(tmp_path / "ours_dist"))
    assert find_megatron_checkpoint(str(tmp_path / "ours")) is None
    assert find_megatron_checkpoint(str(tmp_path / "ours_dist")) is None
