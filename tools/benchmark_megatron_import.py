"""Peak host memory of ``import-megatron`` and ``export-megatron`` against the model and against
the largest tensor they convert.

    python tools/benchmark_megatron_import.py [--hidden-size 512 --num-layers 8 --vocab 32000]

Writes a Llama-like Megatron-LM checkpoint (T=2 x P=2; ``torch_dist`` and legacy files, with the
test suite's fixture writer, tests/helpers/megatron_checkpoints.py) into a temporary directory,
then imports it and exports the import again, each in a fresh process. Each child first converts
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


def _sizes(tensors: dict) -> list[int]:
    """The bytes of every tensor of a DCP ``state_dict_metadata`` (other items left out)."""
    return [m.size.numel() * m.properties.dtype.itemsize for m in tensors.values()
            if hasattr(m, "chunks")]


def _child(fmt: str, what: str, tmp: str) -> None:
    from megatron_chimera.checkpoint.checkpointing import checkpoint_dir
    from megatron_chimera.checkpoint.megatron_format import find_megatron_checkpoint
    from megatron_chimera.checkpoint.safe_reader import read_metadata
    from megatron_chimera.megatron_lm.exporter import export_megatron
    from megatron_chimera.megatron_lm.importer import import_megatron
    from megatron_chimera.megatron_lm.torch_dist_reader import TorchDistReader

    tmp_path, tiny = Path(tmp), Path(tmp) / what
    _write(tiny / "megatron", fmt, 64, 2, 256)  # the warm-up, as measured
    import_megatron(str(tiny / "megatron"), str(tiny / "ours"))
    if what == "import":
        growth = _measure(lambda: import_megatron(str(tmp_path / "megatron"),
                                                  str(tmp_path / "ours")))
    else:
        export_megatron(str(tiny / "ours"), str(tiny / "back"))
        growth = _measure(lambda: export_megatron(str(tmp_path / "ours"), str(tmp_path / "back")))
    # the model: our tensors; the largest: ours or Megatron's as stored on either side (a
    # stacked torch_dist tensor whole: the import reads it, the export writes it, as one)
    ours = _sizes(read_metadata(checkpoint_dir(str(tmp_path / "ours"), 0)).state_dict_metadata)
    model, largest = sum(ours), max(ours)
    for side in ("megatron", "back"):
        found = find_megatron_checkpoint(str(tmp_path / side))
        if found is not None and found.format == "torch_dist":
            largest = max(largest, *_sizes(TorchDistReader(found.path).tensors))
    print(f"{fmt:>10} {what}: model {model / 2**20:7.1f} MiB, largest tensor "
          f"{largest / 2**20:6.1f} MiB, peak RSS growth {growth / 2**20:7.1f} MiB: "
          f"{growth / model:.2f} x model, {growth / largest:.2f} x largest tensor")


def main() -> None:
    """Write both layouts, convert each in a subprocess, print the ratios."""
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    for fmt in ("torch_dist", "legacy"):
        with tempfile.TemporaryDirectory() as tmp:
            _write(Path(tmp) / "megatron", fmt, args.hidden_size, args.num_layers, args.vocab)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            for what in ("import", "export"):  # a fresh process each: no memory reused
                subprocess.run([sys.executable, __file__, "--child", fmt, what, tmp], check=True,
                               env=env)


if __name__ == "__main__":
    run_tool(main)
