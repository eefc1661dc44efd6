"""Small, randomly initialised Hugging Face models and tokenizer files for the interchange tests.

Nothing is downloaded: configs are built here, every parameter (biases and layer norms included)
is perturbed with a seeded generator so that a swapped or mis-ordered tensor changes the logits,
and weights are large enough (std 0.2) that the GeLU forms differ measurably.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers  # the [test] extra installs it: a missing reference must fail, not skip

EOT = "<|endoftext|>"
WORDS = ("the king shall speak and the queen shall answer while the fool laughs at both of them "
         "in the hall of the castle where every lord and lady listens to music and wine").split()

SMALL_GPT2_VOCAB = 300  # the inference tests' GPT-2: padded to 384 when imported


def perturb_(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Add seeded normal noise to every parameter (so no bias or norm weight is trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * std)
    return model.eval()


def write_bpe_files(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer (``vocab.json`` + ``merges.txt``) trained on a tiny corpus."""
    from tokenizers import ByteLevelBPETokenizer

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    bpe.train_from_iterator(corpus * 4, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=[EOT], show_progress=False)
    bpe.save_model(str(folder))
    return folder


def write_wordpiece_vocab(folder: Path, lower_case: bool = True) -> Path:
    """A WordPiece ``vocab.txt`` (BERT's special tokens, letters, words, ``##`` pieces)."""
    folder.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", *letters,
              *[f"##{c}" for c in letters], *sorted(set(WORDS))]
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower_case}))
    return folder


def gpt2_config(vocab_size: int, **overrides) -> object:
    """A 4-layer, hidden-32, 4-head GPT-2 config with 32 positions."""
    fields = dict(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                  eos_token_id=0)
    fields.update(overrides)
    return transformers.GPT2Config(**fields)


def save_gpt2(folder: Path, vocab_size: int = 300, seed: int = 0, tokenizer: bool = False,
              **overrides) -> object:
    """Save a random GPT2LMHeadModel (eager attention) to ``folder``; return the model."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(gpt2_config(vocab_size, **overrides))
    perturb_(model, seed)
    model.save_pretrained(folder)
    if tokenizer:
        write_bpe_files(folder, vocab_size)
    return reload_gpt2(folder)


def reload_gpt2(folder: Path) -> object:
    """``GPT2LMHeadModel.from_pretrained`` in eval mode with eager attention."""
    return transformers.GPT2LMHeadModel.from_pretrained(folder,
                                                        attn_implementation="eager").eval()


def bert_config(vocab_size: int, **overrides) -> object:
    """A 4-layer, hidden-32, 4-head Megatron-BERT config with 32 positions."""
    fields = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=2)
    fields.update(overrides)
    return transformers.MegatronBertConfig(**fields)


def save_bert(folder: Path, vocab_size: int = 90, seed: int = 0, pretraining: bool = True,
              tokenizer: bool = False, **overrides) -> object:
    """Save a random MegatronBertForPreTraining (or ForMaskedLM) to ``folder``."""
    torch.manual_seed(seed)
    cls = (transformers.MegatronBertForPreTraining if pretraining
           else transformers.MegatronBertForMaskedLM)
    model = cls(bert_config(vocab_size, **overrides))
    perturb_(model, seed)
    model.save_pretrained(folder)
    if tokenizer:
        write_wordpiece_vocab(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


# Llama-family architectures the converter maps (model_type -> (config class, model class))
LLAMA_FAMILY = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                "mistral": ("MistralConfig", "MistralForCausalLM"),
                "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama_config(model_type: str = "llama", vocab_size: int = 100, **overrides) -> object:
    """A 2-layer, hidden-32, 4-head, 2-KV-head, untied config of ``model_type`` (SwiGLU,
    RMSNorm, RoPE; Llama's with base 500000 and Llama 3.1's frequency scaling)."""
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0)
    if model_type == "llama":
        fields["rope_parameters"] = dict(LLAMA3_ROPE)
    if model_type == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    return getattr(transformers, LLAMA_FAMILY[model_type][0])(**fields)


def llama_model(model_type: str = "llama", seed: int = 0, **overrides) -> object:
    """A random ``*ForCausalLM`` (eager attention, eval mode, every weight perturbed)."""
    torch.manual_seed(seed)
    config = llama_config(model_type, **overrides)
    config._attn_implementation = "eager"
    model = getattr(transformers, LLAMA_FAMILY[model_type][1])(config)
    return perturb_(model, seed)


def write_fast_tokenizer(folder: Path, vocab_size: int = 100) -> object:
    """A ``transformers`` fast tokenizer (byte-level BPE trained on a tiny corpus, ``<s>`` as
    BOS added to every text, ``</s>`` as EOS) saved with ``save_pretrained``; returns it."""
    from tokenizers import ByteLevelBPETokenizer, processors

    bpe = ByteLevelBPETokenizer()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    bpe.train_from_iterator(corpus * 4, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    fast = bpe._tokenizer  # noqa: SLF001 - the tokenizers object transformers wraps
    fast.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                        special_tokens=[("<s>", 0)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="<s>",
                                                     eos_token="</s>")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_llama(folder: Path, model_type: str = "llama", seed: int = 0, tokenizer: bool = True,
               **overrides) -> object:
    """Save a random ``*ForCausalLM`` of :func:`llama_model` (and a fast tokenizer) to
    ``folder``; return it reloaded with eager attention."""
    model = llama_model(model_type, seed, **overrides)
    model.save_pretrained(folder)
    if tokenizer:
        write_fast_tokenizer(folder, model.config.vocab_size)
    cls = getattr(transformers, LLAMA_FAMILY[model_type][1])
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


# Mixture-of-experts architectures (model_type -> (config class, model class))
MOE_FAMILY = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}


def moe_config(model_type: str = "mixtral", vocab_size: int = 100, **overrides) -> object:
    """A 2-layer, hidden-32, 4-head, 2-KV-head, untied MoE config: 4 experts, top-2 (Qwen2-MoE:
    expert size 16, a shared expert of 24 with its gate, dense MLPs of 48)."""
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  num_experts_per_tok=2, bos_token_id=0, eos_token_id=0)
    if model_type == "mixtral":
        fields.update(num_local_experts=4, sliding_window=None)
    else:
        fields.update(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    fields.update(overrides)
    return getattr(transformers, MOE_FAMILY[model_type][0])(**fields)


def save_moe(folder: Path, model_type: str = "mixtral", seed: int = 0, tokenizer: bool = False,
             **overrides) -> object:
    """Save a random MoE ``*ForCausalLM`` (every weight perturbed, routers included, so the
    top-k choice varies per token) to ``folder``; return it reloaded with eager attention."""
    torch.manual_seed(seed)
    config = moe_config(model_type, **overrides)
    config._attn_implementation = "eager"
    cls = getattr(transformers, MOE_FAMILY[model_type][1])
    perturb_(cls(config), seed).save_pretrained(folder)
    if tokenizer:
        write_fast_tokenizer(folder, config.vocab_size)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()
