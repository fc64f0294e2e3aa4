"""Tiny embedding models for tests: a BERT encoder (all-MiniLM-L6-v2's tokenizer, random weights, no dropout)
saved as a sentence-transformers directory, and Qwen3 decoders read at their last token."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertModel, GteConfig, GteModel

from family_models import save_tiny_family_model
from twinkle_core.hub import resolve_model

MINILM = "pkg://all_minilm_l6_v2/model.zip"

# Rows of different shapes: 0-2 hard negatives, and 9 of them, so a batch of 4 leaves a last micro-batch of 1.
PAIRS = [
    {"query": "Where is the Eiffel Tower?", "positive": "The Eiffel Tower stands in Paris.",
     "negatives": ["The Colosseum is in Rome.", "Big Ben is in London."]},
    {"query": "What do cats eat?", "positive": "Cats eat meat and fish.", "negatives": ["Cows eat grass."]},
    {"query": "How tall is Everest?", "positive": "Everest is 8849 metres tall.", "negatives": []},
    {"query": "Who painted the Mona Lisa?", "positive": "Leonardo da Vinci painted the Mona Lisa.",
     "negatives": ["Van Gogh painted Sunflowers."]},
    {"query": "When does water boil?", "positive": "Water boils at 100 degrees Celsius at sea level.",
     "negatives": ["Water freezes at zero degrees.", "Ice floats on water."]},
    {"query": "What is the capital of Japan?", "positive": "Tokyo is the capital of Japan.", "negatives": []},
    {"query": "Which planet is red?", "positive": "Mars is called the red planet.",
     "negatives": ["Jupiter is the largest planet."]},
    {"query": "What language is spoken in Brazil?", "positive": "People in Brazil speak Portuguese.",
     "negatives": ["People in Mexico speak Spanish."]},
    {"query": "How many legs does a spider have?", "positive": "A spider has eight legs.",
     "negatives": ["An insect has six legs."]},
]


def write_pairs(path: Path, rows: list[dict] = PAIRS) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def save_tiny_bert(directory: str | Path, pooling: str | None = "mean", seed: int = 0) -> Path:
    """A 2-layer, 32-wide BertModel; with `pooling` also sentence-transformers' modules.json and pooling config."""
    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MINILM).path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if pooling:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "last"}))
    return directory


def save_tiny_gte(directory: str | Path, seed: int = 0) -> Path:
    """transformers' native `gte` encoder (rotary positions), 2 layers, 32 wide, no dropout; no pooling file
    (the family's CLS pooling applies)."""
    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MINILM).path)
    torch.manual_seed(seed)
    config = GteConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0)
    GteModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_qwen3(directory: str | Path) -> Path:
    """The tiny dense Qwen3 of the family tests (a causal-LM checkpoint: AutoModel reads its decoder)."""
    return save_tiny_family_model("qwen3", Path(directory), "dense")
