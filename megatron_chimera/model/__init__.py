"""The GPT family (GPT-2 and Llama-style: RoPE, SwiGLU, RMSNorm, grouped-query attention) and
BERT in Megatron's layout, built whole or as one pipeline stage's slice.

* :mod:`.gpt2` (GPTModel, build_gpt_stage), :mod:`.bert` (BertModel, build_bert_stage),
  :mod:`.family` (what the driver and the analytic models know of each family),
  :mod:`.presets` (named model configurations).
* :mod:`.language_model` -- embeddings, pooler, tied-embedding bookkeeping;
  :mod:`.transformer` -- layers, recomputation; :mod:`.architecture` -- the architecture
  flags' rules; :mod:`.rotary` -- RoPE; :mod:`.document_attention` -- attention within each
  packed document.
* :mod:`.linear` -- deferrable weight gradient (split backward); :mod:`.fused` -- Apex /
  torch-native kernels; :mod:`.dropout_rng` -- keyed dropout (masks independent of the rank).
* :mod:`.partition` -- layers -> stages, parameter counts; :mod:`.stage_split` -- Megatron's
  uneven-stage flags (the layout string, first/last stage layers).
* :mod:`.memory` -- per-stage and per-rank bytes; :mod:`.flops` -- the one FLOP count.
* :mod:`.flags` -- a model configuration written back as training flags; :mod:`.utils` --
  deterministic, layout-independent initialisation.
"""
