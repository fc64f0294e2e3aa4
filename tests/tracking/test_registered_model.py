"""A registered version is a real MLflow model: pyfunc chat, load_registered, lineage tags, no duplicates."""
import json
from pathlib import Path

import mlflow.pyfunc
import pytest
import torch
from mlflow import MlflowClient
from peft import PeftModel

from registered_models import ANSWER, QUESTION, prompt_logits, register_checkpoint
from twinkle_core.tracking.chat_model import chat_reply, load_chat_parts
from twinkle_core.tracking.model_logging import BASE_EXPERIMENT, BaseModelRef
from twinkle_core.tracking.registered import RegisteredModelNotFound, load_registered


def test_pyfunc_champion_answers_chat_messages(store):
    direct = chat_reply(*load_chat_parts(store["root"] / "adapter", store["root"] / "base"), QUESTION)
    assert direct == ANSWER
    for name in ("tiny-chat", "tiny-chat-merged"):
        model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
        assert model.predict({"messages": QUESTION}, params={"max_new_tokens": 12}) == [ANSWER]
        rows = [{"messages": QUESTION}, {"messages": [{"role": "user", "content": "hello"}]}]
        answers = model.predict(rows, params={"max_new_tokens": 12})
        assert len(answers) == 2 and answers[0] == ANSWER
    info = mlflow.models.get_model_info("models:/tiny-chat@champion")
    assert info.signature.inputs.input_names() == ["messages"] and info.saved_input_example_info


def test_adapter_version_names_its_base_portably_and_logs_it_once(store):
    client = MlflowClient()
    experiment = client.get_experiment_by_name(BASE_EXPERIMENT)
    assert len(client.search_runs([experiment.experiment_id])) == 1  # two registrations, one logged base
    version = client.get_model_version_by_alias("tiny-chat", "champion")
    local = mlflow.artifacts.download_artifacts("models:/tiny-chat@champion", dst_path=str(store["root"] / "dl"))
    adapter_config = json.loads(next(Path(local).rglob("adapter_config.json")).read_text())
    assert adapter_config["base_model_name_or_path"] == version.tags["twinkle.base_model_id"]
    assert version.tags["twinkle.kind"] == "adapter" and version.tags["twinkle.base_uri"].startswith("runs:/")
    # the stored serving example is a valid request body, and the model answers it
    body = (Path(local) / "serving_input_example.json").read_text()
    assert mlflow.models.validate_serving_input("models:/tiny-chat@champion", body) == [ANSWER]
    merged = client.get_model_version_by_alias("tiny-chat-merged", "champion")
    assert merged.tags["twinkle.kind"] == "merged" and "twinkle.base_uri" not in merged.tags


def test_version_tags_carry_the_lineage(store):
    tags = MlflowClient().get_model_version_by_alias("tiny-chat", "champion").tags
    assert tags["prefect_flow_run"] == "flow-run-tiny-chat"
    assert tags["twinkle.base_model_id"] == str(store["root"] / "base") and len(tags["twinkle.base_content_hash"]) == 64
    assert tags["twinkle.dataset_id"] == "pkg://tiny/chats.jsonl" and tags["twinkle.dataset_content_hash"] == "d" * 64
    assert tags["metric.eval_loss"] == "1"
    assert len(tags["twinkle.git_commit"]) == 40


def test_load_registered_returns_the_peft_model_with_the_trainedprompt_logits(store):
    reference = prompt_logits(*load_chat_parts(store["root"] / "adapter", store["root"] / "base"))
    model, tokenizer = load_registered("tiny-chat", "champion")
    assert isinstance(model, PeftModel)
    assert torch.allclose(prompt_logits(model, tokenizer), reference, atol=1e-6, rtol=0)
    merged, tokenizer = load_registered("tiny-chat-merged", "1")
    assert not isinstance(merged, PeftModel)
    assert torch.allclose(prompt_logits(merged, tokenizer), reference, atol=1e-4, rtol=0)  # merging reorders fp32 sums


def test_a_register_retry_for_the_same_run_makes_no_second_version(store):
    again = register_checkpoint(store["root"], "tiny-chat", store["adapter"]["run_id"], 1.0, "adapter")
    assert again["version"] == store["adapter"]["version"] == "1" and again["promoted"] and again["chat_model"]
    assert len(MlflowClient().search_model_versions("name = 'tiny-chat'")) == 1


def test_unknown_name_or_alias_is_one_clear_error(store):
    with pytest.raises(RegisteredModelNotFound, match=r"no registered model 'nope'.*tiny-chat"):
        load_registered("nope", "champion")
    with pytest.raises(RegisteredModelNotFound, match=r"'tiny-chat' has no alias or version 'best'.*champion=1"):
        load_registered("tiny-chat", "best")


def test_a_base_revision_is_the_hub_revision_or_the_package_version():
    from importlib.metadata import version

    assert BaseModelRef("hf://org/model@v2", "/any", "h").revision() == "v2"
    assert BaseModelRef("pkg://mlflow/some/model.gguf", "/any", "h").revision() == f"mlflow=={version('mlflow')}"
    assert BaseModelRef("./local/model", "./local/model", "h").revision() == ""
