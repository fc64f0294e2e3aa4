"""megatron-core on any machine: the CPU device mode, its process groups, and GPTModel built from HF configs."""
from twinkle_core.megatron.cpu_device import (cpu_device_mode, disable_cpu_device_mode, enable_cpu_device_mode,
                                              is_cpu_device_mode)
from twinkle_core.megatron.model_builder import (ARCHITECTURES, Architecture, UnsupportedArchitectureError,
                                                 build_gpt_chunks, build_gpt_model, padded_vocab_size,
                                                 transformer_config_from_hf)
from twinkle_core.megatron.parallel_state import (MegatronParallel, destroy_megatron_parallel,
                                                  initialize_megatron_parallel)

__all__ = [
    "ARCHITECTURES", "Architecture", "MegatronParallel", "UnsupportedArchitectureError", "build_gpt_chunks",
    "build_gpt_model",
    "cpu_device_mode", "destroy_megatron_parallel", "disable_cpu_device_mode", "enable_cpu_device_mode",
    "initialize_megatron_parallel", "is_cpu_device_mode", "padded_vocab_size", "transformer_config_from_hf",
]
