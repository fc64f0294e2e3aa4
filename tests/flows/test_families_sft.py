"""Every family of the specification through the sft flow on a tiny model of its real architecture:
the family's own template (the tiny tokenizers ship none), LoRA and full training, and exact reloads."""
import pytest
from mlflow import MlflowClient

from family_models import FAMILY_VARIANTS, save_tiny_family_model
from flows.sft import SFTConfig, sft
from twinkle_core.data import collate, load_tokenized
from twinkle_core.families import get_family
from twinkle_core.models import TransformersModel
from twinkle_core.tracking import tracking_uri

# One LoRA run per family and variant, except Qwen3's MoE: its template and detection are the dense run's, its
# router loss is proven through the flow by Qwen3.5's MoE, and tests/models/test_families_train.py trains it
# (LoRA and full). Each flow run costs ~40 s of the suite's 30 minutes.
LORA_CASES = [(family, variant, True) for family, variants in FAMILY_VARIANTS.items() for variant in variants
              if (family, variant) != ("qwen3", "moe")]
# Full fine-tuning through the flow for the two checkpoints whose full save/reload is unusual (a VLM wrapper,
# DeepSeek V4's own layout); tests/models/test_families_train.py trains the others in full without the flow.
FULL_CASES = [("qwen3_5", "moe", False), ("deepseek_v4", "moe", False)]


def _probe_loss(model_dir, result, batch_size: int) -> float:
    """Reload what the flow saved and recompute the loss it recorded on its fixed probe batch."""
    checkpoint = result["checkpoint"]
    is_adapter = checkpoint.endswith("/default")
    model = TransformersModel(str(model_dir) if is_adapter else checkpoint, mixed_precision="no")
    if is_adapter:
        model.load("default", checkpoint.rsplit("/", 1)[0])
    examples = load_tokenized(result["train_data"])
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    return model.forward_only(collate(examples[:batch_size], pad_token_id=pad))


@pytest.mark.parametrize("family,variant,use_lora", LORA_CASES + FULL_CASES,
                         ids=[f"{f}-{v}-{'lora' if l else 'full'}" for f, v, l in LORA_CASES + FULL_CASES])
def test_family_trains_through_the_sft_flow(sft_workspace, family, variant, use_lora):
    ws = sft_workspace
    # A hub-style local folder (org/name), as a downloaded checkpoint would be named: Yi shares the Llama
    # architecture, and only the name tells them apart.
    repo = get_family(family).model_ids.split()[0]
    model_dir = save_tiny_family_model(family, ws["root"] / f"{variant}" / repo, variant=variant)
    config = SFTConfig(model_id=str(model_dir), dataset=str(ws["train"]), eval_dataset=str(ws["heldout"]),
                       mixed_precision="no", use_lora=use_lora, max_steps=8, batch_size=4,
                       lr=2e-2 if use_lora else 5e-3, max_length=192, eval_prompts=1, max_new_tokens=4,
                       registered_model_name=f"tiny-{family}", output_dir=str(ws["root"] / "runs"))
    result = sft(config)
    assert result["family"] == family
    client = MlflowClient(tracking_uri())
    losses = [m.value for m in sorted(client.get_metric_history(result["run_id"], "loss"), key=lambda m: m.step)]
    assert len(losses) == 8
    assert min(losses[-3:]) < losses[0], losses  # the loss goes down
    reports = result["reports"]
    assert reports["trained"]["eval_loss"] < reports["base"]["eval_loss"]
    assert _probe_loss(model_dir, result, config.batch_size) == pytest.approx(result["probe_loss"], abs=1e-5)
    # MoE routers with a load-balancing loss report it (DeepSeek V3/R1 balances with a bias instead).
    metrics = client.get_run(result["run_id"]).data.metrics
    assert ("aux_loss" in metrics) == (variant == "moe" and _has_router_aux_loss(model_dir))
    if "aux_loss" in metrics:
        assert metrics["aux_loss"] > 0


def _has_router_aux_loss(model_dir) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(model_dir).get_text_config(), "router_aux_loss_coef", 0))
