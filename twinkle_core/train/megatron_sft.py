"""The SFT recipe on megatron-core (`backend="megatron"`): the SFT recipe's data, steps and events, with
MegatronModel in place of TransformersModel.

The layout comes from the run's parallel settings (tp_size, pp_size, ep_size; data parallelism is what is
left). The final checkpoint is exported through the bridge to what the Transformers backend writes (a PEFT
adapter or a full HF directory), so evaluation and registration are the same for both backends. The
resumable training state is a megatron dist checkpoint of model, optimizer and step.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from twinkle_core.parallel import is_main_process
from twinkle_core.parallel.process_group import barrier
from twinkle_core.train.recipe import SFTRecipe, emit
from twinkle_core.train.resume import STATE_DIR as STATE, check_resume_settings


class MegatronSFTRecipe(SFTRecipe):
    def _build_model(self):
        from twinkle_core.models import MegatronModel

        cfg, parallel = self.config, self.config.parallel
        return MegatronModel(str(cfg.model_path), mixed_precision=cfg.mixed_precision, tp_size=parallel.tp_size,
                             pp_size=parallel.pp_size, ep_size=parallel.ep_size,
                             sequence_parallel=parallel.sequence_parallel,
                             micro_batch_size=1, seed=cfg.seed)

    def _hf_dir(self) -> Path:
        return Path(self.model.hf_dir)

    def _save_training_state(self) -> None:
        checkpoint_dir = self.config.checkpoint_dir
        self.model.save(STATE + ".partial", checkpoint_dir)
        if is_main_process():  # replaced only once the new state is complete
            progress = {"step": self.model.step, "settings": self._resume_settings()}
            (checkpoint_dir / f"{STATE}.partial" / "progress.json").write_text(json.dumps(progress))
            target = checkpoint_dir / STATE
            if target.exists():
                target.rename(checkpoint_dir / f"{STATE}.old")
            (checkpoint_dir / f"{STATE}.partial").rename(target)
            _remove(checkpoint_dir / f"{STATE}.old")
        barrier()

    def _resume(self) -> int:
        progress_file = self.config.checkpoint_dir / STATE / "progress.json"
        if not progress_file.is_file():
            return 0
        progress = json.loads(progress_file.read_text())
        check_resume_settings(progress, self._resume_settings(), progress_file.parent)
        self.model.load(STATE, self.config.checkpoint_dir)
        emit("resume", step=progress["step"], total=self.total_steps)
        return progress["step"]

    def save_checkpoint(self) -> Path:
        probe_loss = self.model.forward_only(self.probe_batch())
        self.model.calculate_metric(is_training=False)  # reset the eval accumulator
        name = self.config.adapter_name if self.config.use_lora else "model"
        path = self.model.save_hf(self.config.checkpoint_dir / name)
        emit("checkpoint", path=str(path), train_seconds=round(self.train_seconds, 2), probe_loss=probe_loss)
        return path


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
