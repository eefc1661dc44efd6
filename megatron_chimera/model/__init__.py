"""GPT-2 and BERT in Megatron's layout, built whole or as one pipeline stage's slice.

Modules: ``gpt2`` (GPTModel, build_gpt_stage), ``bert`` (BertModel, build_bert_stage),
``language_model`` (embeddings, pooler, tied-embedding bookkeeping), ``transformer`` (layers,
recomputation), ``fused`` (Apex / torch-native kernels), ``linear`` (deferrable weight gradient),
``partition`` (layers -> stages, parameter counts), ``stage_layout`` (Megatron's uneven-stage
flags: the layout string, first/last stage layers), ``memory`` (per-stage and per-rank bytes),
``utils`` (deterministic, layout-independent initialisation).
"""
