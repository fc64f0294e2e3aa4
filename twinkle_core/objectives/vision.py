"""The `vision_lm` objective: supervised fine-tuning of vision-language models on image and video chats.

The loss is the causal-LM loss on the assistant's tokens (twinkle_core.objectives.causal_lm: the model's
multimodal backbone runs the vision tower, the logits are taken at the trained positions only). Its model
loads as `AutoModelForImageTextToText`, its rows are `vision_chat` (twinkle_core.data.vision_rows).

Options: freeze_vision (True), freeze_aligner (True) and freeze_llm (False) say which of the family's parts
(`ModelFamily.vision`) train. A frozen part's parameters stay fixed, and LoRA leaves its linears out: PEFT's
`all-linear` alone would put adapters into the vision tower and the merger too. min_pixels, max_pixels, fps
and max_frames go to the row encoder.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from twinkle_core.objectives import Objective, register_objective
from twinkle_core.objectives.causal_lm import causal_lm_loss_sum

FREEZE_OPTIONS = {"freeze_vision": "vision_tower", "freeze_aligner": "aligner", "freeze_llm": "language_model"}
FREEZE_DEFAULTS = {"freeze_vision": True, "freeze_aligner": True, "freeze_llm": False}
MEDIA_OPTIONS = ("min_pixels", "max_pixels", "fps", "max_frames")


def _options(model_dir: Path, family, options: dict) -> dict:
    if family.vision is None:
        raise ValueError(f"{model_dir}: {family.title} is not a vision-language family; the vision_lm objective "
                         "trains models whose family names its vision parts (e.g. Qwen 2.5 VL)")
    resolved = {**FREEZE_DEFAULTS, **options}
    if all(resolved[name] for name in FREEZE_OPTIONS):
        raise ValueError("freeze_vision, freeze_aligner and freeze_llm are all true: nothing would train; "
                         "set freeze_llm=false (the usual choice) or unfreeze the vision tower or the aligner")
    return resolved


def _encode_options(options: dict) -> dict:
    return {name: options[name] for name in MEDIA_OPTIONS if options.get(name) is not None}


def accepted_inputs(model: torch.nn.Module, batch: dict) -> dict:
    """The batch entries the model's forward names, and the labels: InternVL takes no mm_token_type_ids (its
    generate refuses unknown keys), Qwen's must get them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = inspect.signature(base.forward).parameters
    return {key: value for key, value in batch.items() if key in names or key in ("labels", "shift_labels")}


def packed_positions(model: torch.nn.Module, batch: dict) -> dict:
    """A packed batch (1-D position_ids restarting at each sample) for a model with 3-D M-RoPE positions (Qwen's
    VL models): each sample's 3-D positions as it would have them alone, with the text positions first
    ([4, batch, length], transformers' packed layout). Other models and unpacked batches pass unchanged.

    The model's own get_rope_index over a whole packed row numbers each sample on from where the previous one
    ended, in all three dimensions alike; subtracting each sample's first position restarts it at 0 exactly."""
    position_ids = batch.get("position_ids")
    if position_ids is None or position_ids.dim() != 2:  # not packed
        return batch
    owner = next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)
    if owner is None:  # 1-D positions (InternVL): restarted per sample, as packed text
        return batch
    names = inspect.signature(owner.get_rope_index).parameters
    known = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    three_d, _ = owner.get_rope_index(**{key: batch[key] for key in known if key in batch and key in names})
    steps = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    starts = torch.cummax(torch.where(position_ids == 0, steps, 0), dim=1).values  # each token's sample start
    three_d = three_d - three_d.gather(2, starts.unsqueeze(0).expand_as(three_d))
    return {**batch, "position_ids": torch.cat([position_ids.unsqueeze(0), three_d.to(position_ids.dtype)])}


def vision_lm_loss_sum(model, batch, router_aux_loss_coef=None, group=None, **options):
    """The causal-LM loss of a multimodal batch; the options (freezing, media sizes) acted before it."""
    return causal_lm_loss_sum(model, accepted_inputs(model, packed_positions(model, batch)), router_aux_loss_coef,
                              group)


def freeze_parts(model: torch.nn.Module, family, options: dict) -> tuple[str, ...]:
    """Fix the parameters of the parts the options freeze; return the names of the linear layers inside them,
    which LoRA must leave out."""
    frozen = {part for name, part in FREEZE_OPTIONS.items() if options[name]}
    parts = family.vision
    for name, param in model.named_parameters():
        if parts.part_of(name) in frozen:
            param.requires_grad_(False)
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and parts.part_of(name) in frozen)


register_objective(Objective(
    "vision_lm", "vision_chat", vision_lm_loss_sum, frozenset({"transformers"}),
    auto_class="AutoModelForImageTextToText", splits=frozenset({"dp", "fsdp"}), resolve_options=_options,
    freeze_parts=freeze_parts, option_names=(*FREEZE_OPTIONS, *MEDIA_OPTIONS), encode_options=_encode_options))
