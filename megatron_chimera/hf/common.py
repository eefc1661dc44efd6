"""What both families' mappings share: the error type, a strict tensor source, GeLU names."""

from __future__ import annotations

import torch

from megatron_chimera.errors import UserError

# Hugging Face activation names -> our --gelu form (mathematically the same function)
_TANH_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_ERF_NAMES = ("gelu",)


class HFError(UserError, ValueError):
    """A Hugging Face directory or model we cannot convert; the message names the file/field
    (exit code 2, as a bad flag: the tools' input)."""

    exit_code = 2


class TensorSource:
    """Named tensors that must each be used exactly once (``take``); ``check_consumed`` rejects
    leftovers, so a weight the mapping does not know is never silently dropped."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str, prefix: str = "",
                 ignore_suffixes: tuple[str, ...] = ()) -> None:
        self.source = source
        if prefix and not any(k.startswith(prefix) for k in tensors):
            prefix = ""  # weights saved from the base model carry no prefix
        self.prefix = prefix
        self._tensors = {k: v for k, v in tensors.items()
                         if not (ignore_suffixes and k.endswith(ignore_suffixes))}
        self._used: set[str] = set()

    def has(self, name: str) -> bool:
        """True when ``name`` (under the prefix) is present."""
        return self.prefix + name in self._tensors

    def has_raw(self, key: str) -> bool:
        """True when exactly ``key`` (no prefix) is present."""
        return key in self._tensors

    def take(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor ``name`` (under the prefix) as ``dtype``; HFError when it is missing."""
        key = self.prefix + name
        if key not in self._tensors:
            raise HFError(f"{self.source}: missing tensor {key!r}")
        self._used.add(key)
        return self._tensors[key].to(dtype)

    def take_raw(self, key: str) -> torch.Tensor:
        """The tensor stored under exactly ``key`` (no prefix), marked as used."""
        if key not in self._tensors:
            raise HFError(f"{self.source}: missing tensor {key!r}")
        self._used.add(key)
        return self._tensors[key]

    def check_consumed(self) -> None:
        """HFError listing tensors no mapping used (an architecture we do not support)."""
        left = sorted(set(self._tensors) - self._used)
        if left:
            shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
            raise HFError(f"{self.source}: tensors this converter does not know: {shown}")


def gelu_from_hf(name: object, field: str, source: str) -> str:
    """A Hugging Face activation name -> our ``--gelu`` form (``tanh`` or ``erf``)."""
    if name in _TANH_NAMES:
        return "tanh"
    if name in _ERF_NAMES:
        return "erf"
    raise HFError(f"{source}: {field} = {name!r} is not supported (GeLU only: "
                  f"{', '.join(_TANH_NAMES + _ERF_NAMES)})")


def require(condition: bool, source: str, message: str) -> None:
    """HFError ``source: message`` unless ``condition``."""
    if not condition:
        raise HFError(f"{source}: {message}")
