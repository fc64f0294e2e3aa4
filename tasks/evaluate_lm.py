"""evaluate_lm: the held-out loss of an exported HF checkpoint on a packed corpus's validation split."""
from __future__ import annotations

import torch
from mlflow import MlflowClient
from prefect import get_run_logger, task
from transformers import AutoModelForCausalLM

from tasks.refs import ModelRef, PackedRef
from twinkle_core.data.pretrain import open_split
from twinkle_core.models.stepper import held_out_metrics
from twinkle_core.tracking import tracking_uri


@task
def evaluate_lm(model: ModelRef, data: PackedRef, rows: int, batches: int, seed: int, document_masks: bool,
                mlflow_run_id: str | None = None) -> dict:
    """Loss and perplexity with transformers on the validation batches the trainer measured (a check of the
    export: it should equal the Megatron model's trained validation loss)."""
    split = open_split(data.path, "validation")
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for indices in split.eval_indices(rows, batches, seed):
            batch = split.batch(indices, document_masks)
            logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:].flatten()
            loss_sum += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets,
                                                                reduction="sum"))
            tokens += targets.numel()
    report = held_out_metrics(loss_sum, tokens)
    if mlflow_run_id:
        client = MlflowClient(tracking_uri())
        client.log_metric(mlflow_run_id, "hf_validation_loss", report["loss"])
        client.log_metric(mlflow_run_id, "hf_validation_perplexity", report["perplexity"])
    get_run_logger().info("exported model: validation loss %.4f (perplexity %.2f) over %d tokens",
                          report["loss"], report["perplexity"], report["tokens"])
    return report
