"""Settings that cannot run fail before anything runs: a typo before any task (the parameters are refused),
a layout that does not fit the model right after `download` (the one task that reads its config.json),
before tokenize, convert or torchrun, in every training flow."""
import asyncio

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from pydantic import ValidationError

from flows.multi_lora import MultiLoraConfig, TenantSpec
from flows.pretrain import PretrainConfig
from flows.sft import SFTConfig
from twinkle_core.train.checks import RunConfigError


def _task_names(flow_run_id) -> list[str]:
    async def names():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return sorted(run.name.rsplit("-", 1)[0] for run in runs)
    return asyncio.run(names())


@pytest.mark.parametrize("config", [SFTConfig, MultiLoraConfig, PretrainConfig])
def test_a_precision_typo_is_refused_with_the_parameters(config):
    with pytest.raises(ValidationError, match=r"mixed_precision\n.*'auto', 'bf16', 'fp16', 'fp8' or 'no'"):
        config(mixed_precision="bf17")


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValidationError) as raised:
        SFTConfig(backend="megatron", packing=True, dp_size=2, nproc_per_node=2, mixed_precision="fp8")
    message = str(raised.value)
    assert "sft: 3 problem(s)" in message  # fp8 is one problem on megatron: it names Transformer Engine, not torchao
    for part in ("packing=True", "dp_size=2", "mixed_precision='fp8'"):
        assert part in message


def _flows(workspace):
    from flows.multi_lora import multi_lora
    from flows.pretrain import pretrain
    from flows.sft import sft

    model, data = str(workspace["model"]), str(workspace["train"])
    tenant = TenantSpec(name="t", dataset=data, eval_dataset=str(workspace["heldout"]))
    return {  # tp_size=3 fits 3 processes but not the tiny model's 4 attention heads
        "sft": (sft, SFTConfig(model_id=model, dataset=data, nproc_per_node=3, tp_size=3)),
        "multi_lora": (multi_lora, MultiLoraConfig(model_id=model, backend="megatron", nproc_per_node=3,
                                                   tp_size=3, tenants=[tenant])),
        "pretrain": (pretrain, PretrainConfig(model_id=model, dataset=data, nproc_per_node=3, tp_size=3,
                                              global_batch_size=6)),
    }


@pytest.mark.parametrize("name", ["sft", "multi_lora", "pretrain"])
def test_tp_size_that_does_not_divide_the_heads_fails_right_after_download(sft_workspace, name):
    flow, config = _flows(sft_workspace)[name]
    state = flow(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(RunConfigError, match=r"tp_size=3 must divide num_attention_heads=4"):
        state.result()
    assert _task_names(state.state_details.flow_run_id) == ["download_model"]
    runs = sft_workspace["root"] / "runs"  # no run config written: no worker started
    assert not [p for name in ("train_config.json", "multi_lora_config.json") for p in runs.rglob(name)]


@pytest.mark.parametrize("module", ["flows.sft", "flows.multi_lora", "flows.pretrain"])
def test_the_command_line_names_each_bad_option_in_one_line(module):
    import importlib

    with pytest.raises(SystemExit) as raised:
        importlib.import_module(module).main(["--mixed-precision", "bf17", "--nproc-per-node", "0"])
    first, *problems = str(raised.value).splitlines()
    assert first == "invalid options:" and sorted(problems) == [
        "  mixed_precision: Input should be 'auto', 'bf16', 'fp16', 'fp8' or 'no'",
        "  nproc_per_node: Input should be greater than or equal to 1"]
