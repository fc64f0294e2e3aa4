"""A damaged model folder is refused with one message naming the folder and the file, before anything loads it:
a shard missing, a truncated or corrupt safetensors file, no weights, no tokenizer."""
import json
import shutil
import time

import pytest

from tiny_models import save_tiny_model
from twinkle_core.hub import check_weight_files
from twinkle_core.hub.errors import HubError
from twinkle_core.hub.integrity import model_folder_problems


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("good"), "llama")


def _damaged(good, tmp_path, damage):
    folder = tmp_path / "model"
    shutil.copytree(good, folder)
    damage(folder)
    return folder


def _truncate(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _corrupt_header(folder):
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff\xfe{[ \x00\x01\x02"
    weights.write_bytes(bytes(data))


def _missing_shard(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def _no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()


def _no_weights(folder):
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("damage, message", [
    (_truncate, "model.safetensors is {size} bytes, its tensors need"),
    (_corrupt_header, "model.safetensors: "),
    (_missing_shard, "1 of the 2 weight files model.safetensors.index.json lists are missing: "
                     "model-00002-of-00002.safetensors"),
    (_no_tokenizer, "no tokenizer files (tokenizer.json"),
    (_no_weights, "it has config.json but no weight files"),
], ids=["truncated", "corrupt-header", "missing-shard", "no-tokenizer", "no-weights"])
def test_a_damaged_folder_is_named_with_its_file(good, tmp_path, damage, message):
    folder = _damaged(good, tmp_path, damage)
    if "{size}" in message:
        message = message.format(size=f"{(folder / 'model.safetensors').stat().st_size:,}")
    with pytest.raises(HubError) as error:
        check_weight_files(folder, str(folder))
    assert str(error.value).startswith(f"model id '{folder}' is damaged: ")
    assert message in str(error.value)


def test_an_intact_folder_passes_and_the_model_refuses_a_damaged_one_before_loading(good, tmp_path):
    from twinkle_core.models import TransformersModel

    assert model_folder_problems(good) == [] and check_weight_files(good, str(good)) == "safetensors"
    folder = _damaged(good, tmp_path, _truncate)
    started = time.monotonic()
    with pytest.raises(HubError, match="is damaged: model.safetensors is"):
        TransformersModel(str(folder), mixed_precision="no")
    assert time.monotonic() - started < 10
