"""Reward functions: the built-ins, a user's own by module:function with the row's fields, weights, and
the errors that name the function and the row."""
from __future__ import annotations

import pytest
import torch

from twinkle_core.rl.rewards import (RewardError, RewardSet, answer_text, exact_match, format_reward, last_number,
                                     length_penalty, numeric_match)

COMPLETIONS = ["<think>7 * 6</think><answer>42</answer>", "The answer is 41.", "<answer> Paris. </answer>",
               "1,234.5 apples"]


def test_built_in_rewards():
    assert answer_text(COMPLETIONS[0]) == "42" and answer_text(COMPLETIONS[1]) == COMPLETIONS[1]
    assert last_number("between 3 and -4.5e1") == -45.0 and last_number("none") is None
    assert numeric_match([], COMPLETIONS, solution=["42", "42", "42", "1234.5"]) == [1.0, 0.0, 0.0, 1.0]
    assert exact_match([], COMPLETIONS, solution=["42", "41", "paris", "x"]) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward([], COMPLETIONS) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward([], ["42", "4x"], pattern=r"\d+") == [1.0, 0.0]
    assert length_penalty([], ["a" * 10, "a" * 30, "a" * 60], target_chars=20, max_chars=40) == [-0.0, -0.5, -1.0]
    with pytest.raises(RewardError, match="compares with a row's 'solution', but the rows have none"):
        numeric_match([], COMPLETIONS)


def test_user_reward_by_module_function_gets_the_row_fields_and_weights_combine(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shorter_than(prompts, completions, limit, **kwargs):\n"
        "    return [1.0 if len(c) < n else 0.0 for c, n in zip(completions, limit)]\n"
        "def broken(prompts, completions, **kwargs):\n"
        "    raise KeyError('solution')\n"
        "def not_a_number(prompts, completions, **kwargs):\n"
        "    return [0.5, 'high', 1.0, 0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = RewardSet(["my_rewards:shorter_than", "numeric_match"], weights=[0.5, 2.0])
    rows = [{"row": 7, "solution": "42", "limit": 20}] * 2 + [{"row": 8, "solution": "1234.5", "limit": 3}] * 2
    total, per_function = rewards.score(["p"] * 4, COMPLETIONS, rows)
    assert per_function["my_rewards:shorter_than"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert per_function["numeric_match"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert torch.equal(total, torch.tensor([2.0, 0.5, 0.0, 2.0]))

    with pytest.raises(RewardError, match=r"reward 'my_rewards:broken' raised KeyError: 'solution' \(on the batch "
                                          r"starting at row 7\)"):
        RewardSet(["my_rewards:broken"]).score(["p"] * 4, COMPLETIONS, rows)
    with pytest.raises(RewardError, match="reward 'my_rewards:not_a_number' returned 'high' for completion 1 of row 7"):
        RewardSet(["my_rewards:not_a_number"]).score(["p"] * 4, COMPLETIONS, rows)
    with pytest.raises(RewardError, match="returned 3 values for 4 completions; return one number each"):
        RewardSet(["my_rewards:shorter_than"]).score(["p"] * 4, COMPLETIONS, rows[:3])  # a field one short


def test_reward_names_are_checked_when_the_set_is_built():
    for names, words in [(["nope"], "use a built-in .* or 'module:function'"),
                         (["no_such_module_xyz:f"], "cannot import module 'no_such_module_xyz'"),
                         (["twinkle_core.rl.rewards:missing"], "has no function 'missing'"),
                         ([], "no reward functions")]:
        with pytest.raises(RewardError, match=words):
            RewardSet(names)
    with pytest.raises(RewardError, match="2 reward weights for 1 reward functions"):
        RewardSet(["format"], weights=[1.0, 2.0])
