"""The seams new kinds of training plug into: one model protocol, a backend registry, an objective registry."""
import inspect

import pytest

from tiny_models import SAMPLE_ROWS as ROWS
from twinkle_core.data import collate, encode_chat
from twinkle_core.models import MegatronModel, TransformersModel
from twinkle_core.models.backends import Backend, backend_names, get_backend, register_backend
from twinkle_core.models.protocol import TrainableModel
from twinkle_core.objectives import LossParts, Objective, get_objective, register_objective
from twinkle_core.objectives.causal_lm import causal_lm_loss_sum

VERBS = [name for name, member in inspect.getmembers(TrainableModel, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("cls", [TransformersModel, MegatronModel])
def test_every_backend_model_has_every_verb_of_the_protocol(cls):
    assert {"forward_backward", "forward_only", "clip_grad_and_step", "set_optimizer", "set_lr_scheduler",
            "calculate_metric", "save", "load", "close", "export", "save_training_state"} <= set(VERBS)
    assert [verb for verb in VERBS if not hasattr(cls, verb)] == []


def test_backends_are_registered_once_and_unknown_ones_name_the_choices():
    assert backend_names() == ["megatron", "transformers"]
    with pytest.raises(ValueError, match="training backend 'megatron' is already registered"):
        register_backend(Backend("megatron", print, print, ()))
    with pytest.raises(ValueError, match="backend='jax' is not a known training backend; use one of: megatron, "
                                         "transformers"):
        get_backend("jax")


def test_the_loss_is_the_objective_the_model_is_built_with(tiny_model_dir):
    """A registered objective replaces the loss of forward_backward/forward_only and nothing else."""
    def doubled(model, batch, router_aux_loss_coef=None, group=None) -> LossParts:
        parts = causal_lm_loss_sum(model, batch, router_aux_loss_coef, group)
        return LossParts(2 * parts.loss_sum, parts.num_tokens, parts.aux_loss)

    register_objective(Objective("doubled_causal_lm", "chat", doubled, frozenset({"transformers"})))
    with pytest.raises(ValueError, match="already registered"):
        register_objective(Objective("doubled_causal_lm", "chat", doubled, frozenset({"transformers"})))
    losses = {}
    for name in ("causal_lm", "doubled_causal_lm"):
        model = TransformersModel(str(tiny_model_dir), mixed_precision="no", objective=name)
        batch = collate([encode_chat(model.tokenizer, r["messages"]) for r in ROWS],
                        pad_token_id=model.tokenizer.pad_token_id)
        losses[name] = model.forward_only(batch)
    assert losses["doubled_causal_lm"] == pytest.approx(2 * losses["causal_lm"], rel=1e-6)
    assert get_objective("causal_lm").row_kind == "chat"
    with pytest.raises(ValueError, match="objective='dpo' is not a known training objective"):
        TransformersModel(str(tiny_model_dir), mixed_precision="no", objective="dpo")
