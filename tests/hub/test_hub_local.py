"""Local paths, file:// and pkg:// ids for models and datasets, and their errors."""
from __future__ import annotations

import shutil
import sys

import pytest
from hub_builders import make_package, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_core.hashing import hash_file
from twinkle_core.hub import HubError, resolve_dataset, resolve_model


def test_local_model_dir_absolute_relative_and_file_url(tiny_model_dir, monkeypatch):
    absolute = resolve_model(str(tiny_model_dir))
    assert absolute.path == tiny_model_dir.resolve()
    assert len(absolute.content_hash) == 64
    monkeypatch.chdir(tiny_model_dir.parent)
    relative = resolve_model(f"./{tiny_model_dir.name}")
    from_url = resolve_model(f"file://{tiny_model_dir}")
    assert relative.path == from_url.path == absolute.path
    assert relative.content_hash == from_url.content_hash == absolute.content_hash
    assert relative.model_id == f"./{tiny_model_dir.name}"
    AutoModelForCausalLM.from_pretrained(absolute.path)
    assert AutoTokenizer.from_pretrained(absolute.path).chat_template


def test_local_model_hash_changes_with_a_file(tiny_model_dir):
    before = resolve_model(str(tiny_model_dir)).content_hash
    config = tiny_model_dir / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert resolve_model(str(tiny_model_dir)).content_hash != before


def test_missing_local_path(tmp_path):
    with pytest.raises(HubError, match="does not exist") as info:
        resolve_model(str(tmp_path / "nope"))
    assert "nope" in str(info.value)


def test_directory_without_config_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(HubError, match="no config.json") as info:
        resolve_model(str(tmp_path))
    assert "weights.bin" in str(info.value)


def test_unknown_scheme_for_model_and_dataset():
    for resolve in (resolve_model, resolve_dataset):
        with pytest.raises(HubError, match="unknown scheme 's3://'"):
            resolve("s3://bucket/thing")


def test_pkg_not_installed():
    with pytest.raises(HubError, match=r"pip install --no-deps twinkle_no_such_pkg"):
        resolve_model("pkg://twinkle_no_such_pkg/model")


@pytest.fixture
def fake_package(tmp_path, monkeypatch, tiny_model_files, tiny_gguf):
    """An installed-looking package `twinkle_fake_models` whose __init__ raises when imported."""
    package = make_package(tmp_path / "site", "twinkle_fake_models")
    shutil.copytree(tiny_model_files, package / "model_dir")
    shutil.copy(tiny_gguf[0], package / "tiny.gguf")
    write_jsonl(package / "data" / "chat.jsonl", [{"text": "hello"}])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return package


def test_pkg_model_dir_without_importing(fake_package):
    resolved = resolve_model("pkg://twinkle_fake_models/model_dir")
    assert resolved.path == (fake_package / "model_dir").resolve()
    assert "twinkle_fake_models" not in sys.modules
    AutoModelForCausalLM.from_pretrained(resolved.path)


def test_pkg_gguf_is_materialised(fake_package, isolated_caches):
    resolved = resolve_model("pkg://twinkle_fake_models/tiny.gguf")
    assert resolved.content_hash == hash_file(fake_package / "tiny.gguf")
    assert resolved.path.parent == isolated_caches["twinkle"] / "models"
    assert (resolved.path / "config.json").is_file()


def test_pkg_bad_inner_path(fake_package):
    with pytest.raises(HubError, match="'missing/model' does not exist inside package 'twinkle_fake_models'"):
        resolve_model("pkg://twinkle_fake_models/missing/model")


def test_pkg_dataset_folder_with_one_file(fake_package):
    resolved = resolve_dataset("pkg://twinkle_fake_models/data")
    assert resolved.path == (fake_package / "data" / "chat.jsonl").resolve()
    assert resolved.content_hash == hash_file(resolved.path)


def test_local_dataset_file_and_folder(tmp_path):
    data = write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": "a"}])
    (tmp_path / "ds" / ".cache").mkdir()
    write_jsonl(tmp_path / "ds" / ".cache" / "ignored.jsonl", [{"text": "b"}])
    assert resolve_dataset(str(data)).path == data.resolve()
    from_folder = resolve_dataset(f"file://{tmp_path / 'ds'}")
    assert from_folder.path == data.resolve()
    assert from_folder.content_hash == hash_file(data)


def test_dataset_folder_must_hold_exactly_one_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    write_jsonl(tmp_path / "sub" / "b.json", [{"text": "b"}])
    with pytest.raises(HubError, match=r"exactly one .* found 2: \['a.jsonl', 'sub/b.json'\]"):
        resolve_dataset(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HubError, match="found 0"):
        resolve_dataset(str(empty))


def test_dataset_file_with_wrong_suffix(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(HubError, match=r"is not one of \.jsonl, \.json, \.parquet"):
        resolve_dataset(str(tmp_path / "data.csv"))


def test_model_id_takes_no_split(tiny_model_dir):
    with pytest.raises(HubError, match="a model id takes none"):
        resolve_model("hf://org/name:train")
