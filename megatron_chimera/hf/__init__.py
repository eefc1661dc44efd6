"""Hugging Face ``transformers`` interchange: import GPT-2 / Megatron-BERT weights, export ours.

Modules: ``layouts`` (QKV per-head order, Conv1D transpose, vocabulary rows), ``gpt2`` and
``bert`` (config and parameter-name mappings of each family, both ways), ``hf_dir`` (reading and
atomically writing a ``from_pretrained`` directory), ``tokenizer_files`` (GPT-2 BPE and WordPiece
files in and out), ``convert`` (``import_hf`` / ``export_hf``, behind
``tools/checkpoint/convert.py``).
"""
