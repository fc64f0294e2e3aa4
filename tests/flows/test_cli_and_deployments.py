"""The command line (`python -m flows.sft`) and the deployment presets."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import parse_config
from flows.params import DEFAULT_MODEL
from flows.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_options():
    out = subprocess.run([sys.executable, "-m", "flows.sft", "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--model-id", "--dataset", "--lr", "--config", "--mixed-precision", "--use-lora", "--epochs"):
        assert flag in out


def test_defaults_then_file_then_flags(tmp_path):
    assert parse_config(SFTConfig, [], "d").model_id == DEFAULT_MODEL
    config_file = tmp_path / "run.yaml"
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": []}\n')
    config_file.write_text(yaml.safe_dump({"lr": 0.01, "epochs": 2, "dataset": str(data)}))
    config = parse_config(SFTConfig, ["--config", str(config_file), "--lr", "3e-4", "--use-lora", "false",
                                      "--lora-target-modules", "q_proj,v_proj"], "d")
    assert (config.lr, config.epochs, config.dataset) == (3e-4, 2, str(data))
    assert config.use_lora is False and config.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("argv,words", [
    (["--mixed-precision", "fp8"], ["fp8", "Transformer Engine", "bf16"]),
    (["--nproc-per-node", "2", "--dp-size", "3"], ["dp_size=3", "dp_size=2 would fit"]),
    (["--nproc-per-node", "3", "--tp-size", "2"], ["tp_size=2", "3 processes"]),
    (["--nproc-per-node", "2", "--ep-size", "3"], ["ep_size=3 must divide dp_size × fsdp_size = 2"]),
    (["--lr", "-1"], ["lr", "greater than 0"]),
    (["--strategy", "deepspeed"], ["strategy", "accelerate", "native_fsdp"]),
])
def test_unsupported_options_fail_before_anything_runs(argv, words):
    with pytest.raises(SystemExit) as err:
        parse_config(SFTConfig, argv, "d")
    for word in words:
        assert word in str(err.value)


def test_sequence_parallel_size_is_a_flow_option():
    config = parse_config(SFTConfig, ["--nproc-per-node", "4", "--sp-size", "2"], "d")
    assert config.parallel().mesh_sizes() == dict(dp_size=1, fsdp_size=2, tp_size=1, ep_size=1, sp_size=2)


def test_unknown_keys_in_the_config_file_are_named(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("learning_rate: 0.1\n")
    with pytest.raises(SystemExit, match="learning_rate"):
        parse_config(SFTConfig, ["--config", str(config_file)], "d")


@pytest.mark.parametrize("text, words", [
    ("lr: 0.1\nepochs: [2\n", ["run.yaml, line 3, column 1: not valid YAML"]),
    ("- lr: 0.1\n", ["the top level is a list, not a mapping of options"]),
    ("lr: 0.1\n\xff\n", ["not UTF-8 text"]),
])
def test_a_bad_config_file_is_named_with_where_it_is_wrong(tmp_path, text, words):
    config_file = tmp_path / "run.yaml"
    config_file.write_bytes(text.encode("latin-1"))
    with pytest.raises(SystemExit) as err:
        parse_config(SFTConfig, ["--config", str(config_file)], "d")
    for word in words:
        assert word in str(err.value), str(err.value)


def test_missing_local_paths_and_bad_ids_fail_before_any_server_starts(tmp_path):
    """In the parameters, before a Prefect server or task starts: every wrong id at once, no traceback."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"")
    cases = [
        (["--model-id", str(tmp_path / "missing"), "--dataset", str(tmp_path / "nope.jsonl")],
         [f"model_id={str(tmp_path / 'missing')!r}", "does not exist", "dataset=", "2 problem(s)"]),
        (["--model-id", "hf://just-a-name/"], ["model_id='hf://just-a-name/'", "is not of the form"]),
        (["--dataset", "s3://bucket/data.jsonl"], ["unknown scheme 's3://'"]),
        (["--model-id", str(pickled)], ["only as pickle files", "--allow-pickle-weights"]),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as err:
            parse_config(SFTConfig, argv, "d")
        for word in words:
            assert word in str(err.value), str(err.value)


def test_deployment_presets_are_valid_flow_parameters():
    from deployments.presets import build_deployments

    deployments = {d.name: d for d in build_deployments() if d.flow_name == "sft"}
    assert set(deployments) == {"default", "qwen2.5-lora", "qwen2.5-tp2", "qwen2.5-megatron-tp2", "benchmarks",
                                "nightly"}
    for deployment in deployments.values():
        SFTConfig.model_validate(deployment.parameters["config"])
    assert SFTConfig.model_validate(deployments["benchmarks"].parameters["config"]).eval_tasks == ["twinkle"]
    from flows.evaluate import EvaluateConfig

    (champion,) = [d for d in build_deployments() if d.flow_name == "evaluate"]
    assert EvaluateConfig.model_validate(champion.parameters["config"]).tasks == ["twinkle"]
    assert deployments["nightly"].schedules[0].schedule.cron == "0 2 * * *"
    from flows.pretrain import PretrainConfig

    pretrain = {d.name: d for d in build_deployments() if d.flow_name == "pretrain"}
    assert set(pretrain) == {"default", "qwen2.5-0.5b-tp2-pp2"}
    assert PretrainConfig.model_validate(pretrain["qwen2.5-0.5b-tp2-pp2"].parameters["config"]).pp_size == 2
    from flows.multi_lora import MultiLoraConfig

    (multi,) = [d for d in build_deployments() if d.flow_name == "multi_lora"]
    assert [t.name for t in MultiLoraConfig.model_validate(multi.parameters["config"]).tenants] == ["twinkle", "nova"]
    from flows.dpo import DPOConfig

    dpo = {d.name: d for d in build_deployments() if d.flow_name == "dpo"}
    assert set(dpo) == {"default", "qwen2.5-dpo-lora"}
    assert DPOConfig.model_validate(dpo["qwen2.5-dpo-lora"].parameters["config"]).precompute_reference
    from flows.grpo import GRPOConfig

    grpo = {d.name: d for d in build_deployments() if d.flow_name == "grpo"}
    assert set(grpo) == {"default", "qwen2.5-math-grpo"}
    math = GRPOConfig.model_validate(grpo["qwen2.5-math-grpo"].parameters["config"])
    assert math.grpo_loss_type == "dapo" and math.reward_weights is None  # its own rewards, not the default's
    from flows.service import ServiceOptions

    served = {d.name: d for d in build_deployments() if d.flow_name == "service"}
    assert set(served) == {"default", "qwen2.5-7b", "qwen2.5-72b-tp8"}
    assert ServiceOptions.model_validate(served["qwen2.5-7b"].parameters["config"]).max_lora_rank == 32
    split = ServiceOptions.model_validate(served["qwen2.5-72b-tp8"].parameters["config"])
    assert (split.backend, split.tp_size, split.nproc_per_node) == ("megatron", 8, 8)


def test_the_service_command_line_refuses_bad_options_before_loading_anything(capsys):
    from flows.service import main

    for argv, words in ((["--max-tenants", "0"], ["max_tenants", "greater than or equal to 1"]),
                        (["--tp-size", "2"], ["tensor parallelism splits the base on backend megatron"]),
                        (["--backend", "megatron", "--nproc-per-node", "3", "--tp-size", "2"],
                         ["nproc_per_node=3 is not a multiple of tp_size=2"]),
                        (["--backend", "megatron", "--precision", "fp16"], ["fp16 is not supported on backend"]),
                        (["--backend", "megatron", "--fsdp", "true"], ["fsdp shards the transformers backend"])):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert all(word in str(err.value) for word in words), str(err.value)
    assert main(["--api-keys-file", "/nonexistent/keys"]) == 1
    assert "api_keys_file /nonexistent/keys: no such file" in capsys.readouterr().err


def test_multi_machine_flags_reach_the_parallel_config():
    from flows.cli import build_parser

    help_text = build_parser(SFTConfig, "d").format_help()
    for flag in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"):
        assert flag in help_text
    config = parse_config(SFTConfig, ["--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "run-7",
                                      "--max-restarts", "2"], "d")
    parallel = config.parallel()
    assert (parallel.nnodes, parallel.node_rank, parallel.rdzv_endpoint, parallel.rdzv_id, parallel.max_restarts) == (
        1, 0, "10.0.0.1:29500", "run-7", 2)


@pytest.mark.parametrize("argv,words", [
    (["--nnodes", "2"], ["nnodes=2", "rdzv_endpoint", "HOST:PORT"]),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "head:29500"], ["node_rank=2", "from 0 to 1"]),
    (["--rdzv-endpoint", "head"], ["rdzv_endpoint='head'", "HOST:PORT"]),
    (["--max-restarts", "-1"], ["max_restarts", "greater than or equal to 0"]),
])
def test_wrong_multi_machine_flags_fail_before_anything_runs(argv, words):
    with pytest.raises(SystemExit) as err:
        parse_config(SFTConfig, argv, "d")
    for word in words:
        assert word in str(err.value)


def test_prefect_servers_started_for_this_project_send_no_analytics():
    """The temporary server of `python -m flows.*` and `deployments.serve` inherit the flows package's
    default; a user's own setting wins."""
    code = "import flows; from prefect.settings import get_current_settings as s; print(s().server.analytics_enabled)"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **extra},  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout.strip()
    assert run({}) == "False"
    assert run({"PREFECT_SERVER_ANALYTICS_ENABLED": "true"}) == "True"


def test_mlflow_sends_no_telemetry_from_our_processes():
    """Every process that logs imports twinkle_core.tracking first: MLflow's telemetry client is then off (no
    sender thread trying the network, none holding the worker at exit); a user's own setting wins."""
    code = ("import twinkle_core.tracking, threading; from mlflow.telemetry.utils import is_telemetry_disabled as off;"
            "from mlflow import MlflowClient; MlflowClient('sqlite:///:memory:');"
            "print(off(), any('Telemetry' in t.name for t in threading.enumerate()))")
    # MLflow also turns it off under pytest or CI: leave out the variables it looks for.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS")}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **extra},  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout.strip()
    assert run({}) == "True False"
    assert run({"MLFLOW_DISABLE_TELEMETRY": "false"}).startswith("False")
