"""checkpointing: layout-independent stage files, exact optimizer resume, atomic publish."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_chimera.checkpoint.checkpointing import (
    TRACKER_FILENAME,
    CheckpointContents,
    CheckpointError,
    StageSlice,
    checkpoint_dir,
    read_tracker,
    save_checkpoint,
)
from megatron_chimera.checkpoint.loading import CheckpointTarget, load_checkpoint
from megatron_chimera.config import ModelConfig, OptimizerConfig
from megatron_chimera.model.gpt2 import GPTModel
from megatron_chimera.optimizer import OptimizerParamScheduler, get_megatron_optimizer

CONFIG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8,
                     vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                     attention_dropout=0.0, use_apex=False)
OPT = OptimizerConfig(lr=1e-2, lr_decay_samples=100, clip_grad=0.0)


def build(partition, seed=7):
    """Stage slices of GPT over ``partition``, an optimizer over all of them, a scheduler."""
    last = len(partition) - 1
    stages = [StageSlice(s, r, GPTModel(CONFIG, s == 0, s == last, r, seed=seed))
              for s, r in enumerate(partition)]
    optimizer = get_megatron_optimizer(OPT, [st.module for st in stages])
    scheduler = OptimizerParamScheduler.from_config(optimizer, OPT, 100)
    return stages, optimizer, scheduler


def save_whole(path, iteration, stages, optimizer, scheduler, ckpt_format="torch_dist",
               **contents):
    """One process saves the whole model (``stages`` over layers 0-4) at ``iteration``."""
    save_checkpoint(str(path), CheckpointContents(iteration, stages, [(0, 4)],
                                                  optimizer=optimizer, scheduler=scheduler,
                                                  **contents),
                    rank=0, world_size=1, ckpt_format=ckpt_format)


def train_step(stages, optimizer, scheduler, step):
    """One step of the whole model (stages chained in one process)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 100, (2, 9), generator=g)
    hidden = None
    for st in stages:
        if hidden is not None:
            st.module.set_input_tensor(hidden)
        last = st is stages[-1]
        out = st.module(tokens[:, :-1] if st.stage == 0 else None,
                        torch.arange(8).expand(2, 8) if st.stage == 0 else None,
                        labels=tokens[:, 1:] if last else None)
        hidden = out
    optimizer.zero_grad()
    hidden.mean().backward()
    # tie the embedding copies as the runtime does: sum of both copies' grads into each
    shared = [st.module.shared_embedding_or_output_weight() for st in stages]
    shared = [p for p in shared if p is not None]
    if len(shared) == 2:
        total = shared[0].grad + shared[1].grad
        for p in shared:
            p.grad = total.clone()
    optimizer.step()
    scheduler.step(2)


def global_state(stages):
    from megatron_chimera.checkpoint.checkpointing import global_name

    out = {}
    for st in stages:
        for n, t in st.module.state_dict().items():
            out[global_name(n, st.layer_range[0])] = t.clone()
    return out


FORMATS = pytest.mark.parametrize("fmt", ["torch", "torch_dist"])


@FORMATS
def test_resume_whole_model_is_exact(tmp_path, fmt):
    stages, opt, sched = build([(0, 4)])
    for step in range(2):
        train_step(stages, opt, sched, step)
    save_whole(tmp_path, 2, stages, opt, sched, fmt, consumed_train_samples=4)
    assert read_tracker(str(tmp_path)) == 2
    train_step(stages, opt, sched, 2)
    expected = global_state(stages)

    stages2, opt2, sched2 = build([(0, 4)], seed=99)  # different init: must be overwritten
    loaded = load_checkpoint(str(tmp_path), CheckpointTarget(stages2, 1, opt2, sched2),
                             rank=0, world_size=1)
    assert loaded.iteration == 2 and loaded.consumed_train_samples == 4
    train_step(stages2, opt2, sched2, 2)
    got = global_state(stages2)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


@FORMATS
def test_whole_model_checkpoint_loads_into_two_stages(tmp_path, fmt):
    stages, opt, sched = build([(0, 4)])
    train_step(stages, opt, sched, 0)
    save_whole(tmp_path, 1, stages, opt, sched, fmt, consumed_train_samples=2)
    train_step(stages, opt, sched, 1)
    expected = global_state(stages)

    split, opt2, sched2 = build([(0, 3), (3, 4)], seed=5)
    load_checkpoint(str(tmp_path), CheckpointTarget(split, 2, opt2, sched2), rank=0, world_size=1)
    emb = "language_model.embedding.word_embeddings.weight"
    train_step(split, opt2, sched2, 1)
    got = global_state(split)
    # the last stage's tied copy equals the first stage's embedding after the same step
    assert torch.allclose(got["word_embeddings.weight"], expected[emb], rtol=0, atol=1e-6)
    for key, value in expected.items():
        assert torch.allclose(got[key], value, rtol=0, atol=1e-6), key


@FORMATS
def test_two_stage_checkpoint_loads_into_other_split(tmp_path, fmt):
    stages, opt, sched = build([(0, 2), (2, 4)])
    train_step(stages, opt, sched, 0)
    save_checkpoint(str(tmp_path), CheckpointContents(1, stages, [(0, 2), (2, 4)], optimizer=opt,
                                                      scheduler=sched, consumed_train_samples=2),
                    rank=0, world_size=1, ckpt_format=fmt)
    names = sorted(os.listdir(checkpoint_dir(str(tmp_path), 1)))
    if fmt == "torch":
        assert names == ["common.pt", "layers_000-002.pt", "layers_002-004.pt", "rng"]
    else:
        assert names == [".metadata", "__0_0.distcp", "common.pt", "rng"]
    other, opt2, sched2 = build([(0, 1), (1, 4)], seed=5)
    load_checkpoint(str(tmp_path), CheckpointTarget(other, 2, opt2, sched2), rank=0, world_size=1)
    before = global_state(stages)
    after = global_state(other)
    for key in after:
        assert torch.equal(after[key], before[key]), key


def test_corrupt_file_is_named(tmp_path):
    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched, "torch")
    target = os.path.join(checkpoint_dir(str(tmp_path), 1), "layers_000-004.pt")
    data = open(target, "rb").read()
    open(target, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="layers_000-004.pt"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)


@FORMATS
def test_no_save_optim_requires_no_load_optim(tmp_path, fmt):
    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched, fmt, save_optim=False)
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)
    loaded = load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched,
                                                             load_optim=False),
                             rank=0, world_size=1)
    assert loaded.iteration == 1
    fine = load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched, finetune=True),
                           rank=0, world_size=1)
    assert fine.iteration == 0 and fine.consumed_train_samples == 0


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {test_dir!r})
    from test_checkpointing import build
    from megatron_chimera.checkpoint.checkpointing import CheckpointContents, save_checkpoint
    root = sys.argv[1]
    stages, opt, sched = build([(0, 4)])
    save_checkpoint(root, CheckpointContents(1, stages, [(0, 4)], opt, sched, 1), rank=0,
                    world_size=1)
    real_replace = os.replace
    def dying_replace(src, dst):
        if "iter_0000002" in str(dst) and str(dst).endswith("{victim}"):
            os.kill(os.getpid(), signal.SIGKILL)  # killed between writing and renaming
        return real_replace(src, dst)
    os.replace = dying_replace
    save_checkpoint(root, CheckpointContents(2, stages, [(0, 4)], opt, sched, 2), rank=0,
                    world_size=1)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["layers_000-004.pt", "iter_0000002"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, victim):
    script = CRASH_SCRIPT.format(test_dir=os.path.dirname(__file__), victim=victim)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, timeout=100,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert open(tmp_path / TRACKER_FILENAME).read().strip() == "1"
    stages, opt, sched = build([(0, 4)], seed=3)
    loaded = load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                             rank=0, world_size=1)
    assert loaded.iteration == 1 and loaded.consumed_train_samples == 1


def test_tracker_naming_a_missing_iteration_lists_the_present_ones(tmp_path):
    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 3, stages, opt, sched)
    (tmp_path / TRACKER_FILENAME).write_text("7\n")
    with pytest.raises(CheckpointError, match=r"names iteration 7, .*iterations present: 3\)"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)


def test_torch_dist_truncated_chunk_is_named(tmp_path):
    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched)
    target = os.path.join(checkpoint_dir(str(tmp_path), 1), "__0_0.distcp")
    data = open(target, "rb").read()
    open(target, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: chunk of .* is corrupt or trunc"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)


def test_torch_dist_metadata_never_runs_a_pickle(tmp_path):
    import pickle

    from megatron_chimera.checkpoint.safe_reader import METADATA_FILENAME

    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = os.path.join(checkpoint_dir(str(tmp_path), 1), METADATA_FILENAME)
    with open(path, "wb") as handle:
        pickle.dump(Evil(), handle)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)
    assert not (tmp_path / "pwned").exists()


def test_torch_dist_bit_rot_is_refused_in_one_line_naming_file_tensor_and_iteration(tmp_path):
    from megatron_chimera.checkpoint.safe_reader import read_metadata

    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 2, stages, opt, sched)
    path = checkpoint_dir(str(tmp_path), 2)
    # 4 KiB zeroed in place (same size) inside the word embedding's values (104 x 32 fp32)
    info = next(i for k, i in read_metadata(path).storage_data.items()
                if k.fqn == "model/tied_word_embeddings")
    target = os.path.join(path, info.relative_path)
    size = os.path.getsize(target)
    with open(target, "r+b") as handle:
        handle.seek(info.offset + info.length // 2 - 2048)
        handle.write(bytes(4096))
    assert os.path.getsize(target) == size
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched), rank=0,
                            world_size=1)
    line = str(error.value)
    assert "\n" not in line and line.count("__0_0.distcp") == 1, line
    assert re.search(r"iter_0000002/__0_0.distcp: model/tied_word_embeddings \(chunk at "
                     r"\(0, 0\)\) of iteration 2 is corrupt: bytes \d+-\d+ of its values fail "
                     r"their CRC-32 check", line), line


@pytest.mark.parametrize("fmt,victim", [("torch", "layers_000-004.pt"),
                                        ("torch_dist", "__0_0.distcp")])
def test_a_full_disk_is_one_line_naming_the_file_and_keeps_the_previous(tmp_path, monkeypatch,
                                                                        fmt, victim):
    import errno

    from megatron_chimera.checkpoint import dcp_io
    from megatron_chimera.checkpoint.dcp_io import CheckpointWriteError

    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched, ckpt_format=fmt)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: full() if isinstance(
        obj, dict) and "layer_range" in obj else real_save(obj, f, *a, **k))
    monkeypatch.setattr(dcp_io.ArchiveChunkWriter, "_write_chunk", staticmethod(full))
    with pytest.raises(CheckpointWriteError) as error:
        save_whole(tmp_path, 2, stages, opt, sched, ckpt_format=fmt)
    staging = checkpoint_dir(str(tmp_path), 2) + ".staging"
    assert str(error.value) == (f"No space left on device: {staging}/{victim} (the checkpoint "
                                "of iteration 2 was not saved; the previous checkpoint is intact)")
    assert open(tmp_path / TRACKER_FILENAME).read().strip() == "1"
    loaded = load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched), rank=0,
                            world_size=1)
    assert loaded.iteration == 1


def test_torch_dist_truncated_metadata_names_the_file(tmp_path):
    from megatron_chimera.checkpoint.safe_reader import METADATA_FILENAME

    stages, opt, sched = build([(0, 4)])
    save_whole(tmp_path, 1, stages, opt, sched)
    path = os.path.join(checkpoint_dir(str(tmp_path), 1), METADATA_FILENAME)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(str(tmp_path), CheckpointTarget(stages, 1, opt, sched),
                        rank=0, world_size=1)
    message = str(raised.value)
    assert ".metadata is corrupt or truncated" in message and "\n" not in message, message
