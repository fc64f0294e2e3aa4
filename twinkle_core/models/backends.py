"""The training backends by name: how each builds its model from a run config, and the rules it sets.

    backend = get_backend("megatron")
    model = backend.build(run_config)                 # a TrainableModel (twinkle_core.models.protocol)
    tenants = backend.build_multi_tenant(run_config)  # the same verbs, keyed by tenant

A rule is `rule(config, model_config) -> list[str]`: `config` is a flow's parameter model (its `kind`,
`backend`, `parallel()`, and the fields it has), `model_config` the model's Hugging Face config once the
model is downloaded (None before). Each problem names the field and its value. The rules run once, before
any process starts (twinkle_core.train.checks.check_run); the workers do not repeat them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from twinkle_core.config.registry import Registry

Rule = Callable[[Any, Any], list[str]]


@dataclass(frozen=True)
class Backend:
    name: str
    build: Callable[[Any], Any]  # a TrainRunConfig -> TrainableModel
    build_multi_tenant: Callable[[Any], Any]  # a MultiLoraRunConfig -> the multi-tenant model
    rules: tuple[Rule, ...]


_BACKENDS: Registry[Backend] = Registry("backend", "training backend")


def register_backend(backend: Backend) -> Backend:
    """Add a backend; a name can be registered only once."""
    return _BACKENDS.register(backend.name, backend)


def get_backend(name: str) -> Backend:
    return _BACKENDS.get(name)


def backend_names() -> list[str]:
    return _BACKENDS.names()


def _bad(config, checks) -> list[str]:
    """`field=value: why` for each (field, is_bad, why) that is bad."""
    return [f"{name}={getattr(config, name)!r}: {why}" for name, bad, why in checks if bad]


def raised_problems(check, *args) -> list[str]:
    """A check that raises ValueError on its first problem, as a list of problems."""
    try:
        check(*args)
    except ValueError as err:
        return [str(err)]
    return []


# ----- transformers ------------------------------------------------------------------------------------
def _build_transformers(cfg):
    from twinkle_core.models.transformers_model import TransformersModel
    from twinkle_core.parallel import worker_mesh

    return TransformersModel(str(cfg.model_path), mixed_precision=cfg.mixed_precision,
                             strategy=cfg.parallel.strategy.value, device_mesh=worker_mesh(cfg.parallel),
                             router_aux_loss_coef=cfg.router_aux_loss_coef, objective=cfg.objective,
                             objective_options=cfg.objective_options, padding_free=cfg.padding_free,
                             compile=cfg.compile,
                             **cfg.load_options())


def _build_transformers_tenants(cfg):
    from twinkle_core.models.multi_lora import MultiLoraTransformersModel
    from twinkle_core.parallel import worker_mesh

    return MultiLoraTransformersModel(
        str(cfg.model_path), mixed_precision=cfg.mixed_precision, strategy=cfg.parallel.strategy.value,
        device_mesh=worker_mesh(cfg.parallel), max_loras=cfg.max_loras, max_r=cfg.max_r, **cfg.load_options(),
        # mixed batches train tenants together: the MoE router loss (a statistic over all rows) stays off
        router_aux_loss_coef=0.0 if cfg.mixed_batches else None)


def _transformers_layout(config, model_config) -> list[str]:
    from twinkle_core.models.multi_lora import multi_lora_layout_problems
    from twinkle_core.parallel import check_parallel_config

    parallel = config.parallel()
    if config.kind == "multi_lora":
        split = multi_lora_layout_problems(parallel.model_dump(), parallel.sequence_parallel)
        if split:
            return split
    try:
        check_parallel_config(parallel, model_config)
    except ValueError as err:
        return [line.strip() for line in str(err).splitlines()[1:]] or [str(err)]
    return []


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def recurrent_layer_types(model_config) -> list[str]:
    """The layer types of a hybrid model that carry a state along the sequence (Qwen 3.5's and Qwen3-Next's
    gated-delta-net `linear_attention`, Mamba-style layers): no attention mask keeps packed samples apart there."""
    if model_config is None:
        return []
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return sorted({kind for kind in getattr(text, "layer_types", None) or () if kind not in ATTENTION_LAYER_TYPES})


def _transformers_options(config, model_config) -> list[str]:
    recurrent = recurrent_layer_types(model_config) if getattr(config, "packing", False) else []
    return _bad(config, [
        ("packing", bool(recurrent),
         f"this model's {'/'.join(recurrent)} layers carry their state from one packed sample into the next (a "
         "mask keeps samples apart in attention only; transformers separates them there only with "
         "flash-linear-attention kernels and cu_seqlens, not used here); use packing=false"),
        ("mixed_precision", config.kind == "multi_lora" and config.mixed_precision == "fp8",
         "fp8 linears are not built for multi-tenant LoRA; use bf16 or no"),
        ("compile", getattr(config, "compile", False) and
         getattr(config, "nproc_per_node", 1) * getattr(config, "nnodes", 1) > 1,
         "compiled decoder layers are built and measured for one process; use compile=false"),
        ("cp_size", getattr(config, "cp_size", 1) > 1, "context parallelism belongs to the megatron backend; on "
                                                      "transformers split sequences with sp_size (Ulysses)"),
        ("transformer_impl", getattr(config, "transformer_impl", None) is not None,
         "the layer implementation is a megatron option; leave it empty with backend='transformers'"),
        ("fp8_recipe", getattr(config, "fp8_recipe", "tensorwise") != "tensorwise",
         "the Transformers backend's fp8 (torchao) scales each tensor as it is cast; use fp8_recipe='tensorwise'"),
    ])


# ----- megatron ----------------------------------------------------------------------------------------
def _build_megatron(cfg):
    from twinkle_core.models.megatron_model import MegatronModel

    parallel = cfg.parallel
    return MegatronModel(str(cfg.model_path), mixed_precision=cfg.mixed_precision, tp_size=parallel.tp_size,
                         pp_size=parallel.pp_size, ep_size=parallel.ep_size,
                         sequence_parallel=parallel.sequence_parallel, micro_batch_size=1, seed=cfg.seed,
                         **megatron_engine_options(parallel, lora=cfg.use_lora))


def megatron_engine_options(parallel, lora: bool) -> dict:
    """MegatronModel's keywords for the layer implementation (resolved: LoRA trains on the local spec), its
    fp8 recipe and context parallelism."""
    from twinkle_core.megatron.engine import resolve_transformer_impl

    return {"cp_size": parallel.cp_size, "transformer_impl": resolve_transformer_impl(parallel.transformer_impl, lora),
            "fp8_recipe": parallel.fp8_recipe}


def _build_megatron_tenants(cfg):
    from twinkle_core.models.multi_lora_megatron import MultiLoraMegatronModel

    parallel = cfg.parallel  # tp × pp over the processes, data parallel over what they leave
    return MultiLoraMegatronModel(
        str(cfg.model_path), mixed_precision=cfg.mixed_precision, tp_size=parallel.tp_size,
        pp_size=parallel.pp_size, ep_size=parallel.ep_size, sequence_parallel=parallel.sequence_parallel,
        micro_batch_size=cfg.micro_batch_size, max_loras=cfg.max_loras, max_r=cfg.max_r,
        transformer_impl=parallel.transformer_impl)  # LoRA: the local spec; fp8 and cp_size > 1 refused before


def _megatron_engine_problems(config) -> list[str]:
    """What the layer implementation decides: Transformer Engine runs here or not, and what needs it."""
    from twinkle_core.megatron.engine import fp8_problem, resolve_transformer_impl, transformer_engine_problem

    requested = getattr(config, "transformer_impl", None)
    lora = config.kind == "multi_lora" or getattr(config, "use_lora", False)
    explicit = raised_problems(resolve_transformer_impl, requested, lora)
    if explicit:
        return explicit
    impl = resolve_transformer_impl(requested, lora)
    te_problem = transformer_engine_problem() if impl == "local" else None
    # why the local spec: chosen, LoRA, or no Transformer Engine here
    why = f"transformer_impl={requested!r}" if requested else "LoRA trains on the local spec" if lora and \
        not te_problem else te_problem
    fp8_reason = (why if impl == "local" else fp8_problem()) if config.mixed_precision == "fp8" else None
    cp = getattr(config, "cp_size", 1)
    packs = getattr(config, "packing", False) or getattr(config, "document_masks", False)
    seq_length = getattr(config, "seq_length", None)
    return _bad(config, [
        ("mixed_precision", bool(fp8_reason), f"fp8 on megatron computes in Transformer Engine's layers, and "
                                              f"{fp8_reason}; use bf16 (recommended) or no"),
        ("cp_size", cp > 1 and impl == "local",
         f"context parallelism splits sequences inside Transformer Engine's attention, and {why}; use "
         "cp_size=1, or transformer_impl='transformer_engine' on a CUDA machine with Transformer Engine"),
        ("cp_size", cp > 1 and config.kind == "multi_lora", "context parallelism is not built for multi-tenant "
                                                          "LoRA; use cp_size=1"),
        ("cp_size", cp > 1 and bool(packs), "packed documents under context parallelism would each need padding "
                                          "to a multiple of 2 x cp_size, which is not built; use cp_size=1 with "
                                          "packing/document masks, or turn them off"),
        ("cp_size", cp > 1 and seq_length is not None and seq_length % (2 * cp) != 0,
         f"seq_length={seq_length} must be a multiple of 2 x cp_size={2 * cp} (each rank takes two balanced "
         f"chunks of every sequence); e.g. seq_length={max(2 * cp, (seq_length or 0) // (2 * cp) * 2 * cp)}"),
        ("packing", getattr(config, "packing", False) and impl == "local",
         f"packed samples restart their positions, which megatron's local spec cannot express (Transformer "
         f"Engine's packed 'thd' attention can, and {why}); use packing=false"),
    ])


def _megatron_options(config, model_config) -> list[str]:
    return ["backend='megatron': " + problem for problem in _megatron_engine_problems(config) + _bad(config, [
        ("mixed_precision", config.kind == "multi_lora" and config.mixed_precision == "fp16",
         "each tenant would need its own loss scaler inside one backward; use bf16 or no"),
        ("sp_size", getattr(config, "sp_size", 1) > 1, "Ulysses belongs to the Transformers backend; on megatron "
                                                      "use sequence_parallel=true with tp_size > 1"),
        ("dp_size", getattr(config, "dp_size", 1) > 1, "megatron's data parallelism is what tp_size x pp_size "
                                                      "leave; use 1"),
        ("fsdp_size", getattr(config, "fsdp_size", None) not in (None, 1), "FSDP belongs to the Transformers backend"),
        ("compile", getattr(config, "compile", False), "compiled decoder layers belong to the Transformers backend"),
        ("router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None) not in (None, 0),
         "megatron trains mixture-of-experts models here without a router load-balancing loss; use None or 0, "
         "or backend='transformers'"),
    ])]


def _megatron_layout(config, model_config) -> list[str]:
    from twinkle_core.megatron.parallel_state import MegatronParallel
    from twinkle_core.models.megatron_model import moe_sequence_parallel_problems
    from twinkle_core.parallel.mesh import tp_heads_problems

    parallel = config.parallel()
    layout = MegatronParallel(parallel.tp_size, parallel.pp_size, parallel.ep_size, parallel.sequence_parallel,
                              getattr(config, "virtual_pipeline_stages", None), cp=parallel.cp_size)
    problems = raised_problems(layout.check, parallel.world_size())
    if problems or model_config is None:
        return problems
    return tp_heads_problems(parallel.tp_size, model_config) + moe_sequence_parallel_problems(model_config, layout)


register_backend(Backend("transformers", _build_transformers, _build_transformers_tenants,
                         (_transformers_options, _transformers_layout)))
register_backend(Backend("megatron", _build_megatron, _build_megatron_tenants,
                         (_megatron_options, _megatron_layout)))
