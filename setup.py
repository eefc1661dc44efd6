"""Install megatron_chimera: Megatron-style pretraining of GPT-2 and BERT with Chimera pipelines."""
from setuptools import find_packages, setup

setup(
    name="megatron_chimera",
    version="0.1.0",
    description="Megatron-style GPT-2/BERT pretraining with Chimera bidirectional pipelines",
    packages=find_packages(include=["megatron_chimera", "megatron_chimera.*"]),
    python_requires=">=3.10",
    install_requires=[
        # supported: torch 2.11 through 2.13 (the unit tests pass on both ends); install
        # torch==2.13.0 first (tools/install.sh), or a machine's own CUDA build in that range
        "torch>=2.11,<2.14",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "tensorboard",
        "matplotlib",
        "tqdm",
    ],
    extras_require={
        # Hugging Face interchange (tools/checkpoint/convert.py) (pinned: the tested versions)
        "hf": ["transformers==5.23.0", "safetensors==0.8.0"],
        # Weights & Biases logging (--wandb-project)
        "wandb": ["wandb==0.23.1"],
        "test": ["pytest", "pytest-timeout", "ruff", "transformers==5.23.0", "safetensors==0.8.0",
                 "wandb==0.23.1"],
    },
)
