"""MegatronModel: train a Hugging Face model on megatron-core, with the verbs of TransformersModel.

    model = MegatronModel("hf://Qwen/Qwen2.5-7B", mixed_precision="bf16", tp_size=2, pp_size=2)
    model.add_adapter_to_model("default", LoraConfig(r=8))          # optional: LoRA on the parallel linears
    model.set_optimizer("AdamW", lr=1e-4)                           # megatron's optimizer (distributed when dp > 1)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=10, num_training_steps=1000)
    for batch in batches:                   # this data-parallel rank's rows of the global batch
        model.forward_backward(inputs=batch)  # all its micro-batches through the pipeline schedule (1F1B)
        model.clip_grad_and_step(max_grad_norm=1.0)
    model.save("step-1000", "ckpt/")        # megatron dist checkpoint (model + optimizer): resume at any layout
    model.save_hf("out/")                   # Hugging Face safetensors (or a PEFT adapter) through the bridge

Every process of the torchrun job builds its own part of the model (tp × pp × ep), filled straight from
the HF safetensors by the bridge (twinkle_core.convert). The data-parallel size is what tp × pp leaves.
Each `forward_backward` call runs its rows through megatron's schedule in micro-batches of
`micro_batch_size`; with `gradient_accumulation_steps=N` (set_optimizer) a step is N calls, whose
gradients are reduced once after the last. The loss is normalised by the step's global trained tokens.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from twinkle_core.convert import export_hf_weights, load_hf_weights, megatron_family
from twinkle_core.convert.lora_peft import export_peft_adapter
from twinkle_core.convert.megatron_checkpoint import (HF_DIR, copy_hf_side_files, is_megatron_checkpoint,
                                                      load_megatron_checkpoint, read_checkpoint_info,
                                                      sharded_state_dict)
from twinkle_core.hub import resolve_model
from twinkle_core.megatron import MegatronParallel, build_gpt_chunks, initialize_megatron_parallel
from twinkle_core.megatron.engine import fp8_problem, fp8_settings, resolve_transformer_impl
from twinkle_core.megatron.lora import add_megatron_lora, merge_lora
from twinkle_core.megatron.step import run_schedule, split_micro_batches
from twinkle_core.models.batches import to_batch
from twinkle_core.models.schedulers import lr_factor
from twinkle_core.models.stepper import held_out_metrics
from twinkle_core.models.state_dirs import (PROGRESS_FILE, finish_state, newest_intact_state, partial_dir,
                                            remove_partial)
from twinkle_core.models.training_state import check_resume_settings
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.precision import MixedPrecision, resolve_precision

logger = logging.getLogger(__name__)
_OPTIMIZERS = {"AdamW": "adam", "Adam": "adam", "SGD": "sgd"}
TRAINING_STATE = "training_state.json"


class MegatronModel:
    """A Megatron-capable HF model (or a Megatron checkpoint of this project) trained on megatron-core."""

    def __init__(self, model_id: str, mixed_precision: str = "auto", tp_size: int = 1, pp_size: int = 1,
                 ep_size: int = 1, sequence_parallel: bool = False, dp_size: int | None = None,
                 virtual_pipeline_stages: int | None = None, micro_batch_size: int = 1, use_distributed_optimizer: bool | None = None,
                 max_length: int | None = None, seed: int = 0, expert_tensor_parallel_size: int | None = None,
                 cp_size: int = 1, transformer_impl: str | None = None, fp8_recipe: str = "tensorwise"):
        """`dp_size`: None takes what tp × pp leave of the processes (a given one must equal it);
        `virtual_pipeline_stages`: model chunks per pipeline rank (interleaved 1F1B; needs pp_size > 1);
        `use_distributed_optimizer`: shard optimizer state over data-parallel ranks (None: when dp > 1);
        `expert_tensor_parallel_size`: split each routed expert this many ways, independently of tp_size (None:
        megatron's default, tp_size; 1 keeps experts whole and replicates them over tp as expert data parallelism);
        `cp_size`: context parallelism, each sequence split over cp ranks (Transformer Engine only);
        `transformer_impl`: "local" or "transformer_engine" (None: TE where CUDA and TE are present, else local;
        twinkle_core.megatron.engine); `fp8_recipe`: "tensorwise" or "delayed" with mixed_precision="fp8"."""
        self.transformer_impl = resolve_transformer_impl(transformer_impl)
        if cp_size > 1 and self.transformer_impl != "transformer_engine":
            raise ValueError(f"cp_size={cp_size}: context parallelism splits sequences inside Transformer Engine's "
                             f"attention, and this model uses transformer_impl={self.transformer_impl!r}; use "
                             "cp_size=1, or transformer_impl='transformer_engine' on a CUDA machine.")
        self.layout = MegatronParallel(tp=tp_size, pp=pp_size, ep=ep_size, sequence_parallel=sequence_parallel,
                                       vpp=virtual_pipeline_stages, etp=expert_tensor_parallel_size, cp=cp_size)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.layout.check(world_size)  # a library user's guard; flows check before launch (train.checks)
        if virtual_pipeline_stages and pp_size == 2 and not torch.cuda.is_available():
            # measured: with 2 stages both ring neighbours are the same rank, and gloo then pairs the
            # interleaved schedule's activation and gradient messages wrongly (pp=4 matches one process)
            raise ValueError("virtual_pipeline_stages with pp_size=2 is not supported over gloo (CPU): use "
                             "pp_size >= 3, or no virtual stages.")
        if dp_size is not None and dp_size * tp_size * pp_size * cp_size != world_size:
            cp = f" x cp_size={cp_size}" if cp_size > 1 else ""
            raise ValueError(f"dp_size={dp_size} x tp_size={tp_size} x pp_size={pp_size}{cp} must equal the "
                             f"{world_size} processes; dp_size={world_size // (tp_size * pp_size * cp_size)} would "
                             "fit (or leave it empty).")
        self.precision = _megatron_precision(mixed_precision, self.transformer_impl)
        fp8 = fp8_settings(fp8_recipe) if self.precision.mode is MixedPrecision.fp8 else None
        self.model_id = model_id
        # a Megatron checkpoint of this project (local) loads as it is; anything else resolves like an HF id
        path = Path(model_id) if is_megatron_checkpoint(model_id) else Path(resolve_model(model_id).path)
        self.hf_dir = path / HF_DIR if is_megatron_checkpoint(path) else path
        self.family = read_checkpoint_info(path)["family"] if is_megatron_checkpoint(path) else megatron_family(path)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        problems = moe_sequence_parallel_problems(self.hf_config, self.layout)
        if problems:
            raise ValueError(problems[0])
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        self.micro_batch_size = _positive("micro_batch_size", micro_batch_size)
        self.max_length = max_length
        self.seed = seed
        initialize_megatron_parallel(self.layout, seed=seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        # megatron keeps the model in the compute dtype; its optimizer holds fp32 master weights (bf16/fp16)
        # this rank's model chunks: one, or one per virtual pipeline stage
        self.chunks = build_gpt_chunks(self.hf_config, self.layout, self.precision.compute_dtype,
                                       transformer_impl=self.transformer_impl, fp8=fp8)
        for chunk in self.chunks:
            chunk.config.calculate_per_token_loss = True  # the loss is normalised by global trained tokens
        if is_megatron_checkpoint(path):
            load_megatron_checkpoint(self.chunks, path)
        else:
            load_hf_weights(self.chunks, self.hf_config, self.hf_dir)
        for chunk in self.chunks:
            chunk.to(self.device)
            _to_compute_dtype(chunk, self.precision.compute_dtype)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.adapter_name: str | None = None
        self.lora_config = None
        self.ddp: list | None = None  # megatron's DistributedDataParallel around each chunk, from set_optimizer
        self.optimizer = None
        self._schedule: tuple[str, int, int] | None = None
        self.base_lr = 0.0
        self.step = 0
        self._last: dict[str, float] = {}
        self._pending: tuple[float, int, float] | None = None  # loss sum, tokens, seconds of the step's passes
        self._calls, self._step_tokens = 0, None  # forward_backward calls and trained tokens of this step
        self.gradient_accumulation_steps = 1
        self._eval = [0.0, 0]

    # ----- model structure -------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    def add_adapter_to_model(self, name: str, config, gradient_accumulation_steps: int | None = None) -> None:
        """LoRA on megatron's column/row-parallel linears, split like its base under TP; the base is frozen.

        `target_modules` may name megatron's linears or the HF projections they fuse (q/k/v, gate/up together).
        """
        if self.adapter_name is not None:
            raise ValueError(f"adapter {self.adapter_name!r} is already on this model; MegatronModel trains one "
                             "adapter.")
        resolve_transformer_impl(self.transformer_impl, lora=True)  # TE's fused norm + linear layers: refused
        if self.ddp is not None:
            raise RuntimeError("add_adapter_to_model: call it before set_optimizer.")
        for chunk in self.chunks:
            self.lora_config = add_megatron_lora(chunk, config, name, seed=self.seed)
        self.adapter_name = name
        if gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = _positive("gradient_accumulation_steps", gradient_accumulation_steps)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]

    # ----- optimisation ----------------------------------------------------------------------------
    def set_optimizer(self, optimizer_cls: str = "AdamW", lr: float = 1e-4, weight_decay: float = 0.0,
                      betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      gradient_accumulation_steps: int | None = None) -> None:
        """megatron-core's optimizer (fp32 master weights under bf16/fp16) over megatron's DDP grad buffers.

        `gradient_accumulation_steps`: forward_backward calls per optimizer step (each may hold several
        micro-batches); the step's gradients are reduced and normalised once, after the last call.
        """
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if gradient_accumulation_steps is not None:
            self.gradient_accumulation_steps = _positive("gradient_accumulation_steps", gradient_accumulation_steps)
        if optimizer_cls not in _OPTIMIZERS:
            raise ValueError(f"optimizer_cls={optimizer_cls!r}: the Megatron backend has {sorted(_OPTIMIZERS)}.")
        if self.ddp is not None:
            raise RuntimeError("set_optimizer: the optimizer is already set.")
        distributed = self.data_parallel_size > 1 if self.use_distributed_optimizer is None \
            else self.use_distributed_optimizer
        config = self.chunks[0].config
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
                                                   average_in_collective=False)
        self.ddp = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in self.chunks]
        config.finalize_model_grads_func = self._finalize_grads
        config.no_sync_func = self.ddp[0].no_sync if len(self.ddp) == 1 else [d.no_sync for d in self.ddp]
        self.base_lr = lr
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer=_OPTIMIZERS[optimizer_cls], lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=eps, sgd_momentum=0.0, use_distributed_optimizer=distributed,
            bf16=self.precision.compute_dtype == torch.bfloat16, fp16=self.precision.mode is MixedPrecision.fp16,
            params_dtype=self.precision.compute_dtype, clip_grad=0.0), self.ddp)

    def set_lr_scheduler(self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: int = 0,
                         num_training_steps: int = 1) -> None:
        self._require_optimizer("set_lr_scheduler")
        lr_factor(scheduler_cls, 0, num_warmup_steps, num_training_steps)  # validates the names and numbers
        self._schedule = (scheduler_cls, num_warmup_steps, num_training_steps)
        self._apply_lr()

    def forward_backward(self, inputs: list[dict] | dict) -> float:
        """Forward and backward this rank's rows (all their micro-batches); return their mean token loss."""
        self._require_optimizer("forward_backward")
        for module in self.ddp:
            module.train()
        start = time.perf_counter()
        if self._pending is None:  # the first call of a step
            for module in self.ddp:
                module.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._pending = (0.0, 0, 0.0)
            self._calls, self._step_tokens = 0, None
        self._calls += 1
        loss_sum, tokens = run_schedule(self.ddp, self._micro_batches(inputs), self.hf_config.vocab_size,
                                        forward_only=False)
        previous = self._pending
        self._pending = (previous[0] + loss_sum, previous[1] + tokens, previous[2] + time.perf_counter() - start)
        return loss_sum / max(1, tokens)

    def _finalize_grads(self, model_chunks, num_tokens=None, **kwargs) -> None:
        """megatron's grad finalisation (dp reduce, /global tokens), deferred to a step's last call."""
        from megatron.core.distributed import finalize_model_grads

        self._step_tokens = num_tokens if self._step_tokens is None else self._step_tokens + num_tokens
        if self._calls == self.gradient_accumulation_steps:
            finalize_model_grads(model_chunks, self._step_tokens, **kwargs)

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0) -> bool:
        """At the accumulation boundary: clip to `max_grad_norm` (None or 0: none), step, advance the
        schedule, and return True; before it, return False."""
        self._require_optimizer("clip_grad_and_step")
        if self._pending is None:
            raise RuntimeError("clip_grad_and_step: call forward_backward first.")
        if self._calls < self.gradient_accumulation_steps:
            return False
        start = time.perf_counter()
        for optimizer_config in _configs(self.optimizer):
            optimizer_config.clip_grad = float(max_grad_norm or 0.0)
        stepped, grad_norm, _ = self.optimizer.step()
        loss_sum, tokens, seconds = self._pending
        loss_sum, tokens = self._all_reduce_dp([loss_sum, tokens])
        self._pending = None
        lr = self._current_lr()
        if stepped:
            self.step += 1
            self._apply_lr()
        self._last = {"loss": loss_sum / max(1, tokens), "grad_norm": float(grad_norm or 0.0), "lr": lr,
                      "trained_tokens": int(tokens), "step": self.step,
                      "tokens_per_s": tokens / self.data_parallel_size / (seconds + time.perf_counter() - start),
                      "skipped": float(not stepped)}
        return bool(stepped)

    @torch.no_grad()
    def forward_only(self, inputs: list[dict] | dict) -> float:
        """Evaluation forward; accumulates the held-out loss reported by calculate_metric(False)."""
        modules = self.ddp or self.chunks
        for module in modules:
            module.eval()
        loss_sum, tokens = run_schedule(modules, self._micro_batches(inputs), self.hf_config.vocab_size,
                                        forward_only=True)
        self._eval[0] += loss_sum
        self._eval[1] += tokens
        return loss_sum / max(1, tokens)

    def calculate_metric(self, is_training: bool = True) -> dict[str, float]:
        """Training: the last step's loss, grad_norm, lr, tokens_per_s; eval: held-out loss and perplexity."""
        if not is_training:
            loss_sum, tokens = self._all_reduce_dp(self._eval)
            self._eval = [0.0, 0]
            return held_out_metrics(loss_sum, tokens)
        return dict(self._last)

    # ----- checkpoints -----------------------------------------------------------------------------
    def save(self, name: str, output_dir: str | Path, with_optimizer: bool = True) -> Path:
        """A megatron dist checkpoint `output_dir/name` of model, optimizer and step (every rank calls it).

        It loads at any tp/pp layout with `load` (resharding), and converts to HF with
        `python -m flows.convert --to hf`.
        """
        from megatron.core import dist_checkpointing

        from twinkle_core.convert.megatron_checkpoint import save_megatron_checkpoint

        target = Path(output_dir) / name
        save_megatron_checkpoint(self.chunks, target, self.hf_dir, self.layout, self.family,
                                 self.precision.compute_dtype)
        if with_optimizer and self.optimizer is not None:
            state = self.optimizer.sharded_state_dict(sharded_state_dict(self.chunks))
            (target / "optimizer").mkdir(exist_ok=True)
            _barrier()
            dist_checkpointing.save(state, str(target / "optimizer"))
        if _is_rank0():
            (target / TRAINING_STATE).write_text(json.dumps(
                {"step": self.step, "adapter_name": self.adapter_name, "schedule": self._schedule}) + "\n")
        _barrier()
        return target

    def load(self, name: str, output_dir: str | Path) -> None:
        """Load a checkpoint written by `save` (model, and optimizer + step when set_optimizer ran)."""
        from megatron.core import dist_checkpointing

        source = Path(output_dir) / name
        load_megatron_checkpoint(self.chunks, source)
        state = json.loads((source / TRAINING_STATE).read_text()) if (source / TRAINING_STATE).is_file() else {}
        if self.optimizer is not None and (source / "optimizer").is_dir():
            sharded = self.optimizer.sharded_state_dict(sharded_state_dict(self.chunks), is_loading=True)
            self.optimizer.load_state_dict(dist_checkpointing.load(sharded, str(source / "optimizer")))
            self.optimizer.reload_model_params()  # the fp32 main weights from the model just loaded
            self.step = int(state.get("step", 0))
            self._apply_lr()

    def save_training_state(self, checkpoint_dir: str | Path, progress: dict, keep: int = 2) -> None:
        """A new state under `checkpoint_dir/training_state` (twinkle_core.models.state_dirs): a dist checkpoint
        of model, optimizer and step, plus `progress` and checksums; published only once complete, the newest
        `keep` kept."""
        partial = partial_dir(checkpoint_dir, self.step)
        if _is_rank0():
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        self.save(partial.name, partial.parent)
        if _is_rank0():
            finish_state(partial, {**progress, "step": self.step}, keep)
        _barrier()

    def load_training_state(self, checkpoint_dir: str | Path, settings: dict) -> dict | None:
        """Restore the newest intact state `save_training_state` wrote with these settings; its progress
        (None: none)."""
        if _is_rank0():
            remove_partial(checkpoint_dir)
        state = newest_intact_state(checkpoint_dir)
        if state is None:
            return None
        progress = json.loads((state / PROGRESS_FILE).read_text())
        check_resume_settings(progress, settings, state)
        self.load(state.name, state.parent)
        return progress

    def export(self, name: str, output_dir: str | Path) -> Path:
        """`output_dir/name` as the Transformers backend writes it: a PEFT adapter or a full HF directory."""
        return self.save_hf(Path(output_dir) / name)

    def save_hf(self, output_dir: str | Path, merge_adapter: bool = False) -> Path:
        """Export through the bridge: HF safetensors + config + tokenizer, or with LoRA a PEFT adapter."""
        output_dir = Path(output_dir)
        if self.adapter_name is not None and not merge_adapter:
            export_peft_adapter(self.chunks, self.hf_config, self.lora_config, output_dir, self.adapter_name)
        else:
            with _merged(self.chunks, self.adapter_name if merge_adapter else None):
                export_hf_weights(self.chunks, self.hf_config, output_dir)
            if _is_rank0():
                copy_hf_side_files(self.hf_dir, output_dir)
        _barrier()
        return output_dir

    def close(self) -> None:
        close_distributed()

    # ----- helpers ---------------------------------------------------------------------------------
    def _micro_batches(self, inputs):
        from megatron.core import parallel_state as ps

        batch = to_batch(inputs, self.tokenizer, self.device, self.max_length)
        pad = self.layout.tp if self.layout.sequence_parallel else 1
        if self.precision.mode is MixedPrecision.fp8:  # TE's fp8 GEMMs take token counts in multiples of 16
            pad = math.lcm(pad, 16)
        return split_micro_batches(batch, self.micro_batch_size, pad_multiple=pad, allow_ragged=self.layout.pp == 1,
                                   packed_documents=self.transformer_impl == "transformer_engine",
                                   cp_size=self.layout.cp, cp_rank=ps.get_context_parallel_rank())

    def _current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _apply_lr(self) -> None:
        lr = self.base_lr * (lr_factor(*self._schedule[:1], self.step, *self._schedule[1:])
                             if self._schedule else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _all_reduce_dp(self, values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        # context-parallel ranks hold parts of the same rows: their sums add up too
        if ps.get_data_parallel_world_size(with_context_parallel=True) == 1:
            return list(values)
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=ps.get_data_parallel_group(with_context_parallel=True))
        return tensor.tolist()

    def _require_optimizer(self, verb: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{verb}: call set_optimizer(...) first.")


def _megatron_precision(mode: str, transformer_impl: str = "local"):
    """The precision policy on megatron: fp8 computes in Transformer Engine's layers (bf16 elsewhere)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(mode) == "fp8":
        problem = fp8_problem() if transformer_impl == "transformer_engine" else \
            f"this model uses transformer_impl={transformer_impl!r}"
        if problem:
            raise ValueError(f"mixed_precision='fp8' on the Megatron backend computes in Transformer Engine's "
                             f"layers, and {problem}; use 'bf16' (recommended) or 'no'.")
    return resolve_precision(mode, device, check_fp8=False)


def moe_sequence_parallel_problems(hf_config, layout: MegatronParallel) -> list[str]:
    """megatron's MoE layer refuses to train at tp > 1 without sequence parallelism: say so before building."""
    from twinkle_core.megatron.model_builder import moe_layer_pattern

    has_expert_layers = any(moe_layer_pattern(hf_config))
    if layout.tp > 1 and not layout.sequence_parallel and has_expert_layers:
        return [f"tp_size={layout.tp}: {hf_config.model_type} is a mixture-of-experts model: megatron trains it at "
                f"tp_size={layout.tp} only with sequence_parallel=True; set it, or use tp_size=1 (experts can "
                "still be split with ep_size / expert_tensor_parallel_size)."]
    return []


def _to_compute_dtype(model, dtype: torch.dtype) -> None:
    """Store every parameter in the compute dtype; megatron's local-spec norms are created in fp32.

    Its bf16/fp16 optimizer keeps the fp32 masters, and its checkpoints expect every trained parameter
    among the half-precision ones. Buffers (the router's expert bias) keep their own dtype.
    """
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


def _configs(optimizer) -> list:
    """The OptimizerConfig of each optimizer inside megatron's (chained: dense and expert parameters)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return list({id(o.config): o.config for o in inner}.values())


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    return value


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class _merged:
    """Fold adapter `adapter_name`'s deltas into the base weights for an export, and take them out afterwards."""

    def __init__(self, chunks: list, adapter_name: str | None):
        self.chunks, self.adapter_name = chunks, adapter_name

    def __enter__(self):
        for chunk in self.chunks if self.adapter_name else []:
            merge_lora(chunk, self.adapter_name, sign=1.0)

    def __exit__(self, *exc):
        for chunk in self.chunks if self.adapter_name else []:
            merge_lora(chunk, self.adapter_name, sign=-1.0)
