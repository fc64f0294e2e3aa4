"""Checkpoints saved by a sharded 2-process run are ordinary single-process checkpoints.

Rank 0 gathers the full state (get_model_state_dict, full_state_dict + cpu_offload) and writes the same
directory one process writes: it loads in one process, gives the logits of the single-process run's
checkpoint (within 1e-5, the weight tolerance), and reproduces exactly the probe loss that the sharded
model itself computed before saving.
"""
from pathlib import Path

import pytest
import torch

from twinkle_core.data import collate, load_tokenized
from twinkle_core.models import TransformersModel
from twinkle_core.models.batches import to_batch
from tiny_models import SAMPLE_ROWS

LOGITS_ATOL = 1e-5


def _reload(workspace, run) -> TransformersModel:
    checkpoint = Path(run.result["checkpoint"])
    model = TransformersModel(str(workspace.models["llama"][0]), mixed_precision="no")
    model.load(checkpoint.name, checkpoint.parent)
    return model


def _logits(model: TransformersModel) -> torch.Tensor:
    batch = to_batch(SAMPLE_ROWS, model.tokenizer, model.device, None)
    with torch.no_grad():
        return model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("sharded,single", [("native_fsdp", "single"), ("accelerate_fsdp_lora", "single_lora")],
                         ids=["full-native-fsdp", "lora-accelerate-fsdp"])
def test_a_two_process_checkpoint_reloads_in_one_process(workspace, sharded, single):
    run, reference = workspace.run(sharded), workspace.run(single)
    model = _reload(workspace, run)
    assert (model.adapter_name is not None) == ("lora" in sharded)
    assert (_logits(model) - _logits(_reload(workspace, reference))).abs().max().item() <= LOGITS_ATOL
    probe = collate(load_tokenized(workspace.data["llama"])[:3], pad_token_id=model.tokenizer.pad_token_id)
    assert model.forward_only(probe) == pytest.approx(run.event("checkpoint")["probe_loss"], rel=1e-6)
