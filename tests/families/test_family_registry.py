"""The family registry: README table in sync, id aliases, clear errors for what is not supported."""
from pathlib import Path

import pytest

from twinkle_core.families import (
    ModelFamily,
    UnsupportedModelError,
    check_model_id,
    families,
    family_for_model_dir,
    family_for_model_type,
    get_family,
    register_family,
    render_families_table,
)

README = Path(__file__).resolve().parents[2] / "README.md"
SPEC_FAMILIES = {"qwen3_5", "qwen3", "qwen2_5", "deepseek_v4", "deepseek_r1", "llama3", "mistral", "yi", "glm4", "internlm2_5",
                 "qwen3_embedding", "bert_embedding", "gte", "qwen2_5_vl", "internvl2_5", "qwen3_5_vl", "qwen3_vl"}


def test_every_family_of_the_specification_is_registered():
    assert {f.name for f in families()} == SPEC_FAMILIES


def test_readme_table_is_generated_from_the_registry():
    assert render_families_table() in README.read_text(), "run: python -m twinkle_core.families README.md"


@pytest.mark.parametrize("model_id,family", [
    ("ms://Qwen/Qwen3.5-4B", "qwen3_5"), ("ms://Qwen/Qwen3.5-235B-A22B", "qwen3_5"),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct@main", "qwen2_5"), ("hf://deepseek-ai/DeepSeek-V4", "deepseek_v4"),
    ("hf://deepseek-ai/DeepSeek-R1", "deepseek_r1"), ("hf://meta-llama/Llama-3.3-70B-Instruct", "llama3"),
    ("ms://mistralai/Mistral-7B-v0.3", "mistral"), ("hf://01-ai/Yi-1.5-34B", "yi"),
    ("hf://THUDM/glm-4-9b-chat", "glm4"), ("ms://internlm/internlm2_5-7b-chat", "internlm2_5"),
    ("hf://Qwen/Qwen3-8B", "qwen3"), ("ms://Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3"),
    ("ms://Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl"), ("hf://OpenGVLab/InternVL3-1B-hf", "internvl2_5"),
    ("hf://OpenGVLab/InternVL2_5-8B", "internvl2_5"),
    ("ms://Qwen/Qwen3.5-VL-3B", "qwen3_5_vl"), ("hf://Qwen/Qwen3-VL-2B-Instruct", "qwen3_vl"),
])
def test_hub_ids_name_their_family_before_download(model_id, family):
    assert check_model_id(model_id).name == family


def test_a_qwen3_5_checkpoint_is_the_text_family_unless_a_vision_run_loads_its_vision_tower(tmp_path):
    import json

    with_tower, text_only = tmp_path / "vl", tmp_path / "text"
    for folder, config in ((with_tower, {"model_type": "qwen3_5", "vision_config": {"depth": 1}}),
                           (text_only, {"model_type": "qwen3_5"})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert family_for_model_dir(with_tower).name == "qwen3_5"  # AutoModelForCausalLM: the text model
    assert family_for_model_dir(with_tower, vision=True).name == "qwen3_5_vl"
    assert family_for_model_dir(text_only, vision=True).name == "qwen3_5"  # no tower to load
    assert family_for_model_dir(with_tower, "ms://Qwen/Qwen3.5-VL-3B").name == "qwen3_5_vl"


def test_ids_that_cannot_be_told_yet_pass_and_later_kinds_fail_early():
    assert check_model_id("/models/my-llama") is None
    assert check_model_id("hf://someone/custom-model") is None
    with pytest.raises(UnsupportedModelError, match="vision-language.*Qwen 2.5"):
        check_model_id("hf://deepseek-ai/deepseek-vl-7b-chat")
    assert check_model_id("ms://Qwen/Qwen3-Embedding-0.6B").name == "qwen3_embedding"
    assert check_model_id("hf://thenlper/gte-large-zh").name == "bert_embedding"


def test_model_type_lookup_and_its_error(tmp_path):
    assert family_for_model_type("llama").name == "llama3"
    assert family_for_model_type("llama", "hf://01-ai/Yi-1.5-9B-Chat").name == "yi"
    assert family_for_model_type("qwen3_5_moe_text").is_moe("qwen3_5_moe_text")
    assert family_for_model_type("qwen3_moe", "hf://Qwen/Qwen3-30B-A3B").is_moe("qwen3_moe")
    # A model_type outside the registry is an untested family: nothing but what its model declares.
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    untested = family_for_model_dir(tmp_path)
    assert (untested.name, untested.tested, untested.chat_template) == ("untested-gpt2", False, None)
    assert get_family("untested-gpt2") == untested
    with pytest.raises(UnsupportedModelError, match=r"family 'qwen9' is not registered"):
        get_family("qwen9")
    (tmp_path / "config.json").write_text('{"architectures": ["X"]}')
    with pytest.raises(UnsupportedModelError, match=r"has no model_type; supported families: .*Qwen 2.5 \(qwen2\)"):
        family_for_model_dir(tmp_path)


def test_registry_rejects_duplicates_and_conflicting_defaults():
    with pytest.raises(ValueError, match="already registered"):
        register_family(families()[0])
    clash = ModelFamily(name="other_llama", title="x", model_types=("llama",), model_ids="", id_pattern="^x/",
                        chat_template="chatml", end_of_turn=("</s>",))
    with pytest.raises(ValueError, match="both claim"):
        register_family(clash)
