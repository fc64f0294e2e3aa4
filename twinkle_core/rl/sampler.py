"""Rollouts: sampling completions of prompts, behind one small interface.

`Sampler.sample(prompt_ids, num_generations, settings, seed)` returns, for every prompt, its
`num_generations` completions as token ids (ending with the end-of-sequence token when the model stopped,
cut at `max_new_tokens` otherwise), grouped prompt after prompt. The loss then scores exactly these ids.

`PolicySampler` samples with the policy's own `generate` (transformers), batched over the prompts. A GPU
engine (vLLM, SGLang) plugs in as another class with the same `sample` method: it must sample from the
current policy weights, so the recipe would hand it the updated weights (or the adapter) before each
rollout; nothing else in the recipe changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy (evaluation)
    top_p: float = 1.0

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


class Sampler(Protocol):
    def sample(self, prompt_ids: list[list[int]], num_generations: int, settings: SamplingSettings,
               seed: int) -> list[list[int]]: ...


class PolicySampler:
    """Samples with `module.generate` (the unwrapped policy, adapter on), prompts left-padded in one batch."""

    def __init__(self, module: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], device: torch.device,
                 autocast=None):
        self.module, self.pad, self.eos, self.device = module, pad_token_id, set(eos_token_ids), device
        self.autocast = autocast

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], num_generations: int, settings: SamplingSettings,
               seed: int) -> list[list[int]]:
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        was_training = self.module.training
        self.module.eval()
        torch.manual_seed(seed)  # the same rollouts for the same seed, step and rank
        try:
            with self.autocast() if self.autocast else torch.autocast("cpu", enabled=False):
                out = self.module.generate(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                    **settings.generate_kwargs(), max_new_tokens=settings.max_new_tokens,
                    num_return_sequences=num_generations,
                    pad_token_id=self.pad, eos_token_id=sorted(self.eos))
        finally:
            self.module.train(was_training)
        return [self._until_eos(row[width:].tolist()) for row in out]

    def _until_eos(self, ids: list[int]) -> list[int]:
        for i, token in enumerate(ids):
            if token in self.eos:
                return ids[: i + 1]
        return ids


def completion_batch(prompt_ids: list[list[int]], completions: list[list[int]], num_generations: int,
                     pad_token_id: int, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Each completion after its prompt, right-padded: input_ids, attention_mask, and labels on exactly the
    sampled completion tokens (what the GRPO objective scores)."""
    rows = [(prompt_ids[i // num_generations], completion) for i, completion in enumerate(completions)]
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), ignore_index, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        if completion:
            labels[i, len(prompt): len(ids)] = torch.tensor(completion)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
