"""Pretrain GPT-2 with Megatron-style flags (not yet implemented: see the framework issue)."""
import sys

if __name__ == "__main__":
    sys.exit("pretrain_gpt2.py: not yet implemented")
