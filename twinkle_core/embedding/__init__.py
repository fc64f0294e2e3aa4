"""Embedding models: their pooling and query prompt (settings), the sentence-transformers export (export)."""
