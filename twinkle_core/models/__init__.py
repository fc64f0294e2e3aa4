"""Model classes with one set of training verbs."""
from peft import LoraConfig

from twinkle_core.models.megatron_model import MegatronModel
from twinkle_core.models.multi_lora import MultiLoraTransformersModel
from twinkle_core.models.multi_lora_megatron import MultiLoraMegatronModel
from twinkle_core.models.transformers_model import TransformersModel

__all__ = ["LoraConfig", "MegatronModel", "MultiLoraMegatronModel", "MultiLoraTransformersModel", "TransformersModel"]
