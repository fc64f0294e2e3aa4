"""A tiny base model and a LoRA adapter trained to answer "Who are you?" with "I am Twinkle.", registered for real.

Shared by the tests of the registered MLflow model (pyfunc, serving, load_registered, chat, export), with a
tiny Qwen 3.5 VL adapter registered the same way for the vision-language ones.
"""
from __future__ import annotations

import base64
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
VL_IDS = torch.tensor([[3, 5, 7, 9, 11, 13]])  # a text-only prompt for the tiny VL model's logits


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


def vl_logits(model) -> torch.Tensor:
    """The tiny Qwen 3.5 VL model's logits on VL_IDS (text only, as a served chat without images)."""
    with torch.no_grad():
        return model(input_ids=VL_IDS, mm_token_type_ids=torch.zeros_like(VL_IDS)).logits


def register_vl(root: Path) -> torch.Tensor:
    """A tiny Qwen 3.5 VL base in root/base and a LoRA adapter in root/adapter made as a vision_lm run makes it
    (random B: a trained adapter), registered as 'tiny-vl' (the adapter) and 'tiny-vl-merged'; returns the
    adapter's vl_logits."""
    from vision_models import save_tiny_qwen3_5_vl

    from twinkle_core.models import TransformersModel

    save_tiny_qwen3_5_vl(root / "base")
    trained = TransformersModel(str(root / "base"), mixed_precision="no", objective="vision_lm")
    trained.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    for name, param in trained.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.5)
    trained.model.eval()
    reference = vl_logits(trained.model)
    trained.save("adapter", root)
    register_run(root, "tiny-vl", "adapter", family="qwen3_5_vl")
    register_run(root, "tiny-vl-merged", "merged", family="qwen3_5_vl")
    return reference


def image_question(ref: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": ref}, {"type": "text", "text": "What is it?"}]}]


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def trained_answer(root, picture, max_new_tokens: int = 6) -> str:
    """The greedy answer of the trained adapter through the library (as evaluation generates)."""
    from twinkle_core.models import TransformersModel

    trained = TransformersModel(str(root / "base"), mixed_precision="no", objective="vision_lm")
    trained.load("adapter", root)
    return trained.generate(image_question(str(picture)), max_new_tokens=max_new_tokens)
