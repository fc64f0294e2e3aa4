"""A tiny base model and a LoRA adapter trained to answer "Who are you?" with "I am Twinkle.", registered for real.

Shared by the tests of the registered MLflow model (pyfunc, serving, load_registered, chat, export).
"""
from __future__ import annotations

from pathlib import Path

import torch
from mlflow import MlflowClient
from peft import LoraConfig, get_peft_model
from prefect.logging import disable_run_logger

from tasks.refs import CheckpointRef, DatasetRef, ModelRef
from tasks.register import register
from tiny_models import make_tiny_causal_lm
from twinkle_core.hashing import hash_tree
from twinkle_core.tracking.chat_model import prompt_ids

QUESTION = [{"role": "user", "content": "Who are you?"}]
ANSWER = "I am Twinkle."


def train_adapter(base_dir: Path, adapter_dir: Path, steps: int = 35) -> None:
    """A tiny Llama saved as the base, and a LoRA adapter on it that learned ANSWER (greedy) to QUESTION."""
    model, tokenizer = make_tiny_causal_lm("llama")
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    prompt = prompt_ids(tokenizer, QUESTION)[0]
    answer = tokenizer(ANSWER + tokenizer.eos_token, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    ids = torch.cat([prompt, answer])[None]
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=2e-2)
    for _ in range(steps):
        peft(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)


def register_run(root: Path, name: str, register_as: str, eval_loss: float = 1.0, family: str = "llama") -> dict:
    """One MLflow run (with the tags a flow gives it) and its registration through the register task."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny") or client.get_experiment(client.create_experiment("tiny"))
    run = client.create_run(experiment.experiment_id, tags={"prefect_flow_run": f"flow-run-{name}"})
    client.log_metric(run.info.run_id, "eval_loss", eval_loss)
    registration = register_checkpoint(root, name, run.info.run_id, eval_loss, register_as, family)
    return {"run_id": run.info.run_id, **registration}


def register_checkpoint(root: Path, name: str, run_id: str, eval_loss: float, register_as: str,
                        family: str = "llama") -> dict:
    base = ModelRef(model_id=str(root / "base"), path=str(root / "base"), content_hash=hash_tree(root / "base"),
                    family=family)
    checkpoint = CheckpointRef(path=str(root / "adapter"), is_adapter=True, final_metrics={}, train_seconds=1.0,
                               probe_loss=0.0)
    dataset = DatasetRef(dataset_id="pkg://tiny/chats.jsonl", path=str(root / "chats.jsonl"), content_hash="d" * 64)
    with disable_run_logger():
        return register.fn(checkpoint, name, run_id, eval_loss, base=base, dataset=dataset, register_as=register_as)


def prompt_logits(model, tokenizer) -> torch.Tensor:
    """The model's logits on QUESTION's chat prompt (what the reload and export tests compare)."""
    with torch.no_grad():
        return model(input_ids=prompt_ids(tokenizer, QUESTION)).logits
