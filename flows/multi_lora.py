"""Multi-tenant LoRA: download → per tenant (download → tokenize) → train all tenants in one job → per tenant
(evaluate → register).

    python -m flows.multi_lora                  # two default tenants (Twinkle and Nova) on the embedded model
    python -m flows.multi_lora --help           # every option
    python -m flows.multi_lora --config tenants.yaml
    python -m flows.multi_lora --backend megatron --nproc-per-node 2 --tp-size 2   # on megatron-core

Every tenant trains its own LoRA adapter on one shared base model, in one training job; by default each
round trains all tenants' micro-batches in one mixed batch (one base-model pass). Each tenant gets its own
MLflow run (nested under the flow's run), its own evaluation and its own registered model
`<registered_model_prefix>-<tenant>`. A tenant whose data is bad fails alone: its error is reported in its
MLflow run and in the summary, and the others finish.
"""
from __future__ import annotations

import sys
from typing import ClassVar

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import Field

from flows.cli import run_from_cli
from flows.params import TrainingFlowConfig, default_model_name
from flows.run_folder import discard_bare_run_folder, run_folder
from flows.summary import family_line
from tasks.convert import convert
from tasks.download import download_dataset, download_model
from tasks.evaluate import evaluate
from tasks.prompts import sample_prompts
from tasks.refs import ModelRef
from tasks.register import register
from tasks.tokenize import tokenize
from tasks.track import finish_tracking, start_tracking
from tasks.track_tenants import fail_tenant_tracking, start_tenant_tracking
from tasks.train_multi_lora import train_tenants
from twinkle_core.config.fields import (BackendFields, ChatDataFields, CheckpointFields, DataParallelFields,
                                        DataSourceFields, Epochs, EvalFields, EvalPrompts, ExperimentName, LoopFields,
                                        LoraFields, MaxLoras, MaxNewTokens, MaxR, MicroBatchSize, MixedBatches,
                                        ModelParallelFields, OptimizerFields, ProcessFields, RunFields, TenantName)
from twinkle_core.objectives import get_objective
from twinkle_core.tracking import tracking_uri
from twinkle_core.train.multi_lora_config import MultiLoraRunConfig, TenantRunConfig

class TenantSpec(OptimizerFields, LoopFields, LoraFields, DataSourceFields):
    """One tenant: its data, its LoRA adapter and its hyper-parameters (groups listed last-first)."""

    name: TenantName
    epochs: Epochs = 1.0


DEFAULT_TENANTS = [
    TenantSpec(name="twinkle", dataset="pkg://twinkle_core/datasets/self_cognition/train.jsonl",
               eval_dataset="pkg://twinkle_core/datasets/self_cognition/heldout.jsonl", max_steps=12),
    TenantSpec(name="nova", dataset="pkg://twinkle_core/datasets/nova/train.jsonl",
               eval_dataset="pkg://twinkle_core/datasets/nova/heldout.jsonl", max_steps=12, lora_r=4, lora_alpha=16,
               lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lr=2e-3, seed=7),
]


class MultiLoraConfig(RunFields, EvalFields, ModelParallelFields, DataParallelFields, ProcessFields,
                      CheckpointFields, ChatDataFields, BackendFields, TrainingFlowConfig):
    """Parameters of the multi_lora flow (the Prefect UI form and the CLI options; groups listed last-first)."""

    kind: ClassVar[str] = "multi_lora"

    tenants: list[TenantSpec] = Field(default_factory=lambda: list(DEFAULT_TENANTS), min_length=1, description="The tenants, as a YAML/JSON list of {name, dataset, eval_dataset, lora_r, lr, ...}.")
    mixed_batches: MixedBatches = True
    max_loras: MaxLoras = None
    max_r: MaxR = None
    micro_batch_size: MicroBatchSize = 1
    eval_prompts: EvalPrompts = 2
    max_new_tokens: MaxNewTokens = 32
    registered_model_prefix: str | None = Field(None, description="Registered models are named <prefix>-<tenant> (default: from the model id).")
    experiment_name: ExperimentName = "twinkle-multi-lora"

    def problems(self, model_config) -> list[str]:
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        largest = max(t.lora_r for t in self.tenants)
        return [problem for bad, problem in (
            (duplicates, f"tenants: names {duplicates} appear more than once; give every tenant its own name"),
            (self.max_loras is not None and self.max_loras < len(self.tenants),
             f"max_loras={self.max_loras} is fewer than the {len(self.tenants)} tenants; set max_loras >= "
             f"{len(self.tenants)} or leave it empty"),
            (self.max_r is not None and self.max_r < largest,
             f"max_r={self.max_r} is below tenant rank lora_r={largest}; set max_r >= {largest} or leave it empty"),
        ) if bad]

    def model_name(self, tenant: str) -> str:
        if self.registered_model_prefix:
            return f"{self.registered_model_prefix}-{tenant}"
        return default_model_name(self.model_id) + f"-{tenant}"

    def run_config(self, model: ModelRef, tenants: list[TenantRunConfig], checkpoint_dir: Path) -> MultiLoraRunConfig:
        return MultiLoraRunConfig(
            model_id=self.model_id, model_path=model.path, **model.ref_options(), checkpoint_dir=checkpoint_dir,
            backend=self.backend, micro_batch_size=self.micro_batch_size,
            mixed_precision=self.mixed_precision, parallel=self.parallel(), max_loras=self.max_loras or len(tenants),
            max_r=self.max_r or max(t.lora_r for t in tenants), mixed_batches=self.mixed_batches, tenants=tenants,
            checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints, tracking_uri=tracking_uri())


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@flow(name="multi_lora", on_failure=[discard_bare_run_folder])
def multi_lora(config: MultiLoraConfig = MultiLoraConfig()) -> dict:
    """Train one LoRA adapter per tenant on `config.model_id` in one job; evaluate and register each."""
    log = get_run_logger()
    run_dir = run_folder(config.output_dir, config)  # a retry of this flow run gets the same folder
    # tokenizing and evaluation use the HF checkpoint
    hf_model = download_model(config.model_id, **config.model_options())
    config.check_model(hf_model)  # model-dependent rules before anything else runs
    model = convert(hf_model, config.backend, config.tp_size, config.pp_size, config.timeout_minutes * 60)
    parent = start_tracking(config.experiment_name, run_dir.name, config.model_dump(mode="json", exclude={"tenants"}),
                            {"flow": "multi_lora", "model_id": config.model_id, "prefect_flow_run": str(flow_run.id)})
    runs, prepared, failures, results = {}, {}, {}, {}
    for tenant in config.tenants:  # each tenant's data on its own: a bad dataset fails that tenant only
        runs[tenant.name] = start_tenant_tracking(config.experiment_name, parent, tenant.name,
                                                  tenant.model_dump(mode="json"))
        try:
            prepared[tenant.name] = _prepare_tenant(config, tenant, hf_model, runs[tenant.name])
        except Exception as exc:  # noqa: BLE001 - reported with the tenant, the others go on
            failures[tenant.name] = _error(exc)
    try:
        checkpoints, train_failures = ({}, {}) if not prepared else train_tenants(
            config.run_config(model, [p["run"] for p in prepared.values()], run_dir / "checkpoints"), str(run_dir),
            timeout_s=config.timeout_minutes * 60, device_limit=config.device_limit)
    except BaseException:
        for name in prepared:
            fail_tenant_tracking(runs[name], "the training job failed; see the flow run's log")
        finish_tracking(parent, "FAILED")
        raise
    failures.update(train_failures)
    for name, checkpoint in checkpoints.items():
        try:
            results[name] = _evaluate_and_register(config, name, hf_model, checkpoint, prepared[name], run_dir)
            finish_tracking(runs[name])
        except Exception as exc:  # noqa: BLE001 - one tenant's evaluation or registration fails alone
            failures[name] = _error(exc)
    for name, error in failures.items():
        log.error("tenant %s failed: %s", name, error)
        fail_tenant_tracking(runs[name], error)
    finish_tracking(parent, "FINISHED" if results else "FAILED")
    summary = _summary(config, results, failures, parent, hf_model.family)
    create_markdown_artifact(summary, key="multi-lora-summary", description="tenants: trained, evaluated, registered")
    log.info("run summary:\n%s", summary)
    if not results:
        raise RuntimeError(f"every tenant failed: {failures}")
    return {"summary": summary, "run_id": parent, "tenant_runs": runs, "results": results, "failures": failures}


def _prepare_tenant(config: MultiLoraConfig, tenant: TenantSpec, model: ModelRef, run_id: str) -> dict:
    """Download and tokenize one tenant's data; its resolved run settings for the training job."""
    train_file, eval_file = download_dataset(tenant.dataset), download_dataset(tenant.eval_dataset)
    kind = get_objective(config.objective).row_kind
    train_data = tokenize(train_file, model, config.max_length, False, config.max_bad_fraction,
                          config.enable_thinking, kind, num_proc=config.num_proc)
    eval_data = tokenize(eval_file, model, config.max_length, False, config.max_bad_fraction,
                         config.enable_thinking, kind, num_proc=config.num_proc)
    prompts = sample_prompts(eval_file, config.eval_prompts)
    shared = set(TenantRunConfig.model_fields) & set(TenantSpec.model_fields)
    run = TenantRunConfig(**tenant.model_dump(include=shared), train_data=train_data.path, mlflow_run_id=run_id)
    return {"run": run, "eval_data": eval_data, "prompts": prompts, "train_data": train_data, "train_file": train_file}


def _evaluate_and_register(config: MultiLoraConfig, name: str, model: ModelRef, checkpoint, prepared: dict,
                           run_dir: Path) -> dict:
    tenant_dir = run_dir / name
    tenant_dir.mkdir(exist_ok=True)
    run_id = prepared["run"].mlflow_run_id
    reports = evaluate(model, checkpoint, prepared["eval_data"], prepared["prompts"], str(tenant_dir),
                       config.mixed_precision, config.max_new_tokens, run_id)
    registration = register(checkpoint, config.model_name(name), run_id, reports["trained"]["eval_loss"], base=model,
                            dataset=prepared["train_file"])
    return {"checkpoint": checkpoint.path, "probe_loss": checkpoint.probe_loss, "final_metrics": checkpoint.final_metrics,
            "reports": reports, "registration": registration, "prompts": prepared["prompts"]}


def _summary(config: MultiLoraConfig, results: dict, failures: dict, parent: str, family: str) -> str:
    lines = ["## Twinkle Flows: multi-tenant LoRA summary", "", f"model: {config.model_id} on {config.backend}, "
             f"{'mixed batches' if config.mixed_batches else 'tenants one after another'}, {config.mixed_precision}",
             family_line(family), "",
             "| tenant | status | final train loss | held-out loss base → trained | registered |",
             "|---|---|---|---|---|"]
    for tenant in config.tenants:
        if tenant.name in results:
            r = results[tenant.name]
            base, trained = r["reports"]["base"], r["reports"]["trained"]
            reg = r["registration"]
            lines.append(f"| {tenant.name} | trained | {r['final_metrics'].get('loss', float('nan')):.4f} | "
                         f"{base['eval_loss']:.4f} → {trained['eval_loss']:.4f} | {reg['name']} v{reg['version']} |")
        else:
            error = " ".join(failures.get(tenant.name, "not trained").split())[:300]
            lines.append(f"| {tenant.name} | FAILED: {error} | | | |")
    for name, r in results.items():
        if r["prompts"]:
            lines += ["", f"**{name}** — prompt: {r['prompts'][0][-1]['content']}",
                      f"- base: {' '.join(r['reports']['base']['answers'][0].split())}",
                      f"- trained: {' '.join(r['reports']['trained']['answers'][0].split())}"]
    lines += ["", f"MLflow run id: {parent} (one nested run per tenant)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_from_cli(multi_lora, MultiLoraConfig, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
