"""The process layout of a run: a named `torch.distributed` device mesh, and its validation.

    mesh = DeviceMesh.from_sizes(dp_size=1, fsdp_size=2)   # inside a worker that torchrun started
    validate_mesh_sizes({"fsdp_size": 2}, world_size=2, model_config=config)   # in the flow, before launch

World size = dp × fsdp × sp × tp: `dp` replicates the model (DDP, or the replicas of HSDP), `fsdp`
shards it, `sp` splits sequences and `tp` splits weight matrices. Expert parallelism does not add
ranks: the experts are sharded over `ep` of the data-parallel (dp × fsdp) ranks, as in Megatron and
torchtitan, so `ep` must divide dp × fsdp.

The loader deals rows out over dp × fsdp (`data_parallel_*`); gradients and token counts are summed over
dp × fsdp × sp (`token_parallel_*`) and FSDP shards over fsdp × sp (`shard_dim`): sp ranks hold different
tokens of the same rows.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Mapping

MESH_DIMS = ("dp", "fsdp", "sp", "tp")  # outermost first: replicas span machines, tp stays within one
_MULTIPLIED = tuple(f"{dim}_size" for dim in MESH_DIMS)
SIZE_OPTIONS = (*_MULTIPLIED, "ep_size")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _text_config(model_config: Any) -> Any:
    """The language model's config (vision-language configs nest it as text_config)."""
    getter = getattr(model_config, "get_text_config", None)
    return getter() if callable(getter) else model_config


def _num_experts(config: Any) -> int | None:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _product_problem(sizes: dict[str, int], world_size: int) -> str | None:
    product = math.prod(sizes[name] for name in _MULTIPLIED)
    if product == world_size:
        return None
    fits = []
    for name in _MULTIPLIED:
        others = product // sizes[name]
        if world_size % others == 0:
            fits.append(f"{name}={world_size // others}")
    formula = " × ".join(f"{name}={sizes[name]}" for name in _MULTIPLIED)
    hint = f"with the other sizes unchanged, {' or '.join(fits)} would fit" if fits else (
        f"choose sizes whose product is {world_size}")
    return (f"{formula} = {product}, but the run has {world_size} processes (nproc_per_node × nnodes); "
            f"{hint}.")


def tp_heads_problems(tp_size: int, model_config: Any) -> list[str]:
    """Tensor parallelism splits the attention heads and the kv heads: tp_size must divide both."""
    config = _text_config(model_config)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and tp_size > 1 and (heads % tp_size or kv_heads % tp_size):
        return [f"tp_size={tp_size} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}; "
                f"tp_size can be one of {_divisors(math.gcd(heads, kv_heads))}."]
    return []


def _model_problems(sizes: dict[str, int], model_config: Any) -> list[str]:
    config = _text_config(model_config)
    heads = getattr(config, "num_attention_heads", None)
    problems = tp_heads_problems(sizes["tp_size"], config)
    if heads and sizes["sp_size"] > 1 and heads % sizes["sp_size"]:
        problems.append(f"sp_size={sizes['sp_size']} must divide num_attention_heads={heads} (each rank attends "
                        f"with a share of the heads); sp_size can be one of {_divisors(heads)}.")
    if sizes["sp_size"] > 1:
        from twinkle_core.parallel.sequence import sp_model_problems

        problems += sp_model_problems(config, sizes["sp_size"])
    if sizes["tp_size"] > 1:
        from twinkle_core.parallel.tp_plan import tp_plan_problems

        problems += tp_plan_problems(config, sizes["tp_size"])
    experts = _num_experts(config)
    if sizes["ep_size"] > 1 and experts is None:
        problems.append(f"ep_size={sizes['ep_size']}: model_type {getattr(config, 'model_type', '?')!r} has no "
                        "experts (not a mixture-of-experts model); use ep_size=1.")
    elif sizes["ep_size"] > 1 and experts % sizes["ep_size"]:
        problems.append(f"ep_size={sizes['ep_size']} must divide the number of experts ({experts}); "
                        f"ep_size can be one of {_divisors(experts)}.")
    elif sizes["ep_size"] > 1:
        from twinkle_core.parallel.expert import ep_model_problem

        problems += [p for p in [ep_model_problem(config, sizes["ep_size"])] if p]
    return problems


def validate_mesh_sizes(sizes: Mapping[str, int], world_size: int, model_config: Any = None) -> dict[str, int]:
    """Check a layout before any process starts; return the sizes with every option filled in.

    `sizes` maps dp_size / fsdp_size / tp_size / ep_size / sp_size (missing ones are 1). All problems are
    reported together in one ValueError, each naming the option, its value and the values that would work.
    """
    unknown = sorted(set(sizes) - set(SIZE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown mesh options {unknown}; the options are {list(SIZE_OPTIONS)}.")
    full = {name: sizes.get(name, 1) for name in SIZE_OPTIONS}
    problems = [f"{name}={value!r} must be an integer >= 1." for name, value in full.items()
                if not isinstance(value, int) or value < 1]
    if world_size < 1:
        problems.append(f"world size {world_size} must be >= 1.")
    if not problems:
        problems += [p for p in [_product_problem(full, world_size)] if p]
        data_parallel = full["dp_size"] * full["fsdp_size"]
        if data_parallel % full["ep_size"]:
            problems.append(f"ep_size={full['ep_size']} must divide dp_size × fsdp_size = {data_parallel} (experts "
                            f"are sharded over data-parallel ranks); ep_size can be one of {_divisors(data_parallel)}.")
        if model_config is not None:
            problems += _model_problems(full, model_config)
    if problems:
        raise ValueError("invalid parallel layout:\n  " + "\n  ".join(problems))
    return full


class DeviceMesh:
    """Named ranks of one run (dims dp, fsdp, sp, tp) over `torch.distributed.device_mesh`.

    `mesh["fsdp"]` / `mesh["dp", "fsdp"]` are the torch sub-meshes that strategies shard over.
    """

    def __init__(self, torch_mesh: Any, ep_size: int = 1):
        self.torch_mesh = torch_mesh
        self.ep_size = ep_size

    @classmethod
    def from_sizes(cls, dp_size: int = 1, fsdp_size: int = 1, tp_size: int = 1, ep_size: int = 1, sp_size: int = 1,
                   world_size: int | None = None, model_config: Any = None) -> "DeviceMesh":
        """Validate the sizes, join the process group (gloo on CPU, nccl on GPU) and build the mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        from twinkle_core.parallel.process_group import comm_device_type, init_distributed

        world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        sizes = validate_mesh_sizes(dict(dp_size=dp_size, fsdp_size=fsdp_size, tp_size=tp_size, ep_size=ep_size,
                                         sp_size=sp_size), world_size, model_config)
        init_distributed(world_size)
        shape = tuple(sizes[f"{dim}_size"] for dim in MESH_DIMS)
        return cls(init_device_mesh(comm_device_type(), shape, mesh_dim_names=MESH_DIMS), ep_size=ep_size)

    def __getitem__(self, dims: str | tuple[str, ...]) -> Any:
        return self.torch_mesh[dims]

    def size(self, dim: str | None = None) -> int:
        """Ranks in the whole mesh, or along `dim`."""
        return self.torch_mesh.size() if dim is None else self.torch_mesh[dim].size()

    @property
    def sizes(self) -> dict[str, int]:
        return {**{f"{dim}_size": self.size(dim) for dim in MESH_DIMS}, "ep_size": self.ep_size}

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different data: dp × fsdp (sp and tp ranks share their data)."""
        return self.size("dp") * self.size("fsdp")

    @property
    def data_parallel_rank(self) -> int:
        coordinate = dict(zip(MESH_DIMS, self.torch_mesh.get_coordinate()))
        return coordinate["dp"] * self.size("fsdp") + coordinate["fsdp"]

    @functools.cached_property
    def data_parallel_group(self) -> Any:
        """The process group of the ranks that hold different rows of the batch."""
        return self.torch_mesh["dp", "fsdp"]._flatten("dp_fsdp").get_group()

    @property
    def token_parallel_size(self) -> int:
        """Ranks that hold different tokens: dp × fsdp × sp (sp ranks hold slices of the same rows)."""
        return self.data_parallel_size * self.size("sp")

    @functools.cached_property
    def token_parallel_group(self) -> Any:
        """The group gradients, token counts and losses are summed over: dp × fsdp × sp."""
        if self.size("sp") == 1:
            return self.data_parallel_group
        return self.torch_mesh["dp", "fsdp", "sp"]._flatten("dp_fsdp_sp").get_group()

    @functools.cached_property
    def shard_dim(self) -> str:
        """The mesh dim FSDP shards over: `fsdp`, or fsdp × sp flattened (every rank with different tokens
        reduces gradients, like torchtitan's dp_shard_cp)."""
        if self.size("sp") == 1:
            return "fsdp"
        self.torch_mesh["fsdp", "sp"]._flatten("fsdp_sp")
        return "fsdp_sp"

    def __repr__(self) -> str:
        return f"DeviceMesh({', '.join(f'{k}={v}' for k, v in self.sizes.items())})"
