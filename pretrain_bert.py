"""Pretrain BERT with Megatron-style flags (not yet implemented: see the framework issue)."""
import sys

if __name__ == "__main__":
    sys.exit("pretrain_bert.py: not yet implemented")
