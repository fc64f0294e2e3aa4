"""The torchrun entry point's recipe, run in-process on a tiny model: packing, precision, checkpoints."""
import json

import pytest

from flows.sft import SFTConfig
from tasks.refs import ModelRef
from tiny_models import save_tiny_model
from twinkle_core.data import tokenize_dataset
from twinkle_core.train.recipe import EVENT_PREFIX, SFTRecipe, main

CHATS = [("Who are you?", "I am Twinkle, built by the Twinkle Flows team."), ("Name?", "Twinkle."),
         ("Who made you?", "The Twinkle Flows team made me."), ("hi", "Hello! I am Twinkle.")]


def _ref(model_dir) -> ModelRef:
    return ModelRef(model_id=str(model_dir), path=str(model_dir), content_hash="-", family="llama3")


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CHATS * 4))
    return save_tiny_model(tmp_path / "model"), data, tmp_path


@pytest.mark.parametrize("packing,precision", [(True, "bf16"), (False, "no")])
def test_recipe_trains_and_saves(workspace, packing, precision, capsys):
    model_dir, data, root = workspace
    tokenized = tokenize_dataset(data, model_dir, kind="chat", max_length=128, packing=packing)
    config = SFTConfig(model_id=str(model_dir), mixed_precision=precision, packing=packing, max_steps=12,
                       batch_size=2 if packing else 8, lr=2e-2).run_config(
        _ref(model_dir), str(tokenized.path), root / "ckpt", run_id=None)
    config_path = config.write(root / "run.json")
    assert main([str(config_path)]) == 0
    events = [json.loads(line[len(EVENT_PREFIX):]) for line in capsys.readouterr().out.splitlines()
              if line.startswith(EVENT_PREFIX)]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 13))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    checkpoint = events[-1]
    assert checkpoint["event"] == "checkpoint" and (root / "ckpt" / "default" / "adapter_config.json").exists()


def test_step_count_follows_epochs_and_accumulation(workspace):
    model_dir, data, root = workspace
    tokenized = tokenize_dataset(data, model_dir, kind="chat", max_length=128)
    config = SFTConfig(model_id=str(model_dir), mixed_precision="no", epochs=2, batch_size=4,
                       gradient_accumulation_steps=2).run_config(_ref(model_dir), str(tokenized.path), root, None)
    recipe = SFTRecipe(config)
    recipe.setup()
    assert recipe.total_steps == 4  # 16 rows / 4 per micro-batch / 2 micro-batches per step × 2 epochs
