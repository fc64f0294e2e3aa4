"""sample_prompts: the first held-out conversations, cut before their last answer, for the demo."""
from __future__ import annotations

from prefect import task

from tasks.refs import DatasetRef
from twinkle_core.data import load_rows
from twinkle_core.data.vision_rows import content_list_messages


@task
def sample_prompts(dataset: DatasetRef, count: int, kind: str = "chat") -> list[list[dict]]:
    """Up to `count` conversations ending with a user turn (the model answers it); of chat rows, or the
    prompts of preference rows. Rows with images or videos give content lists naming their media files."""
    rows = load_rows(dataset.path, kind=kind, max_bad_fraction=1.0).rows
    prompts = []
    for row in rows[:count]:
        messages = content_list_messages(row) if row.get("images") or row.get("videos") else row["messages"]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        prompts.append(messages[:last_user + 1])
    return prompts
