"""Frozen configuration dataclasses passed explicitly to library code.

Each field that a command-line flag sets declares that flag (:mod:`.flag`); ``training.arguments``
builds these records from Megatron-style flags, and library modules receive them as arguments and
never read a global args object. Field names follow Megatron's flags (``--hidden-size`` ->
``hidden_size``).

* :mod:`.flag` -- ``flag(...)``: a field that carries its flag, help, choices and check.
* :mod:`.model` -- :class:`ModelConfig` and the model's choice lists.
* :mod:`.moe` -- :class:`MoEConfig` (``ModelConfig.moe``) and ``--moe-layer-freq``'s parser.
* :mod:`.parallel` -- :class:`ParallelConfig` (layout, schedule) and :class:`DDPConfig`.
* :mod:`.training` -- :class:`TrainingConfig`, :class:`LayerSplit`, :class:`OptimizerConfig`.
* :mod:`.data` -- :class:`DataConfig` and the tokenizer names.
* :mod:`.run` -- :class:`CheckpointConfig`, :class:`LoggingConfig`, :class:`TrainConfig`.
"""

from megatron_chimera.config.data import TOKENIZER_TYPES, DataConfig
from megatron_chimera.config.flag import Flag, flag, flag_fields, flag_spec
from megatron_chimera.config.model import (
    CP_COMM_TYPES,
    DOCUMENT_ATTENTIONS,
    DTYPE_BYTES,
    GELU_VARIANTS,
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ModelConfig,
)
from megatron_chimera.config.moe import (
    MOE_LOAD_BALANCING_TYPES,
    MOE_ROUTER_SCORE_FUNCTIONS,
    MOE_TOKEN_DISPATCHERS,
    MoEConfig,
    parse_moe_layer_freq,
)
from megatron_chimera.config.parallel import DDPConfig, ParallelConfig
from megatron_chimera.config.run import (
    FLAG_SECTIONS,
    CheckpointConfig,
    LoggingConfig,
    TrainConfig,
)
from megatron_chimera.config.training import (
    DEFAULT_PROFILE_ITERATIONS,
    PARTITION_METHODS,
    LayerSplit,
    OptimizerConfig,
    TrainingConfig,
)
from megatron_chimera.errors import ConfigError  # re-exported: the flags' error
from megatron_chimera.layout import pad_vocab_size  # re-exported for the checkpoint checks

__all__ = ["TOKENIZER_TYPES", "DataConfig", "Flag", "flag", "flag_fields", "flag_spec",
           "CP_COMM_TYPES", "DOCUMENT_ATTENTIONS", "DTYPE_BYTES", "GELU_VARIANTS", "NORMALIZATIONS",
           "POSITION_EMBEDDING_TYPES", "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS",
           "ModelConfig", "MOE_LOAD_BALANCING_TYPES", "MOE_ROUTER_SCORE_FUNCTIONS",
           "MOE_TOKEN_DISPATCHERS", "MoEConfig", "parse_moe_layer_freq", "DDPConfig",
           "ParallelConfig", "FLAG_SECTIONS", "CheckpointConfig",
           "LoggingConfig", "TrainConfig", "DEFAULT_PROFILE_ITERATIONS", "PARTITION_METHODS",
           "LayerSplit", "OptimizerConfig", "TrainingConfig", "ConfigError", "pad_vocab_size"]
