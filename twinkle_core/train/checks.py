"""One validation pass before launch: every problem of a run's settings, reported together.

    check_run(config)                     # when the flow's parameters are built: fails before any task runs
    check_run(config, model_config)       # after download, with the model's config.json: before torchrun

`config` is a flow's parameter model: it has `kind` (the flow), `backend`, `objective`, `mixed_precision`,
`parallel()` and its own fields, and may add its own rules in `problems(model_config)`. The rules are those
every run shares (below), those its backend registered (twinkle_core.models.backends) and the flow's own.
Each problem names the field and its value; the workers do not check again.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle_core.data import get_row_format, no_template_message, read_chat_template
from twinkle_core.errors import UserError
from twinkle_core.families import check_model_id, get_family
from twinkle_core.hub import check_weight_files, dataset_problems, id_problems
from twinkle_core.models.backends import get_backend, raised_problems
from twinkle_core.objectives import get_objective
from twinkle_core.precision import resolve_precision


class RunConfigError(UserError):
    """A run's settings cannot run; the message lists every problem."""


def _common_problems(config) -> list[str]:
    import torch

    problems = _source_problems(config) or raised_problems(check_model_id, config.model_id)
    if not problems and check_model_id(config.model_id) is not None:
        problems += _kind_problems(config, check_model_id(config.model_id).name, config.model_id)
    if getattr(config, "chat_template", None):
        problems += raised_problems(read_chat_template, config.chat_template)
    if hasattr(config, "benchmark_problems"):
        problems += config.benchmark_problems()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # megatron computes fp8 in Transformer Engine's layers and checks that in its own rules (models.backends)
    problems += raised_problems(resolve_precision, config.mixed_precision, device, config.backend != "megatron")
    try:
        objective = get_objective(config.objective)
    except ValueError as err:
        return problems + [str(err)]
    if config.backend not in objective.backends:
        problems.append(f"backend={config.backend!r}: the {objective.name} objective runs on "
                        f"{', '.join(sorted(objective.backends))}.")
    return problems + _split_problems(config, objective)


def _source_problems(config) -> list[str]:
    """Ids that cannot resolve (bad syntax, a local path that does not exist) and local pickle-only weights:
    caught here, before a Prefect server or any task starts."""
    problems = id_problems("model_id", config.model_id)
    own = getattr(config, "dataset_problems", None)  # a flow whose dataset is more than one id (pretrain's blends)
    problems += own() if own else _dataset_problems(config)
    if not problems and "://" not in config.model_id and Path(config.model_id).expanduser().is_dir():
        problems += raised_problems(check_weight_files, Path(config.model_id).expanduser(), config.model_id,
                                    getattr(config, "allow_pickle_weights", False))
    return problems


def _dataset_problems(config) -> list[str]:
    return [problem for field in ("dataset", "eval_dataset") if getattr(config, field, None)
            for problem in dataset_problems(field, getattr(config, field))]


def _split_problems(config, objective) -> list[str]:
    """Mesh dimensions the objective cannot split over (InfoNCE needs every text whole on one rank)."""
    if objective.splits is None:
        return []
    parallel = config.parallel()
    sizes = {**parallel.mesh_sizes(), "pp_size": parallel.pp_size}
    problems = [f"{name}={size}: the {objective.name} objective splits over "
                f"{', '.join(sorted(objective.splits))} only" for name, size in sizes.items()
                if size > 1 and name.removesuffix("_size") not in objective.splits]
    if parallel.sequence_parallel:
        problems.append(f"sequence_parallel=True: the {objective.name} objective splits over "
                        f"{', '.join(sorted(objective.splits))} only")
    return problems


def _model_problems(config, model) -> list[str]:
    """What the downloaded model itself decides: a chat template for chat rows, a table entry for megatron."""
    if model is None:
        return []
    problems = []
    if config.backend == "megatron" and model.backend == "transformers":
        from twinkle_core.convert import megatron_family

        problems += [f"backend='megatron': {p}" for p in raised_problems(megatron_family, model.path)]
    return problems + _kind_problems(config, model.family, model.model_id) + _template_problems(config, model)


def _kind_problems(config, family_name: str, model_id: str) -> list[str]:
    """An embedding model trains in the embedding flow, a language model in the others."""
    family = get_family(family_name)
    try:
        objective = get_objective(config.objective)
    except ValueError:
        return []  # reported with the other objective problems
    if family.is_embedding and not objective.embeds:
        return [f"model_id={model_id!r} is a {family.title} embedding model; train it with "
                "python -m flows.embedding (InfoNCE)"]
    return []


def _template_problems(config, model) -> list[str]:
    """Chat rows need a template: the run's, the tokenizer's own, or a tested family's."""
    row_kind = get_row_format(get_objective(config.objective).row_kind)
    if not row_kind.needs_chat_template or has_chat_template(model):
        return []
    return ["chat_template=None: " + no_template_message(repr(model.model_id))]


def has_chat_template(model) -> bool:
    """Whether a downloaded model renders chats: the run's template, a tested family's, or the tokenizer's own."""
    if model.template_source or get_family(model.family).chat_template:
        return True
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code).chat_template)


def run_problems(config, model_config: Any = None, model: Any = None) -> list[str]:
    """Every problem of `config` (and of its model, when `model_config` and the downloaded `model` are given);
    empty when it can run."""
    problems = _common_problems(config) + _model_problems(config, model)
    for rule in get_backend(config.backend).rules:
        problems += rule(config, model_config)
    problems += config.problems(model_config)
    return list(dict.fromkeys(problems))  # one line per problem, in the order found


def check_run(config, model_config: Any = None, model: Any = None) -> None:
    """Raise RunConfigError listing every problem of `config`; nothing when it can run."""
    problems = run_problems(config, model_config, model)
    if problems:
        where = " (with the model's config)" if model_config is not None else ""
        raise RunConfigError(f"{config.kind}{where}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def model_config_of(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The Hugging Face config of a downloaded model directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
