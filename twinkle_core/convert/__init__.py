"""The HF <-> Megatron checkpoint bridge: declarative per-architecture tables, sharded load and export."""
from twinkle_core.convert.bridge import CheckpointMismatchError, export_hf_weights, load_hf_weights
from twinkle_core.convert.conversion import (NotMegatronCapableError, convert_hf_to_megatron, convert_megatron_to_hf,
                                             load_hf_as_megatron, load_megatron_as_megatron, megatron_family)
from twinkle_core.convert.mapping import from_te_names, mapping_for, to_te_names
from twinkle_core.convert.megatron_checkpoint import (is_megatron_checkpoint, load_megatron_checkpoint,
                                                      save_megatron_checkpoint)

__all__ = [
    "CheckpointMismatchError", "NotMegatronCapableError", "convert_hf_to_megatron", "convert_megatron_to_hf",
    "export_hf_weights", "from_te_names", "is_megatron_checkpoint", "load_hf_as_megatron", "load_hf_weights",
    "load_megatron_as_megatron", "load_megatron_checkpoint", "mapping_for", "megatron_family",
    "save_megatron_checkpoint", "to_te_names",
]
