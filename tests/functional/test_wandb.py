"""End-to-end: with --wandb-project a run writes the TensorBoard scalars to Weights & Biases too
(offline mode: the test reads the run file back), from one rank, under the same names, at the
same iterations and with the same values (TensorBoard stores float32: compared after rounding)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .launcher import launch

pytestmark = [pytest.mark.functional, pytest.mark.slow]
wandb = pytest.importorskip("wandb")


def wandb_history(save_dir: Path) -> dict[str, dict[int, object]]:
    """``{name: {step: value}}`` of the one offline W&B run under ``save_dir``."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    runs = sorted(save_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"one W&B run expected (one rank writes): {runs}"
    store = DataStore()
    store.open_for_scan(str(runs[0]))
    history: dict[str, dict[int, object]] = {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
        step = int(row.get("_step", record.history.step.num))
        for name, value in row.items():
            if not name.startswith("_"):
                history.setdefault(name, {})[step] = value
    return history


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_wandb_offline_run_has_the_tensorboard_scalars(tmp_path):
    result = launch("pretrain_gpt2.py", [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "200", "--num-workers", "0",
        "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
        "--log-interval", "2", "--pipeline-model-parallel-size", "2",
        "--distributed-timeout-minutes", "1", "--log-timers-to-tensorboard",
        "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "chimera-test",
        "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb")], nproc=2,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    board = {tag: values for tag, values in tensorboard_scalars(tmp_path / "tb").items()
             if not tag.endswith(" vs samples")}
    runs = wandb_history(tmp_path / "wb")
    assert {"lm loss", "lm loss validation", "lm loss test", "learning-rate",
            "forward-backward-time"} <= board.keys()
    assert board.keys() == runs.keys(), (sorted(board), sorted(runs))
    for tag, values in board.items():
        assert values.keys() == runs[tag].keys(), tag
        for step, value in values.items():
            assert float(np.float32(runs[tag][step])) == value, (tag, step)
