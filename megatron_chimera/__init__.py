"""megatron_chimera: Megatron-style GPT-2/BERT pretraining with Chimera bidirectional pipelines."""

__version__ = "0.1.0"
