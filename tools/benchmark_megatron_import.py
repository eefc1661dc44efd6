"""Peak host memory of ``import-megatron`` against the size of the model it builds.

    python tools/benchmark_megatron_import.py [--hidden-size 512 --num-layers 8 --vocab 32000]

Writes a Llama-like Megatron-LM checkpoint (T=2 x P=2; ``torch_dist`` and legacy files, with the
test suite's fixture writer, tests/helpers/megatron_checkpoints.py) into a temporary directory,
then imports each in a fresh process and prints the growth of its peak RSS during the import
divided by the model's bytes: about 1 + (largest stored tensor) / (model) when the conversion
streams (one stored tensor, or one pipeline stage's memory-mapped files, at a time).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402


def _peak_rss_kib() -> int:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss`` not inherited over fork + exec)."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:"))


def _child(source: str, save: str) -> None:
    from megatron_chimera.megatron_lm.importer import import_megatron

    base = _peak_rss_kib()
    result = import_megatron(source, save)
    peak = _peak_rss_kib()
    config = result.model_config
    from megatron_chimera.inference.loader import build_model
    from megatron_chimera.model.family import GPT2

    model = sum(p.numel() * p.element_size() for p in build_model(GPT2, config).parameters())
    growth = (peak - base) * 1024
    print(f"{os.path.basename(source):>10}: model {model / 2**20:7.1f} MiB, peak RSS growth "
          f"{growth / 2**20:7.1f} MiB, ratio {growth / model:.2f}")


def main() -> None:
    """Write both layouts, import each in a subprocess, print the ratios."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    from tests.helpers.megatron_checkpoints import write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("torch_dist", "legacy"):
            write_checkpoint(Path(tmp) / fmt, "llama", fmt, 2, 2, layers=args.num_layers,
                             hidden_size=args.hidden_size, kv_channels=128,
                             ffn_hidden_size=args.hidden_size * 11 // 4,
                             padded_vocab_size=args.vocab, make_vocab_size_divisible_by=128)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--child", str(Path(tmp) / fmt),
                            str(Path(tmp) / f"out_{fmt}")], check=True, env=env)


if __name__ == "__main__":
    run_tool(main)
