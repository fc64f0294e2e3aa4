"""A registered vision-language model is the model its run trained, served, merged and exported.

Qwen 3.5 has two classes over one checkpoint: the text model (AutoModelForCausalLM) and the VL model around it
(AutoModelForImageTextToText, whose text layers are named `...language_model...`). An adapter trained on the
VL model, opened on the text class, matches none of its weights: PEFT then serves the base unchanged. The
merged version and the hf-merged export must keep the vision tower and the image/video processor files, and
`flows.chat --image` and the served pyfunc answer about a picture as the trained model does.
"""
import mlflow
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from flows import chat, export
from registered_models import data_url, image_question, trained_answer
from registered_models import vl_logits as _logits
from twinkle_core.hub.models import PROCESSOR_FILES
from twinkle_core.tracking.registered import opened_registered
from vision_models import write_image

def test_registered_vl_adapter_and_merged_model_give_the_trained_logits(vl_store, tmp_path):
    reference = vl_store["reference"]
    base = AutoModelForImageTextToText.from_pretrained(vl_store["root"] / "base", dtype=torch.float32).eval()
    assert (_logits(base) - reference).abs().max() > 0.1  # the adapter changes the answer: applying it matters
    for name, tolerance in (("tiny-vl", 1e-6), ("tiny-vl-merged", 1e-4)):  # merging reorders fp32 sums
        with opened_registered(name, "champion", dtype=torch.float32) as (model, _, folder):
            for file in ("preprocessor_config.json", "video_preprocessor_config.json"):  # the merged artifact has them
                assert (folder / file).read_text() == (vl_store["root"] / "base" / file).read_text()
        assert type(model.get_base_model() if name == "tiny-vl" else model).__name__ == \
            "Qwen3_5ForConditionalGeneration"
        assert torch.allclose(_logits(model), reference, atol=tolerance, rtol=0), name


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
    # the same encoding (image tokens, pixels, 3-D positions) as evaluation's
    assert answer and answer == trained_answer(vl_store["root"], picture)
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
    assert last == "chat: --image: models:/tiny-chat@champion is not a vision-language model (it takes text only)"


def test_pyfunc_answers_a_base64_image_and_never_opens_a_named_file(vl_store, tmp_path):
    picture = write_image(tmp_path / "stripes.png", seed=3, size=(64, 64))
    served = mlflow.pyfunc.load_model("models:/tiny-vl@champion")
    answers = served.predict({"messages": image_question(data_url(picture))}, params={"max_new_tokens": 6})
    assert answers == [trained_answer(vl_store["root"], picture)]
    assert served.predict({"messages": [{"role": "user", "content": "hi"}]}, params={"max_new_tokens": 2})[0] != ""
    with pytest.raises(Exception, match="base64 data"):  # a caller must not make the server read its files
        served.predict({"messages": image_question(str(picture))})
    local = mlflow.artifacts.download_artifacts("models:/tiny-vl@champion", dst_path=str(tmp_path / "logged"))
    assert (tmp_path / "logged" / "code" / "twinkle_core" / "data" / "vision_encode.py").is_file(), local


def test_a_token_beyond_the_embeddings_is_a_clear_error(tmp_path):
    """InternVL tokenizers name a `<video>` token (as transformers' -hf conversion adds it) that the model has
    no embedding row for: a conversation holding it is refused by name."""
    from transformers import AutoTokenizer
    from vision_models import save_tiny_internvl

    from twinkle_core.tracking.chat_model import chat_reply

    folder = save_tiny_internvl(tmp_path / "internvl")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids("<video>") >= model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match="holds <video>, a token this model has no embedding for"):
        chat_reply(model, tokenizer, [{"role": "user", "content": "<video> what happens?"}])
    assert chat_reply(model, tokenizer, [{"role": "user", "content": "what happens?"}], max_new_tokens=2) is not None
