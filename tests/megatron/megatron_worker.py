"""Train a tiny model with MegatronModel at one layout and write what the tests compare.

    python -m megatron_worker JOB.json [JOB2.json ...]                     (one process)
    torchrun --nproc-per-node 2 -m megatron_worker JOB.json [JOB2.json ...]

Several jobs run one after another in the same processes (a process start costs more than a tiny job):
each starts from the same seed, on megatron groups built for its own layout.

JOB.json: model (an HF dir or a Megatron checkpoint), layout (tp/pp/ep/etp/sequence_parallel/vpp), micro_batch_size,
steps, accumulation (forward_backward calls per step), lora (bool), optimizer, resume_from / save_at (a step to save a dist checkpoint at), out (a folder).
Every step trains the same global batch slice of a fixed seeded corpus; each data-parallel rank takes its
contiguous share of the rows. Rank 0 writes result.json: per-step losses, grad norms and, when asked, the
exported HF weights or PEFT adapter (export/).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from twinkle_core.megatron.parallel_state import destroy_megatron_parallel
from twinkle_core.models import LoraConfig
from twinkle_core.models.megatron_model import MegatronModel
from twinkle_core.parallel.process_group import close_distributed
from twinkle_core.entry import finish_worker

GLOBAL_ROWS, SEQ = 8, 12


def global_batch(step: int, vocab: int) -> dict:
    """A fixed batch per step: random ids, the first 3 positions untrained, one row right-padded."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (GLOBAL_ROWS, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[0, -4:] = -100
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def local_share(batch: dict, rank: int, size: int) -> dict:
    per = GLOBAL_ROWS // size
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def main(job_paths: list[str]) -> None:
    for path in job_paths:
        torch.manual_seed(0)
        run_job(json.loads(Path(path).read_text()))
        destroy_megatron_parallel()  # the next job builds its layout's groups afresh
        gc.collect()
    close_distributed()


def run_job(job: dict) -> None:
    layout = job.get("layout", {})
    model = MegatronModel(job["model"], mixed_precision=job.get("precision", "no"), tp_size=layout.get("tp", 1),
                          pp_size=layout.get("pp", 1), ep_size=layout.get("ep", 1),
                          sequence_parallel=layout.get("sequence_parallel", False),
                          virtual_pipeline_stages=layout.get("vpp"), expert_tensor_parallel_size=layout.get("etp"),
                          micro_batch_size=job.get("micro_batch_size", 1))
    if job.get("lora"):
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    accumulation = job.get("accumulation", 1)  # forward_backward calls per step, each on a part of the rows
    model.set_optimizer(job.get("optimizer", "AdamW"), lr=job.get("lr", 1e-2), gradient_accumulation_steps=accumulation)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=job["steps"])
    out = Path(job["out"])
    start = 0
    if job.get("resume_from"):
        model.load("resume", job["resume_from"])
        start = model.step
    losses, norms, rank_losses = [], [], []
    for step in range(start, job["steps"]):
        batch = local_share(global_batch(step, model.hf_config.vocab_size), model.data_parallel_rank,
                            model.data_parallel_size)
        rows = len(batch["input_ids"]) // accumulation
        for part in range(accumulation):
            rank_losses.append(model.forward_backward(inputs={k: v[part * rows:(part + 1) * rows]
                                                              for k, v in batch.items()}))
            stepped = model.clip_grad_and_step(max_grad_norm=1.0)
            assert stepped == (part == accumulation - 1)
        metrics = model.calculate_metric()
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        if job.get("save_at") == step + 1:
            model.save("resume", out)
    eval_batch = local_share(global_batch(999, model.hf_config.vocab_size), model.data_parallel_rank,
                             model.data_parallel_size)
    model.forward_only(eval_batch)
    held_out = model.calculate_metric(is_training=False)
    if job.get("export"):
        model.save_hf(out / "export")
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        trainable = sum(p.numel() for p in model.trainable_parameters())
        # the decoder's linears, which tp splits (norms are whole; the vocabulary is padded per tp size)
        linears = sum(p.numel() for chunk in model.chunks for n, p in chunk.named_parameters()
                      if n.startswith("decoder.") and "layernorm" not in n)
        (out / "result.json").write_text(json.dumps({"losses": losses, "grad_norms": norms, "held_out": held_out,
                                                     "first_rank_losses": rank_losses,
                                                     "trainable_local": trainable, "linears_local": linears}))
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written its result before any rank starts the next job


if __name__ == "__main__":  # dist_checkpointing starts helper processes that re-import this module
    finish_worker(main(sys.argv[1:]))
