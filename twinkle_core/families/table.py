"""The README's supported-models table, generated from the registry."""
from __future__ import annotations

from pathlib import Path

from twinkle_core.families.registry import families

START, END = "<!-- families:start -->", "<!-- families:end -->"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _template(family) -> str:
    """A language model's chat template, or an embedding model's pooling."""
    return f"{family.pooling} pooling" if family.is_embedding else f"`{family.chat_template}`"


def render_families_table() -> str:
    rows = ["| family | model ids | model_type | MoE | thinking | tools | template / pooling | Megatron | notes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for f in families():
        moe = "dense + MoE" if f.has_moe and len(f.moe_model_types) < len(f.model_types) else _yes(f.has_moe)
        rows.append(f"| {f.title} | {f.model_ids} | {', '.join(f'`{t}`' for t in f.model_types)} | {moe} | "
                    f"{_yes(f.thinking)} | {_yes(f.tools)} | {_template(f)} | {_yes(f.megatron)} | {f.notes} |")
    return "\n".join(rows)


def update_readme(path: str | Path) -> bool:
    """Rewrite the table between the markers; return whether the file changed."""
    path = Path(path)
    text = path.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{path} lacks the {START} / {END} markers around the families table.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{render_families_table()}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text
