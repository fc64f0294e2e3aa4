"""HF ↔ Megatron conversion speed and memory, next to simply reading the same safetensors files.

    python bench/bench_convert.py                       # a ~400 MB random Llama (fp32), tp=1
    python bench/bench_convert.py --layers 4 --tp 2     # smaller, converted by 2 processes

Builds a random-init Llama-architecture checkpoint with `save_pretrained` (2 shards), then runs, each in
its own process (so peak RSS is that step's own): reading every tensor of the checkpoint (the bound the
issue names), reading and writing every tensor again with an fsync (the bound of any conversion on this
disk: it must write what it reads), `python -m twinkle_core.convert --to megatron`, and `--to hf` back. MB/s counts the checkpoint's
tensor bytes over the seconds spent reading and writing weights; building the process groups and the
empty model, process start and imports are reported apart (wall). Peak RSS is also shown over a process
that only imports the libraries. The page cache is warm for all three (the bound is memory bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from twinkle_core.convert.__main__ import RESULT_PREFIX, peak_rss_bytes  # noqa: E402


def build_checkpoint(directory: Path, layers: int) -> int:
    """A random Llama (hidden 768, GQA 12:4, vocab 32k, untied) in 2 safetensors shards; its tensor bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=32768, hidden_size=768, intermediate_size=2048,
                                  num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4,
                                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{size // 2 // 2**20 + 1}MB")
    del model
    return size


def read_all(directory: str) -> None:
    """The bound: every tensor of the checkpoint read into memory, one at a time, nothing else."""
    from twinkle_core.convert.safetensors_io import SafetensorsReader

    start = time.perf_counter()
    reader = SafetensorsReader(directory)
    for name in reader.names():
        reader.read(name)
    reader.close()
    print(RESULT_PREFIX + json.dumps({"seconds": {"read": time.perf_counter() - start},
                                      "peak_rss_bytes": peak_rss_bytes()}), flush=True)


def copy_all(directory: str, output: str) -> None:
    """The bound of any conversion on this disk: read every tensor and write it again (synced), file by file."""
    from safetensors.torch import save_file

    from twinkle_core.convert.safetensors_io import SafetensorsReader

    reader, seconds = SafetensorsReader(directory), {"read": 0.0, "write": 0.0}
    Path(output).mkdir(parents=True, exist_ok=True)
    for file in sorted(set(reader.files.values())):
        start = time.perf_counter()
        tensors = {name: reader.read(name) for name, where in reader.files.items() if where == file}
        middle = time.perf_counter()
        save_file(tensors, Path(output) / file)
        descriptor = os.open(Path(output) / file, os.O_RDONLY)
        os.fsync(descriptor)  # megatron's checkpoint writer syncs its files too
        os.close(descriptor)
        seconds["read"] += middle - start
        seconds["write"] += time.perf_counter() - middle
        del tensors
    print(RESULT_PREFIX + json.dumps({"seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}), flush=True)


def run_measured(cmd: list[str], nproc: int) -> dict:
    """Run a step: its phase seconds and peak RSS (largest process) from its result line, and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    output = proc.stdout.read()
    code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    result = json.loads(next(l for l in output.splitlines() if l.startswith(RESULT_PREFIX))[len(RESULT_PREFIX):])
    # The processes measure their own peak (VmHWM): ru_maxrss would count this process's memory at fork.
    return {"phases": result["seconds"], "wall": wall, "peak_rss": result["peak_rss_bytes"]}


def convert_cmd(to: str, source: Path, output: Path, tp: int) -> list[str]:
    args = ["--to", to, "--source", str(source), "--output", str(output), "--tp", str(tp)]
    if tp == 1:
        return [sys.executable, "-m", "twinkle_core.convert", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", "-m",
            "twinkle_core.convert", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (8: ~400 MB in fp32)")
    parser.add_argument("--tp", type=int, default=1, help="conversion processes (tensor-parallel size)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    hf, mcore, back = work / "hf", work / "megatron", work / "hf-back"
    size = build_checkpoint(hf, args.layers)
    mb = size / 2**20
    steps = {
        "read safetensors (bound)": run_measured([sys.executable, __file__, "--read", str(hf)], 1),
        "read + write again (bound)": run_measured([sys.executable, __file__, "--copy", str(hf), str(work / "copy")], 1),
        f"HF -> Megatron (tp={args.tp})": run_measured(convert_cmd("megatron", hf, mcore, args.tp), args.tp),
        f"Megatron -> HF (tp={args.tp})": run_measured(convert_cmd("hf", mcore, back, args.tp), args.tp),
    }
    baseline = run_measured([sys.executable, __file__, "--baseline"], 1)["peak_rss"]
    bound = mb / steps["read safetensors (bound)"]["phases"]["read"]
    copy = steps["read + write again (bound)"]["phases"]
    copy_bound = mb / (copy["read"] + copy["write"])
    print(f"\ncheckpoint: {mb:.0f} MB of tensors ({args.layers} layers, fp32), {work}")
    print(f"peak RSS of a process that only imports torch, transformers and megatron-core: {baseline / 2**20:.0f} MB")
    print("MB/s = checkpoint MB / (read + write seconds); build (process groups + empty model) and wall are apart")
    print(f"{'step':<28}{'read s':>8}{'write s':>8}{'build s':>8}{'MB/s':>7}{'of read':>8}{'of r+w':>7}"
          f"{'wall s':>8}{'peak RSS MB':>12}{'over base':>10}")
    for name, step in steps.items():
        phases = step["phases"]
        seconds = phases["read"] + phases.get("write", 0.0)
        rate = mb / seconds
        print(f"{name:<28}{phases['read']:>8.2f}{phases.get('write', 0.0):>8.2f}{phases.get('build', 0.0):>8.2f}"
              f"{rate:>7.0f}{rate / bound:>8.0%}{rate / copy_bound:>7.0%}{step['wall']:>8.1f}"
              f"{step['peak_rss'] / 2**20:>12.0f}"
              f"{(step['peak_rss'] - baseline) / 2**20:>10.0f}")


def import_only() -> None:
    """The memory floor: what importing the conversion's libraries alone costs."""
    import megatron.core.models.gpt  # noqa: F401
    import transformers  # noqa: F401

    import twinkle_core.convert  # noqa: F401

    print(RESULT_PREFIX + json.dumps({"seconds": {"read": 0.0}, "peak_rss_bytes": peak_rss_bytes()}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--read":
        read_all(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "--copy":
        copy_all(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 2 and sys.argv[1] == "--baseline":
        import_only()
    else:
        main()
