"""The service's engine on the Transformers backend: `MultiLoraTransformersModel`, padding-free passes.

Under several worker processes the model is replicated (data parallelism): every rank runs its share of
the rows and the tenants' gradients are summed before each step (engine.py).
"""
from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file

from twinkle_core.data.collate import PaddingFreeRow
from twinkle_core.data.device_batch import padding_free_forward, to_device
from twinkle_core.errors import UserError
from twinkle_core.models.checkpoint import save_checkpoint
from twinkle_core.models.lora_routing import RowGroup
from twinkle_core.models.multi_lora import MultiLoraTransformersModel
from twinkle_core.models.tenants import adapter_of
from twinkle_core.objectives.causal_lm import backbone, has_plain_head, unwrap
from twinkle_core.objectives.linear_ce import fusable_head, linear_target_logprobs
from twinkle_core.rl.sampler import PolicySampler, SamplingSettings
from twinkle_service.engine import TinkerEngine, _rank_and_world


class TransformersEngine(TinkerEngine):
    chunked_head = True  # the output layer over the rows' positions a chunk at a time, outside the model's forward
    def __init__(self, model_id: str, max_tenants: int = 8, max_rank: int = 64, max_length: int = 4096,
                 mixed_precision: str = "auto"):
        self.model = MultiLoraTransformersModel(model_id, mixed_precision, max_loras=max_tenants, max_r=max_rank)
        self.model.model.eval()  # no dropout: a forward is a function of the weights and the tokens
        self.device = self.model.device
        self.vocab_size = int(self.model.model.get_input_embeddings().weight.shape[0])
        self._init_engine(max_length)

    def _add_adapter(self, name: str, config: LoraConfig, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model.add_adapter_to_model(name, config)
        self.model.model.eval()

    def _read_adapter(self, name: str, source: Path) -> None:
        weights = load_file(str(source / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.model.model, weights, adapter_name=name)
        missing = [k for k in result.missing_keys if adapter_of(k) == name]
        if missing:
            raise UserError(f"the saved state lacks {len(missing)} of this model's adapter weights (e.g. {missing[0]})")

    def _write_adapter(self, name: str, folder: Path) -> None:
        if _rank_and_world()[0] == 0:  # the ranks hold the same adapter (no collective: the model is not wrapped)
            save_checkpoint(self.model.model, self.model.tokenizer, folder / "adapter", name)

    def _optimizer_layout(self) -> dict:
        return {"backend": "transformers"}

    def _sample_tokens(self, prompt: list[int], num_samples: int, settings: SamplingSettings, seed: int,
                       eos: list[int]) -> list[list[int]]:
        tokenizer = self.model.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        sampler = PolicySampler(self.model.model, pad, eos, self.device,
                                lambda: self.model.precision.autocast(self.device.type))
        return sampler.sample([prompt], num_samples, settings, seed)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        with self.model.precision.autocast(self.device.type):
            return self.model.model(input_ids=ids).logits.float()

    def _target_logprobs(self, data: list, groups: list[RowGroup]) -> list[torch.Tensor]:
        """Each row's log-probability of its target tokens (shaped like target_tokens), with autograd.

        A model that takes padding-free batches runs the rows end to end in one row (`_padding_free_row`): no
        padding, and a tenant's rows that open like its first one hold that prefix once. Others run a
        right-padded batch."""
        device = self.device
        lengths = [len(d.tokens) for d in data]
        targets = [torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long, device=device) for d in data]
        if self.model.padding_free:
            inputs, spans, where = _padding_free_row(data, groups)
            inputs = to_device(inputs, device)
            route = self.model.router.route(spans, axis=1)
        else:
            length = max(lengths)
            input_ids = torch.zeros(len(data), length, dtype=torch.long)
            mask = torch.zeros(len(data), length, dtype=torch.long)
            for r, d in enumerate(data):
                input_ids[r, :len(d.tokens)] = torch.from_numpy(d.tokens)
                mask[r, :len(d.tokens)] = 1
            inputs = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
            route, where = self.model.router.route(groups), mask.flatten().nonzero()[:, 0]
        where = where.to(device)  # each row's positions, in the [rows, length] states flattened
        base = unwrap(self.model.model)
        head = base.get_output_embeddings() if has_plain_head(base) else None
        with route, self.model.precision.autocast(device.type), padding_free_forward(inputs):
            if self.chunked_head and head is not None and fusable_head(head) and all(t.ndim == 1 for t in targets):
                # The output layer a chunk of positions at a time: no [rows, length, vocab] logits (they made
                # a 12-row mixed batch of a 49k vocabulary several times slower than its rows one by one).
                hidden = backbone(base)(**inputs, use_cache=False).last_hidden_state.flatten(0, 1)[where]
                flat = linear_target_logprobs(hidden, head.weight, torch.cat(targets))
                return list(flat.split(lengths))
            logits = self.model.model(**inputs).logits.flatten(0, 1)[where]
        out = []
        for row, t in zip(logits.split(lengths), targets):
            row = torch.log_softmax(row.float(), dim=-1)
            gathered = row.gather(-1, t if t.ndim == 2 else t[:, None])
            out.append(gathered if t.ndim == 2 else gathered[:, 0])
        return out


def _padding_free_row(data: list, groups: list[RowGroup]) -> tuple[dict, list[RowGroup], torch.Tensor]:
    """The rows (`data`, each tenant's rows together as `groups` says) end to end in one row: the batch, each
    tenant's span of its tokens (for the router's token axis), and where each row's positions lie in it.

    A row that opens with the same tokens as its tenant's first row continues that prefix (PaddingFreeRow): the
    prefix runs through the layers once, and the row's positions there read the first row's states, which causal
    attention makes equal to its own (a batch of one tenant's samples of one prompt holds the prompt once)."""
    row, spans, where = PaddingFreeRow(), [], []
    for group in groups:
        first = row_begin = None
        for r in range(group.start, group.stop):
            tokens = data[r].tokens.tolist()
            shared = 0 if first is None else min(_common_prefix(first, tokens), len(tokens) - 1)
            begin = row.add({"input_ids": tokens, "labels": tokens}, (row_begin or 0, shared))
            where.append(torch.cat([torch.arange(row_begin or 0, (row_begin or 0) + shared),
                                    torch.arange(begin, begin + len(tokens) - shared)]))
            if first is None:
                first, row_begin = tokens, begin
        spans.append(RowGroup(group.adapter, row_begin, len(row.input_ids)))
    batch = row.batch()
    del batch["labels"]
    return batch, spans, torch.cat(where)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
