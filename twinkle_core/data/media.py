"""Find, open and decode the images and videos that vision-language rows point at.

An image is a local path (relative to the data file's folder, or absolute), a `pkg://package/path`, or
base64 data (`data:image/png;base64,...` or the bare base64 text). A video is any of these too,
decoded with PyAV (FFmpeg's libraries in a wheel: the same decoder on CPU and GPU machines).
Every failure is a RowError: the row is bad, reported by file and line, and the data set goes on.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RowError

DATA_URL = re.compile(r"^data:[\w.+-]+/[\w.+-]+;base64,", re.IGNORECASE)
_BASE64 = re.compile(r"^[A-Za-z0-9+/\s]+={0,2}$")
BARE_BASE64_MIN = 128  # shorter strings are paths: no image fits in fewer base64 characters


def is_base64(ref: str) -> bool:
    return bool(DATA_URL.match(ref)) or (len(ref) >= BARE_BASE64_MIN and bool(_BASE64.match(ref[:4096])))


def _shown(ref: str) -> str:
    return ref if len(ref) <= 80 else f"{ref[:40]}...({len(ref)} characters)"


def locate_media(ref, folder: Path | None, where: str) -> str:
    """The reference a normalised row keeps: an absolute path, or the base64 text as it is."""
    if not isinstance(ref, str) or not ref.strip():
        raise RowError(f"{where} is {ref!r}, expected a path, a pkg:// path or base64 data")
    ref = ref.strip()
    if is_base64(ref):
        return ref
    if ref.startswith("pkg://"):
        from twinkle_core.hub.errors import HubError
        from twinkle_core.hub.ids import parse_id
        from twinkle_core.hub.local import local_target

        try:
            return str(local_target(parse_id(ref), ref))
        except HubError as error:
            raise RowError(f"{where}: {error}") from None
    path = Path(ref.removeprefix("file://")).expanduser()
    if not path.is_absolute() and folder is not None:
        path = folder / path
    if not path.is_file():
        relative = f" (relative to the data file's folder {str(folder)!r})" if folder and not Path(ref).is_absolute() else ""
        raise RowError(f"{where}: file {_shown(ref)!r} does not exist{relative}")
    return str(path.resolve())


def _base64_bytes(ref: str, where: str) -> bytes:
    text = DATA_URL.sub("", ref, count=1)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as error:
        raise RowError(f"{where}: base64 data {_shown(ref)!r} does not decode ({error})") from None


def _source(ref: str, where: str):
    """What a decoder opens: the path, or the decoded base64 bytes as a file."""
    return io.BytesIO(_base64_bytes(ref, where)) if is_base64(ref) else ref


def open_image(ref: str, where: str = "image"):
    """The image as an RGB PIL image (decoded whole, so a truncated file fails here)."""
    from PIL import Image, UnidentifiedImageError

    source = _source(ref, where)
    try:
        with Image.open(source) as image:
            image.load()
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as error:
        raise RowError(f"{where}: {_shown(ref)!r} is not a readable image ({error})") from None


@dataclass(frozen=True)
class Video:
    """Sampled frames ([T, H, W, 3] uint8), the rate they were sampled at (frames per second) and each frame's
    time in seconds from the first decoded frame (empty: unknown; Qwen3-VL writes them into the prompt)."""

    frames: np.ndarray
    sampled_fps: float
    times: tuple[float, ...] = ()


def read_video(ref: str, fps: float = 2.0, max_frames: int = 64, where: str = "video") -> Video:
    """Frames sampled at `fps` (at most `max_frames`, spread evenly over the video when there are more).

    Times come from each frame's presentation timestamp, so variable-rate files sample by time, not index.
    """
    import av

    try:
        with av.open(_source(ref, where)) as container:
            if not container.streams.video:
                raise RowError(f"{where}: {_shown(ref)!r} has no video stream")
            stream = container.streams.video[0]
            decoded = [(float(frame.time or 0.0), frame.to_ndarray(format="rgb24")) for frame in container.decode(stream)]
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise RowError(f"{where}: {_shown(ref)!r} is not a readable video ({error})") from None
    if not decoded:
        raise RowError(f"{where}: {_shown(ref)!r} holds no frame")
    times = np.array([time for time, _ in decoded])
    duration = float(times[-1] - times[0]) or 1.0 / fps
    wanted = max(1, min(max_frames, int(round(duration * fps)) + 1, len(decoded)))
    targets = np.linspace(times[0], times[-1], wanted)
    picks = sorted({int(np.abs(times - target).argmin()) for target in targets})
    frames = np.stack([decoded[i][1] for i in picks])
    sampled_fps = (len(picks) - 1) / duration if len(picks) > 1 else fps
    return Video(frames, sampled_fps, tuple(float(times[i] - times[0]) for i in picks))


def check_video(ref: str, where: str) -> None:
    """Validation's check: the file opens and its first frame decodes (sampling waits for encoding)."""
    import av

    try:
        with av.open(_source(ref, where)) as container:
            if not container.streams.video:
                raise RowError(f"{where}: {_shown(ref)!r} has no video stream")
            next(container.decode(container.streams.video[0]))
    except StopIteration:
        raise RowError(f"{where}: {_shown(ref)!r} holds no frame") from None
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise RowError(f"{where}: {_shown(ref)!r} is not a readable video ({error})") from None
