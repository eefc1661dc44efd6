"""Using a checkpoint on one process: ``loader`` (model and tokenizer from a checkpoint's saved
arguments), ``generation`` (KV-cached decoding, greedy / temperature / top-k / top-p),
``evaluation`` (sliding-window perplexity, LAMBADA last-word accuracy), ``tool_support`` (what the
checkpoint tools share: checkpoint flags, loading, error reporting, JSON output)."""
