"""The equivalence checker end to end: four published normalisation bugs, each re-created by
monkeypatching one function, are caught in one checker launch, each on the cheapest layout that
shows it (2 ranks, 1 step) and each with the loss or the guilty parameter named:

* torchtitan #3280, TP x CP loss divided twice: the context-parallel loss divided by CP again
  (``sequence_mean_loss``) -> ``CP2``: the loss halves;
* torchtitan #2972, no pre-backward scaling under PP: a pipelined executor's micro-batch losses
  not divided by their count (``ExecutorFactory.train_executor``) -> ``1f1b,D2``: gradients x N;
* torchtitan #1733, per-step rescaling under accumulation: the accumulated gradient averaged over
  the micro-batches again (``microbatch_units``) -> ``DP2`` (N = 2 against one process's 4);
* Megatron-LM #1754, vocabulary padding in the loss (``mask_padded_vocab_``) -> ``T2`` with a
  vocabulary of 501 (500 and the end-of-document token: one process pads none, T = 2 pads one
  column): the loss moves.

Each layout triggers only its own bug (the others need a condition it lacks), and the ratios
asserted below are each bug's exact factor, so a row cannot pass on another bug's account.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.functional]

# the bugs, injected into every process the checker starts (sitecustomize runs at start-up)
BUGS = '''
import megatron_chimera.model.context_parallel as cp
import megatron_chimera.model.language_model as lm
import megatron_chimera.training.running_schedule as rs

_mean = cp.sequence_mean_loss
def _cp_twice(output, mask, *rest):  # torchtitan #3280
    loss, reported = _mean(output, mask, *rest)
    size = cp.context_parallel_size()
    return loss / size, reported / size
cp.sequence_mean_loss = _cp_twice

_train_executor = rs.ExecutorFactory.train_executor
def _unscaled_under_pp(self, schedule):  # torchtitan #2972
    executor = _train_executor(self, schedule)
    if schedule.num_stages > 1:
        executor.loss_scale_divisor = float(self.data_parallel_size)
    return executor
rs.ExecutorFactory.train_executor = _unscaled_under_pp

rs.microbatch_units = lambda sequences, dp: sequences * sequences * dp  # torchtitan #1733

lm.mask_padded_vocab_ = lambda logits, vocab_size: logits  # Megatron-LM #1754
'''
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 "
         "--vocab-size 500 --make-vocab-size-divisible-by 1 --mock-data").split()
LAYOUTS = ("CP2", "1f1b,D2", "DP2", "T2")


def _ratio(row: str, what: str) -> float:
    got, want = re.search(rf"{what} ([\d.e+-]+) vs ([\d.e+-]+)", row).groups()
    return float(got) / float(want)


@pytest.mark.timeout(420)
def test_four_published_bugs_are_caught_and_named(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BUGS)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]))
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "check_equivalence.py"),
                          "--steps", "1", "--work-dir", str(tmp_path / "work"), "--layouts",
                          *LAYOUTS, "--", *MODEL],
                         env=env, capture_output=True, text=True, timeout=400)
    rows = {line.split()[0]: line for line in out.stdout.splitlines()
            if line.startswith(LAYOUTS)}
    print(out.stdout)  # the table, for -rA / a failure's report
    assert out.returncode == 1 and len(rows) == 4, out.stdout + out.stderr
    # #3280: the loss (and every gradient) halves
    assert _ratio(rows["CP2"], "lm loss") == pytest.approx(0.5, rel=1e-4), rows
    assert "first parameter: grad of" in rows["CP2"], rows
    # #2972: the loss is right, the gradients N = 4 times too large -- and 4 times more, as
    # one process carries #1733's extra 1/N (N = 4) while this layout divides by nothing
    assert "lm loss" not in rows["1f1b,D2"], rows
    assert _ratio(rows["1f1b,D2"], "grad norm") == pytest.approx(16.0, rel=1e-4), rows
    assert "first parameter: grad of" in rows["1f1b,D2"], rows
    # #1733: averaged over 2 micro-batches here, over 4 on one process
    assert "lm loss" not in rows["DP2"], rows
    assert _ratio(rows["DP2"], "grad norm") == pytest.approx(2.0, rel=1e-4), rows
    assert "first parameter: grad of" in rows["DP2"], rows
    # #1754: the padding column enters the softmax on T2 only (1 of 502 columns: every
    # gradient moves by ~1e-3, near the per-parameter bound, so either naming may appear)
    assert "lm loss" in rows["T2"], rows
    assert re.search(r"(first parameter|largest parameter difference): grad of", rows["T2"]), rows
