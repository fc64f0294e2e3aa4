"""Held-out evaluation of an RL-trained model: greedy answers to the held-out prompts, scored by the run's
reward functions, for the base and the trained model.

    python -m twinkle_core.evaluate.rewards EVAL_CONFIG.json

For each model: `mean_reward` (the weighted total, averaged over prompts), `accuracy` (the share of prompts
whose first reward function gives its full score of 1, e.g. numeric_match: the right number), each
function's mean, and the first answers.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from pydantic import Field

from twinkle_core.config.fields import ModelLoadFields
from twinkle_core.data import load_tokenized
from twinkle_core.evaluate.run import load_model
from twinkle_core.rl.rewards import RewardSet
from twinkle_core.rl.sampler import PolicySampler, SamplingSettings
from twinkle_core.entry import finish_worker, report_user_errors_in_one_line

logger = logging.getLogger(__name__)


class RewardEvalConfig(ModelLoadFields):
    model_path: Path
    checkpoints: dict[str, Path | None] = Field(description="label -> adapter/full checkpoint (None = base).")
    heldout_data: Path  # a tokenized prompts dataset
    rewards: list[str]
    reward_weights: list[float] | None = None
    reward_options: dict[str, dict] = Field(default_factory=dict)
    max_new_tokens: int = 64
    batch_size: int = 16
    answers_kept: int = 3
    mixed_precision: str = "auto"
    result_path: Path


def evaluate_model(model, examples: list[dict], rewards: RewardSet, config: RewardEvalConfig) -> dict:
    tokenizer = model.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = PolicySampler(model.model, pad, [tokenizer.eos_token_id], model.device,
                            lambda: model.precision.autocast(model.device.type))
    greedy = SamplingSettings(config.max_new_tokens, temperature=0)
    texts = []
    for start in range(0, len(examples), config.batch_size):
        chunk = examples[start:start + config.batch_size]
        completions = sampler.sample([list(e["prompt_ids"]) for e in chunk], 1, greedy, seed=0)
        texts += tokenizer.batch_decode(completions, skip_special_tokens=True)
    rows = [{**json.loads(e["fields"]), "row": i} for i, e in enumerate(examples)]
    total, per_function = rewards.score([e["prompt_text"] for e in examples], texts, rows)
    first = per_function[rewards.names[0]]
    return {"mean_reward": float(total.mean()), "accuracy": float((first >= 1).float().mean()),
            **{f"reward/{name}": float(values.mean()) for name, values in per_function.items()},
            "prompts": len(examples), "questions": [e["prompt_text"] for e in examples[:config.answers_kept]],
            "answers": [t.strip() for t in texts[:config.answers_kept]]}


def evaluate(config: RewardEvalConfig) -> dict[str, dict]:
    examples = load_tokenized(config.heldout_data)
    rewards = RewardSet(config.rewards, config.reward_weights or [], config.reward_options)
    reports = {}
    for label, checkpoint in config.checkpoints.items():
        reports[label] = evaluate_model(load_model(config, checkpoint), examples, rewards, config)
        logger.info("%s: mean reward %.4f, accuracy %.4f", label, reports[label]["mean_reward"],
                    reports[label]["accuracy"])
    return reports


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m twinkle_core.evaluate.rewards EVAL_CONFIG.json")
    report_user_errors_in_one_line()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = RewardEvalConfig.model_validate_json(Path(argv[0]).read_text())
    config.result_path.write_text(json.dumps(evaluate(config), indent=2))
    return 0


if __name__ == "__main__":
    finish_worker(main())
