"""Fixtures of the inference tests: one small Hugging Face GPT-2 and our import of it."""

from __future__ import annotations

import pytest

from megatron_chimera.hf.convert import import_hf
from megatron_chimera.inference.loader import load_model
from tests.helpers.hf_models import SMALL_GPT2_VOCAB, save_gpt2


@pytest.fixture(scope="package")
def models(tmp_path_factory):
    """(Hugging Face GPT-2, our model imported from it), built once for the package."""
    folder = tmp_path_factory.mktemp("inference")
    hf = save_gpt2(folder / "hf", vocab_size=SMALL_GPT2_VOCAB, seed=5)
    import_hf(str(folder / "hf"), str(folder / "ckpt"))
    return hf, load_model(str(folder / "ckpt")).model
