"""The sft flow trains a tiny Qwen2.5-VL on image chats end to end: tokenize with pixels, train, evaluate
with the images, register."""
import json
import shutil

import mlflow.pyfunc
from mlflow import MlflowClient
from vision_models import save_tiny_qwen2_5_vl, write_image

from flows.sft import SFTConfig, sft
from twinkle_core.tracking import tracking_uri
from twinkle_core.tracking.chat_model import chat_reply, load_chat_parts

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def _write_rows(path, names, repeat=1):
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is it?"},
                          {"role": "assistant", "content": f"It is {name}."}], "images": [f"images/{name}.png"]}
            for name in names] * repeat
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_sft_flow_trains_a_vision_language_model_on_image_rows(tmp_path, monkeypatch, prefect_harness,
                                                              empty_mlflow_db):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    for name, rgb in COLOURS.items():
        write_image(tmp_path / "data" / "images" / f"{name}.png", rgb)
    config = SFTConfig(
        model_id=str(save_tiny_qwen2_5_vl(tmp_path / "qwen-vl")), dataset=str(_write_rows(
            tmp_path / "data" / "train.jsonl", COLOURS, repeat=2)),
        eval_dataset=str(_write_rows(tmp_path / "data" / "heldout.jsonl", ["red", "blue"])),
        mixed_precision="no", max_steps=4, batch_size=4, lr=1e-2, max_length=256, eval_prompts=1, max_new_tokens=3,
        registered_model_name="tiny-vl", output_dir=str(tmp_path / "runs"), timeout_minutes=10, checkpoint_every=None)
    assert config.objective == "vision_lm"
    result = sft(config)
    client = MlflowClient(tracking_uri())
    losses = [m.value for m in client.get_metric_history(result["run_id"], "loss")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    reports = result["reports"]
    assert reports["trained"]["eval_loss"] < reports["base"]["eval_loss"]
    assert reports["trained"]["eval_tokens"] == reports["base"]["eval_tokens"] > 0
    assert "[image] What colour is it?" in result["summary"]
    adapter = json.loads((tmp_path / result["checkpoint"] / "adapter_config.json").read_text())
    assert adapter["exclude_modules"] and all("visual" in name for name in adapter["exclude_modules"])
    assert str(client.get_model_version_by_alias("tiny-vl", "champion").version) == "1"
    # The registered version is a chat model: it loads through its image-text-to-text class and answers text.
    question = [{"role": "user", "content": "What colour is it?"}]
    answers = mlflow.pyfunc.load_model("models:/tiny-vl@champion").predict({"messages": question},
                                                                           params={"max_new_tokens": 3})
    local = chat_reply(*load_chat_parts(tmp_path / result["checkpoint"], config.model_id), question, 3)
    assert answers == [local], (answers, local)
