"""One bridge run at one megatron layout, for every model of a job file (started by tests/convert/conftest.py).

    python -m bridge_worker JOB.json LAYOUT_NAME               (tp=1, pp=1)
    torchrun --nproc-per-node 2 -m bridge_worker JOB.json tp2  (tp=2 or pp=2)

For each model: load the HF checkpoint into this layout's megatron model through the bridge, run the
same token ids through it (by hand across the pipeline stages), export it back to HF, and, when asked,
save a dist checkpoint or load the one another layout saved and run the ids again. Rank 0 writes the
logits (`logits_<source>.safetensors`, vocabulary unpadded) into the model's output folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoConfig

from twinkle_core.convert import (export_hf_weights, load_hf_weights, load_megatron_as_megatron,
                                  save_megatron_checkpoint)
from twinkle_core.convert.megatron_checkpoint import copy_hf_side_files
from twinkle_core.megatron import MegatronParallel, build_gpt_model, initialize_megatron_parallel
from twinkle_core.parallel.process_group import close_distributed


def token_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None elsewhere): stages pass hidden states on."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model.eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(ids, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return gather_from_tensor_model_parallel_region(output)


def write_logits(model, hf_config, path: Path) -> None:
    from megatron.core import parallel_state as ps

    logits = megatron_logits(model, token_ids(hf_config.vocab_size))
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        save_file({"logits": logits[..., : hf_config.vocab_size].contiguous()}, path)
    dist.barrier()


def run_model(job: dict, entry: dict, layout: MegatronParallel, name: str) -> None:
    out = Path(entry["out"]) / name
    hf_config = AutoConfig.from_pretrained(entry["hf_dir"])
    model = build_gpt_model(hf_config, layout)
    load_hf_weights(model, hf_config, entry["hf_dir"])
    write_logits(model, hf_config, out / "logits_hf.safetensors")
    export_hf_weights(model, hf_config, out / "exported", max_shard_bytes=entry.get("max_shard_bytes", 2**31))
    if dist.get_rank() == 0:
        copy_hf_side_files(entry["hf_dir"], out / "exported")
    if name == job["save_dist"]:
        save_megatron_checkpoint(model, out / "dist", entry["hf_dir"], layout, entry["family"], torch.float32)
    if name in job["load_dist"]:
        loaded = load_megatron_as_megatron(Path(entry["out"]) / job["load_dist"][name] / "dist", layout)
        write_logits(loaded.model, hf_config, out / "logits_dist.safetensors")


def main() -> None:
    job_path, name = sys.argv[1], sys.argv[2]
    job = json.loads(Path(job_path).read_text())
    layout = MegatronParallel(**job["layouts"][name])
    initialize_megatron_parallel(layout)
    for entry in job["models"]:
        if name in job["only"] and entry["name"] not in job["only"][name]:
            continue
        (Path(entry["out"]) / name).mkdir(parents=True, exist_ok=True)
        run_model(job, entry, layout, name)
    close_distributed()


if __name__ == "__main__":  # dist_checkpointing's helper process re-imports this module
    main()
