"""Reward functions for online RL (GRPO): the built-in ones, a user's own by `module:function`, and their
weighted sum with per-function statistics.

A reward function takes keyword arguments and returns one number per completion, in trl's convention, so
a trl reward function works here unchanged:

    def my_reward(prompts, completions, completion_ids=None, **row_fields) -> list[float]: ...

`prompts` and `completions` are lists of strings (a conversation's prompt is its last user message's text);
`row_fields` are the dataset's other columns, one value per completion (a row's `solution` repeats for each
of its `num_generations` completions). A function that raises, returns the wrong count, or returns a value
that is not a finite number fails the run with a `RewardError` naming the function and the row.

Built in (named without a module):

- `exact_match`: 1 if the completion's answer equals the row's `solution` after normalising (case,
  surrounding whitespace and punctuation, repeated spaces), else 0;
- `numeric_match`: 1 if the last number of the completion's answer equals the `solution` as a number;
- `format`: 1 if the completion matches a regular expression (`reward_options: {"format": {"pattern": ...}}`;
  the default asks for `<answer>...</answer>`);
- `length_penalty`: 0 up to `target_chars` characters, then falling linearly to -1 at `max_chars`.

The "answer" of a completion is the text inside its last `<answer>...</answer>` when it has one, else the
whole completion.
"""
from __future__ import annotations

import importlib
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from twinkle_core.errors import UserError

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
DEFAULT_FORMAT = r"(?s).*<answer>.+?</answer>\s*"


class RewardError(UserError):
    """A reward function failed or returned something that is not a number."""


def answer_text(completion: str) -> str:
    """The text inside the last <answer>...</answer>, else the whole completion."""
    found = ANSWER_TAG.findall(completion)
    return found[-1] if found else completion


def _normalise(text: Any) -> str:
    return " ".join(str(text).lower().split()).strip(" .,;:!?\"'")


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _solutions(solution: list | None, count: int, name: str) -> list:
    if solution is None:
        raise RewardError(f"reward {name!r} compares with a row's 'solution', but the rows have none")
    return solution if len(solution) == count else [solution[0]] * count


def exact_match(prompts: list[str], completions: list[str], solution: list | None = None, **_) -> list[float]:
    solutions = _solutions(solution, len(completions), "exact_match")
    return [float(_normalise(answer_text(c)) == _normalise(s)) for c, s in zip(completions, solutions)]


def numeric_match(prompts: list[str], completions: list[str], solution: list | None = None, tolerance: float = 1e-6,
                  **_) -> list[float]:
    solutions = _solutions(solution, len(completions), "numeric_match")
    scores = []
    for completion, want in zip(completions, solutions):
        got, expected = last_number(answer_text(completion)), last_number(str(want))
        scores.append(float(got is not None and expected is not None and abs(got - expected) <= tolerance))
    return scores


def format_reward(prompts: list[str], completions: list[str], pattern: str = DEFAULT_FORMAT, **_) -> list[float]:
    compiled = re.compile(pattern)
    return [float(compiled.fullmatch(c) is not None) for c in completions]


def length_penalty(prompts: list[str], completions: list[str], target_chars: int = 200, max_chars: int = 400,
                   **_) -> list[float]:
    if max_chars <= target_chars:
        raise RewardError(f"length_penalty: max_chars={max_chars} must be above target_chars={target_chars}")
    return [-min(1.0, max(0, len(c) - target_chars) / (max_chars - target_chars)) for c in completions]


BUILT_IN: dict[str, Callable[..., list[float]]] = {"exact_match": exact_match, "numeric_match": numeric_match,
                                                   "format": format_reward, "length_penalty": length_penalty}


def load_reward(name: str) -> Callable[..., list[float]]:
    """A built-in reward by name, or a user's function by `module:function` (importable from the run)."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardError(f"reward {name!r}: use a built-in ({', '.join(BUILT_IN)}) or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"reward {name!r}: module {module_name!r} has no function {attribute!r}")
    return function


@dataclass
class RewardSet:
    """Named reward functions with weights and options; `score` gives the weighted total per completion."""

    names: list[str]
    weights: list[float] = field(default_factory=list)
    options: dict[str, dict] = field(default_factory=dict)  # name -> keyword arguments

    def __post_init__(self):
        if not self.names:
            raise RewardError("no reward functions: name at least one (e.g. numeric_match)")
        self.weights = list(self.weights) or [1.0] * len(self.names)
        if len(self.weights) != len(self.names):
            raise RewardError(f"{len(self.weights)} reward weights for {len(self.names)} reward functions")
        self.functions = [load_reward(name) for name in self.names]

    def score(self, prompts: list[str], completions: list[str], rows: list[dict],
              completion_ids: list[list[int]] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted reward of each completion and each function's own rewards. `rows[i]` holds the
        dataset fields of completion i's prompt row (with its index as `row`, for messages)."""
        fields = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "row")} if rows else {}
        per_function = {}
        for name, function in zip(self.names, self.functions):
            try:
                values = function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                  **fields, **self.options.get(name, {}))
            except RewardError:
                raise
            except Exception as exc:
                row = rows[0].get("row", 0) if rows else 0
                raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} (on the batch starting at "
                                  f"row {row})") from exc
            per_function[name] = self._checked(name, values, rows, len(completions))
        total = sum(weight * per_function[name] for name, weight in zip(self.names, self.weights))
        return total, per_function

    @staticmethod
    def _checked(name: str, values: Any, rows: list[dict], count: int) -> torch.Tensor:
        if not isinstance(values, (list, tuple)) or len(values) != count:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward {name!r} returned {got} for {count} completions; return one number each")
        for i, value in enumerate(values):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                row = rows[i].get("row", i) if i < len(rows) else i
                raise RewardError(f"reward {name!r} returned {value!r} for completion {i} of row {row}; "
                                  "a reward is a finite number")
        return torch.tensor([float(v) for v in values], dtype=torch.float32)
