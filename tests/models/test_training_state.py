"""Training states survive faults: checksums catch a truncated or corrupted newest state and resume falls
back to the one before; only the newest `keep` are kept; a full disk while saving leaves the earlier ones."""
from __future__ import annotations

import errno
import logging

import pytest
import torch
from peft import LoraConfig

from tiny_models import SAMPLE_ROWS
from twinkle_core.data import collate, encode_chat
from twinkle_core.models import TransformersModel
from twinkle_core.models import training_state
from twinkle_core.models.training_state import STATE_DIR, STATE_FILE, load_training_state, read_progress

SETTINGS = {"settings": {"lr": 1e-2}}


def _model(path) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(str(path), mixed_precision="no")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def _step(model) -> None:
    batch = collate([encode_chat(model.tokenizer, r["messages"]) for r in SAMPLE_ROWS[:2]],
                    pad_token_id=model.tokenizer.pad_token_id)
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if p.requires_grad}


def test_a_damaged_newest_state_falls_back_to_the_one_before(tiny_model_dir, tmp_path, caplog):
    model, saved = _model(tiny_model_dir), {}
    for _ in range(3):
        _step(model)
        model.save_training_state(tmp_path, SETTINGS, keep=2)
        saved[model.stepper.step] = _adapter(model)
    states = sorted(p.name for p in (tmp_path / STATE_DIR).iterdir())
    assert states == ["step-00000002", "step-00000003"] and read_progress(tmp_path)["step"] == 3

    newest = tmp_path / STATE_DIR / "step-00000003" / STATE_FILE
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, as by a crash
    fresh = _model(tiny_model_dir)
    with caplog.at_level(logging.WARNING):
        progress = load_training_state(fresh, tmp_path, SETTINGS["settings"])
    assert progress["step"] == 2 and fresh.stepper.step == 2
    assert "step-00000003" in caplog.text and "does not match its checksum" in caplog.text
    assert "resuming from step-00000002 instead" in caplog.text
    assert all(torch.equal(fresh_w, saved[2][name]) for name, fresh_w in _adapter(fresh).items())

    # one flipped byte is caught as well; with no intact state left the run starts over, saying so
    older = tmp_path / STATE_DIR / "step-00000002" / STATE_FILE
    data = bytearray(older.read_bytes())
    data[len(data) // 2] ^= 0xFF
    older.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert load_training_state(_model(tiny_model_dir), tmp_path, SETTINGS["settings"]) is None
    assert "no intact training state is left" in caplog.text


def test_a_full_disk_while_saving_leaves_the_earlier_states(tiny_model_dir, tmp_path, monkeypatch):
    model = _model(tiny_model_dir)
    for _ in range(2):
        _step(model)
        model.save_training_state(tmp_path, SETTINGS, keep=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / STATE_DIR / "step-00000002").iterdir()}
    _step(model)

    def full_disk(obj, path, *args, **kwargs):  # writes part of the file, then the disk is full
        with open(path, "wb") as handle:
            handle.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(training_state.torch, "save", full_disk)
    with pytest.raises(OSError, match=r"step 3 failed \(No space left on device\); the earlier states "
                                      r"\['step-00000002', 'step-00000001'\] .* are intact"):
        model.save_training_state(tmp_path, SETTINGS, keep=2)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / STATE_DIR).iterdir()) == ["step-00000001", "step-00000002"]
    assert {p.name: p.read_bytes() for p in (tmp_path / STATE_DIR / "step-00000002").iterdir()} == before
    assert load_training_state(_model(tiny_model_dir), tmp_path, SETTINGS["settings"])["step"] == 2
