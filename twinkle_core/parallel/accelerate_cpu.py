"""Monkeypatch (the only one for Accelerate): let Accelerate's FSDP2 path run in CPU processes.

Accelerate 1.15 decides its distributed type from the device: under torchrun on CPU it becomes MULTI_CPU
and ignores the FSDP plugin (it enables FSDP only for GPU-like types), so `prepare` would wrap the model in
DDP. Its FSDP2 code path itself is device-agnostic: the auto-wrap by decoder layer class, `fully_shard` of
the layers, the embedding/output group and the root, the switch of the optimizer to the sharded
parameters and the DTensor-aware gradient clipping all run on gloo. So on CPU we create the Accelerator as
usual and then give its shared state what it would have set up on a GPU: distributed type FSDP, the
plugin, the parallelism config and its device mesh. On GPUs this module is not used.
"""
from __future__ import annotations

from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin,
                       parallelism_config: ParallelismConfig) -> None:
    """Turn a MULTI_CPU accelerator into the FSDP2 accelerator a GPU run would have built."""
    if accelerator.distributed_type is not DistributedType.MULTI_CPU:
        raise RuntimeError(f"enable_fsdp_on_cpu expects a MULTI_CPU accelerator, got {accelerator.distributed_type}.")
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    state.parallelism_config = parallelism_config
    state.device_mesh = parallelism_config.get_device_mesh("cpu")
    parallelism_config._validate_accelerator(accelerator)  # the check Accelerator.__init__ runs on GPUs
