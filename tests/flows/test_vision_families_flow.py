"""The sft flow trains Qwen3-VL, Qwen 3.5 VL and InternVL end to end on image (and, for the Qwen families,
video) chats: download → tokenize → train → evaluate → register, and the saved checkpoint reloads to the
weights the run trained (its probe loss). Qwen2.5-VL goes through the flow in test_vision_sft_flow.py.

The model folders are named as downloads of the real ids (org/name): a `qwen3_5` checkpoint is Qwen 3.5 VL
only when its id names a VL model (or a vision_lm run opens it); under any other name the flow trains its text
model, Qwen 3.5 (the README's design decision)."""
import json
import shutil

import pytest
from mlflow import MlflowClient
from vision_models import save_tiny_internvl, save_tiny_qwen3_5_vl, save_tiny_qwen3_vl, write_image, write_video

from flows.sft import SFTConfig, sft
from twinkle_core.data import get_row_format, load_tokenized
from twinkle_core.models import TransformersModel
from twinkle_core.tracking import tracking_uri

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
# family: (folder named as the hub id, builder, image side in pixels, rows with a video)
FAMILIES = {
    "qwen3_vl": ("Qwen/Qwen3-VL-2B-Instruct", save_tiny_qwen3_vl, 64, True),
    "qwen3_5_vl": ("Qwen/Qwen3.5-VL-3B", save_tiny_qwen3_5_vl, 64, True),
    "internvl2_5": ("OpenGVLab/InternVL2_5-1B", save_tiny_internvl, 56, False),
}


def _write_rows(folder, side: int, video: bool, names, repeat: int = 1):
    for name in names:
        write_image(folder / "images" / f"{name}.png", COLOURS[name], size=(side, side))
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is it?"},
                          {"role": "assistant", "content": f"It is {name}."}], "images": [f"images/{name}.png"]}
            for name in names]
    if video:
        write_video(folder / "clip.mp4", frames=4, fps=4, size=(side, side))
        rows.append({"messages": [{"role": "user", "content": "<video>What moves?"},
                                  {"role": "assistant", "content": "Noise."}], "videos": ["clip.mp4"]})
    return rows * repeat


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _probe_loss(model_dir, result, batch_size: int) -> float:
    """The loss of the run's probe batch (its first rows) through the saved adapter, loaded afresh."""
    model = TransformersModel(str(model_dir), mixed_precision="no", objective="vision_lm")
    model.load("default", result["checkpoint"].rsplit("/", 1)[0])
    examples = load_tokenized(result["train_data"])[:batch_size]
    pad = model.tokenizer.pad_token_id
    return model.forward_only(get_row_format("vision_chat").collate(examples, pad_token_id=pad))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_flow_trains_each_vision_language_family(sft_workspace, family):
    root = sft_workspace["root"]
    repo, save, side, video = FAMILIES[family]
    model_dir = save(root / repo)
    data = root / "data"
    config = SFTConfig(
        model_id=str(model_dir), dataset=_write(data / "train.jsonl", _write_rows(data, side, video, COLOURS, 2)),
        eval_dataset=_write(data / "heldout.jsonl", _write_rows(data, side, False, ["red", "blue"])),
        mixed_precision="no", max_steps=3, batch_size=4, lr=1e-2, max_length=256, eval_prompts=1, max_new_tokens=2,
        registered_model_name=f"tiny-{family}", output_dir=str(root / "runs"), checkpoint_every=None)
    assert config.objective == "vision_lm"
    if family == "qwen3_5_vl":  # the same checkpoint under a name of no VL id is the text model
        plain = shutil.copytree(model_dir, root / "tiny-qwen3_5")  # a whole checkpoint: a damaged one is refused
        assert SFTConfig(model_id=str(plain)).objective == "causal_lm"
    result = sft(config)
    assert result["family"] == family
    client = MlflowClient(tracking_uri())
    losses = [m.value for m in sorted(client.get_metric_history(result["run_id"], "loss"), key=lambda m: m.step)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    reports = result["reports"]
    assert reports["trained"]["eval_loss"] < reports["base"]["eval_loss"]
    examples = load_tokenized(result["train_data"])
    assert sum(bool(e.get("video_rows")) for e in examples) == (2 if video else 0)
    assert _probe_loss(model_dir, result, config.batch_size) == pytest.approx(result["probe_loss"], abs=1e-6)
    assert str(client.get_model_version_by_alias(f"tiny-{family}", "champion").version) == "1"
