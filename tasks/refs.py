"""What tasks pass to each other: paths plus content hashes, never live objects."""
from __future__ import annotations

from pydantic import BaseModel

from twinkle_core.config.fields import ModelLoadFields


class ModelRef(ModelLoadFields):
    """A downloaded (or converted) model; its load options travel with it to every task that opens it."""

    model_id: str
    path: str
    content_hash: str
    backend: str = "transformers"


class DatasetRef(BaseModel):
    dataset_id: str
    path: str  # one local file; for a stream, what datasets.load_dataset(streaming=True) reads
    content_hash: str
    streaming: bool = False  # read row by row by the tokenize task (twinkle_core.hub.open_stream)


class TokenizedRef(BaseModel):
    path: str
    content_hash: str
    num_rows: int
    num_bad: int
    num_tokens: int
    num_trained_tokens: int


class BlendPart(BaseModel):
    dataset_id: str
    weight: float  # normalised: the weights of a blend sum to 1
    train_sequences: int
    validation_sequences: int


class PackedRef(BaseModel):
    path: str  # a packed pre-training corpus folder (twinkle_core.data.pretrain), or a blend's (data.blend)
    content_hash: str
    train_sequences: int
    validation_sequences: int
    train_tokens: int
    blend: list[BlendPart] = []  # the corpora of a weighted blend; empty for one corpus


class CheckpointRef(BaseModel):
    path: str
    is_adapter: bool
    final_metrics: dict[str, float]
    train_seconds: float
    probe_loss: float  # loss of the trained weights on a fixed batch, for checking reloads
    resumed_from_step: int = 0  # a retried run continued from the training state saved at this step
