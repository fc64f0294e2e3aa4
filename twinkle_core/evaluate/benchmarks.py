"""Standard benchmarks through lm-evaluation-harness: which tasks a run asked for, checked offline before it
trains, and how their scores are named, compared and cached.

    plan = plan_benchmarks(["twinkle", "./my_tasks/"])   # the tasks, their folders; loads each task's data offline
    metrics = benchmark_metrics(results)                   # {"bench/twinkle_arithmetic/exact_match": 0.4, ...}

A task is a harness task name (its data already in the local HF datasets cache), a folder of the user's
holding the harness's YAML files, or one of the tasks this package bundles over its own data sets
(`twinkle`: self-cognition multiple choice, arithmetic generate_until, the corpus's rolling log-likelihood).
The scoring itself runs in its own process (twinkle_core.evaluate.harness), like every model load.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, Field

from twinkle_core.errors import UserError

BUNDLED_TASKS = Path(__file__).resolve().parent / "harness_tasks"
PREFIX = "bench"  # MLflow metrics: bench/<task>/<measure> (trained), base_bench/<task>/<measure> (base)


class BenchmarkError(UserError):
    """A benchmark task that cannot run offline, or a harness failure."""


class BenchmarkPlan(BaseModel):
    """The tasks to score, where the harness finds them, and which are rendered with the chat template."""

    tasks: list[str]  # names as the harness knows them (a tag expanded into its tasks)
    include_paths: list[str] = Field(default_factory=list)  # task folders: the bundled one and the user's
    include_defaults: bool = False  # the harness's own task index is needed (slow to build: ~15 s)
    chat: dict[str, bool] = Field(default_factory=dict)  # task -> render its prompts with the chat template
    higher_is_better: dict[str, dict[str, bool]] = Field(default_factory=dict)  # task -> measure -> bool
    content: dict[str, str] = Field(default_factory=dict)  # folder -> content hash of its files (cache key)


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """No hub while the harness runs: its data sets come from the local cache or the task folders."""
    saved = {key: os.environ.get(key) for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def quiet_harness() -> None:
    """The harness logs a notice per custom data set and per request batch; keep its warnings and errors."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


def task_manager(plan_or_paths: BenchmarkPlan | list[str], include_defaults: bool = False):
    """The harness's task index over these folders (and its own ~15,000 tasks when `include_defaults`)."""
    if isinstance(plan_or_paths, BenchmarkPlan):
        return _task_manager(tuple(plan_or_paths.include_paths), plan_or_paths.include_defaults)
    return _task_manager(tuple(plan_or_paths), include_defaults)


@functools.lru_cache(maxsize=8)
def _task_manager(paths: tuple[str, ...], include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths) or None, include_defaults=include_defaults)  # indexing takes ~15 s


def _split_names(requested: list[str]) -> tuple[list[str], list[str]]:
    """(folders, names): an entry that is an existing folder is a task folder; anything else a task name."""
    folders, names = [], []
    for entry in requested:
        path = Path(entry).expanduser()
        if path.is_dir():
            folders.append(str(path.resolve()))
        elif "/" in entry or entry.startswith("."):
            raise BenchmarkError(f"eval task folder {entry!r} does not exist (a folder holds the harness's YAML task "
                                 "files; a name without '/' is a task)")
        else:
            names.append(entry)
    return folders, names


def _folder_tasks(folder: str) -> list[str]:
    """The leaf tasks a user's task folder defines (every YAML task in it)."""
    manager = task_manager([folder])
    tasks = sorted(manager.all_subtasks)
    if not tasks:
        raise BenchmarkError(f"eval task folder {folder!r} holds no harness task (a YAML file with 'task: NAME')")
    return tasks


def plan_benchmarks(requested: list[str], chat_template: str = "auto", has_chat_template: bool = True
                    ) -> BenchmarkPlan:
    """Resolve `requested` (names, tags, groups, folders) and load every task's data offline, so a task that
    cannot run fails now, before any training. `chat_template`: auto (bundled tasks as they say, other
    generate_until tasks when the model has a template), yes or no."""
    folders, names = _split_names(requested)
    paths = [str(BUNDLED_TASKS), *folders]
    bundled = task_manager([str(BUNDLED_TASKS)])
    needs_defaults = any(name not in bundled.all_tasks for name in names)
    manager = task_manager(paths, include_defaults=needs_defaults)
    looked = (f"the bundled tasks ({', '.join(sorted(bundled.all_subtasks))}), "
              + (f"the folders {folders}, " if folders else "")
              + ("the harness's own index" if needs_defaults else ""))
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise BenchmarkError(f"eval task {name!r} is unknown to lm-evaluation-harness{hint} (looked in "
                                 f"{looked.rstrip(', ')})")
    wanted = names + [task for folder in folders for task in _folder_tasks(folder)]
    plan = BenchmarkPlan(tasks=[], include_paths=paths, include_defaults=needs_defaults,
                         content={folder: folder_hash(folder) for folder in paths})
    for name, loaded in _load_offline(manager, wanted).items():
        # A group is scored whole (the harness averages it); a tag is only a list: its tasks go one by one.
        entries = {name: list(loaded["tasks"].values())} if loaded["groups"] else {
            task_name: [task] for task_name, task in loaded["tasks"].items()}
        for entry, tasks in entries.items():
            if entry in plan.chat:
                continue
            plan.tasks.append(entry)
            plan.chat[entry] = all(_is_chat(task, chat_template, has_chat_template) for task in tasks)
            for task in tasks:
                plan.higher_is_better[task.task_name] = {k: bool(v) for k, v in task.higher_is_better().items()}
    return plan


def _load_offline(manager, names: list[str]) -> dict[str, dict]:
    """name -> what the harness built for it ({"tasks": ..., "groups": ...}), the data loaded from the local
    cache; the first task that cannot load is the error."""
    loaded: dict[str, dict] = {}
    with offline():
        for name in names:
            try:
                loaded[name] = manager.load([name])
            except Exception as error:  # the harness raises what datasets raises: ConnectionError, FileNotFound...
                cache = os.environ.get("HF_DATASETS_CACHE") or str(Path.home() / ".cache" / "huggingface" / "datasets")
                first_line = (str(error).splitlines() or [""])[0]
                raise BenchmarkError(
                    f"eval task {name!r} cannot run offline: {type(error).__name__}: {first_line} "
                    f"(looked in the HF datasets cache at {cache}; no hub is used for benchmarks: load the data set "
                    "once on a machine with access, or give a task folder with local data)") from None
    return loaded


def folder_hash(folder: str | Path) -> str:
    """The content of a task folder: its files but Python's caches; the bundled one with the data it reads."""
    from twinkle_core.hashing import hash_file, hash_json

    folder = Path(folder)
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    if folder == BUNDLED_TASKS:
        from twinkle_core.evaluate.harness_tasks.bundled import FILES

        files += list(FILES.values())
    return hash_json({str(path.relative_to(folder) if path.is_relative_to(folder) else path.name): hash_file(path)
                      for path in files})


def _is_chat(task, setting: str, has_chat_template: bool) -> bool:
    if setting != "auto":
        return setting == "yes"
    said = (task.config.metadata or {}).get("chat")
    if said is not None:
        return bool(said) and has_chat_template
    return task.config.output_type == "generate_until" and has_chat_template


def benchmark_metrics(results: dict, prefix: str = PREFIX) -> dict[str, float]:
    """The harness's results as MLflow metrics: `prefix/task/measure` and `.../measure_stderr`; a filter other
    than 'none' is kept as a suffix (`exact_match.first-number`, `exact_match.first-number_stderr`)."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            measure, _, filter_name = key.partition(",")
            stderr = measure.endswith("_stderr")
            name = measure.removesuffix("_stderr") + ("" if filter_name == "none" else f".{filter_name}")
            metrics[f"{prefix}/{task}/{name}" + ("_stderr" if stderr else "")] = float(value)
    return metrics


def summary_table(reports: dict[str, dict]) -> str:
    """Markdown: one row per task and measure, a column per model (base, trained), and the change."""
    labels = list(reports)
    per_label = {label: benchmark_metrics(report) for label, report in reports.items()}
    names = sorted({name for metrics in per_label.values() for name in metrics if not name.endswith("_stderr")})
    header = "| task | measure | " + " | ".join(labels) + (" | change |" if len(labels) == 2 else " |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for name in names:
        _, task, measure = name.split("/", 2)
        cells = []
        for label in labels:
            value, stderr = per_label[label].get(name), per_label[label].get(name + "_stderr")
            cells.append("-" if value is None else f"{value:.4g}" + (f" ± {stderr:.2g}" if stderr else ""))
        change = ""
        if len(labels) == 2 and all(per_label[label].get(name) is not None for label in labels):
            change = f" {per_label[labels[1]][name] - per_label[labels[0]][name]:+.4g} |"
        rows.append(f"| {task} | {measure} | " + " | ".join(cells) + " |" + change)
    return "\n".join(rows)


def champion_value(results: dict, metric: str) -> tuple[float, bool]:
    """(value, higher is better) of `metric` (bench/<task>/<measure>) in a model's results."""
    value = benchmark_metrics(results).get(metric)
    if value is None:
        raise BenchmarkError(f"champion_metric={metric!r} is not among the benchmark scores: "
                             f"{sorted(benchmark_metrics(results))}")
    _, task, measure = metric.split("/", 2)
    higher = results.get("higher_is_better", {}).get(task, {}).get(measure.split(".")[0], True)
    return value, bool(higher)
