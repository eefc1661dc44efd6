"""Hugging Face ``transformers`` interchange: import GPT-2, Llama-style (Llama, Mistral, Qwen2)
and Megatron-BERT weights, export ours.

* :mod:`.tensor_formats` -- tensors stored differently on each side: QKV per-head order, Conv1D
  transpose, vocabulary rows.
* :mod:`.gpt2`, :mod:`.llama`, :mod:`.bert` -- each family's config and parameter-name mappings,
  both ways; :mod:`.common` -- what they share (error type, strict tensor source, GeLU names).
* :mod:`.hf_dir` -- reading and atomically writing a ``from_pretrained`` directory.
* :mod:`.tokenizer_files` -- GPT-2 BPE and WordPiece files in and out (a Llama-style fast
  tokenizer's files in).
* :mod:`.convert` -- ``import_hf`` / ``export_hf``, behind ``tools/checkpoint/convert.py``.
"""
