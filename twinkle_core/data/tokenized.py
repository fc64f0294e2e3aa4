"""Tokenise a data file once and cache the result under a content-derived key."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ..atomic import atomic_dir
from ..hashing import hash_file, hash_json
from ..paths import cache_dir
from .errors import ChatTemplateError, DatasetError, RowError
from .formats import get_row_format
from .parallel import check_num_proc, map_chunks
from .readers import SUFFIXES, chunked, read_record_chunks, read_records
from .row_store import ROWS_FILE, RowWriter, TokenizedRows, record_batch
from .rows import BadRow, IgnoredFields, UnreadKeys, check_fraction, check_records, report_bad_rows
from .templates import renders_tools, use_chat_template

logger = logging.getLogger(__name__)

# Bump when the encoding or the stored layout changes, so stale cache entries are not reused.
# 2: tools and reasoning rendered, replies located in the whole conversation, GLM-style turn ends trained.
# 3: rows in a memory-mapped Arrow file (data.arrow) instead of parquet; meta.json counts the sequences.
FORMAT_VERSION = 3
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    "preprocessor_config.json",  # a vision model's image sizes and normalisation
)
MAX_BAD_STORED = 1000  # meta.json lists at most this many bad rows; num_bad is always the true count
CHUNK_ROWS = 1000  # rows a worker encodes at a time: the memory held is a few chunks per worker


@dataclass(frozen=True)
class TokenizedDataset:
    """A cache entry: `path` holds data.arrow (row_store) and meta.json."""

    path: Path
    content_hash: str
    num_rows: int  # stored sequences (packed sequences when packing)
    num_examples: int  # encoded source rows
    num_bad: int
    num_tokens: int
    num_trained_tokens: int
    bad: tuple[BadRow, ...]
    ignored: IgnoredFields  # what the rows carry that training ignores (row keys, tool schemas)


def _cache_key(data_hash: str, tokenizer_path: Path, tokenizer, settings: dict) -> str:
    files = {name: hash_file(tokenizer_path / name) for name in TOKENIZER_FILES if (tokenizer_path / name).is_file()}
    return hash_json({
        "dataset": data_hash,
        "tokenizer_files": files,
        "chat_template": tokenizer.chat_template,
        "format_version": FORMAT_VERSION,
        **settings,
    })


@dataclass(frozen=True)
class EncodeSpec:
    """What a worker process needs to encode rows as tokenize_dataset does (small and picklable)."""

    dataset_path: str
    tokenizer_path: str
    kind: str
    max_length: int
    enable_thinking: bool
    encode_options: str  # JSON: the spec is a cache key for the loaded encoder
    trust_remote_code: bool
    chat_template: str | None
    chosen_template: str | None


_ENCODERS: dict[EncodeSpec, tuple] = {}  # per process; forked workers inherit the parent's


def _load_encoder(spec: EncodeSpec) -> tuple:
    """(tokenizer, the row kind's encoder), loaded once per process."""
    if spec not in _ENCODERS:
        from transformers import AutoTokenizer  # heavy; only needed here, so importing the package stays light

        row_format = get_row_format(spec.kind)
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path, trust_remote_code=spec.trust_remote_code)
        use_chat_template(tokenizer, spec.chosen_template, spec.chat_template,
                          required=row_format.needs_chat_template)
        _ENCODERS[spec] = tokenizer, row_format.load_encoder(tokenizer, Path(spec.tokenizer_path))
    return _ENCODERS[spec]


@dataclass
class EncodedChunk:
    """A chunk's examples (truncated) with their (tokens, trained) counts, its bad rows, and its tallies; the
    examples as an Arrow record batch (`batch`) when they go to the file as they are (no packing)."""

    examples: list[dict] = field(default_factory=list)
    counts: list[tuple[int, int]] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    records: int = 0  # every record read, good or bad
    source_rows: int = 0  # rows that gave examples
    truncated: int = 0
    sequences: int = 0  # texts the model reads in these examples
    unread: UnreadKeys = field(default_factory=UnreadKeys)
    tools_rows: int = 0  # encoded rows that carry tool schemas
    batch: Any = None


def _encoded_rows(spec: EncodeSpec, encoder, rows: list[tuple[int, dict]], out: EncodedChunk):
    """(line, the row's examples) of every row that encodes: in one batched call where the kind has one."""
    row_format, options = get_row_format(spec.kind), json.loads(spec.encode_options)
    if row_format.encode_batch is not None:
        encoded = row_format.encode_batch(encoder, [row for _, row in rows], enable_thinking=spec.enable_thinking,
                                          **options)
        for (line, _), example in zip(rows, encoded):
            if isinstance(example, (ChatTemplateError, RowError)):
                out.bad.append(BadRow(spec.dataset_path, line, str(example)))
            else:
                yield line, example
        return
    for line, row in rows:
        try:
            yield line, row_format.encode(encoder, row, enable_thinking=spec.enable_thinking, **options)
        except (ChatTemplateError, RowError) as error:  # e.g. a Mistral tool call without a 9-character id
            out.bad.append(BadRow(spec.dataset_path, line, str(error)))


def encode_chunk(spec: EncodeSpec, chunk: list[tuple[int, Any]], to_arrow: bool = False) -> EncodedChunk:
    """Parse, validate, encode and truncate the (line, record) pairs of one chunk; a bad row is recorded
    with its line (unreadable, invalid, unrenderable, or left untrained by truncation), never raised.
    `to_arrow`: hand the examples back as one Arrow record batch, which crosses processes as flat buffers."""
    _, encoder = _load_encoder(spec)
    row_format, out = get_row_format(spec.kind), EncodedChunk(records=len(chunk))
    rows = list(check_records(chunk, row_format, spec.dataset_path, Path(spec.dataset_path).parent, out.bad,
                              out.unread))
    with_tools = {line for line, row in rows if row.get("tools")}
    for line, encoded in _encoded_rows(spec, encoder, rows, out):
        encoded = encoded if isinstance(encoded, list) else [encoded]  # a row may give several examples
        out.truncated += any(row_format.was_truncated(example, spec.max_length) for example in encoded)
        encoded = [row_format.truncate(example, spec.max_length) for example in encoded]
        counts = [row_format.count_tokens(example) for example in encoded]
        if any(trained == 0 for _, trained in counts):
            out.bad.append(BadRow(spec.dataset_path, line, f"no trained token within max_length={spec.max_length}: "
                                  "the reply starts after the cut; raise max_length or shorten the prompt"))
            continue
        out.examples.extend(encoded)
        out.counts.extend(counts)
        out.sequences += sum(row_format.num_sequences(example) for example in encoded)
        out.source_rows += 1
        out.tools_rows += line in with_tools
    out.bad.sort(key=lambda bad: bad.line)  # validation and encoding failures, in file order
    if to_arrow and out.examples:
        out.batch, out.examples = record_batch(out.examples), []
    return out


class StreamPacker:
    """Packs examples as they arrive, next-fit in order exactly as `row_format.pack` packs the whole list: a
    sequence is closed when the next example would not fit, so only the open sequence is held."""

    def __init__(self, row_format, max_length: int):
        self.row_format, self.max_length = row_format, max_length
        self.open: list[dict] = []
        self.used = 0

    def add(self, examples: list[dict]) -> list[dict]:
        """The sequences that `examples` closed."""
        closed = []
        for example in examples:
            length = len(example["input_ids"])
            if self.open and self.used + length > self.max_length:
                closed.extend(self.finish())
            self.open.append(example)
            self.used += length
        return closed

    def finish(self) -> list[dict]:
        """The open sequence, packed (empty when none is open)."""
        packed = self.row_format.pack(self.open, self.max_length) if self.open else []
        self.open, self.used = [], 0
        return packed


@dataclass
class _Tally:
    records: int = 0
    source_rows: int = 0
    truncated: int = 0
    examples: int = 0
    tokens: int = 0
    trained: int = 0
    sequences: int = 0
    rows: int = 0  # stored rows (packed sequences when packing)
    bad_count: int = 0
    bad: list[BadRow] = field(default_factory=list)
    unread: UnreadKeys = field(default_factory=UnreadKeys)
    tools_rows: int = 0


def _encode_to(rows_file: Path, spec: EncodeSpec, packing: bool, num_proc: int, chunks) -> _Tally:
    """Stream the data file through `num_proc` encoding workers into `rows_file`, a chunk at a time."""
    row_format, tally = get_row_format(spec.kind), _Tally()
    packer = StreamPacker(row_format, spec.max_length) if packing else None
    writer = RowWriter(rows_file)

    def store(batch, counts: list[tuple[int, int]], sequences: int) -> None:
        if batch is not None:
            writer.write_batch(batch)
            tally.rows += batch.num_rows
        tally.tokens += sum(tokens for tokens, _ in counts)
        tally.trained += sum(trained for _, trained in counts)
        tally.sequences += sequences

    def store_packed(packed: list[dict]) -> None:
        if packed:
            store(record_batch(packed), [row_format.count_tokens(row) for row in packed],
                  sum(row_format.num_sequences(row) for row in packed))

    try:
        for chunk in map_chunks(partial(encode_chunk, spec, to_arrow=packer is None), chunks, num_proc):
            tally.records += chunk.records
            tally.source_rows += chunk.source_rows
            tally.truncated += chunk.truncated
            tally.examples += len(chunk.counts)
            tally.bad_count += len(chunk.bad)
            tally.bad.extend(chunk.bad[:MAX_BAD_STORED - len(tally.bad)])
            tally.unread.add(chunk.unread)
            tally.tools_rows += chunk.tools_rows
            if packer is None:
                store(chunk.batch, chunk.counts, chunk.sequences)
            else:
                store_packed(packer.add(chunk.examples))
        if packer is not None:
            store_packed(packer.finish())
    finally:
        writer.close()
    return tally


def tokenize_dataset(
    dataset_path: str | Path | Any,
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
    num_proc: int | None = None,
    chunk_rows: int = CHUNK_ROWS,
) -> TokenizedDataset:
    """Encode every row of a data file with a local tokenizer directory, or reuse the cached result.

    The file is read as a stream and encoded by `num_proc` worker processes (None: the machine's cores, see
    parallel.default_num_proc), `chunk_rows` rows at a time, and written as it goes: the memory held is set by
    the chunk, not by the file. The result does not depend on num_proc or chunk_rows (neither is in the key).
    enable_thinking=False trains chat replies without their reasoning. `chat_template` names a family template
    (see chat_template_names()) for a tokenizer that ships none; a tokenizer's own template is kept, unless
    `chosen_template` (Jinja source the user chose) replaces it. Chat rows need one of the three.
    `encode_options` go to the row kind's encoder (e.g. the query prompt of embedding pairs) and into the key.

    `dataset_path` may also be a stream (twinkle_core.hub.open_stream): an object with `dataset_id`,
    `content_hash` (its rows' key) and `records()` yielding (row number, row); its rows are encoded as they are
    read, and nothing else is written.
    """
    row_format = get_row_format(kind)
    encode_options = dict(encode_options or {})
    check_fraction(max_bad_fraction)
    num_proc = check_num_proc(num_proc)
    if packing and not row_format.packable:
        raise ValueError(f"packing=True: {kind} rows cannot be packed")
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be a positive number of tokens")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be at least 1")
    tokenizer_path = Path(tokenizer_path)
    stream = None if isinstance(dataset_path, (str, Path)) else dataset_path
    if stream is None:
        dataset_path = Path(dataset_path)
        if not dataset_path.is_file():
            raise DatasetError(f"dataset_path={str(dataset_path)!r} does not exist or is not a file")
        if dataset_path.suffix.lower() not in SUFFIXES:
            read_records(dataset_path)  # raises the unsupported-suffix error before the tokenizer loads
    if not tokenizer_path.is_dir():
        raise ValueError(
            f"tokenizer_path={str(tokenizer_path)!r} is not a directory; pass a local model or tokenizer folder"
        )
    source = str(dataset_path) if stream is None else stream.dataset_id
    spec = EncodeSpec(source, str(tokenizer_path), kind, max_length, enable_thinking,
                      json.dumps(encode_options, sort_keys=True), trust_remote_code, chat_template, chosen_template)
    if stream is None:
        data_hash, chunks = (lambda: hash_file(dataset_path)), (lambda: read_record_chunks(dataset_path, chunk_rows))
    else:
        data_hash, chunks = (lambda: stream.content_hash), (lambda: chunked(stream.records(), chunk_rows))
    try:
        return _tokenize(spec, packing, max_bad_fraction, num_proc, data_hash, chunks)
    finally:
        _ENCODERS.pop(spec, None)  # the workers are done with it; a flow process may tokenise many sets


def _tokenize(spec: EncodeSpec, packing: bool, max_bad_fraction: float, num_proc: int, data_hash,
              chunks) -> TokenizedDataset:
    """tokenize_dataset once its arguments are checked: `data_hash()` keys the rows, `chunks()` reads them."""
    tokenizer, _ = _load_encoder(spec)
    dataset_path, tokenizer_path = spec.dataset_path, Path(spec.tokenizer_path)
    kind, max_length, enable_thinking = spec.kind, spec.max_length, spec.enable_thinking
    encode_options = json.loads(spec.encode_options)
    settings = {"kind": kind, "max_length": max_length, "packing": packing, "enable_thinking": enable_thinking}
    if encode_options:
        settings["encode_options"] = encode_options
    key = _cache_key(data_hash(), tokenizer_path, tokenizer, settings)
    final = cache_dir("tokenized") / key[:16]
    if (final / "meta.json").is_file():
        logger.info("reusing tokenised data %s for %s", final, dataset_path)
        dataset = read_meta(final)
        rows_read = json.loads((final / "meta.json").read_text()).get("num_source_rows", dataset.num_examples)
        total = rows_read + dataset.num_bad
        report_bad_rows(list(dataset.bad), total, max_bad_fraction, str(dataset_path), num_bad=dataset.num_bad)
        _warn_ignored(dataset, dataset_path)
        return dataset
    with atomic_dir(final) as tmp:
        tally = _encode_to(tmp / ROWS_FILE, spec, packing, num_proc, chunks())
        report_bad_rows(tally.bad, tally.records, max_bad_fraction, str(dataset_path), num_bad=tally.bad_count)
        if tally.truncated:
            logger.info("%s: truncated %d of %d rows to max_length=%d",
                        dataset_path, tally.truncated, tally.records - tally.bad_count, max_length)
        # The template is part of the key, so whether it drops the tools is stored with the rows.
        dropped_tools = tally.tools_rows if tally.tools_rows and not renders_tools(tokenizer) else 0
        meta = {
            "content_hash": key, "format_version": FORMAT_VERSION, **settings,
            "num_rows": tally.rows, "num_examples": tally.examples, "num_source_rows": tally.source_rows,
            "num_bad": tally.bad_count, "num_tokens": tally.tokens, "num_trained_tokens": tally.trained,
            "num_sequences": tally.sequences, "bad": [vars(row) for row in tally.bad],
            "ignored_fields": dict(sorted(tally.unread.keys.items(), key=lambda item: (-item[1], item[0]))),
            "ignored_field_rows": tally.unread.rows, "untrained_tools_rows": dropped_tools,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    logger.info("tokenised %s: %d rows, %d tokens (%d trained) in %s",
                dataset_path, meta["num_rows"], meta["num_tokens"], meta["num_trained_tokens"], final)
    dataset = read_meta(final)
    _warn_ignored(dataset, dataset_path)
    return dataset


def _warn_ignored(dataset: TokenizedDataset, source: str) -> None:
    """One warning per dataset for its ignored row keys, and one for its dropped tools: not one per row."""
    for message in dataset.ignored.warnings(source):
        logger.warning(message)


def write_rows(rows: list[dict], directory: Path) -> None:
    """Store `rows` as a tokenised set's rows file in `directory` (beside which a meta.json must go)."""
    writer = RowWriter(Path(directory) / ROWS_FILE)
    try:
        writer.write(rows)
    finally:
        writer.close()


def read_meta(path: str | Path) -> TokenizedDataset:
    """The TokenizedDataset described by a cache entry's meta.json."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    # An entry written before these counts reads as nothing ignored.
    ignored = IgnoredFields(
        kind=meta.get("kind", "chat"), rows_read=meta.get("num_source_rows", meta["num_examples"]) + meta["num_bad"],
        rows=meta.get("ignored_field_rows", 0), keys=tuple(meta.get("ignored_fields", {}).items()),
        tools_rows=meta.get("untrained_tools_rows", 0),
    )
    return TokenizedDataset(
        path=path, content_hash=meta["content_hash"], num_rows=meta["num_rows"], num_examples=meta["num_examples"],
        num_bad=meta["num_bad"], num_tokens=meta["num_tokens"], num_trained_tokens=meta["num_trained_tokens"],
        bad=tuple(BadRow(**row) for row in meta["bad"]), ignored=ignored,
    )


def load_tokenized(path: str | Path | TokenizedDataset) -> TokenizedRows:
    """The stored rows, opened lazily (memory-mapped): each row, when asked for, is a dict of int lists
    (input_ids, labels, and position_ids when packed), float lists (a vision row's pixel patches) as float32
    numpy arrays."""
    return TokenizedRows(path.path if isinstance(path, TokenizedDataset) else path)
