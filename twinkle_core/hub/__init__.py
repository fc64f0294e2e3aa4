"""Resolve model and dataset ids (ModelScope, Hugging Face, installed packages, local paths) to local files."""
from .datasets import ResolvedDataset, dataset_problems, resolve_dataset
from .errors import HubError, HubUnreachable
from .ids import ParsedId, is_offline, parse_id
from .local import id_problems
from .models import ResolvedModel, check_weight_files, copy_processor_files, resolve_model

__all__ = [
    "HubError",
    "HubUnreachable",
    "ParsedId",
    "ResolvedDataset",
    "ResolvedModel",
    "check_weight_files",
    "copy_processor_files",
    "dataset_problems",
    "id_problems",
    "is_offline",
    "parse_id",
    "resolve_dataset",
    "resolve_model",
]
