"""Vision-language chat rows: user turns that carry images and videos.

Accepted layouts, each normalised to ms-swift's (string contents with `<image>` / `<video>` placeholders,
in order, and top-level `images` / `videos` lists of located references):

    {"messages": [{"role": "user", "content": "<image>What colour is it?"}, ...], "images": ["cat.png"]}
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                               {"type": "text", "text": "What colour is it?"}]}, ...]}

Media paths are relative to the data file's folder (`folder`), or absolute, or pkg://, or base64 data
(twinkle_core.data.media). A placeholder count that differs from the media count, or a file that does not
open, makes the row bad; so does a placeholder in an assistant turn (replies are text).
"""
from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

from .errors import RowError
from .media import check_video, locate_media, open_image
from .validate import CHAT_ROW_KEYS, validate_chat_row

PLACEHOLDERS = {"image": "<image>", "video": "<video>"}
MEDIA_KEYS = {"image": "images", "video": "videos"}
BYTES_URL = "data:application/octet-stream;base64,"  # raw bytes: the decoder finds the format itself
ROW_KEYS = CHAT_ROW_KEYS | set(MEDIA_KEYS.values())
_PART_KEYS = {"image": ("image", "url", "path", "image_url"), "video": ("video", "url", "path", "video_url")}


def _part_ref(part: dict, kind: str, where: str):
    for key in _PART_KEYS[kind]:
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI's {"image_url": {"url": ...}}
            value = value.get("url")
        if value is not None:
            return value
    raise RowError(f"{where} is a {kind} part without a reference; give it as {{\"type\": \"{kind}\", "
                   f"\"{kind}\": path}}")


def _flatten_content(content: list, where: str, found: dict[str, list]) -> str:
    """A transformers content list as text with placeholders; its media references go into `found`."""
    text = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url", "video", "video_url"):
            kind = kind.removesuffix("_url")
            found[kind].append(_part_ref(part, kind, at))
            text.append(PLACEHOLDERS[kind])
        else:
            raise RowError(f"{at} is {part!r}; a content part is {{\"type\": \"text\", \"text\": ...}}, "
                           "{\"type\": \"image\", \"image\": ...} or {\"type\": \"video\", \"video\": ...}")
    return "".join(text)


def _media_list(row: dict, key: str) -> list:
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise RowError(f"'{key}' is {type(value).__name__}, expected a list of paths or base64 strings")
    # ms-swift also writes {"path": ...} or {"bytes": ...} objects (datasets' Image feature, e.g. in parquet).
    items = [item.get("bytes") or item.get("path") if isinstance(item, dict) else item for item in value]
    return [BYTES_URL + base64.b64encode(item).decode() if isinstance(item, bytes) else item for item in items]


def _flatten_messages(row: dict) -> tuple[list[dict], dict[str, list]]:
    messages = row.get("messages")
    if not isinstance(messages, list):
        return messages, {"image": [], "video": []}  # the chat validator names the problem
    found: dict[str, list] = {"image": [], "video": []}
    flat = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _flatten_content(message["content"], f"messages[{index}].content", found)}
        flat.append(message)
    return flat, found


def validate_vision_row(row: Any, folder: Path | None = None) -> dict:
    """The row in ms-swift's layout, its media located and checked to open; RowError when it is bad."""
    if not isinstance(row, dict):
        raise RowError(f"row is {type(row).__name__}, expected a JSON object")
    messages, inline = _flatten_messages(row)
    normalised = validate_chat_row({**row, "messages": messages})
    media = {}
    for kind, key in MEDIA_KEYS.items():
        listed = _media_list(row, key)
        if listed and inline[kind]:
            raise RowError(f"the row lists '{key}' and also has {kind} parts in its messages; use one layout")
        refs = listed or inline[kind]
        placeholder = PLACEHOLDERS[kind]
        for index, message in enumerate(normalised["messages"]):
            if message["role"] == "assistant" and placeholder in (message.get("content") or ""):
                raise RowError(f"messages[{index}] is an assistant reply with a {placeholder} placeholder; "
                               f"{key} ride on user turns")
        count = sum((m.get("content") or "").count(placeholder) for m in normalised["messages"])
        if count != len(refs):
            raise RowError(f"{count} {placeholder} placeholder(s) in the messages but {len(refs)} {key}; "
                           f"each of the row's {key} needs one {placeholder} where it goes")
        media[key] = [locate_media(ref, folder, f"{key}[{i}]") for i, ref in enumerate(refs)]
    for index, ref in enumerate(media["images"]):
        open_image(ref, f"images[{index}]")
    for index, ref in enumerate(media["videos"]):
        check_video(ref, f"videos[{index}]")
    normalised.update(media)
    return normalised


def content_list_messages(row: dict) -> list[dict]:
    """A normalised row's messages in the transformers content-list layout, each placeholder a part that
    names its (located) medium: a conversation that carries its own media, e.g. a prompt for generation."""
    pending = {kind: iter(row.get(key) or []) for kind, key in MEDIA_KEYS.items()}
    split = re.compile("(" + "|".join(re.escape(p) for p in PLACEHOLDERS.values()) + ")")
    kinds = {placeholder: kind for kind, placeholder in PLACEHOLDERS.items()}
    messages = []
    for message in row["messages"]:
        content = message.get("content")
        if not isinstance(content, str) or not split.search(content):
            messages.append(message)
            continue
        parts = []
        for piece in split.split(content):
            if piece in kinds:
                parts.append({"type": kinds[piece], kinds[piece]: next(pending[kinds[piece]])})
            elif piece:
                parts.append({"type": "text", "text": piece})
        messages.append({**message, "content": parts})
    return messages


def content_text(content) -> str:
    """A message's content as text: a content list's text parts, its media shown as [image] / [video]."""
    if isinstance(content, list):
        return "".join(part.get("text", "") if part.get("type") == "text" else f"[{part.get('type')}] "
                       for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""
