"""tools/gpu_check.py runs end to end (CPU smoke mode; its CUDA sections are skipped here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.functional
@pytest.mark.timeout(300)
def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "GPU.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--quick",
         "--sections", "resume,attention,throughput,memory,multi-gpu,memory-report",
         "--output", str(out)],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "**PASS** AdamW on cpu: resumed == uninterrupted bitwise: True" in report
    assert "| tiny | fused |" in report and "matmul peak" in report
    assert report.count("skipped (no CUDA") == 2
    assert "**PASS** predicted total within 10% of measured" in report
    # forward + backward through the gradient buffers timed apart from the optimizer step
    assert "| gradient-accumulation fusion | forward+backward ms | optimizer ms |" in report
    assert "\n| on | " in report and "\n| off | " in report
    assert "- skipped (0 GPU visible)" in report
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--sections",
                           "nonsense"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--sections: unknown section 'nonsense'" in proc.stderr
