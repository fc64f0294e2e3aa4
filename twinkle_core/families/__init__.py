"""Supported model families: model types, chat templates, MoE/thinking flags, LoRA targets."""
from twinkle_core.families import catalog as _catalog  # noqa: F401  (registers the families)
from twinkle_core.families.registry import (
    UNTESTED_PREFIX,
    ModelFamily,
    UnsupportedModelError,
    check_model_id,
    families,
    family_before_download,
    family_for_model_dir,
    family_for_model_id,
    family_for_model_type,
    get_family,
    register_family,
    remote_code_of,
    untested_family,
)
from twinkle_core.families.table import render_families_table, update_readme

__all__ = [
    "ModelFamily", "UnsupportedModelError", "check_model_id", "families", "family_before_download", "family_for_model_dir", "family_for_model_id",
    "family_for_model_type", "get_family", "register_family", "remote_code_of", "render_families_table",
    "untested_family", "update_readme", "UNTESTED_PREFIX",
]
