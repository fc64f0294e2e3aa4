"""The end-of-run report: printed to the terminal and kept as the flow run's markdown artifact."""
from __future__ import annotations

from typing import Any

import torch

from tasks.refs import CheckpointRef, TokenizedRef
from twinkle_core.data.vision_rows import content_text
from twinkle_core.families import get_family
from twinkle_core.precision import auto_precision


def _one_line(text: str | list) -> str:
    return " ".join(content_text(text).split()) or "(empty)"  # a content list: its text, media as [image]


def _settings(config: Any) -> str:
    """The settings that shape a run, on one line (the whole config is in MLflow's params)."""
    parts = [f"{config.backend}", f"lr {config.lr:g}", f"batch {config.batch_size}",
             f"max_steps {config.max_steps}" if config.max_steps else f"epochs {config.epochs:g}",
             f"{config.nproc_per_node * config.nnodes} process(es), {config.strategy.value}"]
    return "settings: " + ", ".join(parts)


def family_line(family_name: str) -> str:
    """How a report names the model's family; an untested one says so."""
    family = get_family(family_name)
    if family.tested:
        return f"family: {family.title}"
    return f"family: untested ({family.notes})"


def render_summary(config: Any, prompts: list[list[dict]], reports: dict, registration: dict, run_id: str,
                   checkpoint: CheckpointRef, train_data: TokenizedRef, links: dict[str, str] | None = None,
                   family: str | None = None) -> str:
    """The report; `links` (MLflow run page, loss-curve image) add a link line and the embedded curve."""
    base, trained = reports["base"], reports["trained"]
    resumed = f", resumed from step {checkpoint.resumed_from_step}" if checkpoint.resumed_from_step else ""
    lines = [
        "## Twinkle Flows: SFT summary",
        "",
        f"model: {config.model_id}",
        *([family_line(family)] if family else []),
        f"dataset: {config.dataset} ({train_data.num_rows} rows, {train_data.num_trained_tokens} trained tokens, "
        f"{train_data.num_bad} bad rows skipped)",
        _settings(config),
        f"training: {'LoRA r=' + str(config.lora_r) if config.use_lora else 'full'}, {_precision(config.mixed_precision)}, "
        f"{checkpoint.train_seconds:.0f} s, final loss {checkpoint.final_metrics.get('loss', float('nan')):.4f}, "
        f"{checkpoint.final_metrics.get('tokens_per_s', 0):.0f} tokens/s{resumed}",
        "",
        "| | base | trained |",
        "|---|---|---|",
        f"| held-out loss | {base['eval_loss']:.4f} | {trained['eval_loss']:.4f} |",
        f"| held-out perplexity | {base['perplexity']:.2f} | {trained['perplexity']:.2f} |",
        "",
    ]
    if prompts:
        lines += [f"prompt: {_one_line(prompts[0][-1]['content'])}",
                  f"base answer: {_one_line(base['answers'][0])}",
                  f"trained answer: {_one_line(trained['answers'][0])}", ""]
    if len(prompts) > 1:
        lines += ["| more held-out prompts | base | trained |", "|---|---|---|"]
        lines += [f"| {_one_line(p[-1]['content'])} | {_one_line(base['answers'][i])} | "
                  f"{_one_line(trained['answers'][i])} |" for i, p in enumerate(prompts) if i > 0]
        lines.append("")
    return "\n".join(lines + registry_lines(run_id, registration, checkpoint, links))


def registry_lines(run_id: str, registration: dict, checkpoint: CheckpointRef, links: dict | None,
                   what: str = "") -> list[str]:
    """The summary's tail: the MLflow run, the registered version (`what` it is), the champion, the links."""
    lines = [
        f"MLflow run id: {run_id}",
        f"registered model: {registration['name']} version {registration['version']} (alias candidate){what}",
        f"champion: {registration['decision']}",
        f"checkpoint: {checkpoint.path}",
    ]
    if registration.get("chat_model"):
        uri = f"models:/{registration['name']}/{registration['version']}"
        lines.append(f"chat with it: python -m flows.chat --model {uri}")
    if links:
        lines += ["", f"MLflow run: {links['run']}"]
        if "loss_curve" in links:
            lines += ["", f"![training loss]({links['loss_curve']})"]
    return lines


def handed_off(run_id: str, family: str) -> dict:
    """The result of a machine that trained but does not hold global rank 0 (which evaluates and registers)."""
    return {"summary": "training finished; the machine that held global rank 0 evaluates and registers",
            "run_id": run_id, "checkpoint": None, "family": family}


def _precision(mode: str) -> str:
    """The setting, and what 'auto' chose on this machine."""
    if mode != "auto":
        return mode
    return f"auto ({auto_precision('cuda' if torch.cuda.is_available() else 'cpu').value})"
