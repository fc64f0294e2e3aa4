"""The conversation format of each supported model family, one Jinja chat template per file.

Each file's header names the checkpoint it reproduces, what was checked against it and where it deliberately
differs. The family registry maps a model family to one of these names.
"""
from __future__ import annotations

from importlib import resources

_SUFFIX = ".jinja"


def chat_template_names() -> list[str]:
    """The names get_chat_template accepts, sorted."""
    files = resources.files(__name__).iterdir()
    return sorted(entry.name.removesuffix(_SUFFIX) for entry in files if entry.name.endswith(_SUFFIX))


def get_chat_template(name: str) -> str:
    """The Jinja source of the chat template called `name`."""
    names = chat_template_names()
    if name not in names:
        raise ValueError(f"chat template {name!r} is unknown; use one of: {', '.join(names)}")
    return resources.files(__name__).joinpath(name + _SUFFIX).read_text(encoding="utf-8")
