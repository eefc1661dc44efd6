"""The flag-error path under torchrun: a quiet local rank outlives local rank 0."""

import os
import signal
import subprocess
import sys
import time

import pytest

_QUIET_RANK = """
from megatron_chimera.errors import ConfigError
from megatron_chimera.training import run_main

def main():
    raise ConfigError("--num-query-group: did you mean --num-query-groups?")

print("started", flush=True)
run_main(main)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("under_torchrun", [True, False])
def test_a_quiet_rank_waits_for_torchruns_sigterm_instead_of_exiting_first(under_torchrun):
    # a quiet rank that exits first lets torchrun SIGTERM local rank 0 before its error line
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    if under_torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    process = subprocess.Popen([sys.executable, "-c", _QUIET_RANK], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().strip() == "started"
    start = time.monotonic()
    if under_torchrun:
        time.sleep(1.0)
        assert process.poll() is None, process.communicate()  # still waiting after 1 s
        process.send_signal(signal.SIGTERM)  # the agent, after local rank 0 exited
        _, err = process.communicate(timeout=30)
        assert process.returncode == -signal.SIGTERM and not err.strip(), (process.returncode, err)
    else:
        _, err = process.communicate(timeout=30)
        assert process.returncode == 2 and not err.strip(), (process.returncode, err)
        assert time.monotonic() - start < 10  # no launcher to wait for: it exits at once
