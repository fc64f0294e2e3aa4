"""Tokenise a data file once and cache the result under a content-derived key."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_dir
from ..hashing import hash_file, hash_json
from ..paths import cache_dir
from .errors import ChatTemplateError, DatasetError, RowError
from .formats import get_row_format
from .rows import BadRow, check_fraction, load_rows, report_bad_rows
from .templates import use_chat_template

logger = logging.getLogger(__name__)

# Bump when the encoding or the stored layout changes, so stale cache entries are not reused.
# 2: tools and reasoning rendered, replies located in the whole conversation, GLM-style turn ends trained.
FORMAT_VERSION = 2
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    "preprocessor_config.json",  # a vision model's image sizes and normalisation
)
MAX_BAD_STORED = 1000  # meta.json lists at most this many bad rows; num_bad is always the true count


@dataclass(frozen=True)
class TokenizedDataset:
    """A cache entry: `path` holds data.parquet and meta.json."""

    path: Path
    content_hash: str
    num_rows: int  # stored sequences (packed sequences when packing)
    num_examples: int  # encoded source rows
    num_bad: int
    num_tokens: int
    num_trained_tokens: int
    bad: tuple[BadRow, ...]


def _cache_key(dataset_path: Path, tokenizer_path: Path, tokenizer, settings: dict) -> str:
    files = {name: hash_file(tokenizer_path / name) for name in TOKENIZER_FILES if (tokenizer_path / name).is_file()}
    return hash_json({
        "dataset": hash_file(dataset_path),
        "tokenizer_files": files,
        "chat_template": tokenizer.chat_template,
        "format_version": FORMAT_VERSION,
        **settings,
    })


def _encode_rows(dataset_path: Path, tokenizer, kind: str, max_length: int, max_bad_fraction: float,
                 enable_thinking: bool, encode_options: dict):
    """Encoded, truncated examples, all bad rows (unreadable, unrenderable, or left untrained by truncation)
    and the number of good source rows (a row may give several examples)."""
    loaded = load_rows(dataset_path, kind, max_bad_fraction)
    row_format = get_row_format(kind)
    examples, bad, truncated, source_rows = [], list(loaded.bad), 0, 0
    for row, line in zip(loaded.rows, loaded.lines):
        try:
            encoded = row_format.encode(tokenizer, row, enable_thinking=enable_thinking, **encode_options)
        except (ChatTemplateError, RowError) as error:  # e.g. a Mistral tool call without a 9-character id
            bad.append(BadRow(str(dataset_path), line, str(error)))
            continue
        encoded = encoded if isinstance(encoded, list) else [encoded]  # a row may give several examples
        truncated += any(row_format.was_truncated(example, max_length) for example in encoded)
        encoded = [row_format.truncate(example, max_length) for example in encoded]
        if any(row_format.count_tokens(example)[1] == 0 for example in encoded):
            bad.append(BadRow(str(dataset_path), line, f"no trained token within max_length={max_length}: "
                              "the reply starts after the cut; raise max_length or shorten the prompt"))
            continue
        examples.extend(encoded)
        source_rows += 1
    if truncated:
        logger.info("%s: truncated %d of %d rows to max_length=%d",
                    dataset_path, truncated, len(loaded.rows), max_length)
    if len(bad) > len(loaded.bad):  # load_rows already reported its own bad rows
        report_bad_rows(bad, len(loaded.rows) + len(loaded.bad), max_bad_fraction, str(dataset_path))
    return examples, bad, source_rows


def tokenize_dataset(
    dataset_path: str | Path,
    tokenizer_path: str | Path,
    *,
    kind: str = "chat",
    max_length: int = 1024,
    packing: bool = False,
    max_bad_fraction: float = 0.01,
    enable_thinking: bool = True,
    chat_template: str | None = None,
    chosen_template: str | None = None,
    trust_remote_code: bool = False,
    encode_options: dict | None = None,
) -> TokenizedDataset:
    """Encode every row of a data file with a local tokenizer directory, or reuse the cached result.

    enable_thinking=False trains chat replies without their reasoning. `chat_template` names a family template
    (see chat_template_names()) for a tokenizer that ships none; a tokenizer's own template is kept, unless
    `chosen_template` (Jinja source the user chose) replaces it. Chat rows need one of the three.
    `encode_options` go to the row kind's encoder (e.g. the query prompt of embedding pairs) and into the key.
    """
    from transformers import AutoTokenizer  # heavy; only needed here, so importing the package stays light

    row_format = get_row_format(kind)
    encode_options = dict(encode_options or {})
    check_fraction(max_bad_fraction)
    if packing and not row_format.packable:
        raise ValueError(f"packing=True: {kind} rows cannot be packed")
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be a positive number of tokens")
    dataset_path, tokenizer_path = Path(dataset_path), Path(tokenizer_path)
    if not dataset_path.is_file():
        raise DatasetError(f"dataset_path={str(dataset_path)!r} does not exist or is not a file")
    if not tokenizer_path.is_dir():
        raise ValueError(
            f"tokenizer_path={str(tokenizer_path)!r} is not a directory; pass a local model or tokenizer folder"
        )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    use_chat_template(tokenizer, chosen_template, chat_template, required=row_format.needs_chat_template)
    encoder = row_format.load_encoder(tokenizer, tokenizer_path)
    settings = {"kind": kind, "max_length": max_length, "packing": packing, "enable_thinking": enable_thinking}
    if encode_options:
        settings["encode_options"] = encode_options
    key = _cache_key(dataset_path, tokenizer_path, tokenizer, settings)
    final = cache_dir("tokenized") / key[:16]
    if (final / "meta.json").is_file():
        logger.info("reusing tokenised data %s for %s", final, dataset_path)
        dataset = read_meta(final)
        rows_read = json.loads((final / "meta.json").read_text()).get("num_source_rows", dataset.num_examples)
        total = rows_read + dataset.num_bad
        report_bad_rows(list(dataset.bad), total, max_bad_fraction, str(dataset_path), num_bad=dataset.num_bad)
        return dataset
    examples, bad, source_rows = _encode_rows(dataset_path, encoder, kind, max_length, max_bad_fraction, enable_thinking,
                                 encode_options)
    rows = row_format.pack(examples, max_length) if packing else examples
    counts = [row_format.count_tokens(row) for row in rows]
    meta = {
        "content_hash": key, "format_version": FORMAT_VERSION, **settings,
        "num_rows": len(rows), "num_examples": len(examples), "num_source_rows": source_rows, "num_bad": len(bad),
        "num_tokens": sum(tokens for tokens, _ in counts),
        "num_trained_tokens": sum(trained for _, trained in counts),
        "bad": [vars(row) for row in bad[:MAX_BAD_STORED]],
    }
    with atomic_dir(final) as tmp:
        _write_parquet(rows, tmp / "data.parquet")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    logger.info("tokenised %s: %d rows, %d tokens (%d trained) in %s",
                dataset_path, len(rows), meta["num_tokens"], meta["num_trained_tokens"], final)
    return read_meta(final)


def _column_type(values: list) -> pa.DataType:
    """int32 token lists, or lists of them (an embedding row's hard negatives or a vision row's media grids), or
    numbers (a preference pair's reference log-probs), or float32 lists (a vision row's pixel patches)."""
    if values and isinstance(values[0], float):
        return pa.float64()
    if any(value and isinstance(value[0], float) for value in values if isinstance(value, list)):
        return pa.list_(pa.float32())
    if values and isinstance(values[0], str):  # a prompt row's text and fields
        return pa.string()
    nested = any(value and isinstance(value[0], list) for value in values)
    return pa.list_(pa.list_(pa.int32())) if nested else pa.list_(pa.int32())


def _write_parquet(rows: list[dict], path: Path) -> None:
    columns = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        columns[name] = pa.array(values, type=_column_type(values))
    pq.write_table(pa.table(columns), path)


def read_meta(path: str | Path) -> TokenizedDataset:
    """The TokenizedDataset described by a cache entry's meta.json."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    return TokenizedDataset(
        path=path, content_hash=meta["content_hash"], num_rows=meta["num_rows"], num_examples=meta["num_examples"],
        num_bad=meta["num_bad"], num_tokens=meta["num_tokens"], num_trained_tokens=meta["num_trained_tokens"],
        bad=tuple(BadRow(**row) for row in meta["bad"]),
    )


def load_tokenized(path: str | Path | TokenizedDataset) -> list[dict]:
    """The stored rows as dicts of int lists (input_ids, labels, and position_ids when packed); float lists (a
    vision row's pixel patches) as float32 numpy arrays, which load several times faster than Python floats."""
    if isinstance(path, TokenizedDataset):
        path = path.path
    table = pq.read_table(Path(path) / "data.parquet")
    floats = [field.name for field in table.schema
              if pa.types.is_list(field.type) and pa.types.is_floating(field.type.value_type)]
    rows = table.drop(floats).to_pylist() if floats else table.to_pylist()
    for name in floats:
        column = table.column(name).combine_chunks()
        offsets, values = column.offsets.to_numpy(), column.values.to_numpy()
        for row, start, end in zip(rows, offsets[:-1], offsets[1:]):
            row[name] = values[start:end]
    return rows
