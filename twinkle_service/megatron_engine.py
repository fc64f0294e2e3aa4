"""The service's engine on the Megatron backend: `MultiLoraMegatronModel`, the base split over tp ranks.

    python -m flows.service --backend megatron --nproc-per-node 4 --tp-size 2   # tp=2 x dp=2

Each tenant's adapter lives on megatron's parallel linears, split like their base weights
(twinkle_core.megatron.lora), so a base that one device cannot hold is served by `--tp-size` processes;
the processes that tp leaves are data-parallel ranks, each running its share of a pass's rows (engine.py).
A pass runs the rows right-padded through the model's one pipeline stage (causal attention: padding at the
end changes no earlier position) with plain autograd; each row's target log-probabilities come from the
vocabulary-parallel logits without gathering them (megatron's vocab-parallel cross-entropy, the padded
vocabulary rows masked out). Gradients: tensor parallelism already gives every whole adapter matrix its
full gradient; data-parallel ranks are summed and the norm taken over the model-parallel group at each
optim_step (MegatronTenantSync). Sampling recomputes the whole sequence at each new token (no key/value
cache on this path): fine for evaluation-sized samples, slow for long ones.

Saved states: the adapter as a PEFT folder of the Hugging Face model (it loads on either backend, and a
PEFT adapter with one shared lora_A for q/k/v and gate/up, as this backend writes, loads here); the AdamW
state per tensor-parallel rank, so it loads on a server with the same --tp-size.
"""
from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig

from twinkle_core.errors import UserError
from twinkle_core.models.lora_routing import RowGroup
from twinkle_core.models.multi_lora_megatron import MultiLoraMegatronModel
from twinkle_core.rl.sampler import SamplingSettings
from twinkle_service.engine import OPTIMIZER_FILE, TinkerEngine

LOADING = "__loading__"  # a saved adapter is read under this name, then copied into its tenant


class MegatronEngine(TinkerEngine):
    def __init__(self, model_id: str, max_tenants: int = 8, max_rank: int = 64, max_length: int = 4096,
                 mixed_precision: str = "auto", tp_size: int = 1):
        self.model = MultiLoraMegatronModel(model_id, mixed_precision, tp_size=tp_size, max_loras=max_tenants,
                                            max_r=max_rank)
        self.model._set_train_mode(False)  # no dropout: a forward is a function of the weights and the tokens
        (self.chunk,) = self.model.chunks  # one pipeline stage (pp_size=1)
        self.device = self.model.device
        self.vocab_size = int(self.model.hf_config.vocab_size)
        self.tp_size = tp_size
        self._init_engine(max_length)

    # ----- tenants and states ----------------------------------------------------------------------
    def _add_adapter(self, name: str, config: LoraConfig, seed: int) -> None:
        self.model.add_adapter_to_model(name, config, seed=seed)
        self.model._set_train_mode(False)

    def _read_adapter(self, name: str, source: Path) -> None:
        """Read the adapter beside the tenant's (so a refused one changes nothing), then copy it in."""
        from twinkle_core.convert.lora_peft import load_peft_adapter
        from twinkle_core.megatron.lora import adapter_parameters, remove_megatron_lora

        try:
            load_peft_adapter(self.chunk, self.model.hf_config, source, LOADING, router=self.model.router,
                              dtype=torch.float32)
            loaded, own = adapter_parameters(self.chunk, LOADING), self.model.tenant_parameters(name)
            if [p.shape for p in loaded] != [p.shape for p in own]:
                raise ValueError("it adapts other layers than this server's training models (every attention "
                                 "and MLP linear layer)")
            with torch.no_grad():
                for p, value in zip(own, loaded):
                    p.copy_(value)
        except (ValueError, FileNotFoundError) as exc:
            raise UserError(f"the saved adapter does not load on this server's megatron backend: {exc}") from exc
        finally:
            remove_megatron_lora(self.chunk, LOADING)

    def _write_adapter(self, name: str, folder: Path) -> None:
        self.model.save("adapter", folder, adapter_name=name)  # every rank takes part; rank 0 writes

    def _optimizer_layout(self) -> dict:
        return {"backend": "megatron", "tp_size": self.tp_size}

    def _optimizer_file(self) -> tuple[str, bool]:
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        file = OPTIMIZER_FILE if self.tp_size == 1 else f"optimizer-tp{tp_rank}.pt"  # each rank's shards
        return file, ps.get_data_parallel_rank() == 0

    # ----- how the work is split -------------------------------------------------------------------
    def _data_parallel(self) -> tuple[int, int]:
        return self.model.data_parallel_rank, self.model.data_parallel_size

    def _sum_and_clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return self.model.sync.clip_grad_norm_(params, max_norm)

    # ----- passes ----------------------------------------------------------------------------------
    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        """This tp rank's logits [rows, length, vocab/tp] of right-padded rows `ids`."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.chunk(ids, positions, None)

    def _target_logprobs(self, data: list, groups: list[RowGroup]) -> list[torch.Tensor]:
        from twinkle_core.megatron.step import vocab_masked_token_losses

        lengths = [len(d.tokens) for d in data]
        width = max(lengths)
        ids = torch.zeros(len(data), width, dtype=torch.long)
        targets = [torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long) for d in data]
        k = max(1 if t.ndim == 1 else t.shape[1] for t in targets)
        padded = torch.zeros(len(data), width, k, dtype=torch.long)
        for r, (d, t) in enumerate(zip(data, targets)):
            ids[r, :len(d.tokens)] = torch.from_numpy(d.tokens)
            padded[r, :len(t)] = t if t.ndim == 2 else t[:, None]
        with self.model.router.route(groups):
            logits = self._run(ids.to(self.device))
        padded = padded.to(self.device)
        # log p(target) = -cross-entropy, over the vocabulary split across tp ranks (one column of targets a time;
        # megatron's cross-entropy works in place on the logits it is given, so each column gets its own copy)
        logprobs = torch.stack([-vocab_masked_token_losses(logits if k == 1 else logits.clone(), padded[..., j],
                                                           self.vocab_size) for j in range(k)], dim=-1)
        return [logprobs[r, :n] if t.ndim == 2 else logprobs[r, :n, 0]
                for r, (n, t) in enumerate(zip(lengths, targets))]

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(self._run(ids))  # the tp ranks' vocabulary slices
        return logits[..., :self.vocab_size].float()  # without the rows megatron pads the vocabulary with

    def _sample_tokens(self, prompt: list[int], num_samples: int, settings: SamplingSettings, seed: int,
                       eos: list[int]) -> list[list[int]]:
        """Every rank draws the same tokens: the same seed, and logits gathered whole on every tp rank."""
        rows = [list(prompt) for _ in range(num_samples)]
        live = list(range(num_samples))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for _ in range(settings.max_new_tokens):
                ids = torch.tensor([rows[i] for i in live], device=self.device)  # live rows have one length
                picked = settings.pick(self._logits(ids)[:, -1]).tolist()
                for i, token in zip(live, picked):
                    rows[i].append(token)
                live = [i for i, token in zip(live, picked) if token not in eos]
                if not live:
                    break
        return [row[len(prompt):] for row in rows]
