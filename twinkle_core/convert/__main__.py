"""`python -m twinkle_core.convert --to megatron|hf --source DIR --output DIR [--tp N --pp N]`.

One process, or each worker of `torchrun --nproc-per-node tp*pp -m twinkle_core.convert ...`. The task
`tasks/convert.py` starts it as a separate process, which keeps megatron's process groups and the CPU
device mode out of the Prefect process.
"""
from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from twinkle_core.convert.conversion import convert_hf_to_megatron, convert_megatron_to_hf
from twinkle_core.megatron.parallel_state import MegatronParallel, destroy_megatron_parallel
from twinkle_core.parallel.process_group import close_distributed

RESULT_PREFIX = "TWINKLE_CONVERT "  # the line the launching task reads


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (VmHWM; it resets at exec, unlike ru_maxrss)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m twinkle_core.convert", description=__doc__)
    parser.add_argument("--to", choices=("megatron", "hf"), required=True)
    parser.add_argument("--source", required=True, help="HF directory (--to megatron) or Megatron checkpoint")
    parser.add_argument("--output", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    layout = MegatronParallel(tp=args.tp, pp=args.pp)
    if args.to == "megatron":
        result = convert_hf_to_megatron(args.source, args.output, layout)
    else:
        result = convert_megatron_to_hf(args.source, args.output, layout, max_shard_bytes=args.max_shard_bytes)
    peaks: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_bytes())
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps({"output": args.output, "seconds": result.seconds,
                                          "peak_rss_bytes": max(peaks)}), flush=True)
    destroy_megatron_parallel()
    close_distributed()


if __name__ == "__main__":  # dist_checkpointing's helper process re-imports this module
    main()
