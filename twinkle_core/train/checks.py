"""One validation pass before launch: every problem of a run's settings, reported together.

    check_run(config)                     # when the flow's parameters are built: fails before any task runs
    check_run(config, model_config)       # after download, with the model's config.json: before torchrun

`config` is a flow's parameter model: it has `kind` (the flow), `backend`, `objective`, `mixed_precision`,
`parallel()` and its own fields, and may add its own rules in `problems(model_config)`. The rules are those
every run shares (below), those its backend registered (twinkle_core.models.backends) and the flow's own.
Each problem names the field and its value; the workers do not check again.
"""
from __future__ import annotations

from typing import Any

from twinkle_core.families import check_model_id
from twinkle_core.models.backends import get_backend, raised_problems
from twinkle_core.objectives import get_objective
from twinkle_core.precision import resolve_precision


class RunConfigError(ValueError):
    """A run's settings cannot run; the message lists every problem."""


def _common_problems(config) -> list[str]:
    import torch

    problems = raised_problems(check_model_id, config.model_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problems += raised_problems(resolve_precision, config.mixed_precision, device)
    try:
        objective = get_objective(config.objective)
    except ValueError as err:
        return problems + [str(err)]
    if config.backend not in objective.backends:
        problems.append(f"backend={config.backend!r}: the {objective.name} objective runs on "
                        f"{', '.join(sorted(objective.backends))}.")
    return problems


def run_problems(config, model_config: Any = None) -> list[str]:
    """Every problem of `config` (and of its model, when `model_config` is given); empty when it can run."""
    problems = _common_problems(config)
    for rule in get_backend(config.backend).rules:
        problems += rule(config, model_config)
    problems += config.problems(model_config)
    return list(dict.fromkeys(problems))  # one line per problem, in the order found


def check_run(config, model_config: Any = None) -> None:
    """Raise RunConfigError listing every problem of `config`; nothing when it can run."""
    problems = run_problems(config, model_config)
    if problems:
        where = " (with the model's config)" if model_config is not None else ""
        raise RunConfigError(f"{config.kind}{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def model_config_of(model_dir: str) -> Any:
    """The Hugging Face config of a downloaded model directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)
