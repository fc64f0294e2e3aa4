"""A registered vision-language model is the model its run trained, served, merged and exported.

Qwen 3.5 has two classes over one checkpoint: the text model (AutoModelForCausalLM) and the VL model around it
(AutoModelForImageTextToText, whose text layers are named `...language_model...`). An adapter trained on the
VL model, opened on the text class, matches none of its weights: PEFT then serves the base unchanged. The
merged version and the hf-merged export must keep the vision tower and the image/video processor files, and
`flows.chat --image` answers about a picture as the trained model does.
"""
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from flows import chat, export
from registered_models import register_run
from twinkle_core.hub.models import PROCESSOR_FILES
from twinkle_core.models import TransformersModel
from twinkle_core.tracking.registered import load_registered
from vision_models import save_tiny_qwen3_5_vl, write_image

IDS = torch.tensor([[3, 5, 7, 9, 11, 13]])  # text-only: what the served chat model receives


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, mm_token_type_ids=torch.zeros_like(IDS)).logits


@pytest.fixture(scope="module")
def vl_registry(tmp_path_factory):
    """A tiny Qwen 3.5 VL base, a LoRA adapter made as a vision_lm run makes it (random B: a trained
    adapter), registered as the adapter and as the merged model."""
    root = tmp_path_factory.mktemp("vl-registry")
    save_tiny_qwen3_5_vl(root / "base")
    trained = TransformersModel(str(root / "base"), mixed_precision="no", objective="vision_lm")
    trained.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    for name, param in trained.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.5)
    trained.model.eval()
    reference = _logits(trained.model)
    trained.save("adapter", root)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        env.setenv("TWINKLE_CACHE", str(root / "cache"))
        register_run(root, "tiny-vl", "adapter", family="qwen3_5_vl")
        register_run(root, "tiny-vl-merged", "merged", family="qwen3_5_vl")
        yield {"root": root, "reference": reference}


@pytest.fixture
def vl_store(vl_registry, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{vl_registry['root'] / 'mlflow.db'}")
    monkeypatch.setenv("TWINKLE_CACHE", str(vl_registry["root"] / "cache"))
    return vl_registry


def test_registered_vl_adapter_and_merged_model_give_the_trained_logits(vl_store, tmp_path):
    reference = vl_store["reference"]
    base = AutoModelForImageTextToText.from_pretrained(vl_store["root"] / "base", dtype=torch.float32).eval()
    assert (_logits(base) - reference).abs().max() > 0.1  # the adapter changes the answer: applying it matters
    for name, tolerance in (("tiny-vl", 1e-6), ("tiny-vl-merged", 1e-4)):  # merging reorders fp32 sums
        model, _ = load_registered(name, "champion", dtype=torch.float32, processor_files_to=tmp_path / name)
        assert type(model.get_base_model() if name == "tiny-vl" else model).__name__ == \
            "Qwen3_5ForConditionalGeneration"
        assert torch.allclose(_logits(model), reference, atol=tolerance, rtol=0), name
        for file in ("preprocessor_config.json", "video_preprocessor_config.json"):  # the merged artifact has them
            assert (tmp_path / name / file).read_text() == (vl_store["root"] / "base" / file).read_text()


def test_hf_merged_export_keeps_the_vision_tower_and_processor_files(vl_store, tmp_path):
    out = tmp_path / "export"
    assert export.main(["--model", "models:/tiny-vl@champion", "--to", "hf-merged", "--output", str(out)]) == 0
    base = vl_store["root"] / "base"
    for name in PROCESSOR_FILES:
        assert (out / name).is_file() == (base / name).is_file()
        if (base / name).is_file():
            assert (out / name).read_text() == (base / name).read_text()
    assert (out / "preprocessor_config.json").is_file() and (out / "video_preprocessor_config.json").is_file()
    exported = load_file(out / "model.safetensors")
    vision = {k: v for k, v in load_file(base / "model.safetensors").items() if ".visual." in k}
    assert vision and all(torch.equal(exported[k], v) for k, v in vision.items())  # frozen tower, unchanged
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.allclose(_logits(merged), vl_store["reference"], atol=1e-4, rtol=0)


def test_chat_with_an_image_answers_as_the_trained_model(vl_store, tmp_path, capsys):
    picture = write_image(tmp_path / "stripes.png", seed=3, size=(64, 64))
    assert chat.main(["--model", "models:/tiny-vl@champion", "--image", str(picture), "--message", "What is it?",
                      "--max-new-tokens", "6"]) == 0
    answer = capsys.readouterr().out.strip()
    trained = TransformersModel(str(vl_store["root"] / "base"), mixed_precision="no", objective="vision_lm")
    trained.load("adapter", vl_store["root"])
    messages = [{"role": "user", "content": [{"type": "image", "image": str(picture)},
                                             {"type": "text", "text": "What is it?"}]}]
    expected = trained.generate(messages, max_new_tokens=6)
    assert answer and answer == expected  # the same encoding (image tokens, pixels, 3-D positions) as evaluation
    capsys.readouterr()

    assert chat.main(["--model", "models:/tiny-vl@champion", "--image", str(tmp_path / "missing.png"),
                      "--message", "What is it?"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"chat: --image: no such file: {tmp_path / 'missing.png'}\n"
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    assert chat.main(["--model", "models:/tiny-vl@champion", "--image", str(tmp_path / "broken.png"),
                      "--message", "What is it?"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1].startswith("chat: --image: ")
    assert "broken.png" in captured.err.splitlines()[-1]


def test_chat_refuses_an_image_for_a_text_model(store, tmp_path, capsys):
    picture = write_image(tmp_path / "red.png")
    assert chat.main(["--model", "models:/tiny-chat@champion", "--image", str(picture), "--message", "hi"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]  # after the loaders' progress bars
    assert last.startswith("chat: --image: models:/tiny-chat@champion is not a vision-language model")
