"""Train tenants with MultiLoraMegatronModel (or one adapter with MegatronModel) and write what the tests compare.

    python -m multi_lora_megatron_worker JOB.json [JOB2.json ...]
    torchrun --nproc-per-node 2 -m multi_lora_megatron_worker JOB.json [JOB2.json ...]

Several jobs run one after another in the same processes, as in megatron_worker.

JOB.json: model (an HF dir), layout (tp/pp/sequence_parallel), steps, micro_batch_size, mixed (one mixed batch
per step for all tenants, else one forward_backward per tenant), tenants ([{name, r, alpha, targets, lr,
seed}]), accumulation ({tenant: forward_backward calls per step}), single (train tenants[0] alone on MegatronModel instead), checks (instead of training: isolation
and mixed-vs-separate gradients), export (save each adapter), out. Tenant i trains on its own fixed batches;
each data-parallel rank takes its contiguous share of the rows. Rank 0 writes result.json.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_worker import global_batch, local_share
from twinkle_core.megatron.parallel_state import destroy_megatron_parallel
from twinkle_core.models import LoraConfig, MegatronModel, MultiLoraMegatronModel
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.entry import finish_worker


def tenant_batch(index: int, step: int, vocab: int, model) -> dict:
    return local_share(global_batch(100 * index + step, vocab), model.data_parallel_rank, model.data_parallel_size)


def lora_config(tenant: dict) -> LoraConfig:
    return LoraConfig(r=tenant["r"], lora_alpha=tenant["alpha"], target_modules=tenant.get("targets", "all-linear"))


def build(job: dict, cls, **kw):
    layout = job.get("layout", {})
    return cls(job["model"], mixed_precision=job.get("precision", "no"), tp_size=layout.get("tp", 1),
               pp_size=layout.get("pp", 1), sequence_parallel=layout.get("sequence_parallel", False),
               micro_batch_size=job.get("micro_batch_size", 2), **kw)


def train_single(job: dict) -> dict:
    """tenants[0] alone, as MegatronModel's one adapter (megatron's DDP and optimizer)."""
    tenant = job["tenants"][0]
    model = build(job, MegatronModel)
    model.seed = tenant["seed"]
    model.add_adapter_to_model(tenant["name"], lora_config(tenant))
    model.set_optimizer("AdamW", lr=tenant["lr"])
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=job["steps"])
    losses = []
    for step in range(job["steps"]):
        model.forward_backward(inputs=tenant_batch(0, step, model.hf_config.vocab_size, model))
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    if job.get("export"):
        model.save_hf(Path(job["out"]) / tenant["name"])
    destroy_megatron_parallel()
    return {"losses": {tenant["name"]: losses}}


def train_tenants(job: dict) -> dict:
    model = build(job, MultiLoraMegatronModel, max_loras=len(job["tenants"]) + 1, max_r=4)
    vocab = model.hf_config.vocab_size
    for tenant in job["tenants"]:
        model.add_adapter_to_model(tenant["name"], lora_config(tenant), seed=tenant["seed"])
        model.set_optimizer("AdamW", lr=tenant["lr"], adapter_name=tenant["name"],
                            gradient_accumulation_steps=job.get("accumulation", {}).get(tenant["name"], 1))
        model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=job["steps"],
                               adapter_name=tenant["name"])
    if job.get("checks"):
        result = run_checks(model, job)
        destroy_megatron_parallel()
        return result
    result = {}
    losses = {t["name"]: [] for t in job["tenants"]}
    for step in range(job["steps"]):
        batches = [tenant_batch(i, step, vocab, model) for i in range(len(job["tenants"]))]
        if job.get("mixed"):
            rows = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            names = [t["name"] for t, b in zip(job["tenants"], batches) for _ in range(len(b["input_ids"]))]
            model.forward_backward(inputs=rows, adapter_name=names)
        else:  # a tenant with accumulation N trains its batch in N calls and steps after the last
            for tenant, batch in zip(job["tenants"], batches):
                parts = job.get("accumulation", {}).get(tenant["name"], 1)
                rows = len(batch["input_ids"]) // parts
                for part in range(parts - 1):
                    model.forward_backward(inputs={k: v[part * rows:(part + 1) * rows] for k, v in batch.items()},
                                           adapter_name=tenant["name"])
                    assert not model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=tenant["name"])
                model.forward_backward(inputs={k: v[(parts - 1) * rows:] for k, v in batch.items()},
                                       adapter_name=tenant["name"])
        for tenant in job["tenants"]:
            assert model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=tenant["name"])
            losses[tenant["name"]].append(model.calculate_metric(adapter_name=tenant["name"])["loss"])
    result["losses"] = losses
    held_out = {}
    for i, tenant in enumerate(job["tenants"]):
        model.forward_only(tenant_batch(i, 999, vocab, model), adapter_name=tenant["name"])
        held_out[tenant["name"]] = model.calculate_metric(is_training=False, adapter_name=tenant["name"])["loss"]
        if job.get("export"):
            model.save(tenant["name"], job["out"], adapter_name=tenant["name"])
    result["held_out"] = held_out
    if job.get("export"):  # read the first adapter back as a new tenant: the same held-out loss
        first = job["tenants"][0]["name"]
        model.load(first, job["out"], adapter_name="reloaded")
        model.forward_only(tenant_batch(0, 999, vocab, model), adapter_name="reloaded")
        result["reloaded_held_out"] = model.calculate_metric(is_training=False, adapter_name="reloaded")["loss"]
    destroy_megatron_parallel()
    return result


def _snapshot(model, name: str) -> dict:
    state = model.slots.get(name, "snapshot").stepper.optimizer.state
    return {"params": [p.detach().clone() for p in model.tenant_parameters(name)],
            "optimizer": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in state.values()]}


def _same(a: dict, b: dict) -> bool:
    return (len(a["params"]) == len(b["params"]) and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and len(a["optimizer"]) == len(b["optimizer"])
            and all(all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
                    for x, y in zip(a["optimizer"], b["optimizer"])))


def run_checks(model, job: dict) -> dict:
    """Mixed batch vs separate batches (losses, gradients), then isolation of a step of one tenant."""
    names = [t["name"] for t in job["tenants"]]
    vocab = model.hf_config.vocab_size
    for i, name in enumerate(names):  # one step each first: B is no longer zero, so A has gradients too
        model.forward_backward(inputs=tenant_batch(i, 400, vocab, model), adapter_name=name)
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
    batches = [tenant_batch(i, 500, vocab, model) for i in range(len(names))]
    separate_losses, separate_grads = {}, {}
    for name, batch in zip(names, batches):
        separate_losses[name] = model.forward_backward(inputs=batch, adapter_name=name)
        separate_grads[name] = [p.grad.clone() for p in model.tenant_parameters(name)]
        for p in model.tenant_parameters(name):
            p.grad = None
    rows = {k: torch.cat([b[k] for b in batches][::-1]) for k in batches[0]}  # tenants' rows in reverse order
    row_names = [n for n, b in list(zip(names, batches))[::-1] for _ in range(len(b["input_ids"]))]
    mixed_losses = model.forward_backward(inputs=rows, adapter_name=row_names)
    grad_diff = max(float((p.grad - g).abs().max()) for n in names
                    for p, g in zip(model.tenant_parameters(n), separate_grads[n]))
    grad_scale = max(float(g.abs().max()) for n in names for g in separate_grads[n])
    # both micro-batches count: step the first tenant on them, the others must not change
    others_before = {n: _snapshot(model, n) for n in names[1:]}
    base_before = [p.detach().clone() for chunk in model.chunks for n, p in chunk.named_parameters() if ".lora_" not in n]
    first_before = _snapshot(model, names[0])
    stepped = model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=names[0])
    base_after = [p.detach() for chunk in model.chunks for n, p in chunk.named_parameters() if ".lora_" not in n]
    result = {"separate_losses": separate_losses, "mixed_losses": mixed_losses, "grad_diff": grad_diff,
              "grad_scale": grad_scale, "stepped": stepped,
              "first_changed": not _same(first_before, _snapshot(model, names[0])),
              "others_unchanged": all(_same(others_before[n], _snapshot(model, n)) for n in names[1:]),
              "base_unchanged": all(torch.equal(a, b) for a, b in zip(base_before, base_after))}
    result["refusals"] = refusals(model, names)
    return result


def refusals(model, names: list[str]) -> dict:
    """Over max_loras or max_r, and a removed tenant's slot taken again: errors, and nothing changed."""
    errors = {}
    for label, name, config in (("rank", "wide", LoraConfig(r=8)), ("name", names[0], LoraConfig(r=2)),
                                ("targets", "odd", LoraConfig(r=2, target_modules=["q_proj"]))):
        try:
            model.add_adapter_to_model(name, config)
        except ValueError as exc:
            errors[label] = str(exc)
    model.add_adapter_to_model("extra", LoraConfig(r=2))  # the last free slot
    try:
        model.add_adapter_to_model("one_too_many", LoraConfig(r=2))
    except ValueError as exc:
        errors["slots"] = str(exc)
    unchanged = model.adapter_names() == [*names, "extra"]
    model.remove_adapter("extra")
    model.add_adapter_to_model("after_remove", LoraConfig(r=2))
    lora_names = {n.rsplit(".", 1)[-1] for chunk in model.chunks for n, _ in chunk.named_parameters() if ".lora_" in n}
    return {"errors": errors, "unchanged": unchanged, "adapters": model.adapter_names(),
            "parameter_owners": sorted(lora_names)}


def main(job_paths: list[str]) -> None:
    for path in job_paths:
        job = json.loads(Path(path).read_text())
        torch.manual_seed(0)
        result = train_single(job) if job.get("single") else train_tenants(job)
        if not dist.is_initialized() or dist.get_rank() == 0:
            out = Path(job["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result))
        gc.collect()
    close_distributed()


if __name__ == "__main__":
    finish_worker(main(sys.argv[1:]))
