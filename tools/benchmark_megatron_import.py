"""Peak host memory of ``import-megatron`` and ``export-megatron`` against the model and against
the largest tensor they convert.

    python tools/benchmark_megatron_import.py [--hidden-size 512 --num-layers 8 --vocab 32000]

Writes a Llama-like Megatron-LM checkpoint (T=2 x P=2; ``torch_dist`` and legacy files, with the
test suite's fixture writer, tests/helpers/megatron_checkpoints.py) into a temporary directory,
then, in a fresh process each, imports it and exports the import again. Each child first converts
a tiny checkpoint the same way (so every module the conversion imports is loaded and the
allocator warmed), resets its peak RSS (``/proc/self/clear_refs``), and prints the growth of its
peak RSS over the conversion divided by the model's bytes and by the largest stored tensor (a
stacked ``torch_dist`` layer tensor counts whole: Megatron stores it as one). A streaming
conversion's second ratio stays a small constant as the model grows; a whole-model one grows with
the layer count.
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


def _rss_kib(field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of this process, KiB."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak RSS becomes the current RSS


def _write(root: Path, fmt: str, hidden: int, layers: int, vocab: int) -> None:
    from tests.helpers.megatron_checkpoints import write_checkpoint

    write_checkpoint(root, "llama", fmt, 2, 2, layers=layers, hidden_size=hidden,
                     kv_channels=hidden // 4, ffn_hidden_size=hidden * 11 // 4,
                     padded_vocab_size=vocab, make_vocab_size_divisible_by=128)


def _measure(convert) -> int:
    """Peak RSS growth (bytes) while ``convert()`` runs."""
    _reset_peak()
    base = _rss_kib("VmRSS")
    convert()
    return (_rss_kib("VmHWM") - base) * 1024


def _child(fmt: str, tmp: str, hidden: int, layers: int, vocab: int) -> None:
    from megatron_chimera.checkpoint.megatron_format import find_megatron_checkpoint
    from megatron_chimera.megatron_lm.exporter import export_megatron
    from megatron_chimera.megatron_lm.importer import import_megatron
    from megatron_chimera.megatron_lm.torch_dist_reader import TorchDistReader

    tmp_path = Path(tmp)
    _write(tmp_path / "tiny", fmt, 64, 2, 256)  # the warm-up
    import_megatron(str(tmp_path / "tiny"), str(tmp_path / "tiny_ours"))
    export_megatron(str(tmp_path / "tiny_ours"), str(tmp_path / "tiny_back"))
    source = tmp_path / "megatron"
    imported = _measure(lambda: import_megatron(str(source), str(tmp_path / "ours")))
    exported = _measure(lambda: export_megatron(str(tmp_path / "ours"), str(tmp_path / "back")))
    reader = TorchDistReader(find_megatron_checkpoint(str(tmp_path / "back")).path)
    sizes = [m.size.numel() * m.properties.dtype.itemsize for m in reader.tensors.values()]
    model = sum(sizes)
    largest = max(sizes)
    for what, growth in (("import", imported), ("export", exported)):
        print(f"{fmt:>10} {what}: model {model / 2**20:7.1f} MiB, largest tensor "
              f"{largest / 2**20:6.1f} MiB, peak RSS growth {growth / 2**20:7.1f} MiB: "
              f"{growth / model:.2f} x model, {growth / largest:.2f} x largest tensor")


def main() -> None:
    """Write both layouts, convert each in a subprocess, print the ratios."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = (args.hidden_size, args.num_layers, args.vocab)
    if args.child:
        _child(args.child[0], args.child[1], *sizes)
        return
    for fmt in ("torch_dist", "legacy"):
        with tempfile.TemporaryDirectory() as tmp:
            _write(Path(tmp) / "megatron", fmt, *sizes)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--child", fmt, tmp, "--hidden-size",
                            str(args.hidden_size), "--num-layers", str(args.num_layers),
                            "--vocab", str(args.vocab)], check=True, env=env)


if __name__ == "__main__":
    run_tool(main)
