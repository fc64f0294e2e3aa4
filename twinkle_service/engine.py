"""The model side of the training service: one base model, one LoRA tenant per Tinker training model.

It is driven by plain-data calls (`create`, `remove`, `forward_backward`, `optim_step`, `sample`, states),
so that the HTTP side can run it in its own process tree. Tinker's semantics, not the flows': a
forward_backward adds the gradient of the *summed* loss to the tenant's gradients, which accumulate until
its optim_step, whose Adam settings come with each step.

`TinkerEngine` holds those semantics once (checks, the rows of waiting requests shared out over the
data-parallel ranks, Tinker's losses and backward, AdamW steps, checkpoints, samplers, sampling's
bookkeeping); a backend gives it a multi-tenant model and a few primitives:
- transformers_engine.py: `MultiLoraTransformersModel`, padding-free mixed-tenant passes;
- megatron_engine.py: `MultiLoraMegatronModel`, the base split over tensor-parallel ranks.
Several tenants' forward_backward requests run as one batch and one backward, each row through its
tenant's adapter; a tenant's gradient is that of its own rows only, so its result does not depend on who
else was in the batch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig
from tinker.types.topk_logprobs import MASK_LOGPROB  # the SDK's "no token here"

from twinkle_core.atomic import atomic_dir
from twinkle_core.errors import UserError
from twinkle_core.models.lora_routing import BASE_ONLY, RowGroup
from twinkle_core.models.state_dirs import MANIFEST_FILE, damage, write_manifest
from twinkle_core.rl.sampler import SamplingSettings
from twinkle_service.losses import check_inputs, loss_sum
from twinkle_service.wire import MAX_TOPK, DatumIn, ForwardBackwardIn

# A sample: its tokens, their log-probabilities, why it stopped, and its top tokens ((ids, logprobs) [n, k]) or None
Sampled = tuple[list[int], list[float], str, "tuple[np.ndarray, np.ndarray] | None"]
# The prompt's log-probabilities ([len], NaN where unscored) or None, and its top tokens or None
Scores = tuple["np.ndarray | None", "tuple[np.ndarray, np.ndarray] | None"]
LORA_ALPHA = 32  # Tinker's LoRA scale is alpha/rank with a fixed alpha
OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_LAYOUT = "optimizer.json"  # which backend and split wrote the optimizer state


@dataclass
class Outcome:
    """What one request came to: a result, or a user error's message (the batch went on without it)."""

    result: object = None
    error: str | None = None


class TinkerEngine:
    """Tinker's semantics over a multi-tenant LoRA model (`self.model`: slots, router, tokenizer, the tenant verbs).

    A backend sets `model`, `max_length`, `vocab_size` and `device`, and gives: `_add_adapter`, `_read_adapter`,
    `_target_logprobs` (with autograd), `_logits`, `_sample_tokens` and `_optimizer_layout`, and where it splits
    the work otherwise, `_data_parallel`, `_sum_and_clip`, `_write_adapter` and `_optimizer_file`."""

    model: object
    max_length: int
    vocab_size: int
    device: torch.device
    every_rank_runs = False  # every rank must run every pass, backward included (FSDP's collectives)

    def _init_engine(self, max_length: int) -> None:
        self.max_length = max_length
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.samplers: dict[str, tuple[str, list[torch.Tensor]]] = {}  # id: (tenant, its adapter weights then)

    # ----- the backend's primitives -----------------------------------------------------------------
    def _add_adapter(self, name: str, config: LoraConfig, seed: int) -> None:
        """Put a new tenant adapter on the model, its initial weights a function of `seed` only."""
        raise NotImplementedError

    def _read_adapter(self, name: str, source: Path) -> None:
        """Give tenant `name` the weights of the PEFT adapter folder `source` (same rank)."""
        raise NotImplementedError

    def _remove_adapter(self, name: str) -> None:
        """Take tenant `name`'s adapter off the model (its weights and slot are free again)."""
        self.model.remove_adapter(name)

    def _target_logprobs(self, data: list, groups: list[RowGroup]) -> list[torch.Tensor]:
        """Each row's log-probability of its target tokens (shaped like target_tokens), with autograd; the rows
        of a group go through its adapter."""
        raise NotImplementedError

    def _sample_tokens(self, prompt: list[int], num_samples: int, settings: SamplingSettings, seed: int,
                       eos: list[int]) -> list[list[int]]:
        """`num_samples` completions of `prompt` through the routed adapter (each ends at an eos token or at
        max_new_tokens)."""
        raise NotImplementedError

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary [rows, length, vocab] of `ids` [rows, length] (no gradient)."""
        raise NotImplementedError

    def _data_parallel(self) -> tuple[int, int]:
        """(this rank's index, count) among the ranks that take different rows."""
        return _rank_and_world()

    def _optimizer_layout(self) -> dict:
        """What a saved optimizer state depends on besides the adapter (a state loads only where it matches)."""
        raise NotImplementedError

    def _optimizer_file(self) -> tuple[str, bool]:
        """This rank's optimizer state file in a saved state, and whether this rank writes it."""
        return OPTIMIZER_FILE, _rank_and_world()[0] == 0  # the ranks hold the same state

    def _save_optimizer(self, name: str, path: Path) -> None:
        torch.save(self.optimizers[name].state_dict(), path)

    def _load_optimizer(self, name: str, path: Path) -> None:
        self.optimizers[name].load_state_dict(torch.load(path, weights_only=True))

    def _sum_and_clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Sum the ranks' gradients of `params` (each holds its rows' part), clip them to `max_norm`; the norm."""
        _sum_gradients_over_ranks(params)
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _write_adapter(self, name: str, folder: Path) -> None:
        """Write tenant `name`'s adapter as a PEFT folder `folder/adapter` (every rank calls this)."""
        raise NotImplementedError

    # ----- tenants ---------------------------------------------------------------------------------
    def create(self, name: str, rank: int, seed: int | None = None, train_attn: bool = True,
               train_mlp: bool = True) -> None:
        if not (train_attn and train_mlp):
            raise UserError("lora_config train_attn/train_mlp=False: this server adapts every attention and MLP "
                            "linear layer; create the model with both left True")
        if not isinstance(rank, int) or rank < 1 or rank > self.model.slots.max_r:
            raise UserError(f"lora rank {rank} is outside 1..{self.model.slots.max_r} (the server's --max-lora-rank)")
        if len(self.model.slots.tenants) >= self.model.slots.max_loras:
            raise UserError(f"the server holds --max-tenants={self.model.slots.max_loras} training models already; "
                            "try again when one is released (its session ends)")
        # The adapter's initial weights depend on its seed only, never on the tenants created before it.
        if seed is None:
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        self._add_adapter(name, LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0), seed)
        self.optimizers[name] = torch.optim.AdamW(self.model.tenant_parameters(name), lr=1e-4)

    def remove(self, name: str) -> None:
        if name in self.model.slots:
            self._remove_adapter(name)
        self.optimizers.pop(name, None)
        for sampler_id in [k for k, (tenant, _) in self.samplers.items() if tenant == name]:
            del self.samplers[sampler_id]

    def _known(self, name: str) -> None:
        if name not in self.optimizers:
            raise UserError(f"model {name!r} is not on this server")

    # ----- checkpoints -----------------------------------------------------------------------------
    def save_state(self, name: str, directory: str) -> None:
        """`directory`: tenant `name`'s adapter as a plain PEFT folder (it loads on the HF base with
        PeftModel.from_pretrained) and its AdamW state, in the checksummed layout of the flows' training states."""
        self._known(name)
        with _shared_atomic_dir(Path(directory)) as tmp:
            self._write_adapter(name, tmp)
            file, writes = self._optimizer_file()
            if writes:
                self._save_optimizer(name, tmp / file)
            if _rank_and_world()[0] == 0:
                (tmp / OPTIMIZER_LAYOUT).write_text(json.dumps(self._optimizer_layout()))

    def create_from_state(self, name: str, directory: str, optimizer: bool) -> None:
        """A new training model with the saved state's rank, weights and (with `optimizer`) AdamW state."""
        config = LoraConfig.from_pretrained(str(Path(directory) / "adapter"))
        self.create(name, int(config.r))
        try:
            self.load_state(name, directory, optimizer)
        except Exception:
            self.remove(name)
            raise

    def load_state(self, name: str, directory: str, optimizer: bool) -> None:
        """Tenant `name` takes the saved adapter weights; with `optimizer`, the saved AdamW state too, else a
        fresh one. Its gradients are cleared."""
        self._known(name)
        source = Path(directory)
        problem = damage(source) if (source / MANIFEST_FILE).is_file() else f"{MANIFEST_FILE} is missing"
        if problem:
            raise UserError(f"the saved state is damaged and was not loaded: {problem}")
        config = LoraConfig.from_pretrained(str(source / "adapter"))
        own = self.model.slots.get(name, "load_state").config
        if config.r != own.r:
            raise UserError(f"the saved state has LoRA rank {config.r}, this training model {own.r}; create the "
                            "training model from the state instead (create_training_client_from_state)")
        file = None
        if optimizer:
            layout = source / OPTIMIZER_LAYOUT
            saved = json.loads(layout.read_text()) if layout.is_file() else {"backend": "transformers"}
            if saved != self._optimizer_layout():
                raise UserError(f"the saved optimizer state was written by {saved}, this server is "
                                f"{self._optimizer_layout()}; load the weights only (load_state without optimizer)")
            file = self._optimizer_file()[0]
        self._read_adapter(name, source / "adapter")
        self.optimizers[name] = torch.optim.AdamW(self.model.tenant_parameters(name), lr=1e-4)
        if file is not None:
            self._load_optimizer(name, source / file)
        self.optimizers[name].zero_grad(set_to_none=True)

    # ----- sampling ----------------------------------------------------------------------------------
    def save_sampler(self, name: str, sampler_id: str, directory: str | None = None) -> None:
        """Keep tenant `name`'s adapter weights as they are now, for sampling under `sampler_id`; with
        `directory`, also as a PEFT adapter folder there (checksummed), which MLflow can register."""
        self._known(name)
        self.samplers[sampler_id] = (name, [p.detach().clone() for p in self.model.tenant_parameters(name)])
        if directory is not None:
            with _shared_atomic_dir(Path(directory)) as tmp:
                self._write_adapter(name, tmp)

    def drop_sampler(self, sampler_id: str) -> None:
        self.samplers.pop(sampler_id, None)

    @contextlib.contextmanager
    def _sampler_weights(self, sampler_id: str | None):
        """The adapter to route through while sampling: the base (None), or the tenant with the sampler's saved
        weights swapped in for the call (the tenant's own weights and gradients come back untouched)."""
        if sampler_id is None:
            yield BASE_ONLY
            return
        if sampler_id not in self.samplers:
            raise UserError("this sampler's weights were released (its training model's session ended)")
        tenant, saved = self.samplers[sampler_id]
        current = self.model.tenant_parameters(tenant)
        kept = [p.detach().clone() for p in current]
        with torch.no_grad():
            for p, value in zip(current, saved):
                p.copy_(value)
        try:
            yield tenant
        finally:
            with torch.no_grad():
                for p, value in zip(current, kept):
                    p.copy_(value)

    @torch.no_grad()
    def sample(self, sampler_id: str | None, prompt: list[int], num_samples: int, max_tokens: int,
               temperature: float, top_p: float, top_k: int, seed: int | None, stop_tokens: list[int] | None,
               prompt_logprobs: bool, stop_strings: list[str] | None = None, topk_prompt: int = 0,
               topk_sample: int = 0, prompt_last_n: int | None = None) -> tuple[list[Sampled], Scores | None]:
        """`num_samples` completions of `prompt`: each one's tokens, their log-probabilities under the sampled
        weights (temperature 1, as forward computes them), why it stopped and (with `topk_sample`) the top
        tokens at each of its positions; the prompt's log-probabilities (and `topk_prompt` top tokens) at every
        position but the first, or only the last `prompt_last_n`.
        `stop_strings`: a completion ends with the token that completes the first of them in its text (the end
        of sequence token still stops it too)."""
        if not prompt or len(prompt) + max_tokens > self.max_length:
            raise UserError(f"prompt of {len(prompt)} tokens + max_tokens={max_tokens} is over this server's "
                            f"--max-length={self.max_length} (or the prompt is empty)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        for k, what in ((topk_prompt, "topk_prompt_logprobs"), (topk_sample, "topk_sample_logprobs")):
            if not 0 <= k <= MAX_TOPK:
                raise UserError(f"{what}={k}: this server returns 0..{MAX_TOPK} top tokens a position")
        if prompt_last_n is not None and not 1 <= prompt_last_n <= len(prompt) - 1:
            raise UserError(f"prompt_logprobs_last_n={prompt_last_n} must be in 1..{len(prompt) - 1} (the prompt's "
                            "positions after the first)")
        tokenizer = self.model.tokenizer
        eos = [tokenizer.eos_token_id] if stop_tokens is None else list(stop_tokens)
        eos = [t for t in eos if t is not None]
        settings = SamplingSettings(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    top_k=max(0, top_k))
        k = max(topk_prompt, topk_sample)
        with self._sampler_weights(sampler_id) as adapter, self.model.router.route([RowGroup(adapter)]):
            completions = self._sample_tokens(prompt, num_samples, settings, seed if seed is not None else 0, eos)
            scored = [self._score(prompt + c, k) for c in completions]
        sequences = []
        for completion, (logprobs, top_ids, top_logprobs) in zip(completions, scored):
            cut = _stop_string_end(tokenizer, completion, stop_strings) if stop_strings else None
            completion = completion if cut is None else completion[:cut]
            stop = "stop" if cut is not None or (completion and completion[-1] in eos) else "length"
            own = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
            top = (top_ids[own, :topk_sample], top_logprobs[own, :topk_sample]) if topk_sample else None
            sequences.append((completion, logprobs[own].tolist(), stop, top))
        if not (prompt_logprobs or topk_prompt) or not scored:
            return sequences, None
        logprobs, top_ids, top_logprobs = scored[0]
        # Position i of the prompt is scored from the tokens before it: none for the first, and (last_n) only the
        # last ones asked for; an unscored position is NaN (no top tokens: id 0, MASK_LOGPROB).
        first = len(prompt) - (prompt_last_n or len(prompt) - 1)
        values = np.full(len(prompt), np.nan, np.float32)
        values[first:] = logprobs[first - 1:len(prompt) - 1]
        top = None
        if topk_prompt:
            ids = np.zeros((len(prompt), topk_prompt), np.int32)
            lps = np.full((len(prompt), topk_prompt), MASK_LOGPROB, np.float32)
            ids[first:], lps[first:] = top_ids[first - 1:len(prompt) - 1, :topk_prompt], \
                top_logprobs[first - 1:len(prompt) - 1, :topk_prompt]
            top = (ids, lps)
        return sequences, (values if prompt_logprobs else None, top)

    def _score(self, tokens: list[int], k: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For every position of one sequence: log p(token i+1 | tokens up to i), and the `k` most likely next
        tokens with their log-probabilities (most likely first)."""
        ids = torch.tensor([tokens], device=self.device)
        log_probs = torch.log_softmax(self._logits(ids)[0, :-1], -1)
        chosen = log_probs.gather(-1, ids[0, 1:, None])[:, 0].cpu().numpy()
        top = log_probs.topk(k, dim=-1) if k else None
        empty = np.zeros((len(tokens) - 1, 0))
        return (chosen, top.indices.int().cpu().numpy() if k else empty.astype(np.int32),
                top.values.cpu().numpy() if k else empty.astype(np.float32))

    # ----- training --------------------------------------------------------------------------------
    def check(self, request: ForwardBackwardIn) -> None:
        """Raise a UserError for a request that cannot run; nothing about the model changes."""
        if request.model_id not in self.model.slots:
            raise UserError(f"model {request.model_id!r} is not on this server")
        if not request.data:
            raise UserError("forward_backward: no data")
        for i, datum in enumerate(request.data):
            where = f"datum {i}"
            n = len(datum.tokens)
            if n == 0 or n > self.max_length:
                raise UserError(f"{where}: {n} input tokens; this server takes 1..{self.max_length} per datum "
                                "(--max-length)")
            bad = datum.tokens[(datum.tokens < 0) | (datum.tokens >= self.vocab_size)]
            if bad.size:
                raise UserError(f"{where}: token id {int(bad[0])} is outside the vocabulary (0..{self.vocab_size - 1})")
            check_inputs(request.loss_fn, request.config, datum.inputs, n, where)
            targets = datum.inputs["target_tokens"]
            if targets.min() < 0 or targets.max() >= self.vocab_size:
                raise UserError(f"{where}: a target token is outside the vocabulary (0..{self.vocab_size - 1})")

    def forward_backward(self, requests: list[ForwardBackwardIn]) -> list[Outcome]:
        """Run every request that passes `check` in one batch; each gets its outputs and loss, or its error.

        Under several processes every data-parallel rank runs its share of the rows (every n-th row, so each
        tenant's rows stay contiguous), gradients stay per rank until `optim_step` sums them, and the rows' results
        are gathered on every rank."""
        outcomes: list[Outcome] = [Outcome() for _ in requests]
        runnable = []
        for i, request in enumerate(requests):
            try:
                self.check(request)
                runnable.append(i)
            except UserError as exc:
                outcomes[i].error = str(exc)
        if not runnable:
            return outcomes
        # Rows of one tenant together, tenants in slot order (the router takes contiguous row groups).
        order = {name: k for k, name in enumerate(self.model.slots.names())}
        runnable.sort(key=lambda i: order[requests[i].model_id])
        passes = [runnable]
        if self.every_rank_runs:  # all ranks run backward together: forward-only requests in a pass of their own
            passes = [part for part in ([i for i in runnable if requests[i].forward_only],
                                        [i for i in runnable if not requests[i].forward_only]) if part]
        for part in passes:
            self._pass(requests, part, outcomes)
        return outcomes

    def _pass(self, requests: list[ForwardBackwardIn], runnable: list[int], outcomes: list[Outcome]) -> None:
        rows = [(i, j) for i in runnable for j in range(len(requests[i].data))]
        tenants = list(dict.fromkeys(requests[i].model_id for i in runnable))
        share, shares = self._data_parallel()
        mine = list(range(share, len(rows), shares))
        local = self._run_rows(requests, [rows[r] for r in mine], tenants) if mine else []
        if not mine and self.every_rank_runs:  # a rank without rows runs one with its loss zeroed
            self._run_rows(requests, rows[:1], tenants, zeroed=True)
        results = dict(zip(mine, local))
        world = _rank_and_world()[1]
        if world > 1:  # (tensor-parallel peers hold the same results)
            import torch.distributed as dist

            gathered: list = [None] * world
            dist.all_gather_object(gathered, results)
            results = {k: v for part in gathered for k, v in part.items()}
        per_request: dict[int, list] = {i: [] for i in runnable}
        for r, (i, _) in enumerate(rows):
            per_request[i].append(results[r])
        for i in runnable:
            outputs = [{"logprobs": logprobs} for logprobs, _ in per_request[i]]
            outcomes[i].result = (outputs, {"loss:sum": float(sum(loss for _, loss in per_request[i]))})

    def _run_rows(self, requests: list[ForwardBackwardIn], rows: list[tuple[int, int]], tenants: list[str],
                  zeroed: bool = False) -> list[tuple]:
        """Forward (and backward, for training requests) of these (request, datum) rows in one pass; each
        row's target log-probabilities (numpy) and summed loss. With `every_rank_runs`, the pass's `tenants`
        without rows here get an empty group (their gradients: zeros), and `zeroed` rows have their loss
        inputs zeroed (a loss and gradient of exactly 0)."""
        groups, start = [], 0
        for i, _ in rows:
            name = requests[i].model_id
            if groups and groups[-1].adapter == name:
                groups[-1] = RowGroup(name, groups[-1].start, groups[-1].stop + 1)
            else:
                groups.append(RowGroup(name, start, start + 1))
            start += 1
        if self.every_rank_runs:
            groups += [RowGroup(name, start, start) for name in tenants if name not in {g.adapter for g in groups}]
        data = [requests[i].data[j] for i, j in rows]
        if zeroed:
            data = [DatumIn(d.tokens, {k: v if k == "target_tokens" else np.zeros_like(v) for k, v in d.inputs.items()})
                    for d in data]
        logprobs = self._target_logprobs(data, groups)
        total, out = None, []
        for (i, _), datum, row_logprobs in zip(rows, data, logprobs):
            request = requests[i]
            inputs = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in datum.inputs.items() if k != "target_tokens"}
            loss = loss_sum(request.loss_fn, request.config, row_logprobs, inputs)
            out.append((row_logprobs.detach().float().numpy(), float(loss.detach())))
            if not request.forward_only:
                total = loss if total is None else total + loss
        if total is not None:
            total.backward()
        return out

    def optim_step(self, name: str, learning_rate: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, grad_clip_norm: float = 0.0) -> dict[str, float]:
        """One AdamW step of tenant `name` over its accumulated gradients, which it then clears."""
        self._known(name)
        for value, what in ((learning_rate, "learning_rate"), (eps, "eps"), (weight_decay, "weight_decay")):
            if not math.isfinite(value) or value < 0:
                raise UserError(f"adam_params.{what}={value} must be a finite number >= 0")
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise UserError(f"adam_params beta1={beta1}, beta2={beta2} must be in [0, 1)")
        optimizer = self.optimizers[name]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # The norm before clipping, computed once (an infinite bound clips nothing); 0 when no weight has a
        # gradient on any rank (no rows since the last step: Adam then skips the weights, as alone).
        norm = self._sum_and_clip(params, grad_clip_norm if grad_clip_norm > 0 else math.inf) \
            if _gradients_anywhere(params) else 0.0
        for group in optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm}


@contextlib.contextmanager
def _shared_atomic_dir(final: Path):
    """`atomic_dir` that every rank enters: rank 0 makes the folder, every rank may write into it, and it
    appears under its final name, checksummed (write_manifest), once all have written."""
    rank, world = _rank_and_world()
    box = [None]
    with atomic_dir(final) if rank == 0 else contextlib.nullcontext() as tmp:
        box[0] = str(tmp) if rank == 0 else None
        if world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(box, src=0)
        yield Path(box[0])
        if world > 1:
            dist.barrier()  # every rank has written
        if rank == 0:
            write_manifest(Path(box[0]))
    if world > 1:
        dist.barrier()  # the folder has its final name before any rank answers



def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gradients_anywhere(params: list[torch.nn.Parameter]) -> bool:
    has = torch.tensor([float(any(p.grad is not None for p in params))])
    if _rank_and_world()[1] > 1:
        import torch.distributed as dist

        dist.all_reduce(has)
    return bool(has.item())


def _sum_gradients_over_ranks(params: list[torch.nn.Parameter]) -> None:
    """Each rank holds the gradient of its own rows: their sum is the whole batch's (the losses are sums)."""
    rank, world = _rank_and_world()
    if world == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _stop_string_end(tokenizer, completion: list[int], stop_strings: list[str]) -> int | None:
    """How many tokens of `completion` it takes for its text to hold one of `stop_strings` (None: it never
    does). Decoded as a whole prefix at each step: a token's text alone can be part of a character."""
    for end in range(1, len(completion) + 1):
        text = tokenizer.decode(completion[:end], skip_special_tokens=False)
        if any(stop in text for stop in stop_strings):
            return end
    return None
