"""Score a base model and trained checkpoints on benchmark tasks with lm-evaluation-harness.

    python -m twinkle_core.evaluate.harness BENCHMARK_CONFIG.json   (writes the result JSON named in the config)

Runs in its own process, like training and evaluation, so the orchestrator never holds a model. The model
is the harness's own `HFLM`: the checkpoint as it was saved, or the base with the saved PEFT adapter on it (no
merge), with the run's chat template on its tokenizer. Scores are cached by the model's content, the tasks'
files and every setting, so a retried run does not score again.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import Field

from twinkle_core.config.fields import ModelLoadFields
from twinkle_core.entry import worker_config_path
from twinkle_core.evaluate.benchmarks import BenchmarkError, BenchmarkPlan, offline, quiet_harness, task_manager

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab", "merges")
KEPT = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


class BenchmarkSettings(ModelLoadFields):
    """How the harness scores (the same for every model of a run)."""

    limit: int | None = None  # examples per task (None: all)
    num_fewshot: int | None = None  # None: each task's own
    batch_size: int = 8
    gen_kwargs: dict = Field(default_factory=dict)  # generation settings over the tasks' own (max_gen_toks, ...)
    mixed_precision: str = "auto"
    seed: int = 1234


class BenchmarkRunConfig(BenchmarkSettings):
    model_path: Path
    tokenizer_path: Path | None = None  # where the tokenizer and its chat template are (None: model_path)
    model_hash: str  # the base model's content hash (cache key)
    checkpoints: dict[str, Path | None] = Field(description="label -> adapter/full checkpoint (None = base).")
    plan: BenchmarkPlan
    result_path: Path
    cache: bool = True


def _dtype(mixed_precision: str):
    import torch

    from twinkle_core.precision.policy import resolve_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_precision(mixed_precision, device, check_fp8=False).compute_dtype


def tokenizer_for(config: ModelLoadFields, path: Path):
    """The tokenizer as the run rendered its chats: the run's template, else its own, else the family's."""
    from transformers import AutoTokenizer

    from twinkle_core.data import use_chat_template
    from twinkle_core.families import get_family

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    use_chat_template(tokenizer, config.template_source, get_family(config.family).chat_template, required=False)
    return tokenizer


def harness_model(config: BenchmarkRunConfig, checkpoint: Path | None):
    """The harness's HFLM for the base (None), a full checkpoint, or the base with a saved adapter."""
    import torch
    from lm_eval.models.huggingface import HFLM

    adapter = checkpoint is not None and (checkpoint / "adapter_config.json").exists()
    weights = config.model_path if checkpoint is None or adapter else checkpoint
    return HFLM(pretrained=str(weights), peft=str(checkpoint) if adapter else None,
                tokenizer=tokenizer_for(config, config.tokenizer_path or config.model_path),
                dtype=_dtype(config.mixed_precision), device="cuda" if torch.cuda.is_available() else "cpu",
                batch_size=config.batch_size,
                trust_remote_code=config.trust_remote_code)


def score(lm, plan: BenchmarkPlan, settings: BenchmarkSettings) -> dict:
    """The harness's results for `plan` on `lm`: chat-style tasks with the chat template, the others without
    (one `simple_evaluate` per kind), merged into one results document."""
    import lm_eval

    manager, merged = task_manager(plan), {}
    for chat in (True, False):
        tasks = [task for task in plan.tasks if plan.chat.get(task, False) == chat]
        if not tasks:
            continue
        try:
            with offline():
                out = lm_eval.simple_evaluate(
                    model=lm, tasks=tasks, task_manager=manager, limit=settings.limit,
                    num_fewshot=settings.num_fewshot, apply_chat_template=chat,
                    gen_kwargs=settings.gen_kwargs or None, log_samples=False, random_seed=settings.seed,
                    numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
                    fewshot_random_seed=settings.seed)
        except Exception as error:  # a task's own code or data: the run fails with the harness's message, once
            detail = (str(error).splitlines() or [""])[0]
            raise BenchmarkError(f"lm-evaluation-harness failed on {', '.join(tasks)}: {type(error).__name__}: "
                                 f"{detail}") from error
        if out is None:
            raise BenchmarkError(f"lm-evaluation-harness returned no results for {tasks}")
        for key in KEPT:
            if isinstance(out.get(key), dict):
                merged.setdefault(key, {}).update(out[key])
        merged.setdefault("chat_template", {}).update({task: chat for task in tasks})
    merged["lm_eval_version"] = lm_eval.__version__
    return json.loads(json.dumps(merged, default=str))  # the harness keeps numpy numbers and callables in configs


def cache_key(config: BenchmarkRunConfig, checkpoint: Path | None) -> str:
    """What decides a model's scores: its weights, the tasks' files and names, every setting, the harness."""
    import lm_eval

    from twinkle_core.hashing import hash_file, hash_json, hash_tree

    tokenizer = config.tokenizer_path  # another folder's tokenizer and chat template (a registered version's)
    return hash_json({
        "model": config.model_hash, "checkpoint": hash_tree(checkpoint) if checkpoint else None,
        "tokenizer": hash_json({p.name: hash_file(p) for p in sorted(tokenizer.iterdir()) if p.name.startswith(
            TOKENIZER_FILES)}) if tokenizer else None,
        "plan": config.plan.model_dump(), "lm_eval": lm_eval.__version__,
        "settings": BenchmarkSettings.model_validate(config.model_dump(include=set(BenchmarkSettings.model_fields)))
        .model_dump(),
    })


def score_cached(config: BenchmarkRunConfig, label: str, checkpoint: Path | None) -> dict:
    from twinkle_core.paths import cache_dir

    path = cache_dir("benchmarks") / f"{cache_key(config, checkpoint)[:24]}.json"
    if config.cache and path.is_file():
        logger.info("%s: benchmark scores from the cache (%s)", label, path)
        return json.loads(path.read_text())
    results = score(harness_model(config, checkpoint), config.plan, config)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(path)
    return results


def main(argv: list[str] | None = None) -> int:
    path = worker_config_path(argv, "python -m twinkle_core.evaluate.harness BENCHMARK_CONFIG.json")
    config = BenchmarkRunConfig.model_validate_json(path.read_text())
    quiet_harness()
    reports = {}
    for label, checkpoint in config.checkpoints.items():
        reports[label] = score_cached(config, label, checkpoint)
        logger.info("%s: %s", label, {task: {k: v for k, v in values.items() if "stderr" not in k and "," in k}
                                      for task, values in reports[label].get("results", {}).items()})
    config.result_path.write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    from twinkle_core.entry import finish_worker

    finish_worker(main())
