"""Rollouts: sampling completions of prompts, behind one small interface.

`Sampler.sample(prompt_ids, num_generations, settings, seed)` returns, for every prompt, its
`num_generations` completions as token ids (ending with the end-of-sequence token when the model stopped,
cut at `max_new_tokens` otherwise), grouped prompt after prompt. The loss then scores exactly these ids.

`PolicySampler` samples with the policy itself, batched over the prompts. A GPU engine (vLLM, SGLang) plugs in
as another class with the same `sample` method: it must sample from the current policy weights, so the recipe
would hand it the updated weights (or the adapter) before each rollout; nothing else in the recipe changes.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy (evaluation)
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row from its fp32 logits, as `generate` picks it with generate_kwargs()."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        scores = logits / self.temperature
        if self.top_k > 0:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)


class Sampler(Protocol):
    def sample(self, prompt_ids: list[list[int]], num_generations: int, settings: SamplingSettings,
               seed: int) -> list[list[int]]: ...


class PolicySampler:
    """Samples with the unwrapped policy (adapter on), prompts left-padded in one batch.

    Each prompt is run through the model once and its KV cache is shared by its group of `num_generations`
    completions (`generate` would run every copy of the prompt); rows that have written an end-of-sequence token
    leave the batch and the cache at once, so the last tokens are computed only for the rows still writing.
    Models whose cache is not a plain key/value cache (recurrent layers) sample through `generate`."""

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
                cache = self._key_value_cache()
                if cache is None:
                    return self._generate(input_ids, mask, num_generations, settings)
                return self._decode(input_ids.to(self.device), mask.to(self.device), cache, num_generations, settings)
        finally:
            self.module.train(was_training)

    def _key_value_cache(self) -> DynamicCache | None:
        """An empty cache for a text model whose layers all keep plain keys and values (they can be repeated and
        dropped by row), else None (recurrent layers; vision models, whose positions `generate` computes)."""
        config = getattr(self.module, "config", None)
        base = self.module.get_base_model() if hasattr(self.module, "get_base_model") else self.module
        if config is None or getattr(config, "vision_config", None) is not None or \
                "logits_to_keep" not in inspect.signature(base.forward).parameters:
            return None
        cache = DynamicCache(config=config)
        return cache if all(isinstance(layer, DynamicLayer) for layer in cache.layers) else None

    def _decode(self, input_ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache, num_generations: int,
                settings: SamplingSettings) -> list[list[int]]:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each prompt's positions start at 0
        logits = self._last_logits(input_ids, mask, positions, cache)
        cache.batch_repeat_interleave(num_generations)  # the group shares its prompt's keys and values
        logits, mask = logits.repeat_interleave(num_generations, 0), mask.repeat_interleave(num_generations, 0)
        position = positions[:, -1].repeat_interleave(num_generations) + 1
        rows = torch.arange(logits.shape[0], device=logits.device)  # each live row's index in the output
        written = torch.full((logits.shape[0], settings.max_new_tokens), self.pad, dtype=torch.long,
                             device=logits.device)
        lengths = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)  # no host sync per token
        eos = torch.tensor(sorted(self.eos), device=logits.device)
        for step in range(settings.max_new_tokens):
            tokens = settings.pick(logits)
            written[rows, step] = tokens
            lengths[rows] = step + 1
            live = ~torch.isin(tokens, eos)
            if step + 1 == settings.max_new_tokens or not bool(live.any()):
                break
            if not bool(live.all()):  # finished rows leave the batch and the cache
                keep = live.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tokens, mask, position = rows[keep], tokens[keep], mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self._last_logits(tokens[:, None], mask, position[:, None], cache)
            position = position + 1
        written = written.cpu()
        return [written[i, :n].tolist() for i, n in enumerate(lengths.cpu().tolist())]

    def _last_logits(self, input_ids, mask, positions, cache) -> torch.Tensor:
        """fp32 logits of each row's last position (the output layer runs only there), the cache extended."""
        out = self.module(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _generate(self, input_ids: torch.Tensor, mask: torch.Tensor, num_generations: int,
                  settings: SamplingSettings) -> list[list[int]]:
        width = input_ids.shape[1]
        out = self.module.generate(
            input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), **settings.generate_kwargs(),
            max_new_tokens=settings.max_new_tokens, num_return_sequences=num_generations, pad_token_id=self.pad,
            eos_token_id=sorted(self.eos))
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


def completion_batch_padding_free(prompt_ids: list[list[int]], completions: list[list[int]], num_generations: int,
                                  ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """completion_batch's sequences end to end in one row (twinkle_core.data.PaddingFreeRow), each group's prompt
    held once: the group's first completion follows its whole prompt, the others hold the prompt's last token
    (their first sampled token is predicted there) and their completion, attending to the rest of the prompt."""
    from twinkle_core.data import PaddingFreeRow, shared_prefix_length

    row, first = PaddingFreeRow(), None
    for i, completion in enumerate(completions):
        prompt = prompt_ids[i // num_generations]
        example = {"input_ids": prompt + completion, "labels": [ignore_index] * len(prompt) + completion}
        if i % num_generations == 0:
            first, begin = example, row.add(example)
        else:
            row.add(example, (begin, shared_prefix_length([first, example])))
    return row.batch()
