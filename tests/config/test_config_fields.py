"""Every knob has one definition: a field name means the same type, bounds, choices and help text in every
flow's parameters and every worker's run config (twinkle_core.config.fields)."""
import importlib
import inspect

from pydantic import BaseModel

import twinkle_core.config.fields as fields

CONFIG_MODULES = ["flows.sft", "flows.multi_lora", "flows.pretrain", "flows.convert", "flows.params",
                  "twinkle_core.config.fields", "twinkle_core.parallel.config", "twinkle_core.train.config",
                  "twinkle_core.train.multi_lora_config", "twinkle_core.train.pretrain"]
NESTED = {"tenants"}  # a flow's tenant specs become resolved tenant run configs (each checked in turn)


def _configs() -> list[type[BaseModel]]:
    found = []
    for name in CONFIG_MODULES:
        module = importlib.import_module(name)
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, BaseModel) and cls.__module__ == name]
    return found


def _definition(field) -> tuple:
    return repr(field.annotation), repr(field.metadata)


def test_no_two_configs_define_a_field_differently():
    seen: dict[str, tuple] = {}
    described: dict[str, tuple[str, str]] = {}
    conflicts = []
    for cls in _configs():
        for name, field in cls.model_fields.items():
            if name in NESTED:
                continue
            where = f"{cls.__module__}.{cls.__name__}.{name}"
            if name in seen and seen[name][0] != _definition(field):
                conflicts.append(f"{where}: {_definition(field)} vs {seen[name][1]}: {seen[name][0]}")
            seen.setdefault(name, (_definition(field), where))
            if field.description:
                if name in described and described[name][0] != field.description:
                    conflicts.append(f"{where}: help text differs from {described[name][1]}")
                described.setdefault(name, (field.description, where))
    assert len(_configs()) >= 10 and not conflicts, "\n".join(conflicts)


def test_every_flow_field_has_help_text():
    from flows.multi_lora import MultiLoraConfig, TenantSpec
    from flows.pretrain import PretrainConfig
    from flows.sft import SFTConfig

    missing = [f"{cls.__name__}.{name}" for cls in (SFTConfig, MultiLoraConfig, TenantSpec, PretrainConfig)
               for name, field in cls.model_fields.items() if not field.description]
    assert missing == []


def test_a_redeclared_default_keeps_the_definition_and_the_place_in_the_form():
    from flows.pretrain import PretrainConfig
    from flows.sft import SFTConfig

    assert SFTConfig.model_fields["lr"].default == 1e-3 and PretrainConfig.model_fields["lr"].default == 5e-5
    assert _definition(SFTConfig.model_fields["lr"]) == _definition(PretrainConfig.model_fields["lr"])
    assert list(SFTConfig.model_fields)[:6] == ["model_id", "chat_template", "trust_remote_code",
                                                "allow_pickle_weights", "dataset", "eval_dataset"]
    assert fields.OptimizerFields.model_fields["lr"].description == "Peak learning rate."
