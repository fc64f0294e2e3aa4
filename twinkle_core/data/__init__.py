"""Training data: load and validate rows, encode them with label masks, pack, batch and cache."""
from .chat_templates import chat_template_names, get_chat_template
from .collate import PaddingFreeRow, block_causal_mask, collate, collate_padding_free, shared_prefix_length
from .encode import IGNORE_INDEX, count_trained_tokens, encode_chat, encode_prompt, encode_text, truncate
from .errors import ChatTemplateError, DatasetError, RowError
from .formats import RowFormat, get_row_format, register_row_format, row_kinds
from .packing import pack_examples
from .rows import BadRow, LoadedRows, load_rows
from .spans import assistant_spans
from .templates import (DEFAULT_CHAT_TEMPLATE, ensure_chat_template, no_template_message, read_chat_template,
                        render_chat, use_chat_template)
from .row_store import TokenizedRows
from .tokenized import FORMAT_VERSION, TokenizedDataset, load_tokenized, read_meta, tokenize_dataset
from .validate import validate_chat_row, validate_text_row

__all__ = [
    "BadRow", "ChatTemplateError", "DEFAULT_CHAT_TEMPLATE", "DatasetError", "FORMAT_VERSION", "IGNORE_INDEX",
    "LoadedRows", "PaddingFreeRow", "RowError", "RowFormat", "TokenizedDataset", "TokenizedRows", "assistant_spans",
    "block_causal_mask",
    "chat_template_names", "collate", "collate_padding_free", "count_trained_tokens", "encode_chat", "encode_prompt",
    "encode_text",
    "ensure_chat_template", "get_chat_template", "get_row_format", "load_rows", "load_tokenized",
    "no_template_message", "pack_examples", "read_chat_template", "read_meta", "register_row_format", "render_chat",
    "row_kinds", "shared_prefix_length", "use_chat_template",
    "tokenize_dataset", "truncate", "validate_chat_row", "validate_text_row",
]
